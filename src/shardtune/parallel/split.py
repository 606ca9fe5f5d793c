"""Context parallelism: each row's positions split over the `cp` ranks of one data-parallel batch, with packed
documents kept apart.

The split is load-balanced for causal attention (zigzag, as in Llama 3's long-context training and ring-flash-
attention): a row of L positions is cut into 2·cp chunks and rank i holds chunks i and 2·cp - 1 - i, so every rank
has as many early (cheap) as late (expensive) queries. Every tensor of the batch is split the same way: the
labels are already shifted (labels[t] is the target of position t), so no target is lost at a chunk edge; the
position ids travel with their tokens, so RoPE sees each token's own position.

The attention (shardtune.models.fastpath's, given a CPShard): the documents are read off the whole row's position ids
before the split (a document starts where the position does not follow the previous one). Within a rank's chunk,
the documents that begin in it attend among its own positions, per document as without context parallelism; the
part of a document that began in an earlier chunk attends the row's keys from that document's start, all-gathered
over the cp ranks (shardtune.parallel.context_parallel), causal aligned at the bottom right. So documents that
span two chunks, or two ranks, attend exactly as in one process, no document ever sees another, and no mask of
the whole row is built. All-gathering K/V (rather than a ring of partial softmaxes) keeps any attention kernel usable
with an exact backward: the gather's backward is a reduce-scatter of the K/V gradients. Its cost is the row's K/V
per rank (2·L·kv_heads·head_dim per layer, not the L² scores), which GQA makes small; see docs/long_context.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

# Batch keys that hold one value per position, split with the row; the others are per row and stay whole.
POSITION_KEYS = ("input_ids", "position_ids", "labels")


@dataclass(frozen=True)
class Part:
    """Consecutive local positions [start, end) of one rank's chunk of a row. With key_start None, documents that
    began within the chunk: the queries attend within these local positions only (`spans`: their per-document
    spans, shardtune.models.fastpath.packed_documents of these positions, set by shardtune.parallel.context_parallel).
    Otherwise the part of a document that began before the chunk, at row position key_start: the queries attend
    the gathered row's keys [key_start, key_end), causal aligned at the bottom right (the last query sees all)."""

    start: int
    end: int
    key_start: int | None = None
    key_end: int | None = None
    spans: tuple = ()


@dataclass(frozen=True)
class CPShard:
    """One rank's share of a micro-batch: its rows' parts in local order, and how it gets the rows' keys and
    values (shardtune.parallel.context_parallel all-gathers them over the batch's cp ranks)."""

    rows: tuple[tuple[Part, ...], ...]
    gather: Callable[[torch.Tensor], torch.Tensor]  # [B, heads, L_local, d] -> [B, heads, L, d] in row order
    varlen: Varlen | None = None  # the same attention as one flash-attention varlen call (CUDA), or per part (SDPA)
    # A per-row value (a sequence's log-prob, its target count) summed over the batch's cp ranks, differentiably.
    sum_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    positions: torch.Tensor | None = None  # the local position ids [B, L_local], host copy (select_rows' varlen)
    size: int = 1
    # The row positions the rank holds [L_local] (zigzag), and the rows' length before padding to 2·size chunks.
    row_index: torch.Tensor | None = None
    length: int = 0
    # A mixture of experts' router logits (one [tokens, experts] tensor per layer) and their token mask
    # ([B, L_local]) gathered over the cp ranks, differentiably: the load-balancing loss of the whole rows.
    gather_tokens: Callable | None = None

    def real(self) -> torch.Tensor:
        """[B, L_local] 1 on the rows' positions, 0 on the ones padded for the split."""
        return (self.row_index < self.length).long()[None].expand(len(self.rows), -1)

    def select_rows(self, rows: slice) -> CPShard:
        """The shard of some of the micro-batch's rows, for a forward on those rows alone (KTO's KL rows)."""
        layout = self.varlen
        if layout is not None:
            layout = varlen(self.rows[rows], self.positions[rows], self.positions.shape[1] * self.size)
            layout = layout.to(self.varlen.cu_q.device)
        return replace(self, rows=self.rows[rows], varlen=layout, positions=self.positions[rows])


@dataclass(frozen=True)
class Varlen:
    """A rank's whole context-parallel attention as one variable-length call (flash-attention's
    flash_attn_varlen_func, causal: aligned at the bottom right where a segment has more keys than queries).

    The queries are the rank's positions flattened row after row ([B·L_local]), cut into segments: each document
    begun in a local part, and each part of a document begun in an earlier chunk. A segment's keys are taken by
    `key_index` from the local keys flattened ([B·L_local]) followed by the gathered rows' keys ([B·L]): a local
    document's own positions, or a crossing part's row keys [key_start, key_end)."""

    cu_q: torch.Tensor  # int32 [segments + 1]: cumulative query lengths
    cu_k: torch.Tensor  # int32 [segments + 1]: cumulative key lengths
    max_q: int
    max_k: int
    key_index: torch.Tensor  # int64 [total keys]

    def to(self, device: torch.device) -> Varlen:
        return replace(self, cu_q=self.cu_q.to(device), cu_k=self.cu_k.to(device), key_index=self.key_index.to(device))


def varlen(rows: tuple[tuple[Part, ...], ...], positions: torch.Tensor, row_len: int) -> Varlen:
    """The Varlen of a rank's parts (`rows`, as split gives them) and its local position ids [B, L_local], for
    rows of row_len positions (padded)."""
    batch, local_len = positions.shape
    q_lens, keys = [], []
    for b, parts in enumerate(rows):
        for p in parts:
            if p.key_start is not None:
                q_lens.append(p.end - p.start)
                start = batch * local_len + b * row_len
                keys.append(torch.arange(start + p.key_start, start + p.key_end))
                continue
            start = b * local_len + p.start
            docs = document_ids(positions[b : b + 1, p.start : p.end])[0]
            for n in torch.unique_consecutive(docs, return_counts=True)[1].tolist():
                q_lens.append(n)
                keys.append(torch.arange(start, start + n))
                start += n
    k_lens = [len(k) for k in keys]
    return Varlen(_cumulative(q_lens), _cumulative(k_lens), max(q_lens), max(k_lens), torch.cat(keys))


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


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
    """(this rank's part of every position-wise tensor of `batch`, each row's Parts in local order, `order`:
    gathered (rank-major) position -> row position). Rows are padded to a multiple of 2·size: padding is a
    document of its own (positions from 0) without targets."""
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
    mine = zigzag(full, size, rank)
    gathered = torch.cat([zigzag(full, size, r) for r in range(size)])
    local = {k: (v[:, mine] if k in POSITION_KEYS else v) for k, v in batch.items()}
    chunk = full // (2 * size)
    rows = tuple(_parts(row, chunk, (rank, 2 * size - 1 - rank)) for row in document_ids(batch["position_ids"]))
    return local, rows, torch.argsort(gathered)


def _parts(docs: torch.Tensor, chunk: int, chunks: tuple[int, int]) -> tuple[Part, ...]:
    """A row's local Parts: for each of the rank's two chunks, the part of a document that began before it (if
    any), then the rest of the chunk."""
    starts = [0, *(torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1).tolist()]
    ends = [*starts[1:], docs.numel()]
    parts = []
    for i, c in enumerate(chunks):
        s, offset = c * chunk, i * chunk
        d = max(j for j, st in enumerate(starts) if st <= s)
        n = 0
        if starts[d] < s:  # a document from an earlier chunk: its queries here see its keys from its start
            n = min(chunk, ends[d] - s)
            parts.append(Part(offset, offset + n, key_start=starts[d], key_end=s + n))
        if n < chunk:
            parts.append(Part(offset + n, offset + chunk))
    return tuple(parts)
