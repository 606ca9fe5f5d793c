"""A fake process group of any world size, for tracing one rank's training step under fake tensors.

torch's "fake" backend (torch.testing._internal.distributed.fake_pg, which torchtitan's memory estimation uses)
accepts every collective and returns at once without communicating, so one process can run the FSDP2 code of
rank 0 of a W-rank job: `fully_shard` splits every parameter W ways and all-gathers/reduce-scatters through the
fake group. Combined with FakeTensorMode nothing is allocated either (shardtune.planning.trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardtune.parallel.context_parallel import groups as cp_groups
from shardtune.parallel.dims import ParallelDims
from shardtune.parallel.mesh import DistInfo, build_mesh


@contextlib.contextmanager
def fake_process_group(
    world_size: int, num_nodes: int, sharding_strategy: str, device: str, context_parallel: int = 1
) -> Iterator[DistInfo]:
    """Rank 0 of a `world_size`-rank job on `num_nodes` machines, with the mesh (and, with context parallelism,
    the cp process group) shardtune would build for it.

    The mesh is built before any FakeTensorMode is entered: DeviceMesh reads its rank layout with real tensors.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; trace in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        local = world_size // num_nodes
        dims = ParallelDims.build(
            world_size=world_size,
            local_world_size=local,
            rank=0,
            sharding_strategy=sharding_strategy,
            cp=context_parallel,
        )
        cp_group = cp_groups(world_size, context_parallel) if context_parallel > 1 else None
        yield DistInfo(0, world_size, 0, local, torch.device(device), build_mesh(device, dims), dims, cp_group)
    finally:
        dist.destroy_process_group()


def track_peak(model: torch.nn.Module, optimizer, inputs: tuple, micro_batches: list) -> dict[str, dict[str, int]]:
    """Call each of `micro_batches` (callables) under FSDP2's memory tracker and return this rank's peaks, each
    split by the tracker's categories (sharded/unsharded parameters, gradients, optimizer states, activations,
    temporaries, ...): "step" over all calls, "forward" and "backward" of the root module, and "decoder-layer
    backward", the largest while one of the other FSDP modules (the decoder blocks) runs backward; module peaks
    are the largest over the micro-batches. The optimizer's existing states and the inputs count from the start."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState
    from torch.distributed.fsdp import FSDPModule

    stack = contextlib.ExitStack()
    tracker = _identity_tracker()(mod=model, optm=optimizer)
    stack.enter_context(_flag_reduce(tracker))
    tracker.track_inputs(inputs)
    _track_unmanaged_parameters(tracker, model)
    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    modules = {"forward": ([model], _FSDPModState.PEAK_FW), "backward": ([model], _FSDPModState.PEAK_BW)}
    modules["decoder-layer backward"] = (blocks, _FSDPModState.PEAK_BW)
    peaks: dict[str, dict[str, int]] = {name: {} for name in modules}
    with stack, tracker:
        for run in micro_batches:
            run()
            for name, (mods, state) in modules.items():
                for m in mods:
                    snaps = tracker.memory_tracking[m].snapshots.get(state) or [{}]
                    peaks[name] = max(peaks[name], _split(snaps[-1]), key=lambda s: s.get("Total", 0))
            # The tracker keeps one forward per module; its global peak survives the reset.
            tracker.reset_mod_stats()
    peaks["step"] = _split(tracker.get_tracker_snapshot("peak"))
    peaks["step by identity"] = dict(tracker.peak_by_identity)
    return peaks


def _track_unmanaged_parameters(tracker, model: torch.nn.Module) -> None:
    """Parameters FSDP does not manage (the frozen base replicated, `--frozen_base replicated`) exist before the
    tracker starts and are none of its FSDP parameters, so it would not see them: they are filed with the sharded
    parameters, the category of every weight held between steps."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if not isinstance(p, DTensor):
            tracker._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)


def untracked_root(model: torch.nn.Module) -> bool:
    """Whether FSDP2's memory tracker cannot follow the root module: it follows FSDP modules that manage
    parameters, and the root manages none when its own are all frozen and replicated."""
    return model._get_fsdp_state()._fsdp_param_group is None


def _split(snap: dict) -> dict[str, int]:
    """{category name: bytes} of a tracker snapshot of one device."""
    return {str(getattr(k, "value", k)): int(v) for k, v in next(iter(snap.values()), {}).items()}


# What a storage is, by the tracker's tag, when its identity does not say otherwise. The tracker tags by when a
# storage was made: whatever forward (or recomputation) allocates is "Activation", whatever backward allocates is
# "Temp", and it re-tags FSDP's own storages only once the hook that made them returns; a peak reached inside such
# a hook (the first block's all-gather copy-out, a block's backward before its reduce-scatter) would file a
# gathered weight as an activation and an unsharded gradient as a temporary.
_BY_TAG = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Buffer": "buffers",  # the rotary tables: not in the estimate (a few KiB)
    "All Gather": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "OptState": "optimizer states",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
}


def _identity_tracker():
    """FSDP2's memory tracker, which also files the storages alive at the step's peak by what they are: every
    FSDP parameter's unsharded storage and all-gather output is a parameter, and their `.grad` a gradient,
    whatever phase allocated them; the rest keeps the tracker's tag (shardtune.planning.trace compares these
    with the estimate's categories)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    class IdentityTracker(FSDPMemTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.peak_by_identity: dict[str, int] = {}
            self._best = -1
            # What FSDP2's foreach_reduce makes (the gradients cast to the reduce dtype and the reduce-scatter
            # input, before the collective re-tags it) is gradient communication, not a temporary.
            self.made_in_reduce = WeakIdKeyDictionary()
            self.in_reduce = False
            self._alive_at_peak = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if self.in_reduce and res is not NotImplemented:
                for t in tree_leaves(res):
                    if isinstance(t, torch.Tensor):
                        self.made_in_reduce[t.untyped_storage()] = True
            if self._alive_at_peak is not None:  # the op that set a new peak has returned: file its outputs too
                self.peak_by_identity = _file_by_identity(self._alive_at_peak, self._root_mod, self.made_in_reduce)
                self._alive_at_peak = None
            return res

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            total = sum(snap["Total"] for snap in self._curr_mem_snap.values())
            if total > self._best:  # a new step peak, inside an op: keep what is alive, file it when it returns
                self._best = total
                self._alive_at_peak = [(s, w) for s, (w, _) in list(self._WINFO.items())]

    return IdentityTracker


def _file_by_identity(alive, model: torch.nn.Module, made_in_reduce) -> dict[str, int]:
    """{category: bytes} of `alive` ([(storage, tracker's record)]), by what each storage is."""
    params, grads = _fsdp_storages(model)
    grads |= {id(s) for s in made_in_reduce}
    out = dict.fromkeys(("parameters", "gradients", "optimizer states", "activations", "temporaries", "buffers"), 0)
    for storage, winfo in alive:
        key = id(storage)
        tag = str(getattr(winfo.reftype, "value", winfo.reftype))
        category = "parameters" if key in params else "gradients" if key in grads else _BY_TAG.get(tag)
        if category is not None:
            out[category] += winfo.mem_consumed
    return out


def _fsdp_storages(model: torch.nn.Module) -> tuple[set[int], set[int]]:
    """ids of the storages of every FSDP parameter's unsharded tensor and all-gather outputs, and of their
    gradients (FSDP2's FSDPParam keeps both; autograd accumulates into the unsharded parameter's .grad)."""
    from torch.distributed.fsdp import FSDPModule

    params: set[int] = set()
    grads: set[int] = set()
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fp in group.fsdp_params if group else ():
            unsharded = getattr(fp, "_unsharded_param", None)
            for t in [unsharded, *getattr(fp, "all_gather_outputs", ())]:
                if t is not None:
                    params.add(id(t.untyped_storage()))
            if unsharded is not None and unsharded.grad is not None:
                grads.add(id(unsharded.grad.untyped_storage()))
    return params, grads


@contextlib.contextmanager
def _flag_reduce(tracker) -> Iterator[None]:
    """Set `tracker.in_reduce` while FSDP2 reduces a group's gradients (its foreach_reduce, as the param group
    module calls it)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    original = group_module.foreach_reduce

    def flagged(*args, **kwargs):
        tracker.in_reduce = True
        try:
            return original(*args, **kwargs)
        finally:
            tracker.in_reduce = False

    group_module.foreach_reduce = flagged
    try:
        yield
    finally:
        group_module.foreach_reduce = original
