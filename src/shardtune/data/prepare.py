"""Tokenize a split into the on-disk cache in parallel processes, with memory bounded by one task's rows.

The split's rows are cut into tasks of _TASK_ROWS consecutive rows. Each task (in a worker process, or inline for
one process) renders and tokenizes its rows _CHUNK at a time, truncates or drops long documents, and appends every
kept document's token ids and shifted labels to its own part files. The parent then concatenates the parts, in row
order, into the flat arrays of the cache (shardtune.data.cache), so the result does not depend on the number of
processes.

Why a process pool and not `datasets.Dataset.map(num_proc=...)`: map writes its output as Arrow list columns into the
datasets cache next to the source data (a second full copy in a format we would then convert again), hashes the
tokenizer with dill to fingerprint every call, and has no `num_proc` for streamed datasets. The pool writes our flat
arrays directly, in our cache folder, and the same task function serves the streaming path.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardtune.runtime import hooks
from shardtune.runtime.log import rank, warn0
from shardtune.runtime.parent import stop_with_parent_process

from .packing import IGNORE_INDEX, Document, fit_documents, shifted_labels
from .templates import (
    TEMPLATE_COLUMNS,
    assistant_spans,
    render_chat,
    template_kwargs,
    token_target_mask,
    tokenize_completions,
    validate_messages,
)

_CHUNK = 1000  # rows tokenized per tokenizer call
_TASK_ROWS = 20_000  # rows per task: a task's part files are copied whole, so this bounds the parent's memory


@dataclass
class TaskResult:
    index: int
    documents: int
    truncated: int
    dropped: int
    tokens: int
    target_tokens: int


# The "column" of prompt/completion rows (TRL's prompt-completion format): two columns, read together.
PROMPT_COMPLETION = "prompt+completion"


def _value_columns(column: str) -> list[str]:
    return ["prompt", "completion"] if column == PROMPT_COMPLETION else [column]


def read_columns(column: str, columns) -> list[str]:
    """The columns a split's rows are tokenized from: the text column (prompt and completion), and for conversations
    the template columns (tools, chat_template_kwargs) the split has."""
    chats = column in ("messages", PROMPT_COMPLETION)
    return [*_value_columns(column), *(c for c in TEMPLATE_COLUMNS if chats and c in columns)]


def row_values(batch: dict, column: str) -> list:
    """The rows' values from a batch of columns: texts or conversations, or (prompt, completion) pairs."""
    if column == PROMPT_COMPLETION:
        return list(zip(batch["prompt"], batch["completion"], strict=True))
    return batch[column]


def row_settings(batch: dict, column: str) -> list[dict] | None:
    """Each row's template columns from a batch of columns ({name: values}), or None when there are none."""
    names = [c for c in batch if c not in _value_columns(column)]
    if not names:
        return None
    return [dict(zip(names, values, strict=True)) for values in zip(*(batch[c] for c in names), strict=True)]


def documents(
    tokenizer, rows: list, split: str, column: str, opts: dict, first_row: int = 0, settings: list[dict] | None = None
) -> list[Document]:
    """Render and tokenize rows (the values of `column`); targets mark the tokens that may be predicted.
    settings: each conversation row's template columns (row_settings), which its chat template is rendered with."""
    assistant_only = opts["assistant_only_loss"]
    if assistant_only and not getattr(tokenizer, "is_fast", False):
        raise ValueError("--assistant_only_loss needs a fast (Rust) tokenizer to map assistant text to tokens.")
    eos_id = tokenizer.eos_token_id
    if opts["append_concat_token"] and eos_id is None:
        raise ValueError("--append_concat_token needs a tokenizer with an EOS token.")
    if column == PROMPT_COMPLETION:
        return _prompt_completion_documents(tokenizer, rows, split, opts, first_row, settings)
    docs: list[Document] = []
    for start in range(0, len(rows), _CHUNK):
        row = first_row + start
        chunk = settings[start : start + _CHUNK] if settings is not None else None
        texts, spans = _chunk_texts(tokenizer, rows[start : start + _CHUNK], chunk, split, column, row, assistant_only)
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
    return docs


def _prompt_completion_documents(
    tokenizer, rows: list, split: str, opts: dict, first_row: int, settings: list[dict] | None
) -> list[Document]:
    """(prompt, completion) rows as trl 1.16's SFTTrainer tokenizes them (templates.tokenize_completions): plain text
    with the EOS text appended to the completion, a conversation rendered with its row's template columns; the
    completion starts where the tokenized prompt and prompt+completion stop agreeing. Targets: the completion
    (--completion_only_loss, on unless set False, as TRL's default for these rows), and with --assistant_only_loss
    only its assistant turns (a tool's reply in the completion is context)."""
    completion_only = opts.get("completion_only_loss") is not False
    docs, left_out = [], []
    for j, (prompt, completion) in enumerate(rows):
        row = first_row + j
        example = {"prompt": prompt, "completion": completion, **(settings[j] if settings else {})}
        prompt_ids, (completion_ids,) = tokenize_completions(
            tokenizer, prompt, {"completion": completion}, split, row, opts["add_special_tokens"], example, left_out
        )
        ids = np.asarray(prompt_ids + completion_ids, dtype=np.int32)
        if not len(ids):
            raise ValueError(f"split {split!r}, row {row}: the text tokenizes to no tokens; remove the row.")
        targets = np.arange(len(ids)) >= len(prompt_ids) if completion_only else np.ones(len(ids), dtype=bool)
        if opts["assistant_only_loss"]:
            if not isinstance(completion, list):
                raise ValueError(
                    f"split {split!r}, row {row}: --assistant_only_loss needs conversations; these prompt/completion "
                    "rows are plain text, whose loss is on the completion already (--completion_only_loss)."
                )
            targets &= _assistant_mask(tokenizer, prompt + completion, ids, split, row, example)
        if opts["append_concat_token"]:
            ids = np.append(ids, np.int32(tokenizer.eos_token_id))
            targets = np.append(targets, not opts["assistant_only_loss"])
        docs.append(Document(ids, targets))
    if left_out:
        _warn_left_out(tokenizer.decode(left_out[0]), split)
    return docs


def _assistant_mask(tokenizer, messages: list, ids: np.ndarray, split: str, row: int, example: dict) -> np.ndarray:
    """The assistant turns' tokens of a conversation (assistant_spans on its rendered text), for tokens `ids`."""
    kw = template_kwargs(example, f"split {split!r}, row {row}")
    text = render_chat(tokenizer, messages, split=split, row=row, kwargs=kw)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids.tolist():
        raise ValueError(
            f"split {split!r}, row {row}: --assistant_only_loss cannot map this conversation's text to its tokens "
            "(the template's tokens differ from its text's); use --assistant_only_loss False."
        )
    spans = assistant_spans(tokenizer, messages, text, split=split, row=row, kwargs=kw)
    return token_target_mask(np.asarray(enc["offset_mapping"]).reshape(-1, 2), spans)


_WARNED_LEFT_OUT: set[str] = set()


def _warn_left_out(end: str, split: str) -> None:
    """As TRL warns, once per split: the tokenized prompt is not a prefix of prompt+completion."""
    if split in _WARNED_LEFT_OUT:
        return
    _WARNED_LEFT_OUT.add(split)
    warn0(
        f"data: split {split!r}: the tokenized prompt is not a prefix of the tokenized prompt+completion (here its "
        f"end {end!r}): the chat template renders the prompt alone differently, or tokens merge across the boundary. "
        "As TRL does, the completion starts where they differ and that end of the prompt is left out; use a template "
        "that renders the prompt the same way, or end prompts on a token boundary."
    )


def _chunk_texts(tokenizer, values: list, settings, split: str, column: str, first_row: int, assistant_only: bool):
    texts, spans = [], []
    for j, value in enumerate(values):
        row = first_row + j
        if column == "messages":
            validate_messages(value, split=split, row=row)
            kw = template_kwargs(settings[j] if settings else {}, f"split {split!r}, row {row}")
            text = render_chat(tokenizer, value, split=split, row=row, kwargs=kw)
            spans.append(
                assistant_spans(tokenizer, value, text, split=split, row=row, kwargs=kw) if assistant_only else []
            )
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"split {split!r}, row {row}: column {column!r} must hold a non-empty string, got {value!r}; "
                    "fix or remove the row."
                )
            text = value
        texts.append(text)
    return texts, spans


# ------------------------------------------------------------------------------------------- worker side

_WORKER: dict = {}


def _worker_state(tokenizer, ds, split: str, column: str, opts: dict, folder: str) -> dict:
    ds = ds.select_columns(read_columns(column, ds.column_names))  # read only the columns that are tokenized
    return {"tokenizer": tokenizer, "ds": ds, "split": split, "column": column, "opts": opts, "folder": Path(folder)}


def _init_worker(*initargs) -> None:
    """A pool worker's state, set once per process (the pool pickles the tokenizer and dataset once, not per task)."""
    # One process per core already: the tokenizer's own thread pool would oversubscribe the CPUs.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches every process of the terminal's group: the parent stops the workers itself (tokenize_to_parts),
    # so a worker does not print a KeyboardInterrupt traceback of its own. And a worker ends with its parent, even
    # one killed with SIGKILL that stops nothing (no orphan left tokenizing).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_with_parent_process()
    _WORKER.update(_worker_state(*initargs))


def _run_pool_task(index: int, start: int, stop: int) -> TaskResult:
    return _run_task(_WORKER, index, start, stop)


def part_paths(folder: Path, index: int) -> tuple[Path, Path, Path]:
    """A task's part files: token ids (int32), shifted labels (int32), document lengths (int64)."""
    stem = folder / f"part-{index:06d}"
    return stem.with_suffix(".ids"), stem.with_suffix(".labels"), stem.with_suffix(".lengths")


def _run_task(w: dict, index: int, start: int, stop: int) -> TaskResult:
    ds, opts = w["ds"], w["opts"]
    result = TaskResult(index, 0, 0, 0, 0, 0)
    ids_path, labels_path, lengths_path = part_paths(w["folder"], index)
    with open(ids_path, "wb") as f_ids, open(labels_path, "wb") as f_lab, open(lengths_path, "wb") as f_len:
        for a in range(start, stop, _CHUNK):
            b = min(a + _CHUNK, stop)
            batch = ds[a:b]
            settings = row_settings(batch, w["column"])
            values = row_values(batch, w["column"])
            docs = documents(w["tokenizer"], values, w["split"], w["column"], opts, a, settings)
            docs, truncated, dropped = fit_documents(docs, opts["max_length"], opts["drop_long_samples"])
            result.truncated += truncated
            result.dropped += dropped
            for doc in docs:
                labels = shifted_labels(doc)
                f_ids.write(doc.ids.astype(np.int32, copy=False).tobytes())
                f_lab.write(labels.tobytes())
                result.target_tokens += int((labels != IGNORE_INDEX).sum())
            f_len.write(np.array([len(d.ids) for d in docs], dtype=np.int64).tobytes())
            result.documents += len(docs)
            result.tokens += sum(len(d.ids) for d in docs)
    return result


def tokenize_to_parts(
    tokenizer, ds, split: str, column: str, opts: dict, folder: Path, num_proc: int | None
) -> list[TaskResult]:
    """Write the part files of every task into folder; results in task (= row) order."""
    n = len(ds)
    tasks = [(i, a, min(a + _TASK_ROWS, n)) for i, a in enumerate(range(0, n, _TASK_ROWS))]
    procs = min(default_num_proc() if num_proc is None else num_proc, len(tasks))
    initargs = (tokenizer, ds, split, column, opts, str(folder))
    if procs <= 1:  # in this process, with its own state: several builds may run at once (threads of a test)
        state = _worker_state(*initargs)
        hooks.at("tokenize", step=0, rank=rank())
        return [_run_task(state, *t) for t in tasks]
    # spawn, not fork: the parent may hold threads (the tokenizer's pool, the process group's) that fork would copy
    # in a locked state. The workers receive the tokenizer and the (memory-mapped) dataset by pickling, once each.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        procs, mp_context=ctx, initializer=_init_worker, initargs=initargs
    ) as ex:
        try:
            futures = [ex.submit(_run_pool_task, *t) for t in tasks]
            hooks.at("tokenize", step=0, rank=rank())
            return [f.result() for f in futures]
        except BaseException:  # a stop signal or a failed task: end the workers now, not after their tasks
            _stop_workers(ex)
            raise


def _stop_workers(ex: concurrent.futures.ProcessPoolExecutor) -> None:
    """Terminate the pool's workers and wait for them (the executor's own shutdown waits for running tasks)."""
    if hasattr(ex, "terminate_workers"):  # Python 3.14
        ex.terminate_workers()
        return
    procs = list((getattr(ex, "_processes", None) or {}).values())  # before 3.14: the executor's own table
    for p in procs:
        p.terminate()
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(timeout=10)


def default_num_proc() -> int:
    """--dataset_num_proc when unset: the CPUs this process may use, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 16))
