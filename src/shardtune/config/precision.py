"""The run's precision, decided once from its flags and launch settings, read by loading, sharding, the planner,
export, merge and the model card.

`--bf16`/`--fp16` (TrainingArguments) and the accelerate YAML's `mixed_precision: bf16|fp16` mean the same thing;
either turns it on. Full fine-tuning keeps fp32 master weights and computes in the low precision (FSDP2's
MixedPrecisionPolicy); a frozen base (LoRA, QLoRA, DoRA) is stored in the compute dtype, since it never steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The values of accelerate's `mixed_precision` (YAML key, ACCELERATE_MIXED_PRECISION) that shardtune runs; accelerate's
# fp8 is refused.
MIXED_PRECISION = ("no", "fp16", "bf16")


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # what FSDP2 casts parameters to for forward and backward
    storage: torch.dtype  # the dtype parameters are loaded and sharded in
    flags: str  # how the user asked for it, for messages ("--bf16 True", "mixed_precision: bf16", ...)

    @property
    def param_dtype(self) -> torch.dtype | None:
        """MixedPrecisionPolicy's param_dtype: None when computing in fp32 (no cast)."""
        return None if self.compute == torch.float32 else self.compute

    @property
    def export(self) -> torch.dtype:
        """Full-model and merged weights are written in the compute dtype: the precision the run trained in."""
        return self.compute

    @property
    def bf16(self) -> bool:
        return self.compute == torch.bfloat16

    @property
    def fp16(self) -> bool:
        return self.compute == torch.float16


def resolve_precision(*, bf16: bool, fp16: bool, mixed_precision: str = "no", peft: bool = True) -> Precision:
    """bf16 wins over fp16 when both are asked for (config validation refuses --bf16 with --fp16)."""
    mp = (mixed_precision or "no").lower()
    if bf16 or mp == "bf16":
        compute, flags = torch.bfloat16, "--bf16 True" if bf16 else "mixed_precision: bf16"
    elif fp16 or mp == "fp16":
        compute, flags = torch.float16, "--fp16 True" if fp16 else "mixed_precision: fp16"
    else:
        compute, flags = torch.float32, "neither --bf16 nor --fp16"
    return Precision(compute=compute, storage=compute if peft else torch.float32, flags=flags)


def casts_every_weight(use_peft_lora: bool, param_dtype: torch.dtype | None) -> bool:
    """Full fine-tuning computing its fp32 master weights in a 16-bit dtype: every weight gets a compute-dtype copy
    (FSDP holds one block's at a time, the plain module all of them). What config.fsdp.fsdp_reason's "auto" reads,
    for the run (parallel.parallelize.use_fsdp) and the planner (planning.fit.plan_inputs) alike."""
    return not use_peft_lora and param_dtype not in (None, torch.float32)
