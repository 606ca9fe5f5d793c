"""The loss's chunk sized from the vocabulary (models.training_module.loss_chunk_tokens) on a family other than
the Llama fixture: Qwen2 with tied embeddings and a 150,001-token vocabulary (not a multiple of 8) takes 192-position
chunks, so 399 targets span three chunks, the last one partial; the chunked loss equals the model's own forward's
cross-entropy."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from shardtune.models.training_module import CausalLMForTraining, loss_chunk_tokens
from shardtune.objectives.heads import token_loss


def test_the_rule_in_logits():
    assert [loss_chunk_tokens(v) for v in (256, 32000, 128256, 150001, 256000, 10**7)] == [
        1024,
        1024,
        256,
        192,
        128,
        64,
    ]


def test_chunks_of_a_large_vocabulary_give_the_models_own_loss():
    """fp64 model; each chunk's log-softmax runs in fp32 (the head upcasts), so the sums agree to fp32's relative
    2**-24 times a few hundred additions: 1e-6 relative. Negative control: the last, partial chunk dropped
    (range(0, n - chunk + 1, chunk) in heads._chunked), the sum is short by 15 targets' loss (~180)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=150001, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=1024,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).double()
    ids = torch.randint(0, 150001, (1, 400))
    pos = torch.arange(400)[None]
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    module = CausalLMForTraining(model, packing=False)
    assert module.chunk_size == 192 and module.layout.path == "fast"
    total, n = module(ids, pos, labels, head=token_loss)[:2]
    own = torch.nn.functional.cross_entropy(
        model(input_ids=ids, position_ids=pos).logits[0], labels[0], ignore_index=-100, reduction="sum"
    )
    assert int(n) == 399
    assert float(total) == pytest.approx(float(own), rel=1e-6)
