"""How close two floating-point computations of the same quantity must be: one home for every tolerance in tests/.

Two computations that differ only in the order of their sums (2 ranks vs 1 process, packed vs alone, compiled vs
eager, and one CPU's kernels vs another's: AVX2 and AVX-512/AMX block their dot products differently) each carry
rounding errors. For a sum of K terms, Wilkinson's bound (Higham, Accuracy and Stability of Numerical
Algorithms, §4.2) is

    |fl(Σ x_i) − Σ x_i| ≤ (K − 1) · u · Σ |x_i|,      u = eps / 2, the unit roundoff of the dtype

(fp32: u = 2^-24; bf16: 2^-8; fp16: 2^-11). A value computed through a chain of reductions (matmuls over the
hidden size, softmax over the vocabulary, the loss over tokens, a gradient over tokens) accumulates, to first
order, the sum of the stages' bounds, so `reduction_size` is the total length of the sums along the chain
(`decoder_chain` counts it for the tiny test models). Both computations lie within the bound of the exact
value, hence within twice the bound of each other:

    tol(dtype, K, scale) = 2 · K · u · scale

with `scale` bounding Σ|x_i| / (number of stages) — in practice the magnitude of the values compared (the
largest |reference| for an absolute tolerance; 1 for a relative one). This is a worst case, reached only when
every rounding errs the same way; the typical error grows like sqrt(K). No CPU's rounding can fail it, but it is
loose: over a whole training run's chain (`train_chain`, about 26,000 for 4 steps of the tiny model) it allows
3e-3, while two fp32 runs split over 1 and 2 ranks agree to 1e-7 and a bug that each rank normalises the loss
by its own token count moves the loss by 1.5e-5. `tol` is for one pass (a forward, a gradient) over few sums;
training runs are compared with `train_parity` below.

bf16 and fp16 computations accumulate their sums in fp32 (CPU and GPU matmul kernels alike) and round each
stage's output once to the low-precision dtype; their error is dominated by those roundings, whose worst case
(stages · u) says nothing useful. `tol_rounding` bounds them statistically: one rounding is an error uniform in
[−u, u]·|x| (variance u²/3), independent between stages; `roundings` of them on each side of a comparison give a
difference of standard deviation σ = u · sqrt(2 · roundings / 3), and a mean over `n` independent values divides
σ by sqrt(n). The bound is 8σ: a Gaussian tail beyond 8σ has probability < 1e-15, so even the largest of 10^6
compared elements stays inside it. When one side is exact (an fp32 reference), `one_sided` halves the variance.

Training runs (`train_parity`) use the same statistical model in fp32. Each addition of a sum is one rounding
(relative error uniform in [−u, u]), so a chain of K sums computed in two orders differs by σ ≈ u · sqrt(2K/3),
the random walk's typical size; a loss is a mean over the `n` target tokens of a step, each through its own
chain with its own errors, which divides σ by sqrt(n). The bound is again 8σ, tol_rounding(fp32, K, n=n), with K
the chain of every step so far (`train_chain`): each update carries its difference into the later steps.
grad_norm gets no such division: each gradient element is a sum over the tokens whose terms largely cancel, so
its relative error is that of the chain itself, 8σ = tol_rounding(fp32, K) (6.3e-5 for 4 steps). A trained
weight's difference is dominated by AdamW's normalisation, not by the sums: an element whose gradient nearly
cancels has a large relative error in m/sqrt(v), so the absolute tolerance is a fraction of how far AdamW can
move an element (lr per step), set from the measured spread with a stated margin (`TRAIN_SPREAD`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one value to `dtype` (fp32 2^-24, bf16 2^-8)."""
    return torch.finfo(dtype).eps / 2


def tol(dtype: torch.dtype, reduction_size: int, scale: float = 1.0) -> float:
    """Largest |a − b| of two summation orders of a chain of reductions of total length `reduction_size`, over
    values of magnitude `scale` (see the module docstring for the derivation)."""
    return 2 * reduction_size * unit_roundoff(dtype) * scale


def tol_rounding(
    dtype: torch.dtype, roundings: int, *, n: int = 1, scale: float = 1.0, one_sided: bool = False
) -> float:
    """8σ bound on the difference of two values (or of two means over `n` values) that each went through
    `roundings` independent roundings to `dtype` (see the module docstring)."""
    sides = 1 if one_sided else 2
    return 8 * unit_roundoff(dtype) * (sides * roundings / (3 * n)) ** 0.5 * scale


def train_chain(*, steps: int, seq: int, tokens_per_step: int) -> int:
    """Total length of the sums behind a loss (or weight) after `steps` optimizer steps of a tiny model: each step
    is a forward and backward over `tokens_per_step` targets of sequences of `seq` tokens; an update's rounding
    difference carries into every later step, so the chains add up."""
    one = decoder_chain(**TINY, seq=seq, vocab=TINY_VOCAB, tokens=tokens_per_step, backward=True)
    return steps * one


def parity(*, steps: int, seq: int, tokens_per_step: int, lr: float) -> dict[str, float]:
    """Worst-case rtol and atol (for torch.testing.assert_close) of the losses and weights of two fp32 training runs
    of a tiny model that differ only in how their sums are split (ranks, micro-batches, nodes, kernels). Loose
    (see the module docstring): distributed parity tests use `train_parity`, whose bounds a small bug exceeds.

    rtol: `tol` over the chain of `steps` forward+backward passes (relative: scale 1). atol: for values near
    zero (a lora_B that started at 0), which only hold the updates: AdamW moves each element by at most about lr
    per step, and an update computed from gradients that agree to rtol agrees to lr·rtol, so `steps` of them
    differ by steps·lr·rtol.
    """
    rtol = tol(torch.float32, train_chain(steps=steps, seq=seq, tokens_per_step=tokens_per_step))
    return {"rtol": rtol, "atol": steps * lr * rtol}


# The 1-process vs 2-rank spread of fp32 training runs of the tiny model (tests/distributed/test_parity.py: LoRA,
# full fine-tuning, SHARD_GRAD_OP, NO_SHARD; test_qlora.py's fp32 QLoRA; 2 or 4 steps of 8 packed rows of 96
# tokens, lr 3e-3; AMD EPYC with AVX-512, torch 2.13 CPU): the largest relative difference of a step's loss and
# grad_norm, and the largest |Δ weight| over (steps · lr), the most AdamW can move an element.
TRAIN_SPREAD = {"loss": 1.1e-7, "grad_norm": 5.0e-7, "weight_per_lr_step": 6.5e-5}
# Margin of the weights' atol over their measured spread. Another CPU (AVX2 rather than AVX-512) blocks its sums
# differently, which changes which elements differ but not the size of the random walk; 15x covers that. The
# atol (1e-3 · steps · lr) stays far below one element whose update flips sign (2 · lr) or a dropped update (lr).
WEIGHT_MARGIN = 15


@dataclass(frozen=True)
class TrainParity:
    """How close two fp32 training runs of the same data and schedule must be (tests/parity.py compares them)."""

    loss: float  # rtol of each step's loss
    grad_norm: float  # rtol of each step's gradient norm
    rtol: float  # of each trained tensor, elementwise (with atol)
    atol: float


def train_parity(*, steps: int, seq: int, tokens_per_step: int, lr: float) -> TrainParity:
    """The bounds of two fp32 runs of the tiny model over `steps` optimizer steps of `tokens_per_step` targets in
    sequences of `seq`, peak learning rate `lr`, whose sums are split differently (ranks, nodes, micro-batches).

    For 4 steps of 768 targets (the measured spreads: TRAIN_SPREAD): loss 8σ of the steps' chains averaged over a
    step's tokens, 2.3e-6, 20x the measured spread and 6x below the shift of a per-rank token normaliser
    (1.5e-5); grad_norm 8σ of the chains, 6.3e-5, 120x the measured spread and 30x below that normaliser's
    (2e-3; a halved gradient: 0.5). Weights: rtol the loss's; atol WEIGHT_MARGIN × the measured |Δw| / (steps ·
    lr), 1.2e-5, 1/250 of one step's largest move.
    """
    chain = train_chain(steps=steps, seq=seq, tokens_per_step=tokens_per_step)
    loss = tol_rounding(torch.float32, chain, n=tokens_per_step)
    atol = WEIGHT_MARGIN * TRAIN_SPREAD["weight_per_lr_step"] * steps * lr
    return TrainParity(loss=loss, grad_norm=tol_rounding(torch.float32, chain), rtol=loss, atol=atol)


def decoder_chain(
    *, hidden: int, intermediate: int, layers: int, seq: int, vocab: int = 0, tokens: int = 0, backward: bool = False
) -> int:
    """Total length of the sums from a Llama-style decoder's input to its logits (vocab = tokens = 0) or its summed
    loss over `tokens` targets (and back, with backward).

    Per layer: two RMSNorms, the q/k/v/o projections (over the hidden size each), the scores (over the head
    size, at most the hidden size) and the weighted values (over `seq` positions), the MLP's gate/up (hidden)
    and down (intermediate): 7 · hidden + seq + intermediate. Then the final norm and the head (hidden), the
    log-sum-exp over the vocabulary and the loss over `tokens`. Backward runs the same sums in reverse and adds
    each weight gradient's sum over the tokens.
    """
    per_layer = 7 * hidden + seq + intermediate
    forward = layers * per_layer + 2 * hidden + vocab + tokens
    return 2 * forward + tokens if backward else forward


# The tiny models of tests/conftest.py (tiny_assets) and tests/distributed/adapters_worker.py: hidden 64,
# intermediate 160 (shardtune.commands.demo.build_model's default for hidden 64), 2 layers; a 600-token vocabulary.
TINY = {"hidden": 64, "intermediate": 160, "layers": 2}
TINY_VOCAB = 600
