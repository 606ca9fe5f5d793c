"""Adapter switching on the FSDP2-sharded training module: disable, activate, and read the adapters safely.

Under FSDP2 a module's registered parameters are swapped between the sharded DTensor parameters (the ones the
optimizer holds and whose `requires_grad` FSDP reads) and temporary unsharded ones (between forward and reshard;
the root and the last block stay unsharded after a forward). peft's `set_adapter`/`disable_adapter` set
`requires_grad` on whatever is registered at that moment, so after a forward the changes land on the temporary
parameters and are lost at the next all-gather: the wrong adapter trains in the last block and lm_head. peft
0.21 does not reshard first, so these helpers do: reshard every FSDP module, then let peft flip the flags on the
sharded parameters.

`use_fast_dora` gives DoRA linear layers a forward with the same value and gradients as peft's but less work
(see docs/adapters.md for the measurements).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
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


# ---------------------------------------------------------------- a faster DoRA forward for linear layers


def dora_weight_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Row norms ‖W + s·B·A‖ in fp32, without forming the (out, in) update: with G = A·Aᵀ,
    ‖W_i + s(BA)_i‖² = ‖W_i‖² + 2s·⟨(W·Aᵀ)_i, B_i⟩ + s²·⟨(B·G)_i, B_i⟩. `weight` is (out, in)."""
    w, a, b = weight.detach(), lora_A.detach().float(), lora_B.detach().float()
    sq = torch.linalg.vector_norm(w, dim=1, dtype=torch.float32).square()
    sq = sq + (2 * scaling) * ((w.float() @ a.T) * b).sum(1)
    sq = sq + (scaling * scaling) * ((b @ (a @ a.T)) * b).sum(1)
    return sq.clamp_min(0).sqrt()


def _fast_dora_forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
    """DoRA linear forward, y = W·x + b + (g − 1)·W·x' + g·s·B·A·x̃, with g = m/‖W+sBA‖ and x̃ = dropout(x),
    computed as y = rest + g·(W·x' + s·B·A·x̃): the norm from the low-rank identity and one multiply-add over the
    activations instead of five elementwise passes.

    x' is x itself (dropout on the low-rank path only, as torchtune's DoRALinear: W·x' is the base output already
    computed), or x̃ with `--dora_dropout peft` (peft's definition: a second product with W). Without dropout, and
    in eval, both are peft's forward, with the same value and gradients."""
    from peft.utils.integrations import dequantize_module_weight
    from peft.utils.other import transpose

    lora_A, lora_B = module.lora_A[active_adapter], module.lora_B[active_adapter]
    dropout, scaling = module.lora_dropout[active_adapter], module.scaling[active_adapter]
    base_layer = module.get_base_layer()
    weight = transpose(dequantize_module_weight(base_layer), module.fan_in_fan_out)
    # The norm is a constant for autograd (DoRA paper, section 4.3), as in peft.
    norm = dora_weight_norm(weight, lora_A.weight, lora_B.weight, scaling)
    g = (module.lora_magnitude_vector[active_adapter].weight / norm).to(result.dtype)
    dropped = not isinstance(dropout, nn.Identity) and module.training
    if dropped and getattr(module, "_shardtune_peft_dropout", False):
        x = dropout(x)
        base = F.linear(x, weight.to(x.dtype))
        rest = result - base
    else:
        if dropped:
            x = dropout(x)
        bias = base_layer.bias
        base, rest = (result, None) if bias is None else (result - bias, bias)
    z = torch.add(base, lora_B(lora_A(x)).to(base.dtype), alpha=scaling)
    return g * z if rest is None else torch.addcmul(rest, g, z)


@functools.cache
def _fast_dora_variant() -> type:
    from peft.tuners.lora.variants import DoraLinearVariant

    # Merging, unmerging and init stay peft's; only forward changes.
    return type("FastDoraLinearVariant", (DoraLinearVariant,), {"forward": staticmethod(_fast_dora_forward)})


def use_fast_dora(model: nn.Module, *, peft_dropout: bool = False) -> int:
    """Give every DoRA linear layer of the model shardtune's faster forward; return how many were switched.

    peft_dropout: lora_dropout also drops the input of the base product that the magnitude scales (peft's
    definition); otherwise it acts on the low-rank path only. Call before sharding or after: the switch is a
    per-layer forward, no weight or state dict changes. Merging, unmerging and saving stay peft's own.
    """
    from peft.tuners.lora.variants import DoraLinearVariant

    fast = _fast_dora_variant()
    n = 0
    for m in model.modules():
        variants = getattr(m, "lora_variant", None)
        if not isinstance(variants, dict):
            continue
        for name, variant in list(variants.items()):
            if type(variant) is DoraLinearVariant:
                variants[name] = fast()
                m._shardtune_peft_dropout = peft_dropout
                n += 1
    return n
