"""4-bit and 8-bit frozen bases (bitsandbytes) under FSDP2: checks of the flag combinations."""

from __future__ import annotations


def quantization_problems(*, use_4bit: bool, use_8bit: bool, quant_storage_dtype: str, bf16: bool, fp16: bool,
                          fsdp_enabled: bool, mixed_precision: str) -> list[str]:
    """Combinations that would train wrongly under FSDP, each with the flags to set."""
    return []
