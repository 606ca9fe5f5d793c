"""What `--lora_target_modules all-linear` wraps, by module path: every linear layer of the model except the
output head, the routers of a mixture of experts, and the layers PEFT cannot adapt or would read as something else.

PEFT's own all-linear collects every nn.Linear/Conv1D by type, then (transformers 5) hands its *leaf names* to a
v4-compatibility remap that turns any target named like a v4 expert projection (gate_proj, up_proj, down_proj, gate,
w1..w3) into the fused expert tensors. Leaf names are not enough on a mixture-of-experts model: its dense MLPs and
shared experts carry the experts' names. So shardtune lists the module paths itself (`plan_all_linear`), and PEFT
wraps exactly those (a list target matches a module whose path equals it). What is left out, and why:

- the output head (as PEFT's all-linear);
- routers: a linear layer (or an nn.Linear subclass) whose outputs are the experts, named like a gate or router; its
  LoRA would change the routing, and some routers' forwards bypass the wrapped layer (name them to train them);
- leaves PEFT refuses on the family (Mamba's out_proj and conv1d);
- leaves PEFT's v4 remap reads as the fused experts on this family (its conversion table), on every module that has
  them: such a path would become the experts' tensors when the adapter is reloaded;
- the experts' fused 3-D tensors are parameters, not linear layers: never targets of all-linear. A 3-D parameter
  of a convolution (an SSM's conv1d) is not an expert.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_ROUTER_NAME = re.compile(r"(gate|router)", re.IGNORECASE)


@dataclass
class TargetPlan:
    """Module paths that get adapters, and the linear layers left out: {reason: [paths]}."""

    paths: list[str]
    left_out: dict[str, list[str]] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)  # modules holding fused expert tensors

    def log_lines(self) -> list[str]:
        lines = [f"LoRA targets (all-linear, {len(self.paths)} layers): {summarise(self.paths)}"]
        for reason, paths in self.left_out.items():
            lines.append(f"  not adapted, {reason}: {summarise(paths)}")
        if self.experts:
            lines.append(
                f"  not adapted, the experts' fused tensors (parameters, not layers): {summarise(self.experts)}"
            )
        return lines


def summarise(paths: list[str]) -> str:
    """Paths with layer indices folded into `*`, each pattern with its count: model.layers.*.self_attn.q_proj (32)."""
    counts = Counter(re.sub(r"\.\d+(?=\.|$)", ".*", p) for p in paths)
    return ", ".join(f"{p} ({n})" if n > 1 else p for p, n in sorted(counts.items())) or "none"


def num_experts(config) -> int:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _EXPERT_COUNT_KEYS:
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 1:
            return n
    return 0


def _linear_classes() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def is_router(name: str, module: nn.Module, n_experts: int) -> bool:
    """A mixture of experts' router: a linear layer with one output per expert named like a gate or router, or an
    nn.Linear subclass whose class says it routes."""
    leaf = name.rpartition(".")[2]
    out = getattr(module, "out_features", None)
    if n_experts and out == n_experts and _ROUTER_NAME.search(leaf):
        return True
    return type(module) is not nn.Linear and "router" in type(module).__name__.lower()


def expert_modules(model: nn.Module, n_experts: int) -> list[str]:
    """Modules holding fused expert tensors: a 3-D parameter with one slice per expert, outside any convolution."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd) or not n_experts:
            continue
        if any(p.ndim == 3 and p.shape[0] == n_experts for p in module.parameters(recurse=False)):
            out.append(name)
    return out


def peft_refused_leaves(model: nn.Module, leaves: set[str]) -> set[str]:
    """Leaf names PEFT refuses to wrap with LoRA on this family (its Mamba check)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba

    cfg = LoraConfig()
    refused = set()
    for leaf in leaves:
        try:
            _check_lora_target_modules_mamba(cfg, model, leaf)
        except ValueError:
            refused.add(leaf)
    return refused


def peft_remapped_leaves(model: nn.Module) -> set[str]:
    """Leaf names PEFT's transformers-v5 conversion turns into the fused experts' tensors on this family."""
    from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return set(_MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type), {}))


def plan_all_linear(model: nn.Module) -> TargetPlan:
    """The module paths all-linear wraps on `model` (a transformers causal LM, before PEFT), and what it leaves out."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n_experts = num_experts(model.config) if hasattr(model, "config") else 0
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, _linear_classes())]
    leaves = {n.rpartition(".")[2] for n, _ in linear}
    refused, remapped = peft_refused_leaves(model, leaves), peft_remapped_leaves(model)
    plan = TargetPlan(paths=[], experts=expert_modules(model, n_experts))
    for name, module in linear:
        leaf = name.rpartition(".")[2]
        if module is head:
            reason = "the output head"
        elif is_router(name, module, n_experts):
            reason = "routers (name them in --lora_target_modules to train them)"
        elif leaf in refused:
            reason = f"PEFT refuses LoRA on {leaf} of {model.config.model_type} models"
        elif leaf in remapped:
            reason = f"PEFT reads {leaf} as the fused experts on {model.config.model_type} models"
        else:
            plan.paths.append(name)
            continue
        plan.left_out.setdefault(reason, []).append(name)
    return plan
