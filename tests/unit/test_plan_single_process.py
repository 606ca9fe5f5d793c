"""The planner for one process without FSDP (estimate_memory(fsdp=False)): no all-gather or reduce-scatter
buffers, only the bf16 copies of the fp32 weights, on torchtune's single-device LoRA/QLoRA row (Llama-3.1-8B, r=8
all linear, bf16, 2 packed rows of 2048 tokens, activation checkpointing)."""

from __future__ import annotations

import pytest

from shardtune.planning.estimate import estimate_memory
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.known_configs import known_config

ROW = {
    "world_size": 1,
    "bf16": True,
    "use_peft_lora": True,
    "lora_r": 8,
    "lora_target_modules": "all-linear",
    "batch_size": 2,
    "seq_len": 2048,
    "packing": True,
    "gradient_checkpointing": True,
}


@pytest.mark.parametrize("use_4bit", [False, True], ids=["lora", "qlora"])
def test_one_process_without_fsdp_plans_no_fsdp_buffers(use_4bit):
    cfg = known_config("meta-llama/Llama-3.1-8B")
    kw = {**ROW, "use_4bit": use_4bit, "nested_quant": use_4bit}
    fsdp, plain = (
        estimate_memory(cfg, PlanInputs(**kw)).device,
        estimate_memory(cfg, PlanInputs(fsdp=False, **kw)).device,
    )
    # FSDP gathers a block and the root in bf16 (GiBs); without it only the adapters' bf16 copies remain: half the
    # bytes of their fp32 masters (the "trainable weights" row).
    assert fsdp["FSDP all-gather buffers"] > 2**31
    assert plain["FSDP all-gather buffers"] == plain["trainable weights"] // 2
    assert plain["FSDP reduce-scatter buffers"] == 0
    same = ("frozen base weights", "quantization constants", "trainable weights", "optimizer state", "activations")
    assert {k: plain[k] for k in same} == {k: fsdp[k] for k in same}
    assert sum(plain.values()) < sum(fsdp.values()) - 2**31


def test_without_fsdp_is_one_process_without_offload():
    cfg = known_config("meta-llama/Llama-3.1-8B")
    for bad in ({"world_size": 2}, {"offload": True}):
        with pytest.raises(ValueError, match="fsdp=False plans one process without offload"):
            estimate_memory(cfg, PlanInputs(**{**ROW, **bad}, fsdp=False))
