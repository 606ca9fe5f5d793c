"""The sync proof: after every sync of the rollout engine, a fixed probe (a few prompts, each followed by a fixed
continuation) is scored by the trainer (its training forward) and by the engine; they must agree within the
tolerance, or the run stops naming the policy version, the engine and the difference. An engine that samples from
a stale adapter, the base model, or another model's weights fails it as soon as the policy has moved by more than
the tolerance on the probe; the probe's own movement per sync is logged, so a user sees when it could not yet tell
(a step that changed the policy by less than the tolerance).

Measured as the mean absolute difference of the per-token log-probs (nats per token, temperature 1). Tolerances by
compute dtype: fp32 1e-3 (the `transformers` engine's KV-cache path and vLLM's CPU build agree with the training
forward to ~1e-6 there, so a thousandfold margin); bf16 5e-2 and fp16 2e-2 (a 16-bit forward's log-probs move by
about 1e-2 per token between a cached and an uncached pass); --sync_probe_tolerance overrides them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardtune.rl.batches import completion_rows, trainer_logps, unaligned
from shardtune.rl.engine import RolloutEngine

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
PROBE_ROWS, PROBE_TOKENS = 4, 16


class SyncError(RuntimeError):
    """The engine samples from another policy than the trainer's (its str() is the line the run stops with)."""


@dataclass
class SyncProbe:
    prompts: list[list[int]]
    continuations: list[list[int]]
    tolerance: float
    pad_id: int
    last: list[list[float]] | None = None  # the trainer's scores at the previous sync

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], tolerance: float, pad_id: int) -> SyncProbe:
        """The first PROBE_ROWS prompts, each continued by the next prompt's first PROBE_TOKENS tokens (text of the
        run's own data, teacher-forced: no sampling, so both sides score the very same tokens)."""
        n = min(PROBE_ROWS, len(prompts))
        conts = [prompts[(i + 1) % len(prompts)][:PROBE_TOKENS] for i in range(n)]
        return cls([list(p) for p in prompts[:n]], conts, tolerance, pad_id)

    def check(self, model: nn.Module, engine: RolloutEngine, version: int, device) -> dict[str, float]:
        """Score the probe on both sides (every rank: the trainer's forward and the engine may be collectives);
        raise SyncError when they differ by more than the tolerance; return the metrics logged."""
        rows = completion_rows(self.prompts, self.continuations, self.pad_id)
        mine = unaligned(trainer_logps(model, rows, 1.0, device), self.prompts, self.continuations)
        theirs = engine.score(self.prompts, self.continuations)
        gap, worst = _mean_abs(mine, theirs)
        moved = _mean_abs(mine, self.last)[0] if self.last is not None else float("nan")
        self.last = mine
        if not gap <= self.tolerance:  # NaN fails too
            raise SyncError(
                f"the rollout engine '{engine.name}' does not sample from the policy being trained: at policy version "
                f"{version} its log-probs of the sync probe differ from the trainer's by {gap:.3g} nats/token on "
                f"average (largest {worst:.3g}; tolerance {self.tolerance:g}, --sync_probe_tolerance). It holds a "
                "stale or another adapter, or another model: check that the engine serves --model_name_or_path with "
                "the adapter shardtune sent (a vLLM server: --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."
            )
        return {"sync/probe_gap": gap, "sync/probe_gap_max": worst, "sync/probe_moved": moved}


def _mean_abs(a: list[list[float]], b: list[list[float]] | None) -> tuple[float, float]:
    """(mean, max) of |a - b| over every token; NaN when the engine returned other lengths."""
    if b is None or [len(x) for x in a] != [len(y) for y in b]:
        return float("nan"), float("nan")
    diffs = [abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return (sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0))
