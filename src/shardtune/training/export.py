"""Final outputs: the adapter in PEFT's format (or a full HF model folder), the tokenizer, written atomically."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from shardtune.runtime import atomic, hooks

# Files replaced last so that a crash in between leaves an older, complete adapter rather than a mixed one.
_LAST = ("adapter_model.safetensors", "model.safetensors.index.json", "model.safetensors")


def tmp_dir_for(output_dir: str | Path, name: str) -> Path:
    """The hidden folder inside output_dir that an export is written into before its files are moved out."""
    return atomic.staging_path(Path(output_dir) / name)


def move_into_place(tmp: Path, output_dir: str | Path) -> None:
    """Move each finished file from tmp into output_dir with an atomic rename, weights last; shards of an older
    export that the new one does not have are removed.

    Not one folder rename, unlike checkpoints: PEFT's and transformers' layout puts the files at the top of
    output_dir, next to checkpoints/ and metrics.jsonl, which must stay.
    """
    out = Path(output_dir)
    stale = [p for p in out.glob("model-*.safetensors") if not (tmp / p.name).exists()]
    atomic.move_files_into(tmp, out, last=lambda name: name in _LAST or name.startswith("model-"), stale=stale)


@contextlib.contextmanager
def _staged(output_dir: str | Path, name: str, what: str, state_dict: dict, step: int) -> Iterator[Path]:
    """A temporary folder inside output_dir, moved into place when the block ends and removed on any error
    (a full disk raises atomic.DiskFullError naming output_dir and the bytes the weights need)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic.staged_folder(
        tmp_dir_for(out, name), what=what, final=out, needed=atomic.tensor_bytes(state_dict)
    ) as tmp:
        yield tmp
        hooks.at("export", step=step, rank=0)
        move_into_place(tmp, out)


def save_adapter(
    peft_model: nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, output_dir: str | Path, step: int = 0
) -> Path:
    """Rank 0: write adapter_config.json + adapter_model.safetensors (from the gathered full tensors) and the
    tokenizer, so that `PeftModel.from_pretrained(base, output_dir)` loads it."""
    with _staged(output_dir, "adapter", "the adapter", state_dict, step) as tmp:
        peft_model.save_pretrained(
            str(tmp), state_dict=state_dict, save_embedding_layers=False, safe_serialization=True
        )
        # peft writes into a subfolder for adapters not named "default".
        for sub in [p for p in tmp.iterdir() if p.is_dir()]:
            for f in sub.iterdir():
                f.rename(tmp / f.name)
            sub.rmdir()
        tokenizer.save_pretrained(str(tmp))
    return Path(output_dir)


def save_full_model(
    hf_model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    tokenizer,
    output_dir: str | Path,
    dtype: torch.dtype | None = None,
    step: int = 0,
) -> Path:
    """Rank 0: write a standard HF model folder (sharded safetensors, config, tokenizer)."""
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    hf_model.config.use_cache = True
    with _staged(output_dir, "model", "the model", state_dict, step) as tmp:
        hf_model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True, max_shard_size="5GB")
        if dtype is not None:
            _name_dtype(tmp / "config.json", dtype)
        tokenizer.save_pretrained(str(tmp))
    return Path(output_dir)


def _name_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights are written in. transformers' save_pretrained writes the model's
    own (the fp32 masters a full fine-tune trains), so that from_pretrained(dtype="auto") would upcast them."""
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)  # the older name of the same key
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
