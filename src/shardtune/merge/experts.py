"""What a LoRA on parameters (PEFT's `target_parameters`: fused expert tensors, router weights) does to the base's
stored tensors, for `shardtune merge`.

PEFT keeps one LoRA per targeted parameter in a `ParamWrapper`; two parameters of one module are two nested
wrappers (`mlp.experts.base_layer.lora_A` and `mlp.experts.lora_A`), and which key adapts which parameter follows
PEFT's own injection order. So the wrappers are found by letting PEFT wrap the base's skeleton on the meta device
(`parameter_wrappers`), not by guessing from names or shapes.

An expert LoRA's A is (r·E, in) and its B (out, r·E), laid out as PEFT's `ParamWrapper.get_delta_weight` reads them:
expert e's delta is scale · B[:, r-block of e] @ A[r-block of e]. transformers 5 fuses the experts while loading
(transformers.conversion_mapping: per-expert `experts.{e}.gate_proj.weight` and `up_proj` stacked and concatenated
into `experts.gate_up_proj`); most checkpoints keep the per-expert layout, which the merged folder keeps too: each
stored tensor gets its expert's slice of the delta (`shardtune.models.weights.expert_slices`), the inverse of that
conversion.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from shardtune.models.weights import PEFT_PREFIX, expert_slices


@dataclass
class Wrapper:
    """One PEFT ParamWrapper: the model parameter it adapts and how PEFT lays out its delta."""

    param: str  # the model's parameter path, e.g. model.layers.0.mlp.experts.gate_up_proj
    num_experts: int  # 1: a 2-D parameter (a router's weight)
    swapped: bool  # PEFT's _did_swap_in_out_features: the parameter is (E, out, in)


@dataclass
class ExpertLora:
    """The LoRA of a fused (E, ., .) tensor stored as such: w[e] += scale · B[e] @ A[e] (transposed: its .T)."""

    A: torch.Tensor  # (E, r, in)
    B: torch.Tensor  # (E, out, r)
    scale: float
    transposed: bool

    @property
    def shape(self) -> tuple[int, int, int]:
        e, out, inp = self.B.shape[0], self.B.shape[1], self.A.shape[2]
        return (e, inp, out) if self.transposed else (e, out, inp)

    def merged(self, w: torch.Tensor) -> torch.Tensor:
        delta = torch.bmm(self.B.float(), self.A.float()) * self.scale
        return w + (delta.transpose(1, 2) if self.transposed else delta)


def parameter_wrappers(skeleton: torch.nn.Module, peft_config: Any) -> dict[str, Wrapper]:
    """{adapter module key (without base_model.model.): Wrapper} for every parameter the adapter targets, found by
    PEFT wrapping `skeleton` (on meta; a copy is wrapped, the skeleton stays as it was)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import ParamWrapper

    if not getattr(peft_config, "target_parameters", None):
        return {}
    probe = LoraConfig(r=peft_config.r, target_modules=[], target_parameters=list(peft_config.target_parameters))
    model = inject_adapter_in_model(probe, copy.deepcopy(skeleton), low_cpu_mem_usage=True)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            owner = name.replace(".base_layer", "")
            out[name] = Wrapper(
                f"{owner}.{module.parameter_name}", module.num_experts, module._did_swap_in_out_features
            )
    return out


def expert_factors(A: torch.Tensor, B: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's layout -> per-expert factors: A (r·E, in) -> (E, r, in); B (out, r·E) -> (E, out, r)."""
    a = A.reshape(experts, -1, A.shape[-1])
    b = B.reshape(B.shape[0], -1, experts).permute(2, 0, 1)
    return a, b


def wrapper_scale(peft_config: Any, module: str, rank: int) -> float:
    from peft.utils.other import get_pattern_key

    alpha = peft_config.alpha_pattern.get(
        get_pattern_key(peft_config.alpha_pattern.keys(), module), peft_config.lora_alpha
    )
    return alpha / math.sqrt(rank) if peft_config.use_rslora else alpha / rank


def rank_of(peft_config: Any, module: str) -> int:
    from peft.utils.other import get_pattern_key

    return peft_config.rank_pattern.get(get_pattern_key(peft_config.rank_pattern.keys(), module), peft_config.r)


def stored_match(names: dict[str, str], model_name: str) -> str | None:
    """The stored tensor a model tensor name means (exact, or up to a leading prefix), or None."""
    if model_name in names:
        return names[model_name]
    found = [n for n in names if n.endswith("." + model_name) or model_name.endswith("." + n)]
    return names[found[0]] if len(found) == 1 else None


@dataclass
class WrapperEdit:
    """One stored tensor's share of a parameter LoRA: a 2-D LoRA update (A, B: a linear layer's layout), or, for
    a fused tensor stored whole, `experts`."""

    stored: str
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    scale: float = 1.0
    transposed: bool = False
    experts: ExpertLora | None = None


def wrapper_edits(
    module: str, A: torch.Tensor, B: torch.Tensor, wrapper: Wrapper, peft_config: Any, config, names, shapes
) -> list[WrapperEdit]:
    """The stored tensors one wrapper's LoRA changes, with what it adds to each."""
    rank = rank_of(peft_config, module)
    scale = wrapper_scale(peft_config, module, rank)
    key = f"{PEFT_PREFIX}{module}.lora_A.weight"
    if A.shape[0] != rank * wrapper.num_experts:
        raise ValueError(f"adapter key {key!r} has {A.shape[0]} rows; rank {rank} x {wrapper.num_experts} "
                         f"experts of {wrapper.param} make {rank * wrapper.num_experts}.")  # fmt: skip
    whole = stored_match(names, wrapper.param)
    if wrapper.num_experts == 1:
        if whole is None:
            raise ValueError(f"adapter key {key!r}: the base stores no {wrapper.param}.")
        return [WrapperEdit(whole, A, B, scale, transposed=False)]
    a, b = expert_factors(A, B, wrapper.num_experts)
    if whole is not None:
        return [WrapperEdit(whole, experts=ExpertLora(a, b, scale, transposed=not wrapper.swapped))]
    slices = expert_slices(config, wrapper.param, shapes, lambda n: stored_match(names, n))
    if not slices:
        raise ValueError(f"adapter key {key!r}: the base stores {wrapper.param} neither whole nor per expert "
                         "as transformers' conversion for this family reads it.")  # fmt: skip
    out = []
    for stored, e, rows in slices:
        if wrapper.swapped:  # expert e's slice is (out, in): the stored tensor holds some of its rows
            out.append(WrapperEdit(stored, a[e], b[e][rows], scale, transposed=False))
        else:  # (in, out): some of its rows are columns of A
            out.append(WrapperEdit(stored, a[e][:, rows], b[e], scale, transposed=True))
    return out
