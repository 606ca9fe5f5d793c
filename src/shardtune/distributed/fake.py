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

from shardtune.distributed.mesh import DistInfo, build_mesh


@contextlib.contextmanager
def fake_process_group(world_size: int, num_nodes: int, sharding_strategy: str, device: str) -> Iterator[DistInfo]:
    """Rank 0 of a `world_size`-rank job on `num_nodes` machines, with the mesh shardtune would build for it.

    The mesh is built before any FakeTensorMode is entered: DeviceMesh reads its rank layout with real tensors.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; trace in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        local = world_size // num_nodes
        mesh = build_mesh(device, world_size, local, sharding_strategy)
        yield DistInfo(0, world_size, 0, local, torch.device(device), mesh)
    finally:
        dist.destroy_process_group()


def track_peak(model: torch.nn.Module, optimizer, inputs: tuple, run) -> tuple[int, dict[str, int]]:
    """Call `run()` under FSDP2's memory tracker; returns the peak bytes of this rank's device and their split by
    the tracker's categories (sharded/unsharded parameters, gradients, optimizer states, activations,
    temporaries, ...). The optimizer's existing states and the inputs are counted from the start."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(mod=model, optm=optimizer)
    tracker.track_inputs(inputs)
    with tracker:
        run()
    snap = tracker.get_tracker_snapshot("peak")
    peak = next(iter(snap.values())) if snap else {}
    by_type = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if k != "Total"}
    return int(peak.get("Total", 0)), by_type
