"""The optimizers `--optim` names: one registry read by config validation, the trainer, checkpoints and the planner.

Adding an optimizer is one `register(OptimizerSpec(...))` call here: its name becomes a valid `--optim`, the trainer
builds it, checkpoints save its state (sharded through DCP, or per rank when `per_rank_state`), and `shardtune plan`
counts its state bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardtune.models.quant import bitsandbytes_missing
from shardtune.runtime.log import print0


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    # (param groups, lr, betas, eps) -> optimizer; the groups hold (name, parameter) pairs under "named".
    build: Callable[..., torch.optim.Optimizer]
    # Bytes of optimizer state for one tensor of `numel` elements of `itemsize` bytes that the optimizer steps.
    state_bytes: Callable[[int, int], int]
    # Why it cannot run on a device (empty when it can); checked before data and model loading.
    problems: Callable[[torch.device], list[str]] = lambda device: []
    # State kept per rank shard outside DCP (bitsandbytes' kernels cannot step DTensors; see LocalShards).
    per_rank_state: bool = False
    # Whether it can step fake tensors (`shardtune plan --trace`).
    traceable: bool = True
    help: str = ""


OPTIMIZERS: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    OPTIMIZERS[spec.name] = spec
    return spec


def names() -> str:
    """'a, b, c or d', for help texts and error messages."""
    n = list(OPTIMIZERS)
    return ", ".join(n[:-1]) + f" or {n[-1]}" if len(n) > 1 else n[0]


def name_problems(name: str) -> list[str]:
    """--optim against the registry (read when the run's flags are checked, before anything loads)."""
    return [] if name in OPTIMIZERS else [f"--optim {name!r} is not supported; use {names()}."]


def get(name: str) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"--optim {name!r} is not supported; use {names()}.")
    return OPTIMIZERS[name]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), without autograd tracking."""
    with torch.no_grad():
        return t.to_local() if hasattr(t, "to_local") else t


def param_groups(named: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases or 1-D scales)."""
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    named_params: list[tuple[str, nn.Parameter]],
    *,
    optim: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.Optimizer:
    """The optimizer `optim` names over the trainable parameters, with weight decay on matrices only."""
    return get(optim).build(named_params, weight_decay=weight_decay, lr=lr, betas=betas, eps=eps)


def optimizer_problems(optim: str, device: torch.device) -> list[str]:
    """Why --optim cannot run on this device (empty when it can)."""
    return get(optim).problems(device)


# --- torch's AdamW -------------------------------------------------------------------------------------------


def _adamw_bytes(numel: int, itemsize: int) -> int:
    return 2 * numel * itemsize  # exp_avg and exp_avg_sq, like the parameter


def _torch_adamw(fused: bool) -> Callable[..., torch.optim.Optimizer]:
    def build(named, *, weight_decay, lr, betas, eps):
        groups = param_groups(named, weight_decay)
        return torch.optim.AdamW(
            groups, lr=lr, betas=betas, eps=eps, fused=fused or None, foreach=None if fused else True
        )

    return build


def _fused_problems(device: torch.device) -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    if device.type not in _get_fused_kernels_supported_devices():
        return [f"--optim adamw_torch_fused: torch has no fused AdamW for {device.type}; use --optim adamw_torch."]
    return []


register(OptimizerSpec("adamw_torch", _torch_adamw(False), _adamw_bytes, help="torch's AdamW (foreach)"))
register(
    OptimizerSpec(
        "adamw_torch_fused", _torch_adamw(True), _adamw_bytes, _fused_problems, help="torch's fused AdamW kernel"
    )
)


# --- bitsandbytes' 8-bit AdamW -------------------------------------------------------------------------------

# bitsandbytes keeps 8-bit states only for tensors of at least min_8bit_size elements (its default), 32-bit below.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256  # one fp32 absmax per 256-element block and state (blockwise quantization)


def _adamw_8bit_bytes(numel: int, itemsize: int) -> int:
    if numel < BNB_MIN_8BIT_SIZE:
        return 2 * numel * 4
    return 2 * numel + 2 * 4 * -(-numel // BNB_BLOCK)


class LocalShards:
    """Lets a bitsandbytes optimizer step FSDP2 parameters.

    bitsandbytes' update kernels have no DTensor sharding rule ("Operator bitsandbytes.optimizer_update_32bit
    does not have a sharding strategy registered"), so the optimizer is given plain tensors that alias each
    rank's local shard. Before each step they are re-pointed at the current local shard and gradient (FSDP2
    may reallocate a shard at lazy init); after it their gradients are dropped. The optimizer state is
    therefore per rank shard, and is saved and restored per rank by the checkpoint code.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.proxies = [nn.Parameter(_local(p).detach()) for p in self.params]

    def shapes(self) -> list[list[int]]:
        return [list(x.shape) for x in self.proxies]

    def pre_step(self, optimizer, args, kwargs) -> None:
        for p, x in zip(self.params, self.proxies, strict=True):
            local = _local(p)
            # bitsandbytes replaces a non-contiguous p.data with a copy, which would stop updating the shard.
            assert local.is_contiguous(), "an FSDP2 local shard is not contiguous"
            x.data = local
            # Empty shards (a rank holding none of a small tensor's rows) are left out of the step.
            x.grad = _local(p.grad) if p.grad is not None and x.numel() else None

    def post_step(self, optimizer, args, kwargs) -> None:
        for x in self.proxies:
            x.grad = None


def _bnb_adamw(paged: bool) -> Callable[..., torch.optim.Optimizer]:
    """A bitsandbytes optimizer gets a `local_shards` attribute (LocalShards), which checkpoints use."""

    def build(named, *, weight_decay, lr, betas, eps):
        import bitsandbytes as bnb

        shards = LocalShards(named)
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        opt = cls(param_groups(list(zip(shards.names, shards.proxies)), weight_decay), lr=lr, betas=betas, eps=eps)
        opt.register_step_pre_hook(shards.pre_step)
        opt.register_step_post_hook(shards.post_step)
        opt.local_shards = shards
        return opt

    return build


def _bnb_problems(optim: str) -> Callable[[torch.device], list[str]]:
    def problems(device: torch.device) -> list[str]:
        missing = bitsandbytes_missing(f"--optim {optim}")
        if missing:
            return [f"{missing[:-1]}, or use --optim adamw_torch."]
        import bitsandbytes as bnb

        # One real 8-bit step on a small tensor: the surest test that this bitsandbytes build supports the device.
        try:
            p = nn.Parameter(torch.zeros(BNB_MIN_8BIT_SIZE, device=device))
            p.grad = torch.ones_like(p)
            bnb.optim.AdamW8bit([p], lr=1e-3).step()
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            why = f"--optim {optim}: bitsandbytes cannot run its 8-bit optimizer on {device.type} ({e})"
            return [f"{why}; use --optim adamw_torch."]
        if optim == "paged_adamw_8bit" and device.type != "cuda":
            print0(
                f"--optim paged_adamw_8bit: paging needs CUDA; on {device.type} the 8-bit states are ordinary tensors."
            )
        return []

    return problems


for _name, _paged in (("adamw_8bit", False), ("paged_adamw_8bit", True)):
    register(
        OptimizerSpec(
            _name,
            _bnb_adamw(_paged),
            _adamw_8bit_bytes,
            _bnb_problems(_name),
            per_rank_state=True,
            traceable=False,  # bitsandbytes' kernels cannot run on fake tensors
            help=f"bitsandbytes' {'paged ' if _paged else ''}8-bit AdamW (extra: qlora)",
        )
    )
