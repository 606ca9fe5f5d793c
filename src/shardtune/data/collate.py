"""Batches for one rank: a per-epoch permutation cut into global batches, each rank taking its contiguous slice.

One process with batch B*N sees exactly the rows (and tensors) that N ranks with batch B see together, step by step:
rows are padded to the longest row of the *global* batch, so concatenating the ranks' batches gives the single
process's batch. Without attention_mask, transformers derives a block-diagonal causal mask from position_ids, so
padding (whose position ids restart at 0) is its own document and never changes the real tokens' outputs.
The model must be called with `use_cache=False`: when it builds a cache, transformers skips that packed-mask
detection (masking_utils._preprocess_mask_arguments) and documents in a row would attend to each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from .packing import IGNORE_INDEX

if TYPE_CHECKING:  # torch is imported where batches are made: tokenizing processes never need it
    import torch


def num_batches(split, *, batch_size: int, world_size: int, drop_last: bool = True) -> int:
    """Steps per epoch: global batches of batch_size * world_size rows (the last partial one kept unless drop_last)."""
    rows, per_step = len(split.input_ids), batch_size * world_size
    return rows // per_step if drop_last else -(-rows // per_step)


def epoch_order(n_rows: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The row order of an epoch: a permutation seeded by seed + epoch (or 0..n-1 without shuffle)."""
    if not shuffle:
        return np.arange(n_rows)
    return np.random.default_rng(seed + epoch).permutation(n_rows)


def iterate_batches(
    split,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    epoch: int,
    seed: int,
    shuffle: bool,
    start_batch: int = 0,
    pad_id: int,
    drop_last: bool = True,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's batches ({input_ids, labels, position_ids}: LongTensor [batch_size, seq]) for one epoch.

    start_batch skips global batches already consumed (exact resume). With drop_last=False the last global batch
    is filled up with rows that have no targets (pad ids, labels -100), so every rank runs the same number of
    steps and a loss summed over targets is unchanged.
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid batching: batch_size={batch_size}, rank={rank}, world_size={world_size}")
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0 (got {start_batch})")
    lengths = _row_lengths(split.input_ids)
    order = epoch_order(len(lengths), seed=seed, epoch=epoch, shuffle=shuffle)
    per_step = batch_size * world_size
    for b in range(start_batch, num_batches(split, batch_size=batch_size, world_size=world_size, drop_last=drop_last)):
        step_rows = order[b * per_step : (b + 1) * per_step]
        seq_len = int(lengths[step_rows].max())
        mine = step_rows[rank * batch_size : (rank + 1) * batch_size]
        yield collate_rows(split, mine, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)


def collate_rows(split, rows: np.ndarray, *, batch_size: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Stack rows into [batch_size, seq_len] tensors; missing rows are filler with no targets."""
    import torch

    input_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    labels = np.full((batch_size, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.tile(np.arange(seq_len, dtype=np.int64), (batch_size, 1))
    for j, r in enumerate(rows.tolist()):
        ids = _row(split.input_ids, r)
        n = len(ids)
        input_ids[j, :n] = ids
        labels[j, :n] = _row(split.labels, r)
        position_ids[j, :n] = _row(split.position_ids, r)
        position_ids[j, n:] = np.arange(seq_len - n)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
    }


def _row(rows, i: int) -> np.ndarray:
    # RaggedRows and the cache's LazyRows give numpy rows without a detour through lists.
    return rows.array(i) if hasattr(rows, "array") else np.asarray(rows[i])


def _row_lengths(rows) -> np.ndarray:
    if hasattr(rows, "lengths"):
        return rows.lengths()
    return np.array([len(r) for r in rows], dtype=np.int64)
