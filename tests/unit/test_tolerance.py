"""The tolerance helpers hold on sums computed in other orders and on bf16 roundings (tests/tolerance.py)."""

from __future__ import annotations

import pytest
import torch

from tests.tolerance import TINY, decoder_chain, tol, tol_rounding, unit_roundoff


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
