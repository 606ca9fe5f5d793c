"""The data pipeline: load splits, render chats, tokenize, pack, cache, and cut batches per rank.

`build_datasets` returns tokenized (and optionally packed) splits whose labels are already shifted;
`iterate_batches` cuts them into per-rank batches. Nothing here imports torch.distributed: when several ranks
prepare data, the caller lets rank 0 build the cache first (writes are atomic, so a race is harmless anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..log import print0
from .collate import iterate_batches, num_batches
from .packing import IGNORE_INDEX, Document, RaggedRows, best_fit_decreasing, build_rows, fit_documents
from .sources import check_not_empty, dataset_identity, load_split, parse_splits
from .templates import (
    CHAT_FORMATS,
    assistant_spans,
    padded_vocab_size,
    render_chat,
    setup_tokenizer,
    token_target_mask,
    validate_messages,
)

__all__ = [
    "CHAT_FORMATS",
    "IGNORE_INDEX",
    "PreparedSplit",
    "RaggedRows",
    "build_datasets",
    "iterate_batches",
    "num_batches",
    "padded_vocab_size",
    "setup_tokenizer",
]

CACHE_FORMAT = 1  # bump when the on-disk layout or the meaning of the arrays changes
_CHUNK = 1000


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

    def __len__(self) -> int:
        return len(self.input_ids)


def build_datasets(
    *,
    tokenizer,
    dataset_name: str,
    splits: str,
    dataset_text_field: str,
    max_length: int,
    packing: bool,
    append_concat_token: bool,
    add_special_tokens: bool,
    assistant_only_loss: bool,
    drop_long_samples: bool,
    cache_dir: str | None,
    seed: int,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    chat_template_format: str | None = None,
) -> tuple[PreparedSplit, PreparedSplit | None]:
    """Load, tokenize and (with packing) pack the train split and the optional eval split named by --splits.

    Rows with a `messages` column are rendered with the tokenizer's chat template, other rows use
    `dataset_text_field`; chat_template_format="none" always uses the text field, as the reference does.
    """
    if max_length < 2:
        raise ValueError(f"--max_length must be >= 2 (got {max_length}).")
    request = parse_splits(splits)
    options = {
        "dataset_name": dataset_name,
        "dataset_text_field": dataset_text_field,
        "max_length": max_length,
        "packing": packing,
        "append_concat_token": append_concat_token,
        "add_special_tokens": add_special_tokens,
        "assistant_only_loss": assistant_only_loss,
        "drop_long_samples": drop_long_samples,
        "seed": seed,
        "chat_template_format": chat_template_format,
    }
    train = _prepare_split(tokenizer, request.train, True, max_train_samples, "--max_train_samples", cache_dir, options)
    evaluation = None
    if request.eval is not None:
        evaluation = _prepare_split(
            tokenizer, request.eval, False, max_eval_samples, "--max_eval_samples", cache_dir, options
        )
    return train, evaluation


def _prepare_split(
    tokenizer, split: str, is_train: bool, max_samples: int | None, samples_flag: str, cache_dir: str | None, opts: dict
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
    path = Path(cache_dir) / f"{safe_split}-{key[:32]}.npz" if cache_dir else None
    prepared = _load_cache(path) if path is not None else None
    if prepared is None:
        prepared = _tokenize_and_pack(tokenizer, ds, split, column, pad_id, opts)
        if path is not None:
            _save_cache(path, prepared)
    _log_split(split, prepared)
    return prepared


def _text_column(tokenizer, columns: list[str], split: str, opts: dict) -> str:
    """`messages` when rows are chats rendered with a template, else the --dataset_text_field column."""
    field, fmt = opts["dataset_text_field"], opts["chat_template_format"]
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


def _tokenize_and_pack(tokenizer, ds, split: str, column: str, pad_id: int, opts: dict) -> PreparedSplit:
    docs = _documents(tokenizer, ds, split, column, opts)
    max_length = opts["max_length"]
    docs, truncated, dropped = fit_documents(docs, max_length, opts["drop_long_samples"])
    if not docs:
        raise ValueError(
            f"split {split!r}: every document is longer than --max_length {max_length} and --drop_long_samples "
            "is set; raise --max_length or turn off --drop_long_samples."
        )
    if opts["packing"]:
        groups = best_fit_decreasing([len(d.ids) for d in docs], max_length, opts["seed"])
        rows = build_rows(docs, groups, row_length=max_length, pad_id=pad_id)
    else:
        rows = build_rows(docs, [[i] for i in range(len(docs))], row_length=None, pad_id=pad_id)
    labels = rows["labels"]
    stats = {
        "documents": len(docs),
        "rows": len(labels),
        "tokens": int(sum(len(d.ids) for d in docs)),
        "target_tokens": int((labels.flat != IGNORE_INDEX).sum()),
        "padding_tokens": rows["padding_tokens"],
        "truncated": truncated,
        "dropped": dropped,
    }
    return PreparedSplit(rows["input_ids"], labels, rows["position_ids"], stats)


def _documents(tokenizer, ds, split: str, column: str, opts: dict) -> list[Document]:
    """Render and tokenize every row; targets mark the tokens that may be predicted."""
    assistant_only = opts["assistant_only_loss"]
    if assistant_only and not getattr(tokenizer, "is_fast", False):
        raise ValueError("--assistant_only_loss needs a fast (Rust) tokenizer to map assistant text to tokens.")
    eos_id = tokenizer.eos_token_id
    if opts["append_concat_token"] and eos_id is None:
        raise ValueError("--append_concat_token needs a tokenizer with an EOS token.")
    docs: list[Document] = []
    row = 0
    for chunk in ds.iter(batch_size=_CHUNK):
        texts, spans = _chunk_texts(tokenizer, chunk[column], split, column, row, assistant_only)
        enc = tokenizer(texts, add_special_tokens=opts["add_special_tokens"], return_offsets_mapping=assistant_only)
        for j, ids in enumerate(enc["input_ids"]):
            if not ids:
                raise ValueError(f"split {split!r}, row {row + j}: the text tokenizes to no tokens; remove the row.")
            ids = np.asarray(ids, dtype=np.int32)
            if assistant_only:
                targets = token_target_mask(np.asarray(enc["offset_mapping"][j]).reshape(-1, 2), spans[j])
            else:
                targets = np.ones(len(ids), dtype=bool)
            if opts["append_concat_token"]:
                # The separator EOS is a target like any token, except when only assistant turns are.
                ids = np.append(ids, np.int32(eos_id))
                targets = np.append(targets, not assistant_only)
            docs.append(Document(ids, targets))
        row += len(texts)
    return docs


def _chunk_texts(tokenizer, values: list, split: str, column: str, first_row: int, assistant_only: bool):
    texts, spans = [], []
    for j, value in enumerate(values):
        row = first_row + j
        if column == "messages":
            validate_messages(value, split=split, row=row)
            text = render_chat(tokenizer, value, split=split, row=row)
            spans.append(assistant_spans(tokenizer, value, text, split=split, row=row) if assistant_only else [])
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"split {split!r}, row {row}: column {column!r} must hold a non-empty string, got {value!r}; "
                    "fix or remove the row."
                )
            text = value
        texts.append(text)
    return texts, spans


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
        "pad_id": pad_id,
        "eos_id": tokenizer.eos_token_id,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        **opts,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _save_cache(path: Path, prepared: PreparedSplit) -> None:
    """Write atomically: a unique temp file in the same folder, then rename over the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                input_ids=prepared.input_ids.flat,
                labels=prepared.labels.flat,
                position_ids=prepared.position_ids.flat,
                offsets=prepared.input_ids.offsets,
                stats=np.array(json.dumps(prepared.stats)),
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    prepared.cache_path = str(path)


def _load_cache(path: Path) -> PreparedSplit | None:
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            offsets = z["offsets"]
            arrays = [RaggedRows(z[name], offsets) for name in ("input_ids", "labels", "position_ids")]
            stats = json.loads(str(z["stats"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None  # unreadable or from an older layout: rebuild it
    return PreparedSplit(*arrays, stats=stats, from_cache=True, cache_path=str(path))


def _log_split(split: str, p: PreparedSplit) -> None:
    s = p.stats
    source = " (from cache)" if p.from_cache else ""
    print0(
        f"data: split {split!r}{source}: {s['documents']} documents -> {s['rows']} rows, {s['tokens']} tokens, "
        f"{s['target_tokens']} targets, {s['padding_tokens']} padding, {s['truncated']} truncated, "
        f"{s['dropped']} dropped"
    )
