"""Attention and logits per family: packed rows never attend across documents (per-document SDPA, its fallback for
sliding windows, eager for soft-capped Gemma 2), and the chunked loss sees the family's own logits."""

from __future__ import annotations

import pytest
import torch

from shardtune.models import families, fastpath, training_module
from shardtune.objectives.heads import token_loss
from tests.families import FAMILIES, FFN, HIDDEN, LAYERS
from tests.tolerance import decoder_chain, tol

DOCS = (40, 30, 26)  # one packed row of 96 positions; the first two are longer than the 32-position window


def _training_module(family: str):
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family].config(256)
    impl = families.family_attention(config, fastpath.register_attention())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=impl).eval()
    return training_module.CausalLMForTraining(model), model, impl


@pytest.mark.parametrize(
    ("family", "impl"),
    [("llama", "shardtune_sdpa"), ("mistral", "shardtune_sdpa"), ("gemma2", "eager"), ("gemma3", "shardtune_sdpa")],
)
def test_packed_row_equals_documents_alone(family, impl):
    train, _, chosen = _training_module(family)
    assert chosen == impl
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (1, sum(DOCS)))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    with torch.no_grad():
        packed = train.logits(ids, pos)[0]
        alone = torch.cat([train.logits(d, torch.arange(d.shape[1])[None])[0] for d in ids.split(DOCS, dim=1)])
    # fp32, the same products in another grouping: two summation orders of one forward to the logits.
    chain = decoder_chain(hidden=HIDDEN, intermediate=FFN, layers=LAYERS, seq=sum(DOCS))
    torch.testing.assert_close(packed, alone, rtol=0, atol=tol(torch.float32, chain, alone.abs().max().item()))


def test_soft_capped_attention_scores_choose_eager():
    config = FAMILIES["gemma3"].config(256)
    assert families.family_attention(config, "shardtune_sdpa") == "shardtune_sdpa"
    config.attn_logit_softcapping = 50.0
    assert families.family_attention(config, "shardtune_sdpa") == "eager"
    assert families.family_attention(config, "flash_attention_2") == "flash_attention_2"  # the user's explicit choice


@pytest.mark.parametrize("family", ["granite", "gemma2"])
def test_chunked_loss_logits_are_the_familys_own(family):
    """Granite divides its logits by logits_scaling, Gemma 2 soft-caps them: the training module does the same."""
    train, model, _ = _training_module(family)
    ids = torch.randint(3, 256, (1, 24))
    pos = torch.arange(24)[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits[0].float()
        got = train.logits(ids, pos)[0]
        loss, n = train(ids, pos, ids.roll(-1, 1), head=token_loss)
    # fp32: the family's forward and the chunked head compute the same logits; only the last steps (the head's
    # product, the scaling or capping, the log-sum-exp and the sum over 24 targets) may sum in another order.
    head = decoder_chain(hidden=HIDDEN, intermediate=FFN, layers=0, seq=0)
    torch.testing.assert_close(got, want, rtol=0, atol=tol(torch.float32, head, want.abs().max().item()))
    ce = torch.nn.functional.cross_entropy(want, ids.roll(-1, 1)[0], reduction="sum")
    rel = tol(torch.float32, decoder_chain(hidden=HIDDEN, intermediate=FFN, layers=0, seq=0, vocab=256, tokens=24))
    assert int(n) == 24 and loss.item() == pytest.approx(ce.item(), rel=rel)
    # The family's transform really changes the logits (else this test would prove nothing).
    assert not torch.allclose(train._head(train.hidden_states(ids, pos))[0].float(), want)
