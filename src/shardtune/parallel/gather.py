"""Gather sharded weights to rank 0 for saving: the trainable ones (adapter) or all of them (full fine-tuning)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor


def gather_trainable(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every trainable parameter in full, on CPU, on rank 0 (empty dict elsewhere). All ranks must call this.

    Gathering only what is trainable keeps saving an adapter cheap: the frozen base is never all-gathered.
    """
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if dist.get_rank() == 0:
            out[name.removeprefix(prefix)] = full.detach().to("cpu", copy=True)
    return out


def gather_full(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0's CPU (empty elsewhere). All ranks must call this."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return {}
    return {(k.removeprefix(prefix)): v for k, v in sd.items()}
