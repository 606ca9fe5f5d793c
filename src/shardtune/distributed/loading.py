"""Filling sharded parameters: from each rank's own copy, or sent from rank 0 (cpu_ram_efficient_loading).

With cpu_ram_efficient_loading only rank 0 reads the checkpoint; the other ranks build the model on the meta
device. Rank 0 then scatters its full tensors one at a time, each rank receiving only its rows, and frees each
tensor once it is sent: the other ranks never hold more than their shards, and rank 0's shards fill the memory its
full tensors give back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


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
    model: nn.Module, full_tensors: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Setup order step 6 for meta-initialised ranks: allocate the local shards, then receive their values.

    Every rank's model is sharded on meta at this point (rank 0's real tensors were taken out by
    `take_full_tensors`). For each parameter, rank 0 scatters the rows of the full tensor (each rank receives
    only its own shard) and drops the tensor. Buffers (rotary frequencies) are broadcast.
    """
    from shardtune.modeling import release_free_memory

    rank = dist.get_rank()
    if rank == 0:
        names = {n for n, _ in model.named_parameters()}
        assert full_tensors is not None and names <= set(full_tensors), "rank 0 lacks some parameters"
    _allocate(model, device)
    for name, param in model.named_parameters():
        full = full_tensors.pop(name).to(device) if rank == 0 else None
        _scatter_rows(param, full, device)
        del full
        release_free_memory()
    if rank == 0:
        full_tensors.clear()
    for buf in model.buffers():
        dist.broadcast(buf.data, src=0)


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Allocate every (meta) parameter's local shard; keep the buffers that are already real."""
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(device)


def _shard_index(global_rank: int, mesh) -> int:
    """This rank's position along the mesh's shard (last) dimension."""
    coords = (mesh.mesh == global_rank).nonzero()
    return int(coords[0, -1])


@torch.no_grad()
def _scatter_rows(param: torch.Tensor, full: torch.Tensor | None, device: torch.device) -> None:
    """Fill this rank's shard of `param` from rank 0's full tensor, sending each rank only its rows.

    FSDP2 shards dim 0 like torch.chunk: shard i holds rows [i·c, (i+1)·c) with c = ceil(rows / shards).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if not isinstance(param, DTensor):
        buf = full if rank == 0 else torch.empty(param.shape, dtype=param.dtype, device=device)
        dist.broadcast(buf, src=0)
        param.copy_(buf)
        return
    mesh, rows, rest = param.device_mesh, param.shape[0], tuple(param.shape[1:])
    shards = mesh.size(-1)
    chunk = -(-rows // shards)
    local = param.to_local()
    start = _shard_index(rank, mesh) * chunk
    assert local.shape[0] == max(0, min(rows - start, chunk)), f"unexpected shard of {tuple(param.shape)}"
    direct = local.shape[0] == chunk and local.is_contiguous()
    out = local if direct else torch.empty((chunk, *rest), dtype=param.dtype, device=device)
    pieces = None
    if rank == 0:
        pieces = [_padded_rows(full, _shard_index(r, mesh) * chunk, chunk) for r in range(world)]
    dist.scatter(out, pieces, src=0)
    if not direct:
        local.copy_(out[: local.shape[0]])


def _padded_rows(full: torch.Tensor, start: int, chunk: int) -> torch.Tensor:
    """full[start:start + chunk], zero-padded to `chunk` rows (a view when no padding is needed)."""
    piece = full[start : start + chunk]
    if piece.shape[0] == chunk:
        return piece
    padded = full.new_zeros((chunk, *full.shape[1:]))
    padded[: piece.shape[0]] = piece
    return padded


def broadcast_quant_states(model: nn.Module, device: torch.device) -> None:
    """Give every rank rank 0's 4-bit quantization states (replicated, not sharded), on `device`.

    The other ranks built theirs on meta with the same shapes; the shapes are checked before any tensor is sent.
    """
    from shardtune.quant import linear4bit_modules, quant_state_tensors

    holders = [h for _, m in linear4bit_modules(model) for h in quant_state_tensors(m.quant_state)]
    shapes = [(tuple(getattr(h, a).shape), str(getattr(h, a).dtype)) for h, a in holders]
    box = [shapes]
    dist.broadcast_object_list(box, src=0)
    assert box[0] == shapes, "4-bit quantization states differ in shape between rank 0 and this rank"
    for holder, attr in holders:
        t = getattr(holder, attr)
        t = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        dist.broadcast(t, src=0)
        setattr(holder, attr, t)
