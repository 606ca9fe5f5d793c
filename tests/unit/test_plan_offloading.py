"""The planner with activation offloading (PlanInputs.activation_offloading, `--enable_activation_offloading`), on
torchtune's single-device row (Llama-3.1-8B, LoRA r=8 on every linear, bf16, 2 packed rows of 2048 tokens,
checkpointing, one process): what the forward saves leaves the GPU (every block's input, the final norm's saved
tensors and the head's input), one block's input comes back for its recomputation, and the copies are held in
pinned host memory, rounded as torch's host allocator rounds them. Every expectation is derived from the model's
shape; that the trainer packs exactly `offloaded_tensor_bytes` is tests/unit/test_activation_offloading.py's.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import shardtune.planning.activations as act
from shardtune.commands.plan import main as plan_main
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.known_configs import known_config
from shardtune.planning.phases import LAYER, LOSS
from shardtune.planning.report import traced_run_inputs
from shardtune.planning.shape import ModelShape

ROW = {
    "world_size": 1,
    "fsdp": False,
    "bf16": True,
    "lora_r": 8,
    "batch_size": 2,
    "seq_len": 2048,
    "packing": True,
    "gradient_checkpointing": True,
}
T, A = 2 * 2048, 2  # tokens of a micro-batch, bytes of bf16


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_config(known_config("meta-llama/Llama-3.1-8B"))


def _pair(shape, **kw):
    inputs = PlanInputs(**{**ROW, **kw})
    offloaded = dataclasses.replace(inputs, activation_offloading=True)
    return estimate_memory(shape, inputs), estimate_memory(shape, offloaded)


def test_the_saved_tensors_leave_the_gpu_at_the_loss_backward(shape):
    kept, off = _pair(shape, loss_chunk_tokens=1024)
    assert kept.peak_phase == off.peak_phase == LOSS  # 1024-position loss chunks: the loss's backward peaks
    h = shape.hidden_size
    blocks = shape.num_layers * T * A * h  # the checkpointed inputs: 1.0 GiB
    final_norm = T * (4 * h + 4 + A * h)  # its fp32 input and rsqrt, and the head's input
    assert kept.device["activations"] - off.device["activations"] == blocks + final_norm
    assert off.device["activations"] == act.step_input_bytes(shape, T, A) + act.span_mask_bytes(2, 2048, True, True)
    assert off.device["logits and loss"] == kept.device["logits and loss"]
    assert off.phase_bytes[LOSS] == kept.phase_bytes[LOSS] - blocks - final_norm


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_the_recomputed_block_input_comes_back(shape, targets):
    """With short loss chunks (the run's for this vocabulary) a block's backward peaks: the offloaded step holds one block's recomputation or
    backward, the recomputation now with that block's input copied back, beside the masks and the micro-batch."""
    kept, off = _pair(shape, lora_target_modules=targets)
    assert kept.inputs.loss_chunk_tokens is None and off.peak_phase == kept.peak_phase  # the run's 256 positions
    assert kept.total == _pair(shape, loss_chunk_tokens=256, lora_target_modules=targets)[0].total
    assert kept.peak_phase == off.peak_phase == LAYER
    layer = T * act.layer_saved_bytes_per_token(
        shape, seq_len=2048, compute_bytes=A, attn_implementation="sdpa", lora_targets=_targets(targets), masked=True,
        per_document=True,
    )  # fmt: skip
    recompute = act.recompute_peak_bytes(
        shape, tokens=T, compute_bytes=A, layer=layer, lora_targets=_targets(targets), lora_r=8, lora_dropout=0.0,
        full_finetune=False, dropout_mask_bytes=1, dropout_scratch_bytes=0, dora=0, dequant=0,
    )  # fmt: skip
    backward = layer + T * act.backward_working_bytes_per_token(shape, A)
    assert kept.temporaries == max(backward, recompute)
    assert off.temporaries == max(backward, recompute + T * A * shape.hidden_size)
    nothing_of_the_blocks = act.step_input_bytes(shape, T, A) + act.span_mask_bytes(2, 2048, True, True)
    assert off.device["activations"] - off.temporaries == nothing_of_the_blocks


def _targets(names: str) -> tuple[str, ...]:
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return all_linear if names == "all-linear" else tuple(names.split(","))


def test_offloaded_activations_do_not_grow_with_depth(shape):
    """Twice the blocks: without offloading the checkpointed inputs double (32 more blocks' T x h); with it the
    activations and logits at the peak are the same, for every attention implementation."""
    deeper = dataclasses.replace(shape, num_layers=2 * shape.num_layers)
    for kw in ({"loss_chunk_tokens": 1024}, {"loss_chunk_tokens": 256}):
        kept, off = _pair(shape, **kw)
        kept_deep, off_deep = _pair(deeper, **kw)
        for impl, row in off.activations_by_attention.items():
            before, after = kept.activations_by_attention[impl], kept_deep.activations_by_attention[impl]
            assert off_deep.activations_by_attention[impl]["checkpointing"] == row["checkpointing"]
            assert after["checkpointing"] - before["checkpointing"] == shape.num_layers * T * A * shape.hidden_size
            # without checkpointing nothing is offloaded (and the flag is refused)
            assert row["no checkpointing"] == before["no checkpointing"]


def test_the_host_holds_pinned_copies(shape):
    """Per rank: 32 block inputs of 32 MiB, the final norm's fp32 input (64 MiB) and rsqrt (16 KiB) twice each, its
    weight (8 KiB), the target mask (4 KiB), and 4 loss chunks of 8 MiB inputs and 8 KiB labels: powers of two
    already, as the pinned allocator would round them."""
    _, off = _pair(shape, loss_chunk_tokens=1024)
    per_rank = 32 * 2**25 + 2 * 2**26 + 2 * 2**14 + 2**13 + 2**12 + 4 * 2**23 + 4 * 2**13
    assert off.host["offloaded activations"] == per_rank  # 1.16 GiB
    assert sum(act.offloaded_tensor_bytes(shape, T, A, 1024)) == per_rank
    assert off.host_total == off.host["processes"] + max(off.host["model loading (local rank 0)"], per_rank)
    two = estimate_memory(shape, PlanInputs(**{**ROW, "fsdp": True, "world_size": 2}, activation_offloading=True))
    assert two.host["offloaded activations"] == 2 * per_rank  # both local ranks' copies
    assert act.pinned_host_bytes(2 * 3000 * 4096 * 2) == 2**26  # a 47 MiB copy takes 64 MiB of pinned memory
    assert act.pinned_host_bytes(2**25) == 2**25 and act.pinned_host_bytes(0) == 0


def test_planned_with_checkpointing_only_and_not_traced(shape):
    with pytest.raises(ValueError, match="activation offloading is planned with gradient checkpointing"):
        estimate_memory(shape, PlanInputs(**{**ROW, "gradient_checkpointing": False}, activation_offloading=True))
    traced = traced_run_inputs(PlanInputs(**ROW, activation_offloading=True), "cpu")
    assert traced.activation_offloading is False  # the traced step is the trainer's without save_on_cpu


def test_plan_takes_train_s_flag(capsys):
    argv = ["--model_name_or_path", "meta-llama/Llama-3.1-8B", "--use_peft_lora", "True", "--bf16", "True",
            "--enable_activation_offloading", "True"]  # fmt: skip
    assert plan_main(argv) == 2
    assert "--enable_activation_offloading True needs activation checkpointing" in capsys.readouterr().err
    assert plan_main([*argv, "--gradient_checkpointing", "True", "--json", "True"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["activation_offloading"] is True  # planning.fit.plan_inputs
