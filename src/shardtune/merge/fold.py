"""Folding a PEFT LoRA/DoRA adapter into its base model, one safetensors shard at a time (`merge_adapter`, run by
`shardtune merge` and by `shardtune train --merge_adapter`).

The base checkpoint is never built as a model: each base shard is memory-mapped, every tensor the adapter touches
is recomputed in fp32 (LoRA, DoRA, modules_to_save, trainable tokens) and cast to the output dtype, and the shard's
tensors are written out before the next shard is opened. Peak memory is about one base shard plus the adapter.
The output is a standard Hugging Face model folder, written to a temporary sibling folder and renamed into place
only once it is complete.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardtune.config import dtypes
from shardtune.config.errors import ConfigError
from shardtune.merge.plan import (
    BaseCheckpoint,
    MergePlan,
    apply_edit,
    load_adapter_weights,
    plan_merge,
    read_adapter_config,
)
from shardtune.models import weights
from shardtune.models.adapter_fit import adapter_base_problem, skeleton_of
from shardtune.models.weights import PendingTensor
from shardtune.runtime import atomic
from shardtune.runtime.hub import is_hub_id
from shardtune.runtime.log import print0, warn0

TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model", "vocab.*", "merges.txt")
# What a merge writes into --output_dir (and may therefore replace there): the weights, configs, the tokenizer,
# remote code and a model card.
MERGED_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    weights.INDEX,
    *TOKENIZER_FILES,
    "chat_template.*",
    "*.py",
    "README.md",
)


def merge_adapter(
    base_dir: str | Path,
    adapter_dir: str | Path,
    output_dir: str | Path,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    trust_remote_code: bool = False,
) -> Path:
    """Merge the PEFT adapter in adapter_dir into base_dir and write a Hugging Face model folder to output_dir."""
    from transformers.utils.hub import convert_file_size_to_int

    max_bytes = convert_file_size_to_int(max_shard_size)
    if max_bytes <= 0:
        raise ValueError(f"--max_shard_size must be positive (got {max_shard_size!r}).")
    out = Path(output_dir).expanduser().absolute()
    _check_output_dir(out)  # before anything is read: a folder of other files is never replaced
    for stale in atomic.sweep_stale(out.parent, out.name):  # a merge into out that was killed (kill -9)
        warn0(f"--output_dir {out}: removed {stale.name}, left by a merge that was killed.")
    base = read_base_checkpoint(_local_or_download(str(base_dir), "base", trust_remote_code))
    adapter = _local_or_download(str(adapter_dir), "adapter", trust_remote_code)
    if out in (base.folder.absolute(), adapter.absolute()):
        raise ValueError(f"--output_dir {out} is the base or adapter folder; write the merged model elsewhere.")
    peft_config = read_adapter_config(adapter)
    _check_adapter_fits(base, adapter, str(base_dir), trust_remote_code, bool(peft_config.target_parameters))
    plan = plan_merge(base, peft_config, load_adapter_weights(adapter), dtype, trust_remote_code)
    print0(
        f"merging {adapter} into {base.folder}: {len(plan.edits)} tensors change, output in {dtypes.name_of(plan.dtype)}"
    )
    with _atomic_folder(out) as tmp:
        weight_map, untied = _write_weights(base, plan, tmp, max_bytes)
        _write_config(base, plan, tmp, untied)
        _copy_side_files(base.folder, adapter, tmp)
    n_shards = len(set(weight_map.values()))
    print0(f"merged model written to {out} ({len(weight_map)} tensors in {n_shards} shard{'s' * (n_shards > 1)})")
    return out


def _check_adapter_fits(
    base: BaseCheckpoint, adapter: Path, base_name: str, trust_remote_code: bool, parameters: bool
) -> None:
    """An adapter trained on another base is a user's mistake (exit 2), named before anything is written: its
    module LoRA against the base's stored tensors, its parameter LoRA (experts, routers) against the base's skeleton."""

    text = base.config.get("text_config") or base.config
    problem = adapter_base_problem(
        adapter,
        base.shapes,
        base_name=base_name,
        flag="--adapter",
        vocab_size=text.get("vocab_size"),
        require_all=False,
        skeleton=skeleton_of(base.folder, trust_remote_code) if parameters else None,
        base_flag="--base",
    )
    if problem:
        raise ConfigError([problem])


def read_base_checkpoint(folder: Path) -> BaseCheckpoint:
    """Read the base's config and every tensor's shape and dtype from the shard headers (no weights are read)."""
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"--base {folder}: no config.json there; give a model folder or a hub id.")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config"):
        raise ValueError(
            f"--base {folder} is quantized (quantization_config in config.json); the merge needs the "
            "original-precision weights. For a QLoRA adapter give the unquantized model it was loaded "
            "from (see docs/merge.md)."
        )
    shards = weights.shard_files(folder, f"--base {folder}")
    shapes, stored = weights.read_headers(shards)
    return BaseCheckpoint(folder, shards, shapes, stored, config)


def _local_or_download(ref: str, flag: str, trust_remote_code: bool) -> Path:
    """A local folder as it is; otherwise a hub id, of which only weights, configs and tokenizer files are fetched."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(ref):
        raise ValueError(f"--{flag} {ref}: no such folder.")
    from huggingface_hub import snapshot_download

    patterns = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"] + (["*.py"] if trust_remote_code else [])
    try:
        return Path(snapshot_download(ref, allow_patterns=patterns))
    except Exception as e:  # network, auth or missing repo: all the same to the user
        raise ValueError(f"--{flag} {ref}: not a local folder, and fetching it from the hub failed: {e}") from e


def _write_weights(base: BaseCheckpoint, plan: MergePlan, folder: Path, max_bytes: int) -> tuple[dict, bool]:
    """Stream the base shard by shard; return the weight map and whether the output embedding had to be untied.

    Output shards never span two base shards: every tensor is computed from the open (memory-mapped) base shard
    while its output shard is written, so only one base shard and one merged tensor are in memory at a time.
    """
    writer = weights.ShardWriter(folder, max_bytes)
    untied = False
    for i, shard in enumerate(base.shards, start=1):
        changed = 0
        with weights.open_shard(shard) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name in plan.aliases:
                    continue  # a tied copy stored in the checkpoint: transformers re-ties it on load
                changed += name in plan.edits
                entries = _tied_entries(f, name, plan) if name in plan.aliases.values() else []
                untied |= len(entries) > 1
                for entry in entries or [_lazy_entry(f, name, plan, base)]:
                    writer.add(entry)
            writer.flush()
        print0(f"  shard {i}/{len(base.shards)} {shard.name}: {changed} tensors merged")
    return writer.finish(), untied


def _lazy_entry(f: Any, name: str, plan: MergePlan, base: BaseCheckpoint) -> PendingTensor:
    edit, base_dtype = plan.edits.get(name), base.dtypes[name]
    dtype = plan.dtype if base_dtype.is_floating_point else base_dtype
    shape = edit.final_shape(base.shapes[name]) if edit else base.shapes[name]
    return PendingTensor(name, dtype, tuple(shape), lambda: apply_edit(edit, f.get_tensor(name), plan.dtype))


def _tied_entries(f: Any, name: str, plan: MergePlan) -> list[PendingTensor]:
    """The input embedding, plus its tied output embedding when the adapter leaves the two different.

    The tied head is the merged embedding itself (trained token rows and rows added by the resize included) unless
    the adapter edits the head on its own; only then can the two differ and the head be written separately."""
    weight = f.get_tensor(name)
    merged = apply_edit(plan.edits.get(name), weight, plan.dtype)
    entries = [PendingTensor(name, merged.dtype, tuple(merged.shape), lambda: merged)]
    for alias in (a for a, src in plan.aliases.items() if src == name and a in plan.edits):
        edit = plan.edits[alias]
        if edit.replacement is None and merged.shape[0] > weight.shape[0]:
            # The head was tied to the resized embedding in training: its added rows are the embedding's.
            grown = torch.cat([weight.to(merged.dtype), merged[weight.shape[0] :]])
            edit = dataclasses.replace(edit, replacement=grown, grow_to=None)
        copy = apply_edit(edit, weight, plan.dtype)
        if copy.shape != merged.shape or not torch.allclose(copy, merged, rtol=1e-5, atol=1e-6):
            warn0(
                f"the adapter leaves {alias} different from {name}; writing it separately and setting "
                "tie_word_embeddings to false."
            )
            entries.append(PendingTensor(alias, copy.dtype, tuple(copy.shape), lambda copy=copy: copy))
    return entries


def _write_config(base: BaseCheckpoint, plan: MergePlan, folder: Path, untied: bool) -> None:
    config = copy.deepcopy(base.config)
    text = (
        config["text_config"] if "vocab_size" not in config and isinstance(config.get("text_config"), dict) else config
    )
    name = plan.input_embedding
    if name is not None and name in plan.edits:
        rows = plan.edits[name].final_shape(base.shapes[name])[0]
        if rows != text.get("vocab_size"):
            print0(f"vocabulary size {text.get('vocab_size')} -> {rows} (the adapter carries resized embeddings)")
            text["vocab_size"] = rows
    # What transformers' resize_token_embeddings changes besides vocab_size (Gemma 4: vocab_size_per_layer_input).
    text.update({k: v for k, v in plan.config_updates.items() if k != "vocab_size"})
    if untied:
        for cfg in {id(config): config, id(text): text}.values():
            cfg["tie_word_embeddings"] = False
    dtype_keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in dtype_keys:
        config[key] = dtypes.name_of(plan.dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_side_files(base: Path, adapter: Path, folder: Path) -> None:
    """generation_config.json and remote code from the base; the tokenizer from the adapter if it has one."""
    for path in [base / "generation_config.json", *sorted(base.glob("*.py"))]:
        if path.exists():
            shutil.copy2(path, folder / path.name)
    tokenizer_source = adapter if (adapter / "tokenizer_config.json").exists() else base
    for path in {p for pattern in (*TOKENIZER_FILES, "chat_template.*") for p in tokenizer_source.glob(pattern)}:
        shutil.copy2(path, folder / path.name)


def _check_output_dir(out: Path) -> None:
    """--output_dir must be new, empty, or a merged model (the kinds of files a merge writes, which it replaces
    whole): a folder holding anything else (a training run's checkpoints, notes) is refused, not replaced."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} is a file; give a folder.")
    if not out.is_dir():
        return
    held = sorted(p.name for p in out.iterdir())
    foreign = [n for n in held if not any(fnmatch.fnmatch(n, pattern) for pattern in MERGED_FILES)]
    if not held or (not foreign and "config.json" in held):
        return
    what = f"files a merge does not write ({', '.join(foreign[:4])}{', ...' * (len(foreign) > 4)})"
    raise ValueError(
        f"--output_dir {out} is not empty and holds "
        + (what if foreign else "no model (no config.json)")
        + "; a merge replaces its --output_dir whole, so it refuses this one. Give a new or empty folder."
    )


@contextlib.contextmanager
def _atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out`, on any error it is removed."""
    _check_output_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.staged_folder(atomic.staging_path(out), what="the merged model", final=out) as staged:
        yield staged
        atomic.replace_folder(staged, out)
