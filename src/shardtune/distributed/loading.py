"""Filling sharded parameters: from each rank's own copy, or broadcast from rank 0 (cpu_ram_efficient_loading)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def materialize_from_rank0(
    model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Setup order step 6 for meta-initialised ranks: allocate the local shards, then receive their values.

    Rank 0 holds the real model (full_state_dict); the other ranks built theirs on meta and never hold more
    than their shards. Buffers that are not in the state dict (rotary frequencies) are broadcast as well.
    """
    rank = dist.get_rank()
    if rank != 0:
        model.to_empty(device=device)
    set_model_state_dict(
        model,
        full_state_dict if rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    for buf in model.buffers():
        dist.broadcast(buf.data, src=0)


def full_state_dict_for_broadcast(model: nn.Module) -> dict[str, torch.Tensor]:
    """The rank-0 model's full state dict, detached, under the names the sharded model will use."""
    return {k: v.detach() for k, v in model.state_dict().items()}
