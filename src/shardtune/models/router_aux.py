"""The router load-balancing loss of a mixture of experts, as the family's own *ForCausalLM.forward adds it.

transformers' MoE causal LMs (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, ...) add `router_aux_loss_coef ×
load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)` to their loss when called with
output_router_logits. shardtune takes that function from the model's own modeling module and the numbers it reads
from the model (`num_experts`, `num_experts_per_tok`, `router_aux_loss_coef`), rather than a hand-kept list, so the
term is the family's own. A family without the function or without those attributes gets no term.

For SFT the loss is a mean over every position of one forward (packed rows carry no attention mask, so padding and
filler rows route like any token, as in transformers' forward without one); the preference objectives leave each
row's padding and their filler rows out (`sequence_mask`), as TRL's trainers do with their attention mask. How it
enters the objectives over micro-batches and ranks: shardtune.objectives.loss.Objective.step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLAG = "--router_aux_loss_coef"


@dataclass(frozen=True)
class RouterAux:
    """The family's load-balancing loss and the coefficient the run uses (0: off)."""

    loss_func: Callable
    num_experts: int
    top_k: int
    coef: float
    config_coef: float  # the config's router_aux_loss_coef, for the log line
    family: str  # the causal LM class, for the log line

    def __call__(self, router_logits, mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The aux loss (fp32, 0-dim) of one forward's router logits (one [tokens, experts] tensor per MoE layer),
        or None when the decoder recorded none. mask [batch, seq] (1: a real token) leaves padding out, as the
        family's forward does with an attention mask."""
        if not isinstance(router_logits, tuple) or not router_logits:
            return None
        if mask is not None and not bool(mask.any()):  # only filler rows: a zero that keeps the graph (and FSDP)
            return self.loss_func(router_logits, self.num_experts, self.top_k, None).float() * 0.0
        aux = self.loss_func(router_logits, self.num_experts, self.top_k, mask)
        return aux.float() if isinstance(aux, torch.Tensor) else None


def family_router_aux(base, coef: float | None = None) -> RouterAux | None:
    """The load-balancing loss of `base` (the causal LM under any PEFT wrapper), or None for a model without one.

    `coef` overrides the config's coefficient (None: keep it); the config's output_router_logits is not read: it
    says whether transformers' own forward adds the term, while fine-tuning experts needs the routers balanced."""
    module = sys.modules.get(type(base).__module__)
    loss_func = getattr(module, "load_balancing_loss_func", None)
    experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
    config_coef = getattr(base, "router_aux_loss_coef", None)
    if not callable(loss_func) or not isinstance(experts, int) or not isinstance(top_k, int) or config_coef is None:
        return None
    used = float(config_coef if coef is None else coef)
    return RouterAux(loss_func, experts, top_k, used, float(config_coef), type(base).__name__)


def log_line(aux: RouterAux | None) -> str | None:
    """The run's line on the router loss: which coefficient and how to turn it off, or None for a dense model."""
    if aux is None:
        return None
    if aux.coef == 0:
        return f"{aux.family}: mixture of experts; the router load-balancing loss is off ({FLAG} 0)."
    source = "the config's" if aux.coef == aux.config_coef else f"{FLAG}; the config has {aux.config_coef}"
    return (
        f"{aux.family}: mixture of experts; the loss adds {aux.coef} ({source}) x the router load-balancing loss, "
        f"logged as aux_loss; {FLAG} 0 turns it off."
    )


def sequence_mask(position_ids: torch.Tensor, keep_rows: torch.Tensor, index: torch.Tensor | None = None):
    """[rows, seq] 1 on the real tokens of rows that each hold one sequence (a preference or KTO row: positions
    0..n-1, then padding whose positions restart at 0), 0 on the padding and on rows not kept (filler rows). A real
    token's position is its index in the row (padding's is less): `index`, the row positions held (context
    parallelism's part of each row), or all of them."""
    if index is None:
        index = torch.arange(position_ids.shape[1], device=position_ids.device)
    real = position_ids == index.to(position_ids.device)
    return (real & keep_rows[:, None]).long()
