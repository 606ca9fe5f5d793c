"""A faster DoRA forward for linear layers (`use_fast_dora`): the same value and gradients as peft's with less
work (see docs/adapters.md for the measurements).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def dora_weight_norm(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, sum_squares=None
) -> torch.Tensor:
    """Row norms ‖W + s·B·A‖ in fp32, without forming the (out, in) update: with G = A·Aᵀ,
    ‖W_i + s(BA)_i‖² = ‖W_i‖² + 2s·⟨(W·Aᵀ)_i, B_i⟩ + s²·⟨(B·G)_i, B_i⟩. `weight` is (out, in).

    Each of the three terms is a sum over the columns, so a layer sliced on its columns (a row-parallel layer
    under tensor parallelism) computes them on its slices and `sum_squares` adds the squares over the slices."""
    w, a, b = weight.detach(), lora_A.detach().float(), lora_B.detach().float()
    sq = torch.linalg.vector_norm(w, dim=1, dtype=torch.float32).square()
    sq = sq + (2 * scaling) * ((w.float() @ a.T) * b).sum(1)
    sq = sq + (scaling * scaling) * ((b @ (a @ a.T)) * b).sum(1)
    if sum_squares is not None:
        sq = sum_squares(sq)
    return sq.clamp_min(0).sqrt()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


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
    magnitude = module.lora_magnitude_vector[active_adapter].weight
    # Under tensor parallelism (shardtune.parallel.tensor.SlicedDora) every tensor is this rank's slice: a
    # column-parallel layer's rows (its magnitude's too) or a row-parallel layer's columns (magnitude whole).
    sliced = getattr(module, "shardtune_sliced", None)
    local = sliced.local if sliced is not None else _whole
    weight, magnitude = local(weight), local(magnitude)
    # The norm is a constant for autograd (DoRA paper, section 4.3), as in peft.
    a, b = local(lora_A.weight), local(lora_B.weight)
    norm = dora_weight_norm(weight, a, b, scaling, sliced.sum_squares if sliced is not None else None)
    g = (magnitude / norm).to(result.dtype)
    dropped = not isinstance(dropout, nn.Identity) and module.training
    if dropped and getattr(module, "_shardtune_peft_dropout", False):
        x = dropout(x)
        base = F.linear(x, weight.to(x.dtype))
        base = sliced.sum_partial(base) if sliced is not None else base  # a row-parallel slice's partial product
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
