"""The run's parallel axes applied to the built training module, each in one place and in this order (torchtitan's
parallelize functions are the model): after the builder (models.builder: weights, adapter, checkpointing; no
ranks) and before the shards are filled (parallel.setup).

1. Context parallelism (`ParallelDims.cp`): nothing to wrap. The builder chose an attention that reads a split
   (SDPA per part, or one flash-attention varlen call) and refused a family it cannot split; the trainer hands each
   micro-batch's split to the module (`parallel.context_parallel.local_part`); FSDP's shard group spans
   dp_shard x cp (`ParallelDims.shard_size`). Here: the line that says so.
2. Tensor parallelism (`ParallelDims.tp`): the family's plan slices each block's linear layers (and their LoRA
   factors) over the "tp" dimension of the mesh (`parallel.tensor`), before FSDP, which then takes the
   data-parallel dimensions (`DistInfo.dp_mesh`) and shards each tp slice further.
3. Data parallelism: `fully_shard` each decoder block, then the root, over the shard mesh (the frozen base left
   out with `--frozen_base replicated`), or, for one process that skips FSDP (`use_fsdp`), the plain module with
   FSDP2's mixed-precision numerics.

How the data-parallel axis shards and places the model is `ShardingSettings` (the model itself is the builder's
`ModelSpec`); `sharding_settings` is the one place a run's FSDP settings become it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardtune.config.fsdp import FSDPSettings, fsdp_reason
from shardtune.config.precision import casts_every_weight
from shardtune.models.builder import ModelSpec
from shardtune.parallel import tensor
from shardtune.parallel.fsdp import shard_model, without_fsdp
from shardtune.parallel.mesh import DistInfo
from shardtune.runtime.log import print0


@dataclass(frozen=True)
class ShardingSettings:
    """How FSDP shards and places the built model, as flat values: the decisions of the run's FSDP settings (what
    accelerate's fsdp_config says) and of its start-up plan, none of them a fact of the model. The defaults: FULL_SHARD
    with every rank reading the weights, and FSDP kept on one process too."""

    sharding_strategy: str = "FULL_SHARD"
    reshard_after_forward: bool | None = None  # None: as the strategy says (FSDP2's False: its ZeRO-2 variant)
    offload: bool = False  # fsdp_offload_params: FSDP2's CPUOffloadPolicy
    cpu_ram_efficient_loading: bool = False  # each node's rank 0 reads the weights, the others build on meta
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    # The decoder block classes FSDP shards one by one (fsdp_transformer_layer_cls_to_wrap; None: the model's
    # _no_split_modules); the builder compiles the same blocks.
    transformer_cls_to_wrap: str | None = None
    # LoRA/DoRA/QLoRA on several ranks: the frozen base "sharded" by FSDP (gathered for every block's forward and
    # backward) or "replicated", whole on every rank (recipe.settings.start_plan decides --frozen_base auto).
    frozen_base: str = "sharded"
    # One process: SHARDTUNE_FSDP_SINGLE_PROCESS (config.fsdp.FSDPSettings.single_process; use_fsdp).
    single_process: str = "fsdp"


DEFAULT_SHARDING = ShardingSettings()  # frozen: safe as a default argument


def sharding_settings(fsdp: FSDPSettings, frozen_base: str = "sharded") -> ShardingSettings:
    """A run's ShardingSettings: its FSDP settings (`RunConfig.fsdp`) with the frozen base placed as `frozen_base`
    (the start-up plan's answer, or the placement `shardtune plan --trace` traces). The one place they are copied."""
    return ShardingSettings(
        sharding_strategy=fsdp.sharding_strategy,
        reshard_after_forward=fsdp.reshard_after_forward,
        offload=fsdp.offload_params,
        cpu_ram_efficient_loading=fsdp.cpu_ram_efficient_loading,
        forward_prefetch=fsdp.forward_prefetch,
        backward_prefetch=fsdp.backward_prefetch,
        transformer_cls_to_wrap=fsdp.transformer_cls_to_wrap,
        frozen_base=frozen_base,
        single_process=fsdp.single_process,
    )


def parallelize(
    train_module: nn.Module,
    blocks: list[nn.Module],
    spec: ModelSpec,
    sharding: ShardingSettings,
    info: DistInfo,
    fsdp: bool,
) -> None:
    """Apply the context-, tensor- and data-parallel axes, in that order (`fsdp`: use_fsdp's answer)."""
    dims = info.dims
    if dims.cp > 1 and spec.read_weights:  # (a traced plan prints its own report)
        print0(
            f"Context parallelism: each row split over {dims.cp} ranks ({2 * dims.cp} chunks, zigzag), "
            f"{dims.dp_size} batch(es) per step; keys and values all-gathered per layer, documents kept apart."
        )
    if dims.tp > 1:
        plan = tensor.family_plan(train_module.model.config)
        assert plan is not None, "setup checks the family's tensor-parallel plan before loading"
        tensor.apply_tensor_parallel(blocks, info.tp_mesh, plan)
    if fsdp:
        _shard(train_module, blocks, spec, sharding, info)
    else:
        without_fsdp(train_module, blocks=blocks, param_dtype=spec.param_dtype)


def use_fsdp(spec: ModelSpec, sharding: ShardingSettings, info: DistInfo) -> tuple[bool, str]:
    """Whether to `fully_shard`, and the one line saying why. Several processes always shard. One process skips
    FSDP unless told to keep it (sharding.single_process "fsdp") or unless it needs FSDP itself: fsdp_offload_params is
    FSDP2's CPUOffloadPolicy, and a model built without weights (`shardtune plan --trace`) is traced by FSDP2's
    memory tracker. "auto" also keeps it for mixed-precision full fine-tuning (below); "no_fsdp" does not."""
    reason = fsdp_reason(  # the rule the planner applies too (planning.fit.plan_inputs)
        info.world_size,
        sharding.single_process,
        offload=sharding.offload,
        full_mixed_precision=casts_every_weight(spec.use_peft_lora, spec.param_dtype),
    )
    if reason == "processes":
        return True, f"FSDP: {info.world_size} processes shard the model."
    if not spec.read_weights:
        return True, "FSDP at world size 1: the traced step runs under FSDP2's memory tracker."
    if reason == "setting":
        return True, "FSDP at world size 1: kept by SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp."
    if reason == "offload":
        return True, "FSDP at world size 1: fsdp_offload_params keeps the weights in host RAM through FSDP2's offload."
    if reason == "full_mixed_precision":
        # Without FSDP the compute-dtype copies live from forward to the end of backward (fsdp.MixedPrecisionCasts):
        # a few MiB of adapters, but the whole model in full fine-tuning, where FSDP gathers one block at a time.
        return True, (
            "FSDP at world size 1: full fine-tuning computes every fp32 weight in "
            f"{str(spec.param_dtype).removeprefix('torch.')}, and FSDP holds one block's copy at a time "
            "(SHARDTUNE_FSDP_SINGLE_PROCESS=no_fsdp trains without it, holding the whole model's copy)."
        )
    return False, (
        "No FSDP at world size 1: the plain module trains with FSDP2's mixed-precision numerics and without its "
        "all-gather and reduce-scatter copies (SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp keeps FSDP)."
    )


def _shard(
    train_module: nn.Module, blocks: list[nn.Module], spec: ModelSpec, sharding: ShardingSettings, info: DistInfo
) -> None:
    """Step 5: shard each block, then the root.

    fsdp_offload_params: FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer step in
    host RAM. Pinned (for asynchronous copies) on CUDA; on a CPU-only machine the same policy runs unpinned, so
    the offload path (host shards, offloaded gradients, the step on CPU tensors) is the one the tests exercise."""
    if sharding.offload and info.device.type != "cuda":
        print0(
            "fsdp_offload_params: on a CPU-only machine the shards already live in host RAM; FSDP2's offload policy "
            "runs without pinned memory."
        )
    shard_model(
        train_module,
        blocks=blocks,
        mesh=info.dp_mesh,
        param_dtype=spec.param_dtype,
        sharding_strategy=sharding.sharding_strategy,
        offload=sharding.offload,
        pin_memory=info.device.type == "cuda",
        forward_prefetch=sharding.forward_prefetch,
        backward_prefetch=sharding.backward_prefetch,
        reshard_after_forward=sharding.reshard_after_forward,
        # Under tensor parallelism the frozen slices stay sharded (--frozen_base auto's planner does not model tp yet).
        replicate_frozen=sharding.frozen_base == "replicated" and info.dims.tp == 1,
    )
