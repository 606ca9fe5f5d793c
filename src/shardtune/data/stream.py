"""`--streaming True`: the training split read as a stream, tokenized (and packed with --packing) online window by
window, resumable exactly.

The stream's rows are cut into windows of `--packing_window` consecutive rows. Each window is tokenized, packed
best-fit-decreasing with --packing (as the cached path packs a whole split: no row mixes documents' attention, same
row format; without it one document a row, as the cached path too: DataArguments.packed_rows decides both) and its
rows shuffled; the windows' rows, one window after the other, form the epoch's row stream. Global batches
of batch_size × world_size rows are cut from that stream and each rank takes its contiguous slice, as
`iterate_batches` does: every rank reads and packs the same windows, so they agree on every batch without talking
to each other (each rank tokenizes the stream: far cheaper than the training step it feeds). The last partial
global batch of an epoch is dropped, as in the cached path.

Window 0 is packed with --seed and its rows shuffled as `epoch_order` shuffles a cached split, so a window that holds
the whole split gives exactly the cached path's batches.

The position is (epoch, window, rows of the window consumed): always at a global batch boundary, since it is saved
between optimizer steps. Resuming skips the rows of the earlier windows without tokenizing them, re-packs the
window and continues at that row.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .collate import collate_rows, epoch_order
from .packing import best_fit_decreasing, build_rows, fit_documents
from .prepare import documents, read_columns, row_settings, row_values
from .sources import load_split

if TYPE_CHECKING:  # torch is imported where batches are made: tokenizing processes never need it
    import torch


@dataclass
class StreamingSplit:
    """A training split that is never held whole: `batches` reads, packs and collates it window by window."""

    tokenizer: object
    dataset_name: str
    split: str
    column: str
    opts: dict
    pad_id: int
    window: int
    max_samples: int | None = None
    columns: tuple[str, ...] = ()  # the split's columns (those read_columns takes are read)
    stats: dict | None = None
    from_cache: bool = False
    cache_path: str | None = None
    digest: str | None = None

    def _rows(self):
        ds = load_split(self.dataset_name, self.split, is_train=True, streaming=True)
        return ds.take(self.max_samples) if self.max_samples is not None else ds

    def windows(self, *, epoch: int, seed: int, start_window: int = 0) -> Iterator[tuple[int, dict, np.ndarray]]:
        """(window index, its packed rows, their order) from start_window on; earlier rows are skipped unread."""
        names = read_columns(self.column, self.columns)
        it = iter(self._rows().skip(start_window * self.window).select_columns(names))
        for w in itertools.count(start_window):
            batch = {c: [] for c in names}
            for r in itertools.islice(it, self.window):
                for c in names:
                    batch[c].append(r[c])
            values = row_values(batch, self.column)
            if not values:
                return
            rows = self.pack(values, first_row=w * self.window, seed=seed + w,
                             settings=row_settings(batch, self.column))  # fmt: skip
            n = len(rows["input_ids"])
            # Window 0 in the cached path's order (see the module docstring); the others from (seed, epoch, window).
            order = (
                epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
                if w == 0
                else np.random.default_rng([seed, epoch, w]).permutation(n)
            )
            yield w, rows, order

    def pack(self, values: list, *, first_row: int, seed: int, settings: list[dict] | None = None) -> dict:
        """Tokenize one window's values (settings: their rows' template columns) and pack them (or one document a
        row without --packing)."""
        o = self.opts
        docs = documents(self.tokenizer, values, self.split, self.column, o, first_row, settings)
        docs, _, _ = fit_documents(docs, o["max_length"], o["drop_long_samples"])
        if o["packing"]:
            groups = best_fit_decreasing([len(d.ids) for d in docs], o["max_length"], seed) if docs else []
            return build_rows(docs, groups, row_length=o["max_length"], pad_id=self.pad_id)
        return build_rows(docs, [[i] for i in range(len(docs))], row_length=None, pad_id=self.pad_id)

    def batches(
        self, *, batch_size: int, rank: int, world_size: int, seed: int, position: list[int] | None
    ) -> Iterator[tuple[dict[str, torch.Tensor], list[int]]]:
        """This rank's micro-batches from `position` on, across epochs, each with the position after it."""
        per_step = batch_size * world_size
        epoch, start_window, start_row = position or (0, 0, 0)
        while True:
            pending: list[tuple[dict, int]] = []  # (window rows, row) of the global batch being filled
            produced = False
            for w, rows, order in self.windows(epoch=epoch, seed=seed, start_window=start_window):
                first = start_row if w == start_window else 0
                for k in range(first, len(order)):
                    pending.append((rows, int(order[k])))
                    if len(pending) == per_step:
                        batch = _collate(pending, rank * batch_size, batch_size, self.pad_id)
                        pending, produced = [], True
                        yield batch, [epoch, w, k + 1]
            if not produced and start_window == 0 and start_row == 0:
                raise ValueError(
                    f"--streaming: split {self.split!r} of --dataset_name {self.dataset_name!r} gives fewer rows than "
                    f"one global batch of {per_step} ({batch_size} per device × {world_size} ranks); add data or "
                    "lower --per_device_train_batch_size."
                )
            epoch, start_window, start_row = epoch + 1, 0, 0


class _GlobalBatch:
    """The rows of one global batch, in the shape collate_rows reads (input_ids/labels/position_ids[i])."""

    def __init__(self, pending: list[tuple[dict, int]]):
        self.input_ids = [rows["input_ids"].array(r) for rows, r in pending]
        self.labels = [rows["labels"].array(r) for rows, r in pending]
        self.position_ids = [rows["position_ids"].array(r) for rows, r in pending]


def _collate(pending: list[tuple[dict, int]], first: int, batch_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    g = _GlobalBatch(pending)
    seq_len = max(len(x) for x in g.input_ids)  # padded to the global batch's longest row, as iterate_batches does
    mine = np.arange(first, first + batch_size)
    return collate_rows(g, mine, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)
