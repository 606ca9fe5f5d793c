"""A generation batch's metrics, under TRL GRPOTrainer's names: rewards (per function and total), completion
lengths, and how many groups gave no learning signal."""

from __future__ import annotations

import torch


def rollout_metrics(g, table: torch.Tensor, total: torch.Tensor, std: torch.Tensor, rewards: list) -> dict[str, float]:
    """`g`: the generation (rl.rollout.Generation); `table` [rows, functions] each function's rewards (NaN where it
    gave None), `total` [rows] the weighted sum, `std` [rows] the std of each row's group."""
    out: dict[str, float] = {}
    for i, f in enumerate(rewards):
        name = getattr(f.fn, "__name__", f.name)  # TRL names a function's metrics by its __name__
        out[f"rewards/{name}/mean"] = _nanmean(table[:, i])
        out[f"rewards/{name}/std"] = _nanstd(table[:, i])
    scored = total.clone()
    scored[torch.isnan(table).all(dim=1)] = float("nan")  # rows no function scored are left out, as TRL does
    out["reward"], out["reward_std"] = _nanmean(scored), _nanstd(scored)
    out["frac_reward_zero_std"] = float(torch.isclose(std, torch.zeros_like(std)).float().mean())
    return {**out, **_lengths(g)}


def _lengths(g) -> dict[str, float]:
    lengths = torch.tensor([len(c) for c in g.completions], dtype=torch.float32)
    cut = torch.tensor(g.truncated, dtype=torch.bool)
    ended = lengths[~cut] if bool((~cut).any()) else torch.zeros(1)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(cut.float().mean()),
        "completions/mean_terminated_length": float(ended.mean()),
        "completions/min_terminated_length": float(ended.min()),
        "completions/max_terminated_length": float(ended.max()),
    }


def _nanmean(x: torch.Tensor) -> float:
    return float(torch.nanmean(x))


def _nanstd(x: torch.Tensor) -> float:
    """TRL's nanstd: the unbiased std of the non-NaN values (NaN with fewer than two)."""
    kept = x[~torch.isnan(x)]
    return float(kept.std()) if len(kept) > 1 else float("nan")
