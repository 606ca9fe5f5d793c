"""Build the sharded training model, in FSDP2 setup order:

1. Process group and mesh (done by `init_distributed` before this is called).
2. Model skeleton: real weights on rank 0 of each node (or on every rank without cpu_ram_efficient_loading); meta
   elsewhere. A 4-bit base is quantized tensor by tensor while it is read (shardtune.models.quant).
3. Resize embeddings; attach the PEFT adapter; freeze the base; packed 4-bit weights become plain parameters of
   the storage dtype (= FSDP's param dtype) with their quantization state kept on the layer.
4. Activation checkpointing per decoder block.
5. `fully_shard` each decoder block, then the root (each node's rank 0 first hands its real tensors to the
   loader, so that it shards on meta like the others). One process may skip it (`use_fsdp`): the plain module
   then computes with FSDP2's mixed-precision numerics (fsdp.without_fsdp), without its all-gather copies.
6. Materialize and fill the shards (scattered from the node's rank 0 one tensor at a time / slice from each rank's
   own copy); give every rank the 4-bit quantization states, replicated, on its device.
7. Assert nothing is left on meta and every rank holds 1/N of each sharded tensor.

Steps 2-4 are the model builder (models.builder, which knows nothing of ranks); this module decides which ranks
read weights and does 5-7, step 5 through `parallel.parallelize` (the one place a parallel axis is applied).
"""

from __future__ import annotations

from torch import nn

from shardtune.models import loading, quant, training_module
from shardtune.models.builder import ModelSpec, build_training_module
from shardtune.parallel import tensor
from shardtune.parallel.fsdp import assert_sharded
from shardtune.parallel.loading import (
    broadcast_quant_states,
    materialize_from_rank0,
    node_group,
    take_full_tensors,
)
from shardtune.parallel.mesh import DistInfo, all_gather_objects
from shardtune.parallel.parallelize import DEFAULT_SHARDING, ShardingSettings, parallelize, use_fsdp
from shardtune.runtime import hooks
from shardtune.runtime.log import print0


def build_sharded_model(
    spec: ModelSpec, info: DistInfo, sharding: ShardingSettings = DEFAULT_SHARDING
) -> training_module.CausalLMForTraining:
    """Steps 2-7 of the setup order: the model of `spec`, sharded and placed as `sharding` says; returns the sharded
    training module (the plain one when `use_fsdp` says one process runs without FSDP; the default settings keep
    FSDP everywhere)."""
    if info.dims.tp > 1:  # before any weight is read
        tensor.check_model(spec.model_name_or_path, info.dims.tp, trust_remote_code=spec.trust_remote_code)
    fsdp, why = use_fsdp(spec, sharding, info)
    print0(why)
    from_rank0 = sharding.cpu_ram_efficient_loading and info.world_size > 1 and spec.read_weights
    node = node_group(info.rank, info.local_rank) if from_rank0 else None
    on_meta = (from_rank0 and not info.is_local_main) or not spec.read_weights
    if from_rank0:
        print0(
            f"cpu_ram_efficient_loading: rank 0 of each node reads the checkpoint; the other ranks build the model "
            f"on meta and receive their shards from it ({info.world_size} rank(s))."
        )
    if not on_meta:
        hooks.at("checkpoint_read", rank=info.rank)
    quantize_device = info.device if info.device.type == "cuda" else None
    train_module, blocks = build_training_module(
        spec, on_meta=on_meta, quantize_device=quantize_device, block_classes=sharding.transformer_cls_to_wrap
    )
    full_tensors = take_full_tensors(train_module) if from_rank0 and info.is_local_main else None
    parallelize(train_module, blocks, spec, sharding, info, fsdp)
    if not fsdp or sharding.frozen_base == "replicated":  # packed weights that FSDP does not manage
        quant.drop_quant_state_keys(train_module)
    if not spec.read_weights:
        return train_module
    _fill(train_module, spec, info, full_tensors, node, offload=sharding.offload)
    # Step 7.
    shards = info.dims.shard_size  # FSDP's shard group (a tp slice is sharded over it again)
    replicated = fsdp and sharding.frozen_base == "replicated" and info.dims.tp == 1
    assert_sharded(train_module, shards)
    trainable, total = loading.count_parameters(train_module)
    print0(
        f"Model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable "
        f"({100 * trainable / max(total, 1):.3f}%), {len(blocks)} blocks "
        + (f"sharded over {info.world_size} rank(s)." if fsdp else "on one process without FSDP.")
        + (" The frozen base is replicated: whole on every rank, never gathered." if replicated else "")
    )
    if spec.quantization_config is not None:
        _report_4bit(train_module, 1 if replicated else shards, sharding.offload)
    return train_module


def _fill(train_module: nn.Module, spec: ModelSpec, info: DistInfo, full_tensors, node, *, offload: bool) -> None:
    """Step 6: fill the shards, from the node's rank 0 or from each rank's own copy (left in host RAM with
    `offload`); place the 4-bit states."""
    from_rank0 = node is not None
    if from_rank0:
        materialize_from_rank0(train_module, full_tensors, info.device, node, offload=offload)
        del full_tensors
    elif info.device.type == "cuda" and not offload:
        train_module.to(info.device)
    if spec.quantization_config is not None and from_rank0:
        broadcast_quant_states(train_module, info.device, node)
    elif spec.quantization_config is not None:
        quant.move_quant_states(train_module, info.device)


def _report_4bit(model: nn.Module, shards: int, offload: bool) -> None:
    """Each rank holds 1/N of the packed 4-bit bytes (all of them with the frozen base replicated: shards 1); the
    quantization states are replicated."""
    per_rank = all_gather_objects(quant.quantized_bytes(model))
    mib = 2**20
    held = ", ".join(f"{b['packed_local'] / mib:.2f}" for b in per_rank)
    experts = per_rank[0]["packed_experts"]
    print0(
        f"4-bit base: {per_rank[0]['packed_total'] / mib:.2f} MiB of packed weights "
        + (f"(experts {experts / mib:.2f} MiB) " if experts else "")
        + (f"sharded over {shards} rank(s), " if shards > 1 else "whole on every rank, ")
        + f"held per rank: [{held}] MiB{' (in host RAM: fsdp_offload_params)' if offload else ''}; quantization "
        f"states {per_rank[0]['quant_state'] / mib:.2f} MiB replicated on every rank."
    )
