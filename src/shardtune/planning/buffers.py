"""Where a run's weights live on each rank and what FSDP2 copies of them: the model state per rank (the frozen
base sharded with the rest or replicated, `--frozen_base`), and the unsharded parameters, casts and
reduce-scatter buffers of one block and the root (StepParts' FSDP pieces), or, for one process without FSDP, the
compute-dtype copies that take their place. shardtune.planning.estimate puts them into the step's phases.
"""

from __future__ import annotations

from typing import Any

from shardtune.parallel import dims
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import Tensor, sharded_bytes
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import compute_dtype_bytes, state_per_rank


def state_and_buffers(shape: ModelShape, tensors: list[Tensor], inputs: PlanInputs, shard: int, strategy: str):
    """The model state one rank holds and FSDP's buffers (StepParts' pieces), for where the frozen base lives:
    sharded with the rest, or whole on every rank (replicate_base); and for one process without FSDP (fsdp)."""
    s = inputs
    rep = s.replicate_base
    state = state_per_rank(shape, tensors, shard, s.optim, None, frozen_shard=1 if rep else shard)
    managed = _fsdp_managed(tensors, rep, s.offload or not s.use_peft_lora)
    a = compute_dtype_bytes(s.bf16, s.fp16)
    buffers = _buffers(s.fsdp, shape, managed, a, shard, strategy, s.prefetch, s.offload, s.world_size)
    return state, buffers


def _fsdp_managed(tensors: list[Tensor], replicate_base: bool, refused: bool) -> list[Tensor]:
    """The tensors FSDP gathers and reduces: all, or the trainable ones when the frozen base is replicated (which
    `refused` says the run cannot do: full fine-tuning has no frozen base, and offload keeps it in host RAM)."""
    if not replicate_base:
        return tensors
    if refused:
        raise ValueError("replicate_base plans LoRA's frozen base whole on every GPU: use_peft_lora, no offload")
    return [t for t in tensors if t.trainable]


def _buffers(fsdp: bool, shape, tensors, a, shard, strategy, prefetch, offload, world_size) -> dict[str, Any]:
    if fsdp:
        return _fsdp_buffers(shape, tensors, a=a, shard=shard, strategy=strategy, prefetch=prefetch, offload=offload)
    return _plain_buffers(shape, tensors, a, world_size, offload)


def _fsdp_buffers(
    shape: ModelShape, tensors: list[Tensor], *, a: int, shard: int, strategy: str, prefetch: bool, offload: bool
) -> dict[str, Any]:
    """The FSDP pieces of StepParts: one block's and the root's unsharded parameters in the compute dtype
    (4-bit weights as stored), how many blocks are gathered at once, the host-to-GPU copies of offloaded shards,
    and a block's or the root's unsharded gradients plus their fp32 reduce-scatter input (`a + 4` bytes each)."""
    s = dims.strategy(strategy)
    keep_all = s.sharded and not s.reshard_after_forward  # ZeRO-2: every block stays gathered after forward
    # With one rank per shard group FSDP2 copies a prefetched block's shard at its wait, not at its issue, so
    # one block is gathered at a time in backward; otherwise the prefetched block's all-gather output exists.
    in_flight = (2 if prefetch and shard > 1 else 1) if not keep_all else shape.num_layers
    block_shard = sum(sharded_bytes(t, shard) for t in tensors if t.group == "block")
    return {
        "root_gathered": _unsharded_bytes(tensors, "root", a),
        # FSDP2 casts each shard stored in another dtype (fp32 adapters, full fine-tuning's fp32 weights) to the
        # compute dtype on the all-gather copy-in stream before copying it in (_get_param_all_gather_inputs)
        "root_casts": _cast_sizes(tensors, "root", a, shard),
        "block_casts": _cast_sizes(tensors, "block", a, shard),
        "block_gathered": _unsharded_bytes(tensors, "block", a),
        "blocks_in_flight": min(in_flight, shape.num_layers),
        "kept_after_forward": shape.num_layers if keep_all else 1,
        "flat_copy": shard > 1,
        "offload_copies": block_shard * (2 if prefetch else 1) if offload else 0,
        "block_scatter": _unsharded_bytes(tensors, "block", a + 4, trainable_only=True),
        "block_scatter_input": _unsharded_bytes(tensors, "block", 4, trainable_only=True),
        "root_scatter": _unsharded_bytes(tensors, "root", a + 4, trainable_only=True),
        "root_grad_shard": sum(sharded_bytes(t, shard) for t in tensors if t.group == "root" and t.trainable),
        # The head's and final norm's gradients are made in the loss's backward and wait, unsharded in the compute
        # dtype, for the root's reduce-scatter after every block; the embeddings' come last.
        "root_early_grads": a
        * sum(t.numel for t in tensors if t.group == "root" and t.trainable and not t.name.startswith("embed_")),
    }


def _plain_buffers(shape: ModelShape, tensors: list[Tensor], a: int, world_size: int, offload: bool) -> dict[str, Any]:
    """The pieces of StepParts `_fsdp_buffers` gives, for one process without FSDP: the weights are used where
    they are stored, so nothing is gathered and no gradient waits for a reduce-scatter (autograd casts each bf16
    gradient to its fp32 parameter's dtype as it is made). What remains is the compute-dtype copy of every
    parameter stored in another dtype (the fp32 adapters of a bf16 run), alive from forward to the end of
    backward (fsdp.MixedPrecisionCasts): it takes the all-gather row's place, counted as the root's."""
    if world_size > 1 or offload:
        raise ValueError("fsdp=False plans one process without offload: world_size 1, offload False")
    cast = [t for t in tensors if not t.quantized and t.itemsize != a]
    # `tensors` lists one block's parameters (group "block") and the root's.
    copies = sum(sharded_bytes(t, 1, itemsize=a) * (shape.num_layers if t.group == "block" else 1) for t in cast)
    zero = dict.fromkeys(("block_gathered", "offload_copies", "block_scatter", "block_scatter_input"), 0)
    return {
        **zero,
        "root_gathered": copies,
        "root_casts": (),
        "block_casts": (),
        "blocks_in_flight": 1,
        "kept_after_forward": 1,
        "flat_copy": False,
        "root_scatter": 0,
        "root_grad_shard": sum(sharded_bytes(t, 1) for t in tensors if t.group == "root" and t.trainable),
        "root_early_grads": 0,
    }


def _unsharded_bytes(tensors: list[Tensor], group: str, compute_bytes: int, trainable_only: bool = False) -> int:
    """Bytes of one group's parameters once all-gathered: quantized weights as stored, the rest in the compute
    dtype (FSDP2's MixedPrecisionPolicy casts them)."""
    return sum(
        t.numel * (t.itemsize if t.quantized else compute_bytes)
        for t in tensors
        if t.group == group and (t.trainable or not trainable_only)
    )


def _cast_sizes(tensors: list[Tensor], group: str, compute_bytes: int, shard: int) -> tuple[int, ...]:
    """Bytes of each of one group's shards that FSDP2 casts to the compute dtype before all-gathering it."""
    return tuple(
        sharded_bytes(t, shard, itemsize=compute_bytes)
        for t in tensors
        if t.group == group and not t.quantized and t.itemsize != compute_bytes
    )
