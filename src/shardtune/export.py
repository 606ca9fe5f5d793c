"""Final outputs: the adapter in PEFT's format (or a full HF model folder), the tokenizer, written atomically."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

# Files replaced last so that a crash in between leaves an older, complete adapter rather than a mixed one.
_LAST = ("adapter_model.safetensors", "model.safetensors.index.json", "model.safetensors")


def tmp_dir_for(output_dir: str | Path, name: str) -> Path:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def move_into_place(tmp: Path, output_dir: str | Path) -> None:
    """Move each finished file from tmp into output_dir with an atomic rename, weights last."""
    out = Path(output_dir)
    files = sorted(tmp.iterdir(), key=lambda p: (p.name in _LAST or p.name.startswith("model-"), p.name))
    stale = [p for p in out.glob("model-*.safetensors") if not (tmp / p.name).exists()]
    for f in files:
        target = out / f.name
        if f.is_dir():
            if target.exists():
                shutil.rmtree(target)
            f.rename(target)
        else:
            os.replace(f, target)
    for p in stale:
        p.unlink()
    tmp.rmdir()


def save_adapter(peft_model: nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, output_dir: str | Path) -> Path:
    """Rank 0: write adapter_config.json + adapter_model.safetensors (from the gathered full tensors) and the
    tokenizer, so that `PeftModel.from_pretrained(base, output_dir)` loads it."""
    tmp = tmp_dir_for(output_dir, "adapter")
    peft_model.save_pretrained(str(tmp), state_dict=state_dict, save_embedding_layers=False, safe_serialization=True)
    # peft writes into a subfolder for adapters not named "default".
    for sub in [p for p in tmp.iterdir() if p.is_dir()]:
        for f in sub.iterdir():
            f.rename(tmp / f.name)
        sub.rmdir()
    tokenizer.save_pretrained(str(tmp))
    move_into_place(tmp, output_dir)
    return Path(output_dir)


def save_full_model(
    hf_model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    tokenizer,
    output_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Rank 0: write a standard HF model folder (sharded safetensors, config, tokenizer)."""
    tmp = tmp_dir_for(output_dir, "model")
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    hf_model.config.use_cache = True
    hf_model.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True, max_shard_size="5GB")
    tokenizer.save_pretrained(str(tmp))
    move_into_place(tmp, output_dir)
    return Path(output_dir)
