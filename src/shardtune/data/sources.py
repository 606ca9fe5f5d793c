"""Where rows come from: a hub dataset, a `save_to_disk` folder, a folder of data files, or one data file.

`--dataset_name` is resolved in this order:

1. an existing local file ending in .jsonl/.json/.parquet/.csv: a single (training) split;
2. an existing folder holding `dataset_dict.json` (a saved DatasetDict): its splits;
3. an existing folder holding `state.json` (a saved Dataset): a single (training) split;
4. an existing folder with one `save_to_disk` folder per split (`<dir>/<split>/`) or one data file per split
   (`<dir>/<split>.jsonl|json|parquet|csv`);
5. otherwise, if it is a hub id (runtime.hub.is_hub_id), that hub dataset: `datasets.load_dataset(name, split=split)`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from shardtune.runtime.hub import is_hub_id

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# What --dataset_name may name, for the messages that refuse a name.
ACCEPTED = (
    f"an existing {'/'.join(FILE_BUILDERS)} file, a folder saved with save_to_disk, a folder of <split>.<ext> "
    "files, or a hub dataset id"
)


def is_hub_dataset(dataset_name: str) -> bool:
    """Whether --dataset_name names a hub dataset rather than a local file or folder: runtime.hub.is_hub_id, with
    a name ending in a data file's suffix (any case) taken as a file, so that a missing `train.jsonl` is refused
    as a missing file (by validation, before the model loads) instead of being looked up on the hub."""
    return is_hub_id(dataset_name, file_suffixes=FILE_BUILDERS)


def dataset_problems(dataset_name: str | None, *, check_paths: bool = True) -> list[str]:
    """--dataset_name given, and (with `check_paths`) a local name that exists, checked with the run's flags."""
    if not dataset_name:
        return [f"--dataset_name is required: {ACCEPTED}."]
    if check_paths and not is_hub_dataset(dataset_name) and not Path(dataset_name).expanduser().exists():
        return [f"--dataset_name {dataset_name}: no such file or folder; give {ACCEPTED}."]
    return []


@dataclass(frozen=True)
class SplitRequest:
    """The splits named by `--splits`: the first is trained on, the optional second is evaluated."""

    train: str
    eval: str | None


def parse_splits(splits: str) -> SplitRequest:
    """Parse `--splits "train,test"` (one or two comma-separated names)."""
    names = [s.strip() for s in splits.split(",") if s.strip()]
    if not 1 <= len(names) <= 2:
        raise ValueError(
            f"--splits {splits!r} must name one or two splits separated by a comma "
            "(the training split, then optionally the evaluation split), e.g. --splits train,test."
        )
    if len(names) == 2 and names[0] == names[1]:
        raise ValueError(f"--splits {splits!r} names the same split twice; give distinct train and eval splits.")
    return SplitRequest(names[0], names[1] if len(names) == 2 else None)


def load_split(dataset_name: str, split: str, *, is_train: bool, streaming: bool = False):
    """Load one split as a `datasets.Dataset`, or with streaming as an `IterableDataset` read while it is iterated
    (data files and hub datasets are then never converted to Arrow first; a save_to_disk split is memory-mapped
    Arrow already and is iterated as it is). Raise ValueError naming --dataset_name/--splits on any mistake."""
    ds = _load(dataset_name, split, is_train, streaming)
    if streaming and not hasattr(ds, "skip"):  # a save_to_disk Dataset
        ds = ds.to_iterable_dataset()
    return ds


def _load(dataset_name: str, split: str, is_train: bool, streaming: bool):
    path = Path(dataset_name).expanduser()
    file_loader = partial(_load_file, streaming=streaming)
    if path.is_file():
        return _load_single(path, split, is_train, file_loader)
    if path.is_dir():
        return _load_from_dir(path, split, is_train, file_loader)
    if not is_hub_dataset(dataset_name):  # a data file's name is never a hub id
        raise ValueError(f"--dataset_name {dataset_name!r}: no such file or folder. Give {ACCEPTED}.")
    return _load_hub(dataset_name, split, streaming)


def dataset_identity(dataset, dataset_name: str, split: str) -> str:
    """A string that changes whenever the rows of this split may have changed (used in the cache key)."""
    parts = [dataset_name, split, str(getattr(dataset, "_fingerprint", "")), str(len(dataset))]
    for f in dataset.cache_files:
        p = Path(f["filename"])
        if p.exists():
            st = p.stat()
            parts.append(f"{p}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def requested_splits(data) -> list[tuple[str, object] | None]:
    """The train and eval splits --splits asks for (`data`: the run's DataArguments), each loaded, checked not
    empty and cut to --max_train_samples / --max_eval_samples: [(name, dataset) or None, (name, dataset) or None]."""
    request = parse_splits(data.splits)
    out = []
    for split, limit, flag in (
        (request.train, data.max_train_samples, "--max_train_samples"),
        (request.eval, data.max_eval_samples, "--max_eval_samples"),
    ):
        if split is None:
            out.append(None)
            continue
        ds = load_split(data.dataset_name, split, is_train=split == request.train)
        check_not_empty(ds, data.dataset_name, split)
        if limit is not None:
            if limit < 1:
                raise ValueError(f"{flag} must be >= 1 (got {limit}).")
            ds = ds.select(range(min(len(ds), limit)))
        out.append((split, ds))
    return out


def check_not_empty(dataset, dataset_name: str, split: str) -> None:
    if len(dataset) == 0:
        _empty(dataset_name, split)


def _empty(where: str, split: str):
    raise ValueError(f"--dataset_name {where!r}: split {split!r} is empty; give a split with rows.")


def _load_file(path: Path, split: str, streaming: bool = False):
    import datasets

    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"--dataset_name {str(path)!r}: unsupported file type {path.suffix!r}; "
            f"use one of {', '.join(FILE_BUILDERS)} or a save_to_disk folder."
        )
    if path.stat().st_size == 0:
        _empty(str(path), split)
    if builder in ("json", "csv"):
        check_utf8(path)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming)
    except Exception as e:  # a malformed file: say which one
        if "corresponds to no data" in str(e) or isinstance(e, StopIteration):
            _empty(str(path), split)
        raise ValueError(f"--dataset_name: could not read {str(path)!r} as {builder}: {e!r}") from e


# Read in blocks cut at line ends: a newline byte is never inside a multi-byte UTF-8 character, so each block
# decodes on its own and an error's offset gives its line.
_UTF8_BLOCK = 1 << 24


def check_utf8(path: Path) -> None:
    """Refuse a text data file that is not UTF-8, naming its line. The datasets library reads the bytes into Arrow
    unchecked (json) and fails later, in a tokenizer worker, with a traceback that names no file; one pass over
    the file here (at disk speed; an ASCII block is only scanned, not decoded) says where the byte is and how to
    re-encode it. Lines are counted only once a bad byte is found."""
    start = 0
    with open(path, "rb") as f:
        while block := f.read(_UTF8_BLOCK) + f.readline():
            try:
                block.isascii() or block.decode("utf-8")
            except UnicodeDecodeError as e:
                line = _lines_before(path, start) + block.count(b"\n", 0, e.start) + 1
                col = e.start - (block.rfind(b"\n", 0, e.start) + 1) + 1
                raise ValueError(
                    f"--dataset_name: {str(path)!r} is not UTF-8: line {line}, byte {col} is "
                    f"0x{block[e.start]:02x} ({e.reason}). Re-encode the file as UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8 {path} > {path.with_suffix('.utf8' + path.suffix)}` "
                    "(give the file's real encoding after -f)."
                ) from None
            start += len(block)


def _lines_before(path: Path, offset: int) -> int:
    """Newlines in the file's first `offset` bytes."""
    n = 0
    with open(path, "rb") as f:
        while offset > 0 and (chunk := f.read(min(offset, _UTF8_BLOCK))):
            n, offset = n + chunk.count(b"\n"), offset - len(chunk)
    return n


def _load_single(path: Path, split: str, is_train: bool, loader):
    """A single file or saved Dataset is the training split; an evaluation split must come from elsewhere."""
    if not is_train:
        raise ValueError(
            f"--splits asks for an evaluation split {split!r}, but --dataset_name {str(path)!r} holds a single "
            "split. Pass only the training split (e.g. --splits train), or point --dataset_name at a folder with "
            f"one file or save_to_disk folder per split (e.g. train.jsonl and {split}.jsonl)."
        )
    return loader(path, split)


def _load_disk(path: Path, split: str):
    from datasets import load_from_disk

    try:
        return load_from_disk(str(path))
    except Exception as e:  # datasets cannot reload a saved split with no rows (IndexError on zero shards)
        raise ValueError(
            f"--dataset_name: could not load the save_to_disk folder {str(path)!r} for split {split!r} ({e!r}). "
            "datasets cannot reload a saved split that has no rows: check that every split saved there has rows."
        ) from e


def _load_from_dir(path: Path, split: str, is_train: bool, file_loader=_load_file):
    if (path / "dataset_dict.json").exists():
        dd = _load_disk(path, split)
        if split not in dd:
            _missing_split(path, split, list(dd.keys()))
        return dd[split]
    if (path / "state.json").exists():
        return _load_single(path, split, is_train, _load_disk)
    available = _dir_splits(path)
    if split not in available:
        _missing_split(path, split, sorted(available))
    target = available[split]
    return _load_disk(target, split) if target.is_dir() else file_loader(target, split)


def _dir_splits(path: Path) -> dict[str, Path]:
    """Splits of a folder: `<split>/` saved with save_to_disk (preferred) or `<split>.<ext>` data files."""
    found: dict[str, Path] = {}
    for child in sorted(path.iterdir()):
        if child.is_file() and child.suffix.lower() in FILE_BUILDERS:
            found.setdefault(child.stem, child)
    for child in sorted(path.iterdir()):
        if child.is_dir() and (child / "state.json").exists():
            found[child.name] = child
    return found


def _missing_split(path: Path, split: str, available: list[str]) -> None:
    listed = ", ".join(repr(s) for s in available) if available else "none"
    raise ValueError(
        f"--splits: split {split!r} not found in --dataset_name {str(path)!r} (available splits: {listed}). "
        "Name existing splits in --splits, e.g. --splits train,test."
    )


def _load_hub(name: str, split: str, streaming: bool = False):
    import datasets

    try:
        return datasets.load_dataset(name, split=split, streaming=streaming)
    except ValueError as e:
        if "split" in str(e).lower():
            raise ValueError(f"--splits: split {split!r} not found in hub dataset {name!r}: {e}") from e
        raise ValueError(f"--dataset_name {name!r}: could not load it from the hub: {e}") from e
    except Exception as e:  # network or missing repo: the fix is the same
        raise ValueError(
            f"--dataset_name {name!r} is not a local file or folder and could not be loaded from the hub ({e}). "
            "Check the id and your connection, or give a local path."
        ) from e
