"""Prompt + completion rows as the training module reads them, and per-token values aligned with their targets.

A row is the prompt then the completion, right-padded; position ids count from 0 and are 0 on padding; labels are
shifted (labels[i] is the target of position i): the completion's tokens are the targets of the positions from
the prompt's last token on, everything else is -100. A per-token value of the completion (a log-prob) sits at its
target's position, so that it lines up with what `objectives.heads.token_logps` returns."""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardtune.objectives.heads import token_logps

IGNORE = -100


def completion_rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, position_ids, labels [rows, longest prompt + completion] for the pairs."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    pos = torch.zeros(len(prompts), width, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        pos[i, :n] = torch.arange(n)
        labels[i, len(p) - 1 : n - 1] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def aligned(values: list[list[float]], prompts: list[list[int]], width: int) -> torch.Tensor:
    """Per-token values of each completion [rows, width], at their targets' positions (0 elsewhere)."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompts, strict=True)):
        if v:
            out[i, len(p) - 1 : len(p) - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def unaligned(table: torch.Tensor, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """The inverse of `aligned`: each completion's values read back from their targets' positions."""
    rows = table.tolist()
    return [r[len(p) - 1 : len(p) - 1 + len(c)] for r, p, c in zip(rows, prompts, completions, strict=True)]


@torch.no_grad()
def trainer_logps(model: nn.Module, rows: dict[str, torch.Tensor], temperature: float, device) -> torch.Tensor:
    """The training forward's per-token log-probs [rows, width] of the rows' targets under softmax(logits /
    temperature) (0 where no target): what the GRPO loss computes, without gradients."""
    batch = {k: rows[k].to(device) for k in ("input_ids", "position_ids", "labels")}
    logps, _ = model(**batch, head=functools.partial(token_logps, temperature=temperature))
    return logps.float().cpu()
