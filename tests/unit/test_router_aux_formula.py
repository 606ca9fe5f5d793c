"""The router load-balancing loss shardtune adds, against the formula written out here (Switch Transformer, as
transformers' Mixtral defines it), not only against transformers' own function: over every MoE layer's tokens,

    aux = E · Σ_e f_e · P_e,   f_e = (1/T) Σ_t [e is among token t's top-k experts],   P_e = (1/T) Σ_t softmax(z_t)_e

with T the (real, when an attention mask is given) tokens of all layers together. Checked on shardtune's RouterAux
and on the aux_loss the SFT objective logs; the planted controls (top-1 counts instead of top-k, the mask ignored)
fall outside the same tolerance."""

from __future__ import annotations

import pytest
import torch

from shardtune.models.router_aux import family_router_aux
from tests.unit.test_router_aux_loss import COEF, EXPERTS, LAYERS, ROWS, SEQ, TOP_K, _batch, _hf_model, _ours


def switch_aux(router_logits, experts: int, top_k: int, mask: torch.Tensor | None = None) -> float:
    """The formula above, in float64, from each layer's [tokens, experts] router logits."""
    z = torch.cat([layer.double() for layer in router_logits])  # [L·T, E]
    probs = torch.softmax(z, dim=-1)
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)  # [e in top-k of t]
    weight = torch.ones(z.shape[0], dtype=torch.float64)
    if mask is not None:
        weight = mask.reshape(-1).double().repeat(len(router_logits))  # every layer sees the same tokens
    f = (chosen * weight[:, None]).sum(0) / weight.sum()
    p = (probs * weight[:, None]).sum(0) / weight.sum()
    return float(experts * (f * p).sum())


def _router_logits(hf):
    batch, _ = _batch()
    return hf(input_ids=batch["input_ids"], output_router_logits=True).router_logits


def _tolerance(value: float) -> float:
    return 64 * torch.finfo(torch.float32).eps * (LAYERS * ROWS * SEQ * EXPERTS) ** 0.5 * max(1.0, abs(value))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_the_aux_loss_is_the_switch_formula(family):
    hf = _hf_model(family)
    aux = family_router_aux(hf)
    assert (aux.num_experts, aux.top_k) == (EXPERTS, TOP_K)
    logits = _router_logits(hf)
    assert len(logits) == LAYERS and tuple(logits[0].shape) == (ROWS * SEQ, EXPERTS)
    want = switch_aux(logits, EXPERTS, TOP_K)
    got = float(aux(logits))
    assert got == pytest.approx(want, abs=_tolerance(want))
    # What the SFT objective logs (one forward of the same batch through shardtune's training module).
    _, metrics = _ours(hf)
    assert metrics["aux_loss"] == pytest.approx(want, abs=_tolerance(want))
    # Planted control: counting only each token's first choice (top-1) is another number, outside the tolerance.
    assert abs(switch_aux(logits, EXPERTS, 1) - want) > 10 * _tolerance(want)


def test_the_mask_leaves_padding_out_as_the_formula_does():
    hf = _hf_model("mixtral")
    aux, logits = family_router_aux(hf), _router_logits(hf)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[0, 7:] = 0  # a padded row
    mask[2, 3:] = 0
    want = switch_aux(logits, EXPERTS, TOP_K, mask)
    got = float(aux(logits, mask))
    assert got == pytest.approx(want, abs=_tolerance(want))
    # Planted control: the mask ignored (padding routed like a token) is another number.
    assert abs(switch_aux(logits, EXPERTS, TOP_K) - want) > 10 * _tolerance(want)
    assert COEF > 0  # the objective's term (tests/unit/test_router_aux_loss.py) scales this number
