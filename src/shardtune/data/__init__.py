"""The data pipeline: load splits, render chats, tokenize, pack, cache, and cut batches per rank.

`build_datasets` returns tokenized (and optionally packed) splits whose labels are already shifted;
`iterate_batches` cuts them into per-rank batches. Nothing here imports torch.distributed: when several ranks
prepare data, the caller lets rank 0 build the cache first (writes are atomic, so a race is harmless anyway).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.runtime.log import print0

from .cache import CACHE_FORMAT, LazyRows, PackedStore, move_into_place, new_tmp_folder, open_cache, write_cache
from .collate import iterate_batches, num_batches
from .packing import IGNORE_INDEX, RaggedRows
from .prepare import PROMPT_COMPLETION, read_columns, tokenize_to_parts
from .sources import check_not_empty, dataset_identity, load_split, parse_splits
from .stream import StreamingSplit
from .templates import CHAT_FORMATS, padded_vocab_size, setup_tokenizer

if TYPE_CHECKING:
    from shardtune.config.arguments import DataArguments

# The DataArguments fields that shape the tokenized rows (with the seed and the chat template format).
TOKENIZE_FLAGS = (
    "dataset_name",
    "dataset_text_field",
    "max_length",
    "packing",
    "append_concat_token",
    "add_special_tokens",
    "assistant_only_loss",
    "completion_only_loss",
    "drop_long_samples",
)

# How conversations are rendered, in the cache key: 2 = with the row's tools and chat_template_kwargs columns (caches
# of version 1 rendered rows that have them without, and are not reused).
CHAT_RENDER = 2

__all__ = [
    "CHAT_FORMATS",
    "IGNORE_INDEX",
    "PreparedSplit",
    "RaggedRows",
    "StreamingSplit",
    "build_datasets",
    "iterate_batches",
    "num_batches",
    "padded_vocab_size",
    "setup_tokenizer",
]


@dataclass
class PreparedSplit:
    """One tokenized split: rows of input_ids, shifted labels (-100: no target) and position ids.

    stats: documents, rows, tokens (non-padding), target_tokens, padding_tokens, truncated, dropped.
    """

    input_ids: Sequence[Sequence[int]]
    labels: Sequence[Sequence[int]]
    position_ids: Sequence[Sequence[int]]
    stats: dict
    from_cache: bool = False
    cache_path: str | None = None
    digest: str | None = None  # of the cache's content: equal digests, equal rows

    def __len__(self) -> int:
        return len(self.input_ids)

    # The split protocol the trainer reads (as PreferenceSplit's): steps per epoch, a rank's batches, the log line.
    def num_batches(self, *, batch_size: int, world_size: int, drop_last: bool = True) -> int:
        return num_batches(self, batch_size=batch_size, world_size=world_size, drop_last=drop_last)

    def iterate(self, **kwargs) -> Iterator[dict]:
        """This rank's batches of rows (shardtune.data.collate.iterate_batches)."""
        return iterate_batches(self, **kwargs)

    def summary(self, evals: PreparedSplit | None, max_length: int) -> str:
        st = self.stats
        return (
            f"Data: {st.get('documents')} documents → {st.get('rows')} rows of up to {max_length} tokens "
            f"({st.get('truncated', 0)} truncated, {st.get('dropped', 0)} dropped); "
            f"eval rows: {len(evals.input_ids) if evals is not None else 0}."
        )


def build_datasets(
    data: DataArguments,
    *,
    tokenizer,
    seed: int,
    cache_dir: str | None = None,
    chat_template_format: str | None = None,
) -> tuple[PreparedSplit | StreamingSplit, PreparedSplit | None]:
    """Load, tokenize and (with packing) pack the train split and the optional eval split named by data.splits.

    Rows with `prompt` and `completion` columns are trained on the completion (TRL's prompt-completion format, plain
    text or conversations), rows with a `messages` column are rendered with the tokenizer's chat template, other rows
    use `dataset_text_field`; chat_template_format="none" always uses the text field, as the reference does.
    Splits are tokenized by data.dataset_num_proc processes (None: one per CPU) into memory-mapped caches in
    `cache_dir`; with data.streaming, the training split is a StreamingSplit packed data.packing_window rows at a
    time while training reads it.
    """
    max_length, splits, num_proc = data.max_length, data.splits, data.dataset_num_proc
    max_train_samples, max_eval_samples = data.max_train_samples, data.max_eval_samples
    if max_length < 2:
        raise ValueError(f"--max_length must be >= 2 (got {max_length}).")
    request = parse_splits(splits)
    # What decides the tokenized rows (and so the cache key): the data flags that shape them, the seed, the template.
    options = {name: getattr(data, name) for name in TOKENIZE_FLAGS}
    # Packed or one document a row, for the cached and the streamed split alike: the run's one rule.
    options.update(packing=data.packed_rows, seed=seed, chat_template_format=chat_template_format)
    if data.streaming:
        train = _stream_split(tokenizer, request.train, max_train_samples, data.packing_window, options)
    else:
        train = _prepare_split(
            tokenizer, request.train, True, max_train_samples, "--max_train_samples", cache_dir, options, num_proc
        )
    evaluation = None
    if request.eval is not None:
        evaluation = _prepare_split(
            tokenizer, request.eval, False, max_eval_samples, "--max_eval_samples", cache_dir, options, num_proc
        )
    return train, evaluation


def _stream_split(tokenizer, split: str, max_samples: int | None, window: int, opts: dict) -> StreamingSplit:
    """The training split as a stream; its first row is read now, so that a wrong column fails before training."""
    if window < 1:
        raise ValueError(f"--packing_window must be >= 1 (got {window}).")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max_train_samples must be >= 1 (got {max_samples}).")
    name = opts["dataset_name"]
    first = next(iter(load_split(name, split, is_train=True, streaming=True)), None)
    if first is None:
        raise ValueError(f"--dataset_name {name!r}: split {split!r} is empty; give a split with rows.")
    column = _text_column(tokenizer, list(first), split, opts)
    rows = "packed" if opts["packing"] else "one document a row (--packing False)"
    print0(f"data: split {split!r} is streamed, {window} rows at a time (--packing_window), {rows}.")
    return StreamingSplit(
        tokenizer, name, split, column, opts, _pad_id(tokenizer), window, max_samples, columns=tuple(first)
    )


def _prepare_split(
    tokenizer,
    split: str,
    is_train: bool,
    max_samples: int | None,
    samples_flag: str,
    cache_dir: str | None,
    opts: dict,
    num_proc: int | None,
) -> PreparedSplit:
    dataset_name = opts["dataset_name"]
    ds = load_split(dataset_name, split, is_train=is_train)
    check_not_empty(ds, dataset_name, split)
    if max_samples is not None:
        if max_samples < 1:
            raise ValueError(f"{samples_flag} must be >= 1 (got {max_samples}).")
        ds = ds.select(range(min(len(ds), max_samples)))
    column = _text_column(tokenizer, ds.column_names, split, opts)
    pad_id = _pad_id(tokenizer)
    key = _cache_key(tokenizer, ds, split, column, pad_id, opts)
    safe_split = re.sub(r"[^\w.-]", "_", split)  # hub splits may be slices like train[:10%]
    final = Path(cache_dir) / f"{safe_split}-{key[:32]}" if cache_dir else None
    opened = open_cache(final) if final is not None else None
    if opened is not None:
        prepared = _split_from(*opened, from_cache=True, cache_path=str(final))
    else:
        # Without a cache folder the arrays go to a temporary one, removed once mapped (the maps stay valid).
        tmp = new_tmp_folder(final) if final is not None else Path(tempfile.mkdtemp(prefix="shardtune-data-"))
        try:
            _tokenize_to_cache(tokenizer, ds, split, column, pad_id, opts, tmp, num_proc)
            folder = move_into_place(tmp, final) if final is not None else tmp
            opened = open_cache(folder)
            assert opened is not None, f"the cache just written in {folder} does not read back"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        prepared = _split_from(*opened, from_cache=False, cache_path=str(final) if final else None)
    _log_split(split, prepared)
    return prepared


def _text_column(tokenizer, columns: list[str], split: str, opts: dict) -> str:
    """PROMPT_COMPLETION for prompt/completion rows (TRL's format, which TRL takes before any other), `messages` when
    rows are chats rendered with a template, else the --dataset_text_field column."""
    field, fmt = opts["dataset_text_field"], opts["chat_template_format"]
    if "prompt" in columns and "completion" in columns:
        if "label" in columns:
            raise ValueError(
                f"split {split!r} has prompt, completion and label columns, KTO's unpaired format (the label says "
                "whether a completion is desirable): train it with --objective kto, or remove the label column to "
                "fine-tune on every completion."
            )
        return PROMPT_COMPLETION
    if opts.get("completion_only_loss"):
        raise ValueError(
            f"--completion_only_loss needs prompt/completion rows (split {split!r} has columns: {', '.join(columns)}); "
            "give `prompt` and `completion` columns, or remove the flag (--assistant_only_loss for conversations)."
        )
    has_messages = "messages" in columns
    if has_messages and fmt != "none":
        if not tokenizer.chat_template:
            raise ValueError(
                f"split {split!r} has a `messages` column but the tokenizer has no chat template. Pass "
                "--chat_template_format chatml or zephyr, or use a tokenizer that has one with --chat_template_format auto."
            )
        return "messages"
    if opts["assistant_only_loss"]:
        raise ValueError(
            "--assistant_only_loss needs rows with a `messages` column rendered with a chat template "
            f"(split {split!r} has columns: {', '.join(columns)}); set --assistant_only_loss False for plain text."
        )
    if field not in columns:
        hint = (
            " Rows have a `messages` column: pass --chat_template_format chatml, zephyr or auto to use it."
            if has_messages
            else " Name an existing column with --dataset_text_field."
        )
        raise ValueError(
            f"--dataset_text_field {field!r}: no such column in split {split!r} of --dataset_name "
            f"{opts['dataset_name']!r} (columns: {', '.join(columns)}).{hint}"
        )
    return field


def _pad_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError("the tokenizer has neither a pad nor an EOS token; set one before preparing data.")


def _tokenize_to_cache(
    tokenizer, ds, split: str, column: str, pad_id: int, opts: dict, folder: Path, num_proc: int | None
) -> None:
    """Tokenize into part files in folder (in parallel processes), then write the cache arrays there."""
    results = tokenize_to_parts(tokenizer, ds, split, column, opts, folder, num_proc)
    if not sum(r.documents for r in results):
        raise ValueError(
            f"split {split!r}: every document was dropped, longer than --max_length {opts['max_length']} with "
            "--drop_long_samples set, or with no target token within --max_length (a prompt filling it); raise "
            "--max_length or turn off --drop_long_samples."
        )
    write_cache(
        folder, results, max_length=opts["max_length"], packing=opts["packing"], seed=opts["seed"], pad_id=pad_id
    )


def _split_from(store: PackedStore, meta: dict, *, from_cache: bool, cache_path: str | None) -> PreparedSplit:
    rows = (LazyRows(store, k) for k in ("input_ids", "labels", "position_ids"))
    return PreparedSplit(
        *rows, stats=meta["stats"], from_cache=from_cache, cache_path=cache_path, digest=meta["digest"]
    )


def _tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    template = tokenizer.chat_template
    extra = [type(tokenizer).__name__, template, tokenizer.special_tokens_map, len(tokenizer)]
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _cache_key(tokenizer, ds, split: str, column: str, pad_id: int, opts: dict) -> str:
    parts = {
        "format": CACHE_FORMAT,
        "data": dataset_identity(ds, opts["dataset_name"], split),
        "split": split,
        "rows": len(ds),
        "column": column,
        "columns_read": read_columns(column, ds.column_names),
        "chat_render": CHAT_RENDER,
        "pad_id": pad_id,
        "eos_id": tokenizer.eos_token_id,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        **opts,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _log_split(split: str, p: PreparedSplit) -> None:
    s = p.stats
    source = " (from cache)" if p.from_cache else ""
    print0(
        f"data: split {split!r}{source}: {s['documents']} documents -> {s['rows']} rows, {s['tokens']} tokens, "
        f"{s['target_tokens']} targets, {s['padding_tokens']} padding, {s['truncated']} truncated, "
        f"{s['dropped']} dropped"
    )
