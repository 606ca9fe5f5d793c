"""The tolerance helpers hold on sums computed in other orders and on bf16 roundings (tests/tolerance.py), and the
run comparison (tests/parity.py) fails on the differences it is meant to catch."""

from __future__ import annotations

import pytest
import torch

from tests.parity import assert_same_tensors, assert_same_training, trained_steps
from tests.tolerance import (
    TINY,
    TRAIN_SPREAD,
    WEIGHT_MARGIN,
    decoder_chain,
    tol,
    tol_rounding,
    train_parity,
    unit_roundoff,
)


def test_unit_roundoffs():
    assert unit_roundoff(torch.float32) == 2**-24 and unit_roundoff(torch.bfloat16) == 2**-8


@pytest.mark.parametrize("k", [16, 1024, 65536])
def test_tol_bounds_two_summation_orders(k):
    """Sequential left-to-right vs torch's blocked sum vs the reverse order: within tol(fp32, K, Σ|x|)."""
    g = torch.Generator().manual_seed(k)
    for _ in range(5):
        x = torch.randn(k, generator=g) * torch.rand(k, generator=g).mul(8).exp2()  # mixed magnitudes
        exact = x.double().sum()
        blocked = x.sum()
        reverse = x.flip(0).cumsum(0)[-1]
        bound = tol(torch.float32, k, float(x.abs().sum()))
        assert abs(float(blocked) - float(reverse)) <= bound
        assert abs(float(blocked) - float(exact)) <= bound / 2  # one side alone: Wilkinson's bound


def test_tol_rounding_bounds_bf16_roundings_of_a_mean():
    """n values each rounded `r` times to bf16 (through r scalings), on both sides: their means stay within
    tol_rounding(bf16, r, n=n) of each other."""
    g = torch.Generator().manual_seed(0)
    n, r = 4096, 8
    x = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    sides = []
    for seed in (1, 2):
        y = x.clone()
        scales = torch.rand(r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
        for s in scales:
            y = (y * s).bfloat16().double() / s  # one bf16 rounding per stage
        sides.append(float(y.mean()))
    assert abs(sides[0] - sides[1]) <= tol_rounding(torch.bfloat16, r, n=n) * float(x.mean())


def test_decoder_chain_counts_the_sums():
    # Forward logits: per layer 7·64 + seq + 160; 2 layers; final norm and head over 64.
    assert decoder_chain(**TINY, seq=12) == 2 * (7 * 64 + 12 + 160) + 2 * 64
    fwd = decoder_chain(**TINY, seq=12, vocab=600, tokens=24)
    assert fwd == decoder_chain(**TINY, seq=12) + 600 + 24
    assert decoder_chain(**TINY, seq=12, vocab=600, tokens=24, backward=True) == 2 * fwd + 24


def test_train_parity_lies_between_the_measured_spread_and_a_small_bug():
    """4 steps of 768 targets: the bounds exceed the measured 1-vs-2-rank spread by a margin and stay below the
    shifts of a per-rank token normaliser (loss 1.5e-5, grad_norm 2e-3) and a halved gradient (grad_norm 0.5)."""
    t = train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)
    assert 10 * TRAIN_SPREAD["loss"] < t.loss < 1.5e-5 / 5
    assert 100 * TRAIN_SPREAD["grad_norm"] < t.grad_norm < 2e-3 / 20
    # Weights: above the measured |Δw| (6.5e-5 · steps · lr) by the margin, far below one dropped update (lr).
    assert t.atol == pytest.approx(WEIGHT_MARGIN * TRAIN_SPREAD["weight_per_lr_step"] * 4 * 3e-3)
    assert t.atol < 3e-3 / 100


def _records(losses, grad_norms, lrs):
    return [
        {"type": "train", "step": i + 1, "loss": l, "grad_norm": g, "learning_rate": lr}
        for i, (l, g, lr) in enumerate(zip(losses, grad_norms, lrs, strict=True))
    ]


def test_trained_steps_follow_a_nonzero_learning_rate():
    # A record logs the rate the next step applies: warmup 1 of 2 steps logs [3e-3, 0]; step 2's weights were
    # updated by step 1 at rate 0, so no step counts. 4 steps: step 2 ran at 3e-3, so steps 3 and 4 count.
    assert trained_steps(_records([1, 1], [1, 1], [3e-3, 0])) == []
    assert trained_steps(_records([1] * 4, [1] * 4, [3e-3, 2e-3, 1e-3, 0])) == [3, 4]
    # With the run's start record: no warmup, so step 1 ran at the learning rate and step 2 counts too.
    start = {"type": "start", "config": {"train": {"learning_rate": 3e-3, "warmup_steps": 0, "warmup_ratio": 0.0}}}
    assert trained_steps([start, *_records([1] * 3, [1] * 3, [2e-3, 1e-3, 0])]) == [2, 3]
    warm = {"type": "start", "config": {"train": {"learning_rate": 3e-3, "warmup_steps": 1, "warmup_ratio": 0.0}}}
    assert trained_steps([warm, *_records([1] * 3, [1] * 3, [2e-3, 1e-3, 0])]) == [3]


def test_parity_helpers_fail_on_grad_norm_loss_and_tensors():
    t = train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)
    lrs = [3e-3, 2e-3, 1e-3, 0]
    ref = _records([6.4, 6.3, 6.2, 6.1], [9.0, 8.0, 3.0, 1.0], lrs)
    assert_same_training(ref, _records([6.4, 6.3, 6.2 * (1 + t.loss / 2), 6.1], [9.0, 8.0, 3.0, 1.0], lrs), t)
    with pytest.raises(AssertionError, match="step 3 grad_norm"):
        assert_same_training(ref, _records([6.4, 6.3, 6.2, 6.1], [9.0, 8.0, 3.0 * (1 + 2e-3), 1.0], lrs), t)
    with pytest.raises(AssertionError, match="step 4 loss"):
        assert_same_training(ref, _records([6.4, 6.3, 6.2, 6.1 * (1 + 1.5e-5)], [9.0, 8.0, 3.0, 1.0], lrs), t)
    with pytest.raises(AssertionError, match="nonzero learning rate"):
        assert_same_training(ref, ref, t, min_trained_steps=3)
    b = torch.full((8, 4), 6e-3)
    assert assert_same_tensors({"x.lora_B.weight": b}, {"x.lora_B.weight": b + t.atol / 2}, t) == 1
    with pytest.raises(AssertionError, match="1 of 1 tensors differ"):
        assert_same_tensors({"x.lora_B.weight": b}, {"x.lora_B.weight": b + 2 * t.atol}, t)
    with pytest.raises(AssertionError, match="hardly moved"):
        assert_same_tensors({"x.lora_B.weight": b * 0}, {"x.lora_B.weight": b * 0}, t)
    with pytest.raises(AssertionError, match="no tensor with a known start"):
        assert_same_tensors({"w": b}, {"w": b}, t)
