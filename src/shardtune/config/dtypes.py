"""Dtype names: the one table from the names users write (flags, YAML, config.json) to torch dtypes and sizes."""

from __future__ import annotations

import torch

# Canonical names as transformers writes them in config.json ("torch_dtype"/"dtype").
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
# The short names of accelerate, TRL and the CLI flags.
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
# Bytes per element, by canonical name or alias; planning counts bytes without building tensors.
DTYPE_BYTES: dict[str, int] = {
    **{name: dt.itemsize for name, dt in DTYPES.items()},
    **{alias: DTYPES[name].itemsize for alias, name in ALIASES.items()},
}
FLOATING = ("bfloat16", "float16", "float32")


def canonical(name: str) -> str:
    """'bf16', 'torch.bfloat16', 'BFloat16' -> 'bfloat16'; unknown names are returned lowered, for the caller's error."""
    name = str(name).strip().lower().removeprefix("torch.")
    return ALIASES.get(name, name)


def parse(name: str) -> torch.dtype | None:
    """The torch dtype for a name or alias; None for names not in the table."""
    return DTYPES.get(canonical(name))


def name_of(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the name config.json uses)."""
    return str(dtype).removeprefix("torch.")
