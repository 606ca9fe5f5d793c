"""Parity of two training runs: the same per-step loss and grad_norm, the same trained tensors, and proof that
training happened.

Two runs that see the same global batches under the same schedule (1 process vs N ranks, one node vs two, an
uninterrupted run vs a resumed one) must agree to a `tests.tolerance.TrainParity`:

    assert_runs_match(ref_dir, got_dir, train_parity(steps=4, seq=96, tokens_per_step=768, lr=3e-3))

checks, from each run's metrics.jsonl train records, every step the compared run logged (the reference logged
it too): loss and grad_norm within the tolerance's rtol, the same learning rate; that at least `min_trained_steps` of them were computed on weights
that a nonzero learning rate had already moved (a run whose updates are all zero would otherwise compare its
initial weights); and the trained tensors (adapter_model.safetensors, else model.safetensors) elementwise, each
tensor whose start is known (lora_B starts at zero, or `start` gives it) moved by far more than the tolerance.
The pieces, `assert_same_training` and `assert_same_tensors`, take records or tensors directly too. `BUGS` are
planted bugs that a negative control shows these checks catch. Models other than the tiny one build their own
`TrainParity` (its four numbers) from tests/tolerance.py's helpers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.mutation import Edit
from tests.tolerance import TrainParity

# A tensor "moved" when its largest change from its start exceeds this many times its tolerance: then agreeing
# to the tolerance says the two runs made the same update, not merely that neither moved.
MOVED = 100
WEIGHT_FILES = ("adapter_model.safetensors", "model.safetensors")

Records = Path | str | list[dict]
Tensors = Path | str | dict[str, torch.Tensor]


def _records(run: Records) -> list[dict]:
    if isinstance(run, (str, Path)):
        return list(map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines()))
    return run


def train_steps(run: Records) -> dict[int, dict]:
    """Step → train record of an output folder's metrics.jsonl (or of a list of records); the last record of a
    step wins, as a resumed run redoes the steps after its checkpoint."""
    return {r["step"]: r for r in _records(run) if r.get("type") == "train"}


def trained_steps(run: Records) -> list[int]:
    """The steps whose loss and gradient were computed on weights a nonzero learning rate had moved.

    A record logs the learning rate after the scheduler stepped, the one the next step applies: step s's weights
    were last updated by step s − 1 with the rate of record s − 2. Step 1's rate is the run's learning_rate
    when it has no warmup (every transformers schedule starts a warmup at 0), read from the run's first start
    record; without one (a list of train records only), step 1 is taken to have updated nothing."""
    records = _records(run)
    steps = train_steps(records)
    moved_after = min((s + 2 for s, r in steps.items() if r["learning_rate"] > 0), default=math.inf)
    start = next((r for r in records if r.get("type") == "start"), None)
    if start is not None:
        t = start["config"]["train"]
        if t["learning_rate"] > 0 and not t["warmup_steps"] and not t["warmup_ratio"]:
            moved_after = 2
    return sorted(s for s in steps if s >= moved_after)


def assert_same_training(ref: Records, got: Records, tol: TrainParity, *, min_trained_steps: int = 2) -> None:
    """Every step `got` logged is in `ref` with the same learning rate, a loss and a grad_norm within tol's rtol;
    at least `min_trained_steps` of those steps come after a nonzero-lr update (judged on `ref`'s records, which
    a resumed `got` may not have)."""
    want, have = train_steps(ref), train_steps(got)
    assert have and set(have) <= set(want), f"steps logged: reference {sorted(want)}, compared run {sorted(have)}"
    trained = [s for s in trained_steps(ref) if s in have]
    assert len(trained) >= min_trained_steps, (
        f"only steps {trained} of {sorted(have)} follow an update with a nonzero learning rate (want "
        f"{min_trained_steps}): the comparison would see untrained weights; train more steps or lower warmup_steps"
    )
    bad = []
    for s in sorted(have):
        w, h = want[s], have[s]
        for key, rtol in (("loss", tol.loss), ("grad_norm", tol.grad_norm)):
            rel = abs(h[key] - w[key]) / max(abs(w[key]), 1e-30)
            if not rel <= rtol:  # `not` so that a NaN fails
                bad.append(f"step {s} {key}: {h[key]!r} vs {w[key]!r} (relative {rel:.3g} > {rtol:.3g})")
        if not math.isclose(h["learning_rate"], w["learning_rate"], rel_tol=1e-12, abs_tol=1e-20):
            bad.append(f"step {s} learning_rate: {h['learning_rate']!r} vs {w['learning_rate']!r}")
    assert not bad, "training differs:\n  " + "\n  ".join(bad)


def load_weights(run: Tensors) -> dict[str, torch.Tensor]:
    """The trained tensors of an output folder (its adapter, else its full model), or `run` itself if a dict."""
    if isinstance(run, dict):
        return run
    path = Path(run)
    if path.is_file():
        return load_file(path)
    for name in WEIGHT_FILES:
        if (path / name).exists():
            return load_file(path / name)
    raise AssertionError(f"{path} holds none of {', '.join(WEIGHT_FILES)}")


def _start_of(key: str, value: torch.Tensor, start: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The tensor `key` started from: `start`'s (its first rows when training added rows, as for new tokens), zero
    for a LoRA B (peft's initialisation), else unknown."""
    if key in start:
        s = start[key]
        if s.shape == value.shape:
            return s
        if s.shape[1:] == value.shape[1:] and s.shape[0] <= value.shape[0]:
            return s  # compared with value[: len(s)]
        return None
    return torch.zeros_like(value) if "lora_B" in key else None


def assert_same_tensors(ref: Tensors, got: Tensors, tol: TrainParity, *, start: Tensors | None = None) -> int:
    """The same tensor names, every tensor within (tol.rtol, tol.atol) elementwise, and every tensor whose start is
    known moved by more than MOVED times its tolerance. Returns how many tensors moved (at least one)."""
    want, have = load_weights(ref), load_weights(got)
    assert want.keys() == have.keys(), f"tensor names differ: {sorted(want.keys() ^ have.keys())[:6]}"
    bad = []
    for k in sorted(want):
        w, h = want[k].float(), have[k].float()
        excess = ((h - w).abs() - tol.atol - tol.rtol * w.abs()).max() if w.numel() else torch.tensor(0.0)
        if h.shape != w.shape or not float(excess) <= 0:
            diff = float((h - w).abs().max()) if h.shape == w.shape else "shape"
            bad.append(f"{k}: largest |difference| {diff} (atol {tol.atol:.3g}, rtol {tol.rtol:.3g})")
    assert not bad, f"{len(bad)} of {len(want)} tensors differ:\n  " + "\n  ".join(bad[:12])
    known = load_weights(start) if start is not None else {}
    moved, still = 0, []
    for k, w in want.items():
        s = _start_of(k, w, known)
        if s is None:
            continue
        w = w[: len(s)].float()
        bound = MOVED * (tol.atol + tol.rtol * float(s.float().abs().max()))
        if float((w - s.float()).abs().max()) > bound:
            moved += 1
        else:
            still.append(k)
    assert not still and moved, (
        f"{len(still)} tensor(s) hardly moved from their start (by at most {MOVED}x the tolerance): {still[:6]}"
        if still
        else "no tensor with a known start (a lora_B, or one in `start`): the check cannot tell trained from not"
    )
    return moved


def assert_runs_match(
    ref: Path | str,
    got: Path | str,
    tol: TrainParity,
    *,
    min_trained_steps: int = 2,
    start: Tensors | None = None,
) -> None:
    """`assert_same_training` and `assert_same_tensors` of two output folders."""
    assert_same_training(ref, got, tol, min_trained_steps=min_trained_steps)
    assert_same_tensors(ref, got, tol, start=start)


# Planted bugs of the class these comparisons exist for, as edits of the sources (tests/mutation.py): a run
# started with `plant(BUGS[name], tmp_path)`'s environment must fail `assert_runs_match` against a correct run.
_CLIP = "        grad_norm = clip_grad_norm(params, settings.max_grad_norm)\n"
BUGS = {
    # Every gradient halved before clipping: AdamW is almost scale-free, so losses barely move; grad_norm halves.
    "halved_gradients": Edit(
        "training/trainer.py", _CLIP, "        _ = [p.grad.mul_(0.5) for p in params if p.grad is not None]\n" + _CLIP
    ),
    # Each rank normalises its gradient by its own target count (times the ranks) instead of the global one, while
    # the logged loss stays right: ranks whose packed rows hold more targets weigh less. Step 1's loss is exact;
    # the later ones move by about 1e-5 relative.
    "per_rank_normaliser": Edit(
        "training/trainer.py",
        "        loss, parts = objective.step(model, b, totals, info.dims.gradient_divisor)\n",
        "        own = {k: sum(c[k] for c in local) * info.dims.dp_size for k in keys}\n"
        "        loss, parts = objective.step(model, b, own, info.dims.dp_size)\n",
    ),
    # Rank 1's shard of every gradient is lost (as if its reduce-scatter output were dropped).
    "dropped_shard": Edit(
        "training/trainer.py",
        _CLIP,
        "        if info.rank == 1:\n            _ = [p.grad.zero_() for p in params if p.grad is not None]\n" + _CLIP,
    ),
}
