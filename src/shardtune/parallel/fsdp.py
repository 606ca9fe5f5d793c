"""FSDP2 sharding of a (PEFT) causal LM: each decoder block, then the root; or, on one process, the plain module
with FSDP2's mixed-precision numerics (`without_fsdp`)."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from shardtune.parallel.dims import strategy


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
    replicate_frozen: bool = False,
) -> nn.Module:
    """`fully_shard` each decoder block, then the root (setup order step 5). With `offload`, FSDP2's
    CPUOffloadPolicy keeps the shards in host RAM (pinned when `pin_memory`, which needs CUDA). With
    `replicate_frozen`, FSDP manages the trainable parameters only (`frozen_parameters`): every rank keeps the
    whole frozen base, which is never gathered."""
    if reshard_after_forward is None:
        reshard_after_forward = strategy(sharding_strategy).reshard_after_forward
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    mp = mixed_precision_policy(param_dtype)
    ignored = frozen_parameters(model, param_dtype) if replicate_frozen else None
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
            ignored_params=ignored,
        )
    # the root (embeddings, final norm, head) runs last in forward and first in backward.
    fully_shard(
        model, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=False, ignored_params=ignored
    )
    _set_prefetch(blocks, forward_prefetch, backward_prefetch)
    return model


def frozen_parameters(model: nn.Module, param_dtype: torch.dtype | None) -> set[nn.Parameter]:
    """The frozen parameters, for `fully_shard(ignored_params=...)`: FSDP leaves them as they are, whole on every
    rank, without all-gathers (their gradients, of which there are none, would not be reduced either).

    FSDP would cast each of them to `param_dtype` at every all-gather; left out of FSDP they are cast once, here,
    which is the same number (a frozen weight never changes) and what the layers then compute with. The 4-bit
    packed weights are stored in that dtype already (shardtune.models.quant.prepare_for_fsdp)."""
    frozen = {p for p in model.parameters() if not p.requires_grad}
    if param_dtype is not None:
        with torch.no_grad():
            for p in frozen:
                if p.is_floating_point() and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)
    return frozen


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


@contextlib.contextmanager
def kept_gathered(model: nn.Module) -> Iterator[None]:
    """Inside the block, every FSDP module keeps its weights gathered from its first forward on, instead of
    resharding after each: a generated rollout then costs one all-gather per block rather than one per block and
    token (TRL's ds3_gather_for_generation). On exit each module's own reshard-after-forward setting is restored
    and its weights resharded (no communication). Peak memory inside: the whole model in the compute dtype."""
    modules = [m for m in model.modules() if is_fsdp(m)]
    saved = [(g, g.post_forward_mesh_info) for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for group, info in saved:  # FSDP2 keeps the setting per parameter group (None: never reshard after forward)
            group.post_forward_mesh_info = info
        for m in modules:
            m.reshard()


def local_state_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds for parameters (trainable and frozen) — what the sharded tensors really occupy."""
    out = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out["trainable" if p.requires_grad else "frozen"] += t.numel() * t.element_size()
    return out


# ---------------------------------------------------------------------------------------------------------------
# One process without fully_shard: the same numerics as mixed_precision_policy, on the plain module


class MixedPrecisionCasts:
    """What `fully_shard` with `mixed_precision_policy(param_dtype)` does to the numbers, without FSDP's copies.

    At world size 1 FSDP2's all-gather copies each parameter into a buffer in param_dtype, the forward and
    backward run on that copy, and the reduce-scatter casts its gradient to reduce_dtype (fp32) and into the
    parameter's own dtype. Here the root's forward pre-hook registers `p.to(param_dtype)` in place of every
    floating parameter stored in another dtype (the fp32 adapter masters of a bf16 run) and autograd's cast-back
    is FSDP's fp32 reduce: one bf16 gradient per parameter and forward (summed over its uses in bf16, as on FSDP's
    unsharded parameter), cast to fp32 and accumulated there. The copies stay registered until backward ends (as
    the root's unsharded parameters do: checkpointed blocks and loss chunks recompute on them), or until a
    forward without gradients ends. Floating inputs of the root and of each block are cast like
    MixedPrecisionPolicy(cast_forward_inputs=True) casts them. Parameters already in param_dtype (a bf16 frozen
    base, the 4-bit packed weights) are used as they are."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], param_dtype: torch.dtype):
        self.dtype = param_dtype
        self.slots = [
            (module, name)
            for module in model.modules()
            for name, p in module._parameters.items()
            if p is not None and p.is_floating_point() and p.dtype != param_dtype
        ]
        self.masters: list[torch.Tensor] | None = None  # the registered parameters while the copies are in place
        model.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        model.register_forward_hook(self._root_post_forward)
        for block in blocks:
            block.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)

    def _cast_inputs(self, module: nn.Module, args, kwargs):
        cast = functools.partial(_cast_floating, self.dtype)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_pre_forward(self, module: nn.Module, args, kwargs):
        # A second forward before backward (a preference objective's two passes) keeps the same copies, as
        # FSDP's root keeps its unsharded parameters until backward.
        if self.masters is None:
            self.masters = [m._parameters[n] for m, n in self.slots]
            copies: dict[int, torch.Tensor] = {}
            for (owner, name), p in zip(self.slots, self.masters, strict=True):
                # Tied parameters share one copy, as they share one unsharded FSDP parameter.
                owner._parameters[name] = copies.setdefault(id(p), p.to(self.dtype))
        return self._cast_inputs(module, args, kwargs)

    def _root_post_forward(self, module: nn.Module, args, output):
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            self.restore()
        for t in tensors:
            t.register_hook(self._at_backward_start)
        return output

    def _at_backward_start(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.restore)

    def restore(self) -> None:
        """Register the parameters themselves again (those the optimizer steps and the state dict holds)."""
        if self.masters is None:
            return
        for (owner, name), p in zip(self.slots, self.masters, strict=True):
            owner._parameters[name] = p
        self.masters = None


def _cast_floating(dtype: torch.dtype, x):
    # FSDP2's _cast_fp_tensor: floating tensors only, and only when the dtype differs.
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def without_fsdp(model: nn.Module, *, blocks: list[nn.Module], param_dtype: torch.dtype | None) -> nn.Module:
    """One process, no `fully_shard`: the plain module computes in `param_dtype` as FSDP2's mixed precision would
    (MixedPrecisionCasts); a fp32 run (param_dtype None or fp32) needs nothing."""
    mp = mixed_precision_policy(param_dtype)
    if mp.param_dtype is not None:
        model._mixed_precision_casts = MixedPrecisionCasts(model, blocks, mp.param_dtype)
    return model
