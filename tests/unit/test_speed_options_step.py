"""The speed options, in one forward and backward of the model a training run builds (`build_sharded_model`: FSDP2
on a 1-rank gloo group, LoRA, activation checkpointing), against the same step without them: the suite's
representative of tests/e2e/test_speed_options.py's two bench tests (CLI runs of 3 steps each).

The batch holds two packed documents per row (positions restarting), so that a compiled block, which attends
through transformers' masked SDPA rather than shardtune's per-document attention, must keep them apart as well."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from shardtune.models.builder import ModelSpec
from shardtune.objectives.heads import token_loss
from shardtune.parallel.mesh import init_distributed, shutdown
from shardtune.parallel.setup import build_sharded_model
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain, tol

SEQ, ROWS = 32, 2


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, TINY_VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, [11, -1]] = -100  # each document's last position
    positions = torch.cat([torch.arange(12), torch.arange(SEQ - 12)]).repeat(ROWS, 1)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _step(path, **options) -> tuple[float, dict[str, torch.Tensor], list[bool]]:
    """Loss, the trainable parameters' gradients and each block's checkpointing flag after one step."""
    info = init_distributed()
    try:
        torch.manual_seed(0)
        spec = ModelSpec(
            model_name_or_path=str(path), dtype=torch.float32, n_tokens=TINY_VOCAB, lora_r=4, packing=True,
            **{"lora_dropout": 0.1, "gradient_checkpointing": True, **options},
        )  # fmt: skip
        model = build_sharded_model(spec, info)
        model.train()
        torch.manual_seed(1)  # the dropout masks
        loss_sum, n = model(**_batch(), head=token_loss)
        (loss_sum / n).backward()
        grads = {k: p.grad.full_tensor().clone() for k, p in model.named_parameters() if p.grad is not None}
        flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        return float(loss_sum.detach() / n), grads, flags
    finally:
        shutdown()


def _assert_same_step(ref, got, chain):
    (loss_r, grads_r, _), (loss_g, grads_g, _) = ref, got
    assert abs(loss_g - loss_r) <= tol(torch.float32, chain, loss_r), (loss_g, loss_r)
    assert grads_g.keys() == grads_r.keys() and any("lora_B" in k for k in grads_r)
    for k, want in grads_r.items():
        torch.testing.assert_close(grads_g[k], want, rtol=0, atol=tol(torch.float32, chain, float(want.abs().max())))
    # The gradients are not zero (lora_B's is the one dropout reaches): equal zeros would prove nothing.
    assert max(float(g.abs().max()) for k, g in grads_r.items() if "lora_B" in k) > 100 * tol(torch.float32, chain)


# One forward and backward over 2 rows of 32 positions, in another order of sums.
CHAIN = decoder_chain(**TINY, seq=SEQ, vocab=TINY_VOCAB, tokens=2 * ROWS * (SEQ // 2), backward=True)


def test_checkpointing_every_second_block_computes_the_step_of_every_block(tiny_assets):
    """Bugs caught: --checkpoint_every_n_layers choosing the wrong blocks (all, none, or not every n-th), and a
    recomputed block drawing other dropout masks than its forward did (its lora_B gradient then differs)."""
    every = _step(tiny_assets["model"], checkpoint_every=1)
    second = _step(tiny_assets["model"], checkpoint_every=2)
    plain = _step(tiny_assets["model"], gradient_checkpointing=False)
    assert (every[2], second[2], plain[2]) == ([True, True], [True, False], [False, False])
    _assert_same_step(plain, every, CHAIN)
    _assert_same_step(plain, second, CHAIN)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_torch_compile_with_fsdp2_and_checkpointing_computes_the_eager_step(tiny_assets, monkeypatch):
    """Bugs caught: compiled blocks that attend across the packed documents of a row (their attention is
    transformers' masked SDPA, not the per-document one), or that compute another step than eager ones under
    FSDP2 and checkpointing (dropout off: compiled dropout draws its masks differently).

    The blocks compile with the aot_eager backend: dynamo's tracing and AOT autograd's graphs, which decide what
    a compiled block computes (the attention it takes, the fast paths it leaves under `is_compiling`), without
    inductor's C++ code generation (minutes of g++ on 2 CPU cores; the bench test keeps it)."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, *a, **k: compile_module(self, *a, **{"backend": "aot_eager", **k})
    )
    eager = _step(tiny_assets["model"], lora_dropout=0.0)
    compiled = _step(tiny_assets["model"], lora_dropout=0.0, torch_compile=True)
    _assert_same_step(eager, compiled, CHAIN)
