"""Adapter switching on the FSDP2-sharded training module: disable, activate, and read the adapters safely.

Under FSDP2 a module's registered parameters are swapped between the sharded DTensor parameters (the ones the
optimizer holds and whose `requires_grad` FSDP reads) and temporary unsharded ones (between forward and reshard;
the root and the last block stay unsharded after a forward). peft's `set_adapter`/`disable_adapter` set
`requires_grad` on whatever is registered at that moment, so after a forward the changes land on the temporary
parameters and are lost at the next all-gather: the wrong adapter trains in the last block and lm_head. peft
0.21 does not reshard first, so these helpers do: reshard every FSDP module, then let peft flip the flags on the
sharded parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from shardtune.parallel.fsdp import is_fsdp


def peft_model_of(model: nn.Module):
    """The PeftModel inside shardtune's training module (or the model itself when it is one)."""
    from peft import PeftModel

    inner = model if isinstance(model, PeftModel) else getattr(model, "model", None)
    if not isinstance(inner, PeftModel):
        raise ValueError(f"{type(model).__name__} holds no PEFT adapter (train with --use_peft_lora True).")  # noqa: TRY004
    return inner


def active_adapter(model: nn.Module) -> str:
    return peft_model_of(model).active_adapter


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of `model` back on its sharded parameters (no communication; a no-op unsharded)."""
    for m in model.modules():
        if is_fsdp(m):
            m.reshard()


def _check_unmerged(peft_model) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    # FSDP2 does not reshard a merged layer's parameters; switching then would mix merged and unmerged weights.
    merged = [n for n, m in peft_model.named_modules() if isinstance(m, BaseTunerLayer) and m.merged]
    if merged:
        raise ValueError(f"adapters are merged into {merged[0]} (and {len(merged) - 1} more); unmerge them first.")


def set_active_adapter(model: nn.Module, name: str, *, trainable: bool = True) -> None:
    """Make adapter `name` the one used in forward; with `trainable`, its weights (only) require grad.

    The optimizer keeps the parameters it was built with: build it after choosing the adapter to train.
    """
    peft_model = peft_model_of(model)
    if name not in peft_model.peft_config:
        raise ValueError(f"no adapter named {name!r} is loaded; loaded: {', '.join(peft_model.peft_config)}.")
    _check_unmerged(peft_model)
    reshard(model)
    peft_model.set_adapter(name, inference_mode=not trainable)


def _grad_flags(model: nn.Module) -> dict[nn.Parameter, bool]:
    return {p: p.requires_grad for p in model.parameters()}


def _restore_grad_flags(flags: dict[nn.Parameter, bool]) -> None:
    for p, flag in flags.items():
        if p.requires_grad != flag:
            p.requires_grad_(flag)


@contextmanager
def disabled_adapter(model: nn.Module) -> Iterator[None]:
    """Run the base model alone (no LoRA/DoRA, modules_to_save or trained token rows) inside the block.

    On exit the adapter is active again and every parameter's `requires_grad` is what it was on entry (peft's
    own context manager would make the active adapter trainable even when it was frozen).
    """
    peft_model = peft_model_of(model)
    _check_unmerged(peft_model)
    reshard(model)
    flags = _grad_flags(model)
    try:
        with peft_model.disable_adapter():
            try:
                yield
            finally:
                reshard(model)
    finally:
        _restore_grad_flags(flags)


@contextmanager
def using_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Use adapter `name` inside the block (e.g. to evaluate it), then restore the previous one and the flags."""
    peft_model = peft_model_of(model)
    previous = peft_model.active_adapter
    reshard(model)
    flags = _grad_flags(model)
    set_active_adapter(model, name, trainable=False)
    try:
        yield
    finally:
        reshard(model)
        peft_model.set_adapter(previous)
        _restore_grad_flags(flags)
