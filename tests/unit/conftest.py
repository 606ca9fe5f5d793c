"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def info():
    """A gloo process group of one rank and its DistInfo, for a module whose tests run the training loop or FSDP
    in this process (the group is torn down at the module's end, so the next module starts without one)."""
    from shardtune.parallel.dims import ParallelDims
    from shardtune.parallel.mesh import DistInfo

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield DistInfo(0, 1, 0, 1, torch.device("cpu"), None, ParallelDims(dp_replicate=1, dp_shard=1))
    dist.destroy_process_group()
