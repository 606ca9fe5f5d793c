"""Context parallelism: each row's positions split over the `cp` ranks of one data-parallel batch, with packed
documents kept apart.

The split is load-balanced for causal attention (zigzag, as in Llama 3's long-context training and ring-flash-
attention): a row of L positions is cut into 2·cp chunks and rank i holds chunks i and 2·cp - 1 - i, so every rank
has as many early (cheap) as late (expensive) queries. Every tensor of the batch is split the same way: the
labels are already shifted (labels[t] is the target of position t), so no target is lost at a chunk edge; the
position ids travel with their tokens, so RoPE sees each token's own position.

The attention: each rank all-gathers (shardtune.distributed.context_parallel) the keys and values of its row (its queries stay local), puts them in the
row's order and runs SDPA with a mask that is causal by global position and within each document, the documents
read off the whole row's position ids before the split (a document starts where the position does not follow the
previous one). So documents that span two chunks, or two ranks, attend exactly as in one process, and no document
ever sees another. All-gathering K/V (rather than a ring of partial softmaxes) keeps any attention kernel usable
with an exact backward: the gather's backward is a reduce-scatter of the K/V gradients. Its cost is the row's K/V
per rank (2·L·kv_heads·head_dim per layer, not the L² scores), which GQA makes small; see docs/long_context.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Batch keys that hold one value per position, split with the row; the others are per row and stay whole.
POSITION_KEYS = ("input_ids", "position_ids", "labels")


@dataclass(frozen=True)
class CPShard:
    """One rank's share of a micro-batch: what its queries may attend to in the row, and how it gets the row's
    keys and values (shardtune.distributed.context_parallel all-gathers them over the batch's cp ranks)."""

    mask: torch.Tensor  # [B, 1, L_local, L] bool: causal by row position and within the query's document
    gather: Callable[[torch.Tensor], torch.Tensor]  # [B, heads, L_local, d] -> [B, heads, L, d] in row order


def zigzag(length: int, size: int, rank: int) -> torch.Tensor:
    """The row positions rank `rank` of `size` holds: chunks rank and 2·size - 1 - rank of 2·size."""
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def padded_length(length: int, size: int) -> int:
    return -(-length // (2 * size)) * (2 * size)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: a running document index per row (a new document where the position does not follow)."""
    breaks = torch.ones_like(position_ids, dtype=torch.bool)
    breaks[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return breaks.long().cumsum(dim=1)


def split(batch: dict[str, torch.Tensor], *, size: int, rank: int, pad_id: int):
    """(this rank's part of every position-wise tensor of `batch`, its queries' mask over the row [B, 1, L_local,
    L], `order`: gathered (rank-major) position -> row position). Rows are padded to a multiple of 2·size:
    padding is a document of its own (positions from 0) without targets."""
    length = batch["input_ids"].shape[1]
    full = padded_length(length, size)
    batch = dict(batch)
    if full != length:
        extra = full - length
        pad = {"input_ids": pad_id, "labels": -100}
        for key in ("input_ids", "labels"):
            batch[key] = F.pad(batch[key], (0, extra), value=pad[key])
        tail = torch.arange(extra, dtype=batch["position_ids"].dtype).expand(batch["position_ids"].shape[0], -1)
        batch["position_ids"] = torch.cat([batch["position_ids"], tail], dim=1)
    docs = document_ids(batch["position_ids"])
    mine = zigzag(full, size, rank)
    gathered = torch.cat([zigzag(full, size, r) for r in range(size)])
    local = {k: (v[:, mine] if k in POSITION_KEYS else v) for k, v in batch.items()}
    causal = torch.arange(full)[None, :] <= mine[:, None]  # [L_local, L]
    mask = (docs[:, mine, None] == docs[:, None, :]) & causal[None]
    return local, mask[:, None], torch.argsort(gathered)


def attention(q, k, v, shard: CPShard, dropout: float, scaling: float | None) -> torch.Tensor:
    """This rank's queries [B, H, L_local, d] against its rows' gathered keys and values -> [B, L_local, H, d]."""
    keys, values = shard.gather(k), shard.gather(v)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=shard.mask.to(q.device), dropout_p=dropout, scale=scaling,
        enable_gqa=q.shape[1] != keys.shape[1],
    )  # fmt: skip
    return out.transpose(1, 2)
