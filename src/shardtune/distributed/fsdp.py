"""FSDP2 sharding of a (PEFT) causal LM: each decoder block, then the root."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardtune.parallel import strategy


def mixed_precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Compute in param_dtype; reduce gradients in fp32 so that summing shards loses nothing."""
    if param_dtype is None or param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    *,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    sharding_strategy: str = "FULL_SHARD",
    offload: bool = False,
    pin_memory: bool = True,
    forward_prefetch: bool = False,
    backward_prefetch: str = "BACKWARD_PRE",
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """`fully_shard` each decoder block, then the root (setup order step 5). With `offload`, FSDP2's
    CPUOffloadPolicy keeps the shards in host RAM (pinned when `pin_memory`, which needs CUDA)."""
    if reshard_after_forward is None:
        reshard_after_forward = strategy(sharding_strategy).reshard_after_forward
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    mp = mixed_precision_policy(param_dtype)
    # Reshard after forward follows the YAML's strategy: freeing each block's gathered weights after its forward is
    # what lets a 70B model fit (FULL_SHARD), at one more all-gather per block in backward (docs/speed.md measures
    # the choices). Two exceptions cost one block's weights and save a gather each step:
    for i, block in enumerate(blocks):
        # the last block is all-gathered again as soon as backward starts: keeping it unsharded saves a gather;
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=policy,
            reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
        )
    # the root (embeddings, final norm, head) runs last in forward and first in backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=False)
    _set_prefetch(blocks, forward_prefetch, backward_prefetch)
    return model


def _set_prefetch(blocks: list[nn.Module], forward: bool, backward: str) -> None:
    """FSDP2 already prefetches the next block in backward (BACKWARD_PRE, the guide's setting): its all-gather is
    issued before the current block's backward, so on GPUs communication overlaps compute. Forward prefetch
    (off in the guide) holds one more block's weights to start the next block's all-gather early; it helps when
    all-gathers are slow next to a block's forward (slow interconnect, small blocks). Over gloo on CPU a
    collective blocks the process and nothing overlaps: the choices measure within noise there (docs/speed.md)."""
    if forward:
        for cur, nxt in itertools.pairwise(blocks):
            cur.set_modules_to_forward_prefetch([nxt])
    if backward.upper() == "NO_PREFETCH":
        for b in blocks:
            b.set_modules_to_backward_prefetch([])


def assert_sharded(model: nn.Module, shard_size: int) -> None:
    """Setup order step 7: nothing left on meta, and each sharded tensor holds about 1/N of its rows here
    (N = shard_size, the ranks of the shard group)."""
    for name, p in model.named_parameters():
        assert not p.is_meta, f"parameter {name} is still on the meta device after loading"
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and shard_size > 1:
            rows = p.shape[0] if p.dim() else 1
            local = p.to_local().shape[0] if p.dim() else 1
            assert local <= -(-rows // shard_size), f"{name}: {local} of {rows} rows on one rank"
    for name, b in model.named_buffers():
        assert not b.is_meta, f"buffer {name} is still on the meta device after loading"


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local_state_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds for parameters (trainable and frozen) — what the sharded tensors really occupy."""
    out = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out["trainable" if p.requires_grad else "frozen"] += t.numel() * t.element_size()
    return out
