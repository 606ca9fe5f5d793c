"""Loading from each node's rank 0 scatters rows: it fills FSDP2's placements (Shard(0) along the mesh's shard
dimension, Replicate along the others) and refuses any other placement by name instead of filling it wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardtune.parallel.loading import check_row_sharded


@pytest.fixture
def one_rank():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_fsdp_placements_are_filled_and_others_refused(one_rank):
    flat = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    hybrid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    local = torch.zeros(4, 2)
    check_row_sharded(DTensor.from_local(local, flat, [Shard(0)]))
    check_row_sharded(DTensor.from_local(local, hybrid, [Replicate(), Shard(0)]))
    for mesh, placements in ((flat, [Shard(1)]), (flat, [Replicate()]), (hybrid, [Shard(0), Shard(0)])):
        with pytest.raises(NotImplementedError, match="set cpu_ram_efficient_loading false") as e:
            check_row_sharded(DTensor.from_local(local, mesh, placements))
        assert str(list(placements)) in str(e.value)
