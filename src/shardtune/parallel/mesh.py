"""Process group and device mesh (1-D for FULL_SHARD/SHARD_GRAD_OP/NO_SHARD, 2-D for HYBRID_SHARD; one more
dimension, "tp", last, with tensor parallelism)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtune.parallel import context_parallel
from shardtune.parallel.dims import ParallelDims
from shardtune.runtime.parent import stop_with_parent


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh
    dims: ParallelDims  # data-parallel sizes and ranks: use these wherever the data-parallel size is meant
    cp_group: object | None = None  # the process group of this rank's batch's context-parallel ranks (cp > 1)

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The dimensions FSDP shards and replicates over: the whole mesh, or all of it but "tp"."""
        return self.mesh[self.dims.dp_mesh_dim_names] if self.dims.tp > 1 else self.mesh

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """This rank's tensor-parallel ranks (None without tensor parallelism)."""
        return self.mesh["tp"] if self.dims.tp > 1 else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


# The launcher variables init_distributed set itself (a plain single process), taken back by shutdown().
_SET_FOR_ONE_PROCESS: list[str] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    sharding_strategy: str = "FULL_SHARD", timeout_s: float = 1800.0, cp: int = 1, tp: int = 1
) -> DistInfo:
    """Start the process group (NCCL on CUDA, gloo on CPU) and build the mesh for the sharding strategy.

    A plain single process gets a 1-rank group, so that the same FSDP2 code path runs everywhere.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: stop if torchrun is killed (shardtune.runtime.parent)
        stop_with_parent()
    if "RANK" not in os.environ:
        single = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
        # Undone by shutdown(): a caller running shardtune in its own process (a notebook, a test) must not be left
        # looking like a distributed worker, which accelerate and torch.distributed would then act on.
        _SET_FOR_ONE_PROCESS.extend(k for k in single if k not in os.environ)
        os.environ.update(single)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    dims = ParallelDims.build(
        world_size=world, local_world_size=local_world, rank=rank, sharding_strategy=sharding_strategy, cp=cp, tp=tp
    )
    cp_group = context_parallel.groups(world, cp, tp) if cp > 1 else None
    return DistInfo(rank, world, local_rank, local_world, device, build_mesh(device.type, dims), dims, cp_group)


def build_mesh(device_type: str, dims: ParallelDims) -> DeviceMesh:
    """HYBRID_SHARD shards within a node and replicates across nodes (2-D); NO_SHARD is shards of one rank each,
    full replicas whose gradients are all-reduced across the replicate dimension; the others use a 1-D mesh."""
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device, dims: ParallelDims | None = None) -> list[float]:
    """Sum a few floats across ranks (float64, so token counts stay exact). With `dims`, each tensor-parallel group
    counts once: its ranks see the same batch, so only its first rank's values enter the sum."""
    if dims is not None and dims.tp_rank:
        values = [0.0] * len(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


# How gloo and NCCL report that the process at the other end of a collective has gone away.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether a collective failed because another rank died (rather than from a bug of our own)."""
    if isinstance(exc, dist.DistBackendError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOST)


def shutdown(wait: bool = True) -> None:
    """Leave together: a rank tearing down its groups while a peer is still in a collective can abort at exit.
    Then take back the environment init_distributed set for a plain single process. wait=False (a run stopped by
    a signal outside the loop): leave at once, as the peers may be in another collective than a barrier."""
    if dist.is_initialized():
        try:
            if wait:
                dist.barrier()
        except (RuntimeError, dist.DistBackendError):  # a peer is already gone; nothing to wait for
            pass
        dist.destroy_process_group()
    while _SET_FOR_ONE_PROCESS:
        os.environ.pop(_SET_FOR_ONE_PROCESS.pop(), None)
