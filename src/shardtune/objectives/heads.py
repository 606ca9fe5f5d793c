"""What the training module's forward computes from the decoder's output: a head function the objective passes
(`model(input_ids, position_ids, labels, head=...)`), so that the loss is the objective's while it still runs inside
the FSDP2 root's forward (whose hooks gather the output head and reduce its gradients).

A head takes the training module (its chunked logits, `chunk_logits`, and its `chunk_size`), the decoder's output
`h` [batch, seq, hidden] (on the own-forward path, the model's logits) and the shifted labels (-100: no target),
and returns what the objective reads: the summed token cross-entropies and their count (`token_loss`, SFT), or each
row's summed log-probs and target count (`sequence_logps`, the preference objectives). Positions are chunked and
each chunk's logits recomputed in the backward, so the fp32 [batch, seq, vocab] logits are never held. An
objective with another need (per-token log-probs for a policy gradient) passes its own head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _chunked(fn, h: torch.Tensor, y: torch.Tensor, chunk_size: int):
    """fn over chunks of `chunk_size` positions, each recomputed in the backward when gradients are on."""
    for start in range(0, h.shape[0], chunk_size):
        hc, yc = h[start : start + chunk_size], y[start : start + chunk_size]
        if torch.is_grad_enabled():
            yield start, torch.utils.checkpoint.checkpoint(fn, hc, yc, use_reentrant=False)
        else:
            yield start, fn(hc, yc)


def token_loss(model: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the targets' cross-entropies, number of targets), chunked over positions."""

    def chunk_loss(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model.chunk_logits(hc), yc, reduction="sum")

    h, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    keep = y != -100
    if not keep.any():
        # No target in this batch (--assistant_only_loss and no assistant turn in it): a loss of exactly zero
        # that still runs through the head, so that backward reaches every parameter and this rank's FSDP
        # reduce-scatters run like the other ranks'. Its gradient is zero (0 * finite), the sum unchanged.
        return chunk_loss(h[:1], torch.zeros_like(y[:1])) * 0.0, keep.sum()
    h, y = h[keep], y[keep]
    total = h.new_zeros((), dtype=torch.float32)
    for _, part in _chunked(chunk_loss, h, y, model.chunk_size):
        total = total + part
    return total, keep.sum()


def sequence_logps(model: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the targets' log-probs, number of targets) per row, through the same chunked head as token_loss;
    with context parallelism, the rows' sums over the cp ranks (each rank holds some of each row's positions)."""

    def chunk_logps(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return -F.cross_entropy(model.chunk_logits(hc), yc, reduction="none")

    rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels).reshape(-1)
    h, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    keep = y != -100
    h, y, rows = h[keep], y[keep], rows[keep]
    total = h.new_zeros(labels.shape[0], dtype=torch.float32)
    for start, lp in _chunked(chunk_logps, h, y, model.chunk_size):
        total = total.index_add(0, rows[start : start + model.chunk_size], lp)
    n = torch.bincount(rows, minlength=labels.shape[0])
    shard = getattr(model, "cp_shard", None)
    if shard is not None:
        return shard.sum_rows(total), shard.sum_rows(n)
    return total, n


def token_logps(
    model: nn.Module, h: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's log-prob, the entropy of its distribution), both [batch, seq] fp32 and 0 where labels is
    -100, the logits divided by `temperature` first (TRL's GRPOTrainer scores the sampling distribution); the
    entropy is detached. The same chunked head as token_loss; pass the temperature with
    functools.partial(token_logps, temperature=t). Context parallelism is not supported (GRPO refuses it)."""
    if getattr(model, "cp_shard", None) is not None:
        raise NotImplementedError("token_logps: context parallelism is not supported (per-token log-probs).")

    def chunk_logps(hc: torch.Tensor, yc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = F.log_softmax(model.chunk_logits(hc) / temperature, dim=-1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, yc[:, None]).squeeze(-1), entropy

    h, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    keep = labels != -100
    # [batch, seq] tensors of their own, not views of flat ones: FSDP2 warns of a root output that is a view.
    out = h.new_zeros(labels.shape, dtype=torch.float32)
    if not keep.any():
        # No target (every completion masked): zeros that still run through the head, so that backward reaches
        # every parameter and this rank's FSDP reduce-scatters run like the other ranks' (as token_loss).
        logp, _ = chunk_logps(h[:1], torch.zeros_like(y[:1]))
        return out + logp.sum() * 0.0, out.clone()
    flat = keep.reshape(-1)
    parts = list(_chunked(chunk_logps, h[flat], y[flat], model.chunk_size))
    logps = out.masked_scatter(keep, torch.cat([lp for _, (lp, _) in parts]))
    entropy = out.masked_scatter(keep, torch.cat([e for _, (_, e) in parts]))
    return logps, entropy
