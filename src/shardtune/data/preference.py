"""Preference data: prompt/chosen/rejected pairs (plain text or TRL's conversational format), tokenized as TRL's
DPOTrainer does, stored as two rows per pair and batched so that a pair never splits across ranks or steps; and
KTO's unpaired prompt/completion/label rows, tokenized as trl 1.16's KTOTrainer does.

Tokenization follows trl 1.16 (`DPOTrainer._prepare_dataset` and `DataCollatorForPreference`), so that the same
rows give the same tokens: plain-text completions get the EOS text appended; the prompt and prompt+completion are
tokenized separately and the completion starts where they stop agreeing (a template or a merge across the boundary
may change the end of the prompt); each sequence is cut to --max_length keeping its start, and a pair whose prompt
alone fills --max_length is dropped (it would have no completion token). With --drop_long_samples a pair with a
sequence over --max_length is dropped instead of truncated. Conversations without a `prompt` column have it taken
as the turns chosen and rejected share (TRL's `extract_prompt`); a conversation's `tools` and `chat_template_kwargs`
columns go to its chat template as TRL passes them (templates.template_kwargs, the rule SFT rows follow too; so
{"enable_thinking": false} puts a Qwen3 template's empty thinking block in the prompt, not in the completion).

Row 2i is pair i's chosen sequence, row 2i+1 its rejected one; labels are shifted (labels[t] is the target of
position t) and -100 on the prompt, so prompt tokens never count. For KTO, row 2i is example i's prompt+completion
and row 2i+1 its KL row: its prompt with a mismatched completion, which estimates the KL term. TRL builds the
mismatched completions by rotating the completions by one within each consecutive group of a micro-batch's
examples in the dataset's order, (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}); shardtune does the same with the
group size of the global micro-batch (per-device batch × ranks), so N ranks see the rows of one process with N
times the batch, and the KL rows are fixed data whose reference log-probs can be precomputed like the others.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from shardtune.runtime.atomic import replaced_file
from shardtune.runtime.log import print0, warn0

from .collate import collate_rows, epoch_order
from .packing import Document, build_rows
from .sources import dataset_identity, requested_splits
from .templates import tokenize_completions

if TYPE_CHECKING:
    from shardtune.config.arguments import DataArguments

PAIR_COLUMNS = ("chosen", "rejected")
UNPAIRED_COLUMNS = ("prompt", "completion", "label")


@dataclass
class PreferenceSplit:
    """Tokenized pairs: rows 2i (chosen) and 2i+1 (rejected); ref_logps[r] is row r's reference log-prob once
    computed (shardtune.objectives.reference)."""

    input_ids: object  # RaggedRows
    labels: object
    position_ids: object
    stats: dict
    from_cache: bool = False
    cache_path: str | None = None
    ref_logps: np.ndarray | None = field(default=None, repr=False)
    digest: str | None = None  # of the tokenized pairs: equal digests, equal rows (compared across nodes and on resume)
    desirable: np.ndarray | None = None  # KTO: example i's label (True: desirable); None for pairs

    def __len__(self) -> int:
        return len(self.input_ids) // 2

    def summary(self, evals: PreferenceSplit | None, max_length: int) -> str:
        """The run's data line (the tokenizing pass's own line said the rest)."""
        unit = "examples" if "desirable" in self.stats else "pairs"
        return f"Data: {self.stats['pairs']} {unit}; eval {unit}: {len(evals) if evals is not None else 0}."

    def num_batches(self, *, batch_size: int, world_size: int, drop_last: bool = True) -> int:
        """Steps per epoch in global batches of batch_size × world_size pairs."""
        per_step = batch_size * world_size
        return len(self) // per_step if drop_last else -(-len(self) // per_step)

    def iterate(self, *, batch_size, rank, world_size, epoch, seed, shuffle, start_batch=0, pad_id, drop_last=True):
        """This rank's batches: batch_size pairs as [chosen_1..chosen_B, rejected_1..rejected_B] (TRL's layout),
        padded to the longest sequence of the global batch, with `pair_index` (-1: filler pair without targets)
        and, once computed, `ref_logps`. Pairs are shuffled per epoch as shardtune.data.collate shuffles rows."""
        lengths = self.input_ids.lengths()
        order = epoch_order(len(self), seed=seed, epoch=epoch, shuffle=shuffle)
        per_step = batch_size * world_size
        for b in range(
            start_batch, self.num_batches(batch_size=batch_size, world_size=world_size, drop_last=drop_last)
        ):
            step_pairs = order[b * per_step : (b + 1) * per_step]
            seq_len = int(np.maximum(lengths[2 * step_pairs], lengths[2 * step_pairs + 1]).max())
            yield self.collate(step_pairs[rank * batch_size : (rank + 1) * batch_size], batch_size, seq_len, pad_id)

    def collate(self, pairs: np.ndarray, batch_size: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
        filler = np.full(batch_size - len(pairs), -1, dtype=np.int64)
        index = np.concatenate([pairs.astype(np.int64), filler])
        rows = np.concatenate([2 * pairs, 2 * pairs + 1])
        chosen = collate_rows(self, 2 * pairs, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)
        rejected = collate_rows(self, 2 * pairs + 1, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id)
        batch = {k: torch.cat([chosen[k], rejected[k]]) for k in chosen}
        batch["pair_index"] = torch.from_numpy(index)
        if self.desirable is not None:
            batch["desirable"] = torch.from_numpy(np.concatenate([self.desirable[pairs], np.zeros(len(filler), bool)]))
        if self.ref_logps is not None:
            ref = np.zeros(2 * batch_size, dtype=np.float64)
            ref[: len(pairs)] = self.ref_logps[rows[: len(pairs)]]
            ref[batch_size : batch_size + len(pairs)] = self.ref_logps[rows[len(pairs) :]]
            batch["ref_logps"] = torch.from_numpy(ref)
        return batch


def build_preference_datasets(
    data: DataArguments,
    *,
    tokenizer,
    cache_dir: str | None = None,
    kto_group: int | None = None,
) -> tuple[PreferenceSplit, PreferenceSplit | None]:
    """Load and tokenize the pairs of the train split and the optional eval split named by --splits.

    kto_group: unpaired KTO rows instead of pairs, their KL completions rotated within groups of this many
    consecutive examples (the global micro-batch)."""
    from . import _tokenizer_fingerprint

    dataset_name, max_length = data.dataset_name, data.max_length
    add_special_tokens, drop_long_samples = data.add_special_tokens, data.drop_long_samples

    if kto_group is not None and kto_group < 2:
        raise ValueError(
            "--objective kto estimates its KL term from other examples of the same micro-batch: it needs "
            "--per_device_train_batch_size × ranks >= 2 (TRL: a batch size > 1); raise --per_device_train_batch_size."
        )
    out = []
    for requested in requested_splits(data):
        if requested is None:
            out.append(None)
            continue
        split, ds = requested
        _check_columns(ds.column_names, dataset_name, split, unpaired=kto_group is not None)
        opts = {"max_length": max_length, "add_special_tokens": add_special_tokens, "drop_long": drop_long_samples}
        if kto_group is not None:
            opts["kto_group"] = kto_group
        key = hashlib.sha256(
            json.dumps(
                ["preference-2", dataset_identity(ds, dataset_name, split), _tokenizer_fingerprint(tokenizer), opts],
                default=str,
            ).encode()
        ).hexdigest()
        path = Path(cache_dir) / f"pairs-{key[:32]}.npz" if cache_dir else None
        prepared = _load_pairs(path) if path is not None else None
        if prepared is None:
            tokenize = _tokenize_pairs if kto_group is None else _tokenize_unpaired
            prepared = tokenize(tokenizer, ds, split, opts)
            if path is not None:
                _save_pairs(path, prepared)
        _log_split(split, prepared)
        out.append(prepared)
    return out[0], out[1]


def _log_split(split: str, prepared: PreferenceSplit) -> None:
    s = prepared.stats
    what = f"{s['pairs']} pairs"
    if prepared.desirable is not None:
        what = f"{s['pairs']} examples ({s['desirable']} desirable, {s['pairs'] - s['desirable']} undesirable)"
    print0(
        f"data: split {split!r}{' (from cache)' if prepared.from_cache else ''}: {what} "
        f"({s['truncated']} truncated, {s['dropped']} dropped) of {s['rows_in']} rows, "
        f"{s['completion_tokens']} completion tokens"
    )
    if s.get("prompt_ends_left_out"):
        warn0(
            f"data: split {split!r}: in {s['prompt_ends_left_out']} rows the tokenized prompt is not a prefix of the "
            f"tokenized prompt+completion (e.g. its end {s['prompt_end_example']!r}): the chat template renders the "
            "prompt alone differently, or tokens merge across the boundary. As TRL does, the completion starts where "
            "they differ and that end of the prompt is left out, so the model trains on another context than it "
            "sees at inference; use a template that renders the prompt the same way, or end prompts on a token "
            "boundary."
        )


def _check_columns(columns: list[str], dataset_name: str, split: str, *, unpaired: bool) -> None:
    where = f"--dataset_name {dataset_name!r}, split {split!r}"
    if unpaired:
        if all(c in columns for c in UNPAIRED_COLUMNS):
            return
        hint = (
            " These are prompt/chosen/rejected pairs: train them with --objective dpo, simpo or orpo."
            if all(c in columns for c in PAIR_COLUMNS)
            else ""
        )
        raise ValueError(
            f"{where}: --objective kto needs `prompt`, `completion` and `label` (true: desirable) columns, as plain "
            f"text or as conversations; found {', '.join(columns)}.{hint}"
        )
    if all(c in columns for c in PAIR_COLUMNS):
        return
    hint = (
        " Unpaired prompt/completion/label rows are KTO's format: train them with --objective kto."
        if "label" in columns and "completion" in columns
        else ""
    )
    raise ValueError(
        f"{where}: preference objectives need `chosen` and `rejected` "
        f"columns (and optionally `prompt`), as plain text or as conversations; found {', '.join(columns)}.{hint}"
    )


def _tokenize_pairs(tokenizer, ds, split: str, opts: dict) -> PreferenceSplit:
    docs, truncated, dropped, completion, left_out = [], 0, 0, 0, []
    max_length = opts["max_length"]
    for row, example in enumerate(ds):
        prompt_ids, chosen_ids, rejected_ids = tokenize_pair(
            tokenizer, example, split, row, opts["add_special_tokens"], left_out
        )
        seqs = [prompt_ids + chosen_ids, prompt_ids + rejected_ids]
        too_long = max(len(s) for s in seqs) > max_length
        if len(prompt_ids) >= max_length or (too_long and opts["drop_long"]):
            dropped += 1
            continue
        truncated += too_long
        for ids in seqs:
            ids = np.asarray(ids[:max_length], dtype=np.int32)
            targets = np.arange(len(ids)) >= len(prompt_ids)
            completion += int(targets.sum())
            docs.append(Document(ids, targets))
    if not docs:
        raise ValueError(
            f"split {split!r}: every pair was dropped (prompt alone fills --max_length {max_length}, or a sequence "
            "is longer and --drop_long_samples is set); raise --max_length."
        )
    prepared = _split_from_docs(docs, len(ds), truncated, dropped, completion)
    _count_left_out(prepared.stats, left_out, tokenizer)
    prepared.digest = _pairs_digest(prepared)
    return prepared


def _count_left_out(stats: dict, left_out: list, tokenizer) -> None:
    stats["prompt_ends_left_out"] = len(left_out)
    if left_out:
        stats["prompt_end_example"] = tokenizer.decode(left_out[0])


def tokenize_pair(tokenizer, example: dict, split: str, row: int, add_special_tokens: bool, left_out=None):
    """(prompt_ids, chosen_ids, rejected_ids) of one row, as trl 1.16's DPOTrainer tokenizes it. left_out: a list
    that gets the prompt's end when it is not part of the sequence (see templates.tokenize_completions)."""
    prompt, chosen, rejected = example.get("prompt"), example["chosen"], example["rejected"]
    where = f"split {split!r}, row {row}"
    if isinstance(chosen, list) and prompt is None:
        prompt, chosen, rejected = _extract_prompt(chosen, rejected, where)
    prompt_ids, (chosen_ids, rejected_ids) = tokenize_completions(
        tokenizer, prompt, {"chosen": chosen, "rejected": rejected}, split, row, add_special_tokens,
        example, left_out,
    )  # fmt: skip
    return prompt_ids, chosen_ids, rejected_ids


def tokenize_unpaired(tokenizer, example: dict, split: str, row: int, add_special_tokens: bool, left_out=None):
    """(prompt_ids, completion_ids, desirable) of one KTO row, as trl 1.16's KTOTrainer tokenizes it (left_out: as
    tokenize_pair's)."""
    label = example["label"]
    if not isinstance(label, bool | np.bool_):  # a data mistake: ValueError, which the CLI reports with exit 2
        bad = f"split {split!r}, row {row}: `label` must be true or false (desirable or not), got {label!r}."
        raise ValueError(bad)  # noqa: TRY004
    if example.get("prompt") is None:
        raise ValueError(f"split {split!r}, row {row}: `prompt` is missing; KTO rows need a prompt.")
    prompt_ids, (completion_ids,) = tokenize_completions(
        tokenizer, example["prompt"], {"completion": example["completion"]}, split, row, add_special_tokens,
        example, left_out,
    )  # fmt: skip
    return prompt_ids, completion_ids, bool(label)


def _tokenize_unpaired(tokenizer, ds, split: str, opts: dict) -> PreferenceSplit:
    """KTO rows: each example's prompt+completion, then its KL row (see the module docstring)."""
    max_length, group = opts["max_length"], opts["kto_group"]
    kept, dropped, left_out = [], 0, []
    for row, example in enumerate(ds):
        prompt_ids, completion_ids, desirable = tokenize_unpaired(
            tokenizer, example, split, row, opts["add_special_tokens"], left_out
        )
        too_long = len(prompt_ids) + len(completion_ids) > max_length
        if len(prompt_ids) >= max_length or (too_long and opts["drop_long"]):
            dropped += 1  # TRL drops an example whose prompt alone fills max_length
            continue
        kept.append((prompt_ids, completion_ids, desirable))
    if not kept:
        raise ValueError(
            f"split {split!r}: every example was dropped (prompt alone fills --max_length {max_length}, or a "
            "sequence is longer and --drop_long_samples is set); raise --max_length."
        )
    docs, truncated, completion = [], 0, 0
    for start in range(0, len(kept), group):
        chunk = kept[start : start + group]
        for j, (prompt_ids, completion_ids, _) in enumerate(chunk):
            mismatched = chunk[j - 1][1]  # j = 0 takes the group's last completion
            for k, ids in enumerate((prompt_ids + completion_ids, prompt_ids + mismatched)):
                truncated += k == 0 and len(ids) > max_length
                ids = np.asarray(ids[:max_length], dtype=np.int32)
                targets = np.arange(len(ids)) >= len(prompt_ids)
                completion += int(targets.sum()) if k == 0 else 0
                docs.append(Document(ids, targets))
    desirable = np.array([d for _, _, d in kept], dtype=bool)
    split_ = _split_from_docs(docs, len(ds), truncated, dropped, completion)
    split_.desirable = desirable
    split_.stats["desirable"] = int(desirable.sum())
    _count_left_out(split_.stats, left_out, tokenizer)
    split_.digest = _pairs_digest(split_)
    return split_


def _split_from_docs(docs: list, rows_in: int, truncated: int, dropped: int, completion: int) -> PreferenceSplit:
    rows = build_rows(docs, [[i] for i in range(len(docs))], row_length=None, pad_id=0)
    stats = {
        "rows_in": rows_in,
        "pairs": len(docs) // 2,
        "rows": len(docs),
        "tokens": int(sum(len(d.ids) for d in docs)),
        "completion_tokens": completion,
        "target_tokens": int((rows["labels"].flat != -100).sum()),
        "padding_tokens": 0,
        "truncated": int(truncated),
        "dropped": dropped,
        "documents": len(docs) // 2,
    }
    return PreferenceSplit(rows["input_ids"], rows["labels"], rows["position_ids"], stats)


def _extract_prompt(chosen: list, rejected: list, where: str):
    """The shared leading turns are the prompt (TRL's extract_prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise ValueError(f"{where}: chosen and rejected share no leading turn; add a `prompt` column.")
    return chosen[:n], chosen[n:], rejected[n:]


_PAIR_ARRAYS = ("input_ids", "labels", "position_ids")


def _pairs_digest(prepared: PreferenceSplit) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _PAIR_ARRAYS:
        rows = getattr(prepared, name)
        h.update(np.ascontiguousarray(rows.offsets).tobytes())
        h.update(np.ascontiguousarray(rows.flat).tobytes())
    if prepared.desirable is not None:  # KTO: the labels are part of the data
        h.update(np.ascontiguousarray(prepared.desirable).tobytes())
    return h.hexdigest()


def _save_pairs(path: Path, prepared: PreferenceSplit) -> None:
    """The tokenized pairs as one .npz, written atomically (ranks of one node may write it at the same time)."""

    arrays = {name: getattr(prepared, name).flat for name in _PAIR_ARRAYS}
    if prepared.desirable is not None:
        arrays["desirable"] = prepared.desirable
    with replaced_file(path) as f:
        np.savez(f, offsets=prepared.input_ids.offsets, stats=np.array(json.dumps(prepared.stats)), **arrays)
    prepared.cache_path = str(path)


def _load_pairs(path: Path) -> PreferenceSplit | None:
    """The cached pairs, or None when absent or unreadable (then they are tokenized again)."""

    from .packing import RaggedRows

    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = [RaggedRows(z[name], z["offsets"]) for name in _PAIR_ARRAYS]
            stats = json.loads(str(z["stats"]))
            desirable = z["desirable"] if "desirable" in z.files else None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    prepared = PreferenceSplit(*arrays, stats=stats, from_cache=True, cache_path=str(path), desirable=desirable)
    prepared.digest = _pairs_digest(prepared)
    return prepared
