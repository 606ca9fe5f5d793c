"""The speed options change how the step runs, not what it computes: the same per-step losses and gradient norms as
the default run, and the same trained adapter, elementwise."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_cli, train_args, train_records
from tests.families import assert_runs_match, run_tolerance
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain, tol

LR = 3e-3


def _args(assets, out, extra):
    flags = {"max_seq_len": 128, "seed": 11, "max_steps": 3, "learning_rate": LR, "per_device_train_batch_size": 2}
    lora = {"use_peft_lora": True, "lora_r": 4, "lora_target_modules": "all-linear", "gradient_checkpointing": True}
    return train_args(assets, out, **flags, **lora) + list(extra)


# 3 steps of 2 packed rows of 128 tokens (_args): the options change the order of the sums only.
CLOSE = run_tolerance(
    chain=3 * decoder_chain(**TINY, seq=128, vocab=TINY_VOCAB, tokens=2 * 128, backward=True), n=2 * 128, steps=3, lr=LR
)


def _same_training(ref, got):
    """Losses, grad_norm and the adapter within CLOSE, after 3 updates that moved lora_B (from 0) far beyond it."""
    adapter = assert_runs_match(ref, got, CLOSE, min_updates=3)
    assert max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > LR > 3 * CLOSE.atol


def _losses(out):
    losses = [r["loss"] for r in train_records(out)]
    assert len(losses) == 3
    return torch.tensor(losses)


# bench: a checkpointing variant, 20 s; gradient checkpointing itself runs in most parity tests, every second block's step in tests/unit/test_speed_options_step.py (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_checkpointing_every_second_block_trains_the_same(tiny_assets, tmp_path):
    """With dropout on: the recomputed blocks draw the same dropout masks as the blocks that keep activations."""
    drop = ["--lora_dropout", "0.1"]
    every = run_cli(_args(tiny_assets, tmp_path / "every", drop))
    second = run_cli(_args(tiny_assets, tmp_path / "second", [*drop, "--checkpoint_every_n_layers", "2"]))
    assert "Activation checkpointing: 2 of 2 decoder blocks" in every.stdout + every.stderr
    assert "Activation checkpointing: 1 of 2 decoder blocks" in second.stdout + second.stderr
    _same_training(tmp_path / "every", tmp_path / "second")


# bench: torch.compile's compilation, 20 s; compiled blocks' step (aot_eager) in tests/unit/test_speed_options_step.py (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_torch_compile_with_fsdp2_and_checkpointing_trains_the_same(tiny_assets, tmp_path):
    """Compiled blocks run transformers' masked SDPA; eager ones the per-document attention: same numbers."""
    nodrop = ["--lora_dropout", "0.0"]
    run_cli(_args(tiny_assets, tmp_path / "eager", nodrop))
    run_cli(_args(tiny_assets, tmp_path / "compiled", [*nodrop, "--torch_compile", "True"]), timeout=900)
    _same_training(tmp_path / "eager", tmp_path / "compiled")


def test_checkpoint_every_must_be_positive(tiny_assets, tmp_path):
    proc = run_cli(_args(tiny_assets, tmp_path / "bad", ["--checkpoint_every_n_layers", "0"]), check=False)
    assert proc.returncode == 2
    assert "--checkpoint_every_n_layers must be >= 1 (got 0)" in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_dora_dropout_choice_reaches_the_layers(tiny_assets, tmp_path):
    """`--dora_dropout`: the same first step (the magnitude starts at ‖W‖, lora_B at zero, so both forwards are
    W·x), then different updates with dropout on; an unknown value is refused before loading."""
    dora = ["--use_dora", "True", "--lora_dropout", "0.3"]
    run_cli(_args(tiny_assets, tmp_path / "lora_path", dora))
    run_cli(_args(tiny_assets, tmp_path / "peft", [*dora, "--dora_dropout", "peft"]))
    lp, pf = _losses(tmp_path / "lora_path"), _losses(tmp_path / "peft")
    # Step 1's loss is one forward (W·x either way) in another order of sums: 2 rows of 128 tokens.
    first = tol(torch.float32, decoder_chain(**TINY, seq=128, vocab=TINY_VOCAB, tokens=2 * 128))
    torch.testing.assert_close(pf[0], lp[0], rtol=first, atol=0)
    assert float((pf[1:] - lp[1:]).abs().max()) > 1e-6
    bad = run_cli(_args(tiny_assets, tmp_path / "bad", [*dora, "--dora_dropout", "both"]), check=False)
    assert bad.returncode == 2 and "--dora_dropout" in bad.stderr and "lora_path" in bad.stderr
