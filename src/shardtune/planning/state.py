"""The model state one rank holds once FSDP2 has sharded it: frozen and trainable parameters, gradients, optimizer
states, the replicated quantization constants, and the host copies (offload, model loading).

Strategies come from parallel.dims, optimizer state bytes from training.optimizers and dtype sizes from
shardtune.config.dtypes: the planner counts what the run builds from the same tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from shardtune.config import dtypes
from shardtune.parallel import dims
from shardtune.parallel.tensor import LLAMA_PLAN
from shardtune.planning.inputs import DEFAULTS, PlanInputs
from shardtune.planning.model import (
    Tensor,
    model_tensors,
    quant_constant_bytes,
    resolve_lora_targets,
    shard_rows,
    sharded_bytes,
)
from shardtune.planning.shape import ModelShape
from shardtune.training import optimizers

GiB = 1024**3
# Each host process (Python, torch, CUDA runtime, data loading) before any model state. Calibrated, from two
# measurements none of which is a figure docs/plan.md compares with: the peak RSS of a process that has imported
# shardtune's training stack is 513 MiB (torch 2.11, transformers 5.17, peft, datasets; 219 MiB for torch alone;
# `python -c "import torch, transformers, peft, datasets; import commands.train" ` with resource.getrusage), and
# initialising CUDA and making one tensor adds 1,734,560 KiB of peak RSS to a torch process (pytorch/pytorch#113326,
# RTX 3090, torch 2.2, CUDA 11.8): 2.15 GiB.
HOST_PROCESS_BYTES = int(2.15 * GiB)


# Tensor parallelism's plan by layer name (shardtune.parallel.tensor.LLAMA_PLAN): q, k, v, gate and up are
# column-parallel, o and down row-parallel.
TP_STYLE = {path.rpartition(".")[2]: style for path, style in LLAMA_PLAN.items()}
# The dimension of a sliced layer's tensor that one tp rank holds 1/tp of, by (style, tensor): a column-parallel
# layer's weight rows (W: out x in), bias, lora_B's rows and DoRA's magnitude follow its output; a row-parallel
# layer's weight columns and lora_A's columns follow its input. Absent: whole on every tp rank (a row-parallel
# layer's bias and lora_B, a column-parallel layer's lora_A), as torch's ColwiseParallel and RowwiseParallel place
# them (shardtune.parallel.tensor).
TP_DIM = {
    ("colwise", "weight"): 0,
    ("colwise", "bias"): 0,
    ("colwise", "lora_B"): 0,
    ("colwise", "lora_magnitude_vector"): 0,
    ("rowwise", "weight"): 1,
    ("rowwise", "lora_A"): 1,
}


def as_shape(model: ModelShape | Mapping | Any) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape.from_config(model)


def compute_dtype_bytes(bf16: bool, fp16: bool) -> int:
    """Bytes of the compute dtype the flags give (shardtune.config.precision decides which flags a run has)."""
    return dtypes.DTYPE_BYTES["bfloat16" if bf16 else "float16" if fp16 else "float32"]


def shard_group_size(world_size: int, num_nodes: int, sharding_strategy: str) -> int:
    """Ranks one parameter is split over: all of them, those of one node (hybrid), or none (NO_SHARD)."""
    s = dims.strategy(sharding_strategy.upper())
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"world size {world_size} must be a positive multiple of the number of machines {num_nodes}")
    if not s.sharded:
        return 1
    return world_size // num_nodes if s.hybrid else world_size


def optimizer_bytes(t: Tensor, shard: int, optim: str, rank: int | None) -> int:
    """Optimizer state bytes of one rank's shard of `t`. The optimizer steps the rank's local shard (FSDP2's
    `to_local()`; bitsandbytes through optimizers.LocalShards), so size-dependent choices such as bitsandbytes'
    8-bit threshold see the shard's element count, not the full tensor's."""
    local_numel = shard_rows(t.shape[0], shard, rank) * math.prod(t.shape[1:])
    return optimizers.get(optim).state_bytes(local_numel, t.itemsize)


def dtype_bytes(name: str, what: str) -> int:
    canonical = dtypes.canonical(name)
    if canonical not in dtypes.DTYPES:
        raise ValueError(f"{what} {name!r}: use one of {', '.join(dtypes.DTYPES)}")
    return dtypes.DTYPE_BYTES[canonical]


def run_tensors(shape: ModelShape, inputs: PlanInputs) -> list[Tensor]:
    """The run's parameter tensors (planning.model.model_tensors) for its inputs: the compute and stored dtypes,
    quantization, LoRA's targets and rank, DoRA and modules_to_save."""
    s = inputs
    a = compute_dtype_bytes(s.bf16, s.fp16)
    targets = resolve_lora_targets(shape, s.lora_target_modules, s.lora_target_parameters) if s.use_peft_lora else ()
    return model_tensors(
        shape,
        base_bytes=dtype_bytes(s.base_dtype, "base_dtype") if s.base_dtype else a,
        trainable_bytes=dtype_bytes(s.adapter_dtype, "adapter_dtype") if s.use_peft_lora else 4,
        use_4bit=s.use_4bit,
        use_8bit=s.use_8bit,
        quant_storage_bytes=dtype_bytes(s.quant_storage_dtype, "quant_storage_dtype"),
        full_finetune=not s.use_peft_lora,
        lora_r=s.lora_r,
        lora_targets=targets,
        use_dora=s.use_dora,
        modules_to_save=s.modules_to_save,
    )


def tensor_parallel_slices(tensors: list[Tensor], tp: int) -> list[Tensor]:
    """The run's tensors as one of `tp` tensor-parallel ranks holds them before FSDP shards them (FSDP2 then splits
    each rank's local tensor on dim 0 over the data-parallel ranks, as it splits a whole one): each block linear of
    the plan sliced (TP_DIM), everything else whole: the blocks' norms, the embeddings, final norm and head."""
    return tensors if tp == 1 else [_tp_slice(t, tp) for t in tensors]


def _tp_slice(t: Tensor, tp: int) -> Tensor:
    layer, _, kind = t.name.rpartition(".")  # "q_proj.weight", "model.layers.*.mlp.down_proj.lora_A"
    dim = TP_DIM.get((TP_STYLE.get(layer.rpartition(".")[2], ""), kind)) if t.group == "block" else None
    if dim is None:
        return t
    return replace(t, shape=tuple(n // tp if d == dim else n for d, n in enumerate(t.shape)))


def tensor_parallel_problems(shape: ModelShape | None, inputs: PlanInputs) -> list[str]:
    """What keeps `inputs` from running under its tensor_parallel size as shardtune trains it (empty: nothing; tp 1
    always runs): the same refusals as training's, from the shape and the plan's inputs instead of the config
    (shardtune.config.validation's flags, shardtune.parallel.tensor.model_problems' model; shape None: the run's
    settings only), so that the estimate refuses what training would and the recommender never proposes it."""
    s, tp = inputs, inputs.tensor_parallel
    if tp == 1:
        return []
    local = s.world_size // s.num_nodes
    ranks = f"must divide a machine's {local} processes, and all {s.world_size} with cp {s.context_parallel}"
    unsupported = [
        (local % tp or s.world_size % (tp * s.context_parallel), ranks),
        *([] if shape is None else _tensor_parallel_model_problems(shape, tp)),
        (s.use_4bit or s.use_8bit, "a quantized base is not sliced"),
        (s.lora_target_parameters, "expert or parameter LoRA targets are not sliced"),
        (s.offload or s.replicate_base or s.activation_offloading,
         "offload, a replicated frozen base and activation offloading are not verified with it"),
        (not dims.strategy(s.sharding_strategy.upper()).sharded, "NO_SHARD is refused with it"),
        (s.rows_per_example != 1 or s.rollout_engine is not None, "only sft is verified with it"),
    ]  # fmt: skip
    return [f"tensor_parallel {tp}: {why}" for bad, why in unsupported if bad]


def _tensor_parallel_model_problems(shape: ModelShape, tp: int) -> list[tuple[bool, str]]:
    """shardtune.parallel.tensor.model_problems on the shape: the verified plan (ModelShape.tensor_parallel_plan),
    no experts (nor a latent attention, which has no such plan), whole heads and equal MLP slices per rank."""
    widths = (shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    return [
        (not shape.tensor_parallel_plan, f"{shape.model_type} has no tensor-parallel plan shardtune has verified"),
        (bool(shape.num_experts or shape.latent_attention), "experts and latent attention are not sliced"),
        (any(n % tp for n in widths), f"heads, key/value heads and MLP width {widths} must divide by it"),
    ]


def quant_constants(shape: ModelShape, use_4bit: bool, use_8bit: bool, nested_quant: bool) -> int:
    """Constants bitsandbytes keeps beside the quantized weights; they are not FSDP parameters, so every rank
    holds all of them on its GPU."""
    if not (use_4bit or use_8bit):
        return 0
    bits = 4 if use_4bit else 8
    dims = [d for name, d in shape.linear_dims().items() if name in shape.block_linears()]
    per_block = sum(quant_constant_bytes(i, o, nested_quant, bits) for i, o in dims)
    if shape.block_extra_linear > 0:  # the linear weights beyond the layout, as hidden-wide rows
        rows = -(-shape.block_extra_linear // shape.hidden_size)
        per_block += quant_constant_bytes(shape.hidden_size, rows, nested_quant, bits)
    if use_4bit:  # 4-bit experts: one state per expert (shardtune.models.quant_experts)
        experts = [shp for shp in shape.expert_tensors().values() if len(shp) == 3]
        per_block += sum(e * quant_constant_bytes(i, o, nested_quant) for e, i, o in experts)
    return shape.num_layers * per_block


def state_per_rank(
    shape: ModelShape, tensors: list[Tensor], shard: int, optim: str, rank: int | None, frozen_shard: int | None = None
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states on one rank; the frozen tensors are split over
    `frozen_shard` ranks (default `shard`; 1: replicated, whole on every rank)."""
    out = {"frozen": 0, "trainable": 0, "gradients": 0, "optimizer": 0}
    for t in tensors:
        n = shape.num_layers if t.group == "block" else 1
        if t.trainable:
            local = sharded_bytes(t, shard, rank) * n
            out["trainable"] += local
            out["gradients"] += local
            out["optimizer"] += optimizer_bytes(t, shard, optim, rank) * n
        else:
            out["frozen"] += sharded_bytes(t, shard if frozen_shard is None else frozen_shard, rank) * n
    return out


def model_state_bytes_per_rank(
    model: ModelShape | Mapping | Any, inputs: PlanInputs = DEFAULTS, rank: int | None = None
) -> dict[str, int]:
    """Bytes of model state one rank holds after `fully_shard`, for the run `inputs` describe: frozen and trainable
    parameters, gradients and optimizer states (each tensor split on dim 0 with torch.chunk; the frozen ones whole
    with replicate_base; under tensor parallelism each rank's slices, tensor_parallel_slices), plus the replicated
    quantization constants.

    rank=None gives the padded shard every rank allocates; a rank number gives that rank's real chunk, i.e.
    what `param.to_local()` holds there.
    """
    s = inputs
    shape = as_shape(model)
    if problems := tensor_parallel_problems(shape, s):
        raise ValueError(problems[0])
    # FSDP shards over the ranks that hold the same tp slice (parallel.dims.ParallelDims.shard_size)
    shard = shard_group_size(s.world_size // s.tensor_parallel, s.num_nodes, s.sharding_strategy)
    tensors = tensor_parallel_slices(run_tensors(shape, s), s.tensor_parallel)
    frozen_shard = 1 if s.replicate_base else shard
    out = state_per_rank(shape, tensors, shard, s.optim, None if rank is None else rank % shard, frozen_shard)
    lora = s.use_peft_lora
    out["quant_constants"] = quant_constants(shape, s.use_4bit and lora, s.use_8bit and lora, s.nested_quant)
    out["total"] = sum(out.values())
    return out


def host_bytes(
    state: dict[str, int], tensors: list[Tensor], shape: ModelShape, local_ranks: int, offload: bool
) -> dict[str, int]:
    """Host RAM per machine: offloaded shards of every local rank, and the full model that local rank 0 builds
    in its training dtypes (4-bit packed once quantized) before it is sharded."""
    full = sum(t.numel * t.itemsize * (shape.num_layers if t.group == "block" else 1) for t in tensors)
    on_host = local_ranks if offload else 0
    return {
        "offloaded parameters": (state["frozen"] + state["trainable"]) * on_host,
        "offloaded gradients": state["gradients"] * on_host,
        "offloaded optimizer state": state["optimizer"] * on_host,
        "model loading (local rank 0)": full,
        "processes": HOST_PROCESS_BYTES * local_ranks,
    }
