"""Filling sharded parameters: from each rank's own copy, or sent from rank 0 of the node
(cpu_ram_efficient_loading).

With cpu_ram_efficient_loading only rank 0 of each node (LOCAL_RANK 0) reads the checkpoint; the other ranks build
the model on the meta device. Each node's rank 0 then scatters its full tensors one at a time over a node-local
process group, each rank of the node receiving only its rows, and frees each tensor once it is sent: the other
ranks never hold more than their shards, and the node's rank 0 fills its shards from the memory its full tensors
give back. Nothing crosses nodes; on one node this is rank 0 sending over the default group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardtune.models.quant import packed_modules, quant_state_tensors
from shardtune.models.weights import release_free_memory


@dataclass
class NodeGroup:
    """The ranks of this node: `src` (global rank of the node's local rank 0) sends to them over `group`."""

    src: int
    ranks: list[int]
    group: dist.ProcessGroup | None  # None: the default group (a single node)


def node_group(rank: int, local_rank: int) -> NodeGroup:
    """This rank's node-local process group; a collective call, made by every rank in the same order.

    Nodes are told apart by their local rank 0's global rank (torchrun numbers a node's ranks contiguously), so
    nodes of different sizes work too. Every rank creates every node's group, as `dist.new_group` requires.
    """
    leaders: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(leaders, rank - local_rank)
    mine, group = leaders[rank], None
    nodes = sorted(set(leaders))
    if len(nodes) == 1:
        return NodeGroup(mine, list(range(len(leaders))), None)
    for leader in nodes:
        members = [r for r, lead in enumerate(leaders) if lead == leader]
        g = dist.new_group(members)
        if leader == mine:
            group, ranks = g, members
    return NodeGroup(mine, ranks, group)


def take_full_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0, before sharding: move the real parameters out of the model (leaving meta ones of the same shape).

    Sharding then allocates nothing on rank 0 either; `materialize_from_rank0` sends these tensors out and
    drops each once it is sent. Keys are the parameters' names in the model passed here; tied parameters share
    one meta parameter, so FSDP still sees them as tied.
    """
    taken: dict[str, torch.Tensor] = {}
    meta_of: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in meta_of:
                module._parameters[name] = meta_of[id(param)]
                continue
            if param.is_meta:
                continue
            taken[f"{module_name}.{name}" if module_name else name] = param
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            meta_of[id(param)] = module._parameters[name] = meta
    return taken


def materialize_from_rank0(
    model: nn.Module,
    full_tensors: dict[str, torch.Tensor] | None,
    device: torch.device,
    node: NodeGroup,
    *,
    offload: bool = False,
) -> None:
    """Setup order step 6 for meta-initialised ranks: allocate the local shards, then receive their values.

    Every rank's model is sharded on meta at this point (the node's rank 0 had its real tensors taken out by
    `take_full_tensors`). For each parameter, the node's rank 0 scatters the rows of the full tensor to the ranks
    of its node (each receives only its own shard) and drops the tensor. Buffers (rotary frequencies) are
    broadcast within the node.

    `device` is where the collectives run (the rank's GPU under NCCL, the CPU under gloo). With `offload`
    (FSDP2's CPUOffloadPolicy) the shards live in host RAM, pinned on CUDA, as FSDP2 requires of offloaded
    parameters: they are allocated there, each is received into a buffer on `device` and then copied into place,
    so a collective never writes into host memory that NCCL cannot reach.
    """
    sender = dist.get_rank() == node.src
    if sender:
        names = {n for n, _ in model.named_parameters()}
        assert full_tensors is not None and names <= set(full_tensors), "the node's rank 0 lacks some parameters"
    _allocate(model, params_on=torch.device("cpu") if offload else device, buffers_on=device)
    for name, param in model.named_parameters():
        # A frozen parameter FSDP leaves whole was cast to the compute dtype on every rank (fsdp.frozen_parameters).
        full = full_tensors.pop(name).to(device=device, dtype=param.dtype) if sender else None
        _scatter_rows(param, full, device, node, offloaded=offload)
        del full
        release_free_memory()
    if sender:
        full_tensors.clear()
    for buf in model.buffers():
        dist.broadcast(buf.data, src=node.src, group=node.group)


def _allocate(model: nn.Module, *, params_on: torch.device, buffers_on: torch.device) -> None:
    """Allocate every (meta) parameter's local shard on `params_on` and put every buffer on `buffers_on`, keeping
    the values of the buffers that are already real.

    `to_empty` on a fully_shard-ed module ends in FSDP2's `reset_sharded_param`, which pins offloaded shards
    (CPUOffloadPolicy(pin_memory=True)); the shards filled later are those tensors, written in place.
    """
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]
    model.to_empty(device=params_on)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(buffers_on)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != buffers_on:
                module._buffers[name] = buf.to(buffers_on)


def allocate_unread(model: nn.Module, device: torch.device) -> None:
    """Allocate every (meta) parameter's local shard and 4-bit quantization state on `device`, unfilled: the
    model of `ModelSpec(read_weights=False)`, whose step is traced for its memory, not its values."""
    _allocate(model, params_on=device, buffers_on=device)
    for _, module in packed_modules(model):
        for holder, attr in quant_state_tensors(module.quant_state):
            setattr(holder, attr, torch.empty_like(getattr(holder, attr), device=device))


def _shard_dim(mesh) -> int:
    """The mesh dimension of the shard group (FSDP2 shards dim 0 of every parameter along it): the one named
    "shard" (shardtune.parallel.dims.ParallelDims.mesh_dim_names); other dimensions replicate (HYBRID_SHARD across
    nodes, NO_SHARD across all ranks). A mesh without names has a single dimension, which is the shard group."""
    names = mesh.mesh_dim_names
    if names is None and mesh.ndim == 1:
        return 0
    if names is None or "shard" not in names:
        raise ValueError(f"the device mesh has no 'shard' dimension (dimensions: {names}); build it with build_mesh.")
    return names.index("shard")


def _shard_index(global_rank: int, mesh) -> int:
    """A rank's index in its shard group: its coordinate along the mesh's shard dimension."""
    coords = (mesh.mesh == global_rank).nonzero()
    return int(coords[0, _shard_dim(mesh)])


@torch.no_grad()
def _scatter_rows(
    param: torch.Tensor, full: torch.Tensor | None, device: torch.device, node: NodeGroup, *, offloaded: bool = False
) -> None:
    """Fill this rank's shard of `param` from its node's rank 0's full tensor, sending each rank only its rows.

    FSDP2 shards dim 0 like torch.chunk: shard i holds rows [i·c, (i+1)·c) with c = ceil(rows / shards), i being
    the rank's index along the mesh's shard dimension (a slice of the global tensor when FULL_SHARD spans nodes).
    """
    rank = dist.get_rank()
    sender = rank == node.src
    if not isinstance(param, DTensor):
        buf = full if sender else torch.empty(param.shape, dtype=param.dtype, device=device)
        dist.broadcast(buf, src=node.src, group=node.group)
        param.copy_(buf)
        return
    mesh_ranks = set(param.device_mesh.mesh.flatten().tolist())
    if "tp" in (param.device_mesh.mesh_dim_names or ()) or not set(node.ranks) <= mesh_ranks:
        # sliced over tp, or sharded over the data-parallel ranks of this rank's tp slice only
        _broadcast_slice(param, full, device, node)
        return
    check_row_sharded(param)
    mesh, rows, rest = param.device_mesh, param.shape[0], tuple(param.shape[1:])
    shards = mesh.size(_shard_dim(mesh))  # the shard group's size, not the world's
    chunk = -(-rows // shards)
    local = param.to_local()
    start = _shard_index(rank, mesh) * chunk
    assert local.shape[0] == max(0, min(rows - start, chunk)), f"unexpected shard of {tuple(param.shape)}"
    # Receive straight into the shard only where the collective can write it: a shard that is not offloaded (so on
    # the communication device), with the full (padded) row count, contiguous. An offloaded shard (host RAM,
    # pinned on CUDA) always goes through a buffer on `device`, also where that is the CPU (gloo), so the path
    # NCCL needs is the path the CPU tests run.
    direct = not offloaded and local.device == device and local.shape[0] == chunk and local.is_contiguous()
    out = local if direct else torch.empty((chunk, *rest), dtype=param.dtype, device=device)
    pieces = None
    if sender:
        pieces = [_padded_rows(full, _shard_index(r, mesh) * chunk, chunk) for r in node.ranks]
    dist.scatter(out, pieces, src=node.src, group=node.group)
    if not direct:
        local.copy_(out[: local.shape[0]])  # in place: the shard keeps its storage (and its pinning)


def _broadcast_slice(param: DTensor, full: torch.Tensor | None, device: torch.device, node: NodeGroup) -> None:
    """A parameter under tensor parallelism (sliced over "tp" then sharded by FSDP, or whole on the tp ranks and
    sharded over the data-parallel ranks): the node's rank 0 broadcasts the full
    tensor and each rank copies its block (DTensor's own offsets, as DCP reads them). Each rank holds one full
    tensor at a time, briefly: a scatter of exactly the blocks, as for FSDP's row shards, is left to do."""
    buf = full if dist.get_rank() == node.src else torch.empty(param.shape, dtype=param.dtype, device=device)
    dist.broadcast(buf, src=node.src, group=node.group)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    block = buf[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    param.to_local().copy_(block)


def check_row_sharded(param: DTensor) -> None:
    """Refuse a placement the row scatter would fill wrong: it sends each rank rows [i·c, (i+1)·c) of the full
    tensor, which is the rank's shard only for FSDP2's placements, Shard(0) along the shard dimension and
    Replicate along the others (a tensor-parallel axis would shard other dimensions: its loading lands here)."""
    shard_dim = _shard_dim(param.device_mesh)
    want = [Shard(0) if d == shard_dim else Replicate() for d in range(param.device_mesh.ndim)]
    if list(param.placements) != want:
        raise NotImplementedError(
            f"loading from each node's rank 0 fills FSDP2's row shards ({want}); a parameter of shape "
            f"{tuple(param.shape)} is placed {list(param.placements)}: set cpu_ram_efficient_loading false so that "
            "every rank reads its own copy."
        )


def _padded_rows(full: torch.Tensor, start: int, chunk: int) -> torch.Tensor:
    """full[start:start + chunk], zero-padded to `chunk` rows (a view when no padding is needed)."""
    piece = full[start : start + chunk]
    if piece.shape[0] == chunk:
        return piece
    padded = full.new_zeros((chunk, *full.shape[1:]))
    padded[: piece.shape[0]] = piece
    return padded


def broadcast_quant_states(model: nn.Module, device: torch.device, node: NodeGroup) -> None:
    """Give every rank its node's rank 0's 4-bit quantization states (replicated, not sharded), on `device`.

    The other ranks built theirs on meta with the same shapes; the shapes are checked before any tensor is sent.
    """
    holders = [h for _, m in packed_modules(model) for h in quant_state_tensors(m.quant_state)]
    shapes = [(tuple(getattr(h, a).shape), str(getattr(h, a).dtype)) for h, a in holders]
    box = [shapes]
    dist.broadcast_object_list(box, src=node.src, group=node.group)
    assert box[0] == shapes, "4-bit quantization states differ in shape between the node's rank 0 and this rank"
    for holder, attr in holders:
        t = getattr(holder, attr)
        t = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        dist.broadcast(t, src=node.src, group=node.group)
        setattr(holder, attr, t)
