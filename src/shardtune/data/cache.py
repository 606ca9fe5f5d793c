"""The on-disk cache of a prepared split: memory-mapped documents plus the packing, rows built on demand.

A cache is a folder `<split>-<key>/` holding

- `ids.npy`, `labels.npy`: every kept document's token ids and shifted labels (int32), one after the other;
- `doc_offsets.npy`: where each document starts in them (int64, documents + 1 entries);
- `row_docs.npy`, `row_offsets.npy`: the documents of each row, row after row, and where each row starts;
- `meta.json`: the format version, the row length (packing) and pad id, the split's stats, and a digest of the
  content (nodes without a shared file system compare it to check that they trained on the same rows).

It is written into a temporary folder (unique per host and process) and renamed into place once complete, so a
reader never sees half a cache and concurrent writers (several nodes on one shared file system) are harmless.
Rows are materialised from the memory maps when a batch asks for them: preparing and training hold the lengths
and the packing in memory, never the tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from shardtune.runtime.atomic import DiskFullError, fsync_dir, is_disk_full, preallocate, temp_name

from .packing import IGNORE_INDEX, RowSequence, best_fit_decreasing_flat
from .prepare import TaskResult, part_paths

CACHE_FORMAT = 2  # 1: one .npz of packed rows (read whole into memory); 2: this folder of memory maps
_ARRAYS = ("ids", "labels", "doc_offsets", "row_docs", "row_offsets")
_COPY_BLOCK = 1 << 24  # int32 values copied (and hashed) at a time while concatenating parts: 64 MiB


class PackedStore:
    """Memory-mapped documents and the rows they are packed into (row_length None: one unpadded document a row)."""

    def __init__(self, arrays: dict[str, np.ndarray], *, row_length: int | None, pad_id: int):
        self.ids, self.labels = arrays["ids"], arrays["labels"]
        self.doc_offsets, self.row_docs, self.row_offsets = (
            arrays["doc_offsets"],
            arrays["row_docs"],
            arrays["row_offsets"],
        )
        self.row_length, self.pad_id = row_length, pad_id

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def row_lengths(self) -> np.ndarray:
        if self.row_length is not None:
            return np.full(len(self), self.row_length, dtype=np.int64)
        docs = self.row_docs  # unpacked rows hold one document each
        return (self.doc_offsets[docs + 1] - self.doc_offsets[docs]).astype(np.int64)

    def row(self, i: int, kind: str) -> np.ndarray:
        """Row i's input_ids, labels or position_ids, as build_rows would have stored them."""
        ids, pos, lab = [], [], []
        for d in self.row_docs[self.row_offsets[i] : self.row_offsets[i + 1]].tolist():
            a, b = int(self.doc_offsets[d]), int(self.doc_offsets[d + 1])
            ids.append(self.ids[a:b])
            lab.append(self.labels[a:b])
            pos.append(np.arange(b - a, dtype=np.int32))
        total = sum(len(x) for x in ids)
        if self.row_length is not None and total < self.row_length:
            n = self.row_length - total  # padding: its own document, no targets
            ids.append(np.full(n, self.pad_id, dtype=np.int32))
            lab.append(np.full(n, IGNORE_INDEX, dtype=np.int32))
            pos.append(np.arange(n, dtype=np.int32))
        parts = {"input_ids": ids, "labels": lab, "position_ids": pos}[kind]
        return np.concatenate(parts).astype(np.int32, copy=False)


class LazyRows(RowSequence):
    """One field (input_ids, labels or position_ids) of a PackedStore's rows, built from the memory-mapped arrays
    when asked for."""

    def __init__(self, store: PackedStore, kind: str):
        self.store, self.kind = store, kind

    def __len__(self) -> int:
        return len(self.store)

    def _row(self, i: int) -> np.ndarray:
        return self.store.row(i, self.kind)

    def lengths(self) -> np.ndarray:
        return self.store.row_lengths()


def new_tmp_folder(final: Path) -> Path:
    """A temporary folder next to `final`, unique per host and process (node-local and shared file systems)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(temp_name(f"{final.name}.{uuid.uuid4().hex[:8]}"))
    tmp.mkdir()
    return tmp


# What to do after a full disk while the cache is written.
CACHE_FIX = "free some space there, or give --dataset_cache_dir a folder on a disk with room, then run again"


def write_cache(
    folder: Path, results: list[TaskResult], *, max_length: int, packing: bool, seed: int, pad_id: int
) -> dict:
    """Concatenate the tasks' part files in folder into the cache arrays, pack, and write meta.json; returns meta.
    A full disk is a DiskFullError naming the cache folder and the bytes it needs (the caller removes `folder`)."""
    n_docs, n_tokens = sum(r.documents for r in results), sum(r.tokens for r in results)
    try:
        return _write_cache(folder, results, n_docs, n_tokens, max_length, packing, seed, pad_id)
    except OSError as e:
        if not is_disk_full(e):
            raise
        # The whole cache's size, not the one file's that did not fit (the arrays' own reservation says that).
        needed = 2 * 4 * n_tokens + 3 * 8 * (n_docs + 1)  # ids and labels (int32), three int64 index arrays
        raise DiskFullError(folder.parent, needed, "the tokenized data cache", CACHE_FIX) from e


def _write_cache(folder, results, n_docs, n_tokens, max_length, packing, seed, pad_id) -> dict:
    digest = hashlib.blake2b(digest_size=16)
    if n_docs == 0:
        raise ValueError(
            f"every document is longer than --max_length {max_length} and --drop_long_samples is set; raise "
            "--max_length or turn off --drop_long_samples."
        )
    lengths = np.concatenate([np.fromfile(part_paths(folder, r.index)[2], dtype=np.int64) for r in results])
    assert len(lengths) == n_docs and int(lengths.sum()) == n_tokens
    for k, name in enumerate(("ids", "labels")):
        _concatenate([part_paths(folder, r.index)[k] for r in results], folder / f"{name}.npy", n_tokens, digest)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if packing:
        row_docs, row_offsets = best_fit_decreasing_flat(lengths, max_length, seed)
    else:
        row_docs, row_offsets = np.arange(n_docs, dtype=np.int64), np.arange(n_docs + 1, dtype=np.int64)
    for name, arr in (("doc_offsets", offsets), ("row_docs", row_docs), ("row_offsets", row_offsets)):
        digest.update(arr.tobytes())
        _save_synced(folder / f"{name}.npy", arr)
    for r in results:
        for p in part_paths(folder, r.index):
            p.unlink()
    n_rows = len(row_offsets) - 1
    stats = {
        "documents": n_docs,
        "rows": n_rows,
        "tokens": n_tokens,
        "target_tokens": sum(r.target_tokens for r in results),
        "padding_tokens": n_rows * max_length - n_tokens if packing else 0,
        "truncated": sum(r.truncated for r in results),
        "dropped": sum(r.dropped for r in results),
    }
    meta = {
        "format": CACHE_FORMAT,
        "row_length": max_length if packing else None,
        "pad_id": pad_id,
        "stats": stats,
        "digest": digest.hexdigest(),
    }
    with open(folder / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    return meta


def _concatenate(parts: list[Path], out: Path, total: int, digest) -> None:
    """Copy the int32 part files, in order, into one .npy of `total` values, a block at a time. The file is
    reserved on disk before it is mapped: a full disk is then an error here, not a SIGBUS while copying."""
    dest = np.lib.format.open_memmap(out, mode="w+", dtype=np.int32, shape=(total,))  # header, then a sparse file
    fd = os.open(out, os.O_RDWR)
    try:
        preallocate(fd, os.fstat(fd).st_size, out.parent.parent, "the tokenized data cache", CACHE_FIX)
    finally:
        os.close(fd)
    pos = 0
    for part in parts:
        src = np.memmap(part, dtype=np.int32, mode="r") if part.stat().st_size else np.zeros(0, np.int32)
        for a in range(0, len(src), _COPY_BLOCK):
            block = np.asarray(src[a : a + _COPY_BLOCK])
            dest[pos : pos + len(block)] = block
            digest.update(block.tobytes())
            pos += len(block)
        del src
    assert pos == total
    dest.flush()
    del dest
    fsync_dir(out)


def _save_synced(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())


def move_into_place(tmp: Path, final: Path) -> Path:
    """Rename the finished tmp folder to final. If another process (another node on a shared file system) put a
    complete cache there first, keep that one: both hold the same rows (the digests are compared by the caller)."""
    try:
        os.rename(tmp, final)
    except OSError:
        if read_meta(final) is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # a damaged folder under the final name (renames only ever put complete ones there): replace it
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


def read_meta(folder: Path) -> dict | None:
    """The cache's meta.json, or None when absent, unreadable or of another format (then it is rebuilt)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == CACHE_FORMAT else None


def open_cache(folder: Path) -> tuple[PackedStore, dict] | None:
    """Memory-map a complete cache folder; None when it is missing or not of this format."""
    meta = read_meta(folder)
    if meta is None:
        return None
    try:
        arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    except (OSError, ValueError):
        return None
    return PackedStore(arrays, row_length=meta["row_length"], pad_id=meta["pad_id"]), meta
