"""Documents to rows: truncation, shifted labels, best-fit-decreasing packing, and compact row storage.

A document is its token ids and a boolean per token saying whether that token is a training target. Labels are
stored already shifted: `labels[i]` is the token to predict at position i, -100 where there is none (the last token
of every document, padding, and tokens that are not targets).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


@dataclass
class Document:
    ids: np.ndarray  # int32 token ids
    targets: np.ndarray  # bool, True where the token may be predicted


class RowSequence(Sequence):
    """Rows of token ids of varying length: `rows[i]` is a list of ints, `rows.array(i)` a numpy array. Subclasses
    say where row i lives (`_row`), how many there are and their lengths."""

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.array(i).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))

    def array(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        return self._row(i % n)

    def _row(self, i: int) -> np.ndarray:
        raise NotImplementedError


class RaggedRows(RowSequence):
    """Rows stored as one flat int32 array plus row offsets (in memory)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        assert offsets.ndim == 1 and offsets[0] == 0 and offsets[-1] == len(flat)
        self.flat = flat
        self.offsets = offsets

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]]) -> RaggedRows:
        arrays = [np.asarray(r, dtype=np.int32) for r in rows]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
        return cls(flat, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _row(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]  # a view, no copy

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def shifted_labels(doc: Document) -> np.ndarray:
    """labels[i] = ids[i + 1] where that token is a target; the last position never has a target."""
    labels = np.full(len(doc.ids), IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(doc.targets[1:], doc.ids[1:], IGNORE_INDEX)
    return labels


def fit_documents(docs: list[Document], max_length: int, drop_long: bool) -> tuple[list[Document], int, int]:
    """Truncate (or drop, with drop_long) documents longer than max_length; return (kept, truncated, dropped).

    A document whose targets all lie past max_length (a prompt alone filling it) is dropped, as TRL drops the
    examples truncation leaves fully masked: it would add no loss."""
    kept, truncated, dropped = [], 0, 0
    for doc in docs:
        if len(doc.ids) <= max_length:
            kept.append(doc)
        elif drop_long or not doc.targets[:max_length].any():
            dropped += 1
        else:
            truncated += 1
            kept.append(Document(doc.ids[:max_length], doc.targets[:max_length]))
    return kept, truncated, dropped


def best_fit_decreasing(lengths: Sequence[int], max_length: int, seed: int) -> list[list[int]]:
    """Group document indices into rows of at most max_length tokens, never splitting a document.

    Longest documents are placed first, each into the open row with the least room that still fits it. Documents of
    equal length are taken in an order shuffled by `seed`, so the result is deterministic given the seed.
    """
    docs, offsets = best_fit_decreasing_flat(lengths, max_length, seed)
    return [docs[a:b].tolist() for a, b in itertools.pairwise(offsets.tolist())]


def best_fit_decreasing_flat(lengths: Sequence[int], max_length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`best_fit_decreasing` as two arrays: the document indices of all rows, row after row (each row's documents
    in the order they were placed), and the row offsets into them. Memory is a few integers per document, so that
    tens of millions of documents pack without Python lists of lists."""
    lengths = np.asarray(lengths, dtype=np.int64)
    assert (lengths >= 1).all() and (lengths <= max_length).all()
    perm = np.random.default_rng(seed).permutation(len(lengths))
    order = perm[np.argsort(-lengths[perm], kind="stable")]
    row_of = np.empty(len(lengths), dtype=np.int64)  # row of each placed document, in placement order
    n_rows = 0
    caps: list[int] = []  # distinct remaining capacities of open rows, sorted
    by_cap: dict[int, list[int]] = {}  # remaining capacity -> open rows with it
    for k, n in _in_blocks(lengths[order]):
        pos = bisect.bisect_left(caps, n)
        if pos < len(caps):
            cap = caps[pos]
            row = by_cap[cap].pop()
            if not by_cap[cap]:
                del by_cap[cap], caps[pos]
        else:
            cap, row = max_length, n_rows
            n_rows += 1
        row_of[k] = row
        rest = cap - n
        if rest > 0:
            if rest not in by_cap:
                by_cap[rest] = []
                bisect.insort(caps, rest)
            by_cap[rest].append(row)
    # Group by row, keeping placement order within a row (stable sort).
    grouped = np.argsort(row_of, kind="stable")
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=n_rows), out=offsets[1:])
    return order[grouped], offsets


def _in_blocks(values: np.ndarray, block: int = 1 << 16):
    """(index, value) as Python ints, converted a block at a time: no list of every value at once."""
    for start in range(0, len(values), block):
        yield from enumerate(values[start : start + block].tolist(), start)


def build_rows(docs: list[Document], groups: list[list[int]], *, row_length: int | None, pad_id: int) -> dict:
    """Concatenate each group of documents into a row, padded to row_length (None: no padding).

    Position ids restart at 0 for every document and again for the padding, which forms its own document.
    Returns {"input_ids", "labels", "position_ids"} as RaggedRows and the padding token count.
    """
    ids_parts, label_parts, pos_parts, lengths = [], [], [], []
    padding = 0
    for group in groups:
        total = 0
        for i in group:
            doc = docs[i]
            ids_parts.append(doc.ids)
            label_parts.append(shifted_labels(doc))
            pos_parts.append(np.arange(len(doc.ids), dtype=np.int32))
            total += len(doc.ids)
        if row_length is not None and total < row_length:
            n = row_length - total
            ids_parts.append(np.full(n, pad_id, dtype=np.int32))
            label_parts.append(np.full(n, IGNORE_INDEX, dtype=np.int32))
            pos_parts.append(np.arange(n, dtype=np.int32))
            padding += n
            total = row_length
        lengths.append(total)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)

    def ragged(parts: list[np.ndarray]) -> RaggedRows:
        return RaggedRows(np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32), offsets)

    return {
        "input_ids": ragged(ids_parts),
        "labels": ragged(label_parts),
        "position_ids": ragged(pos_parts),
        "padding_tokens": padding,
    }
