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

Two rules on the targets a user names live here too: a tied output head in --modules_to_save
(`tied_head_saved_problem`), and each alternative of a --lora_target_modules regular expression that matches no
module (`regex_alternative_warnings`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from shardtune.data.templates import CHAT_FORMATS
from shardtune.runtime.log import warn0

# The config keys families name their number of routed experts with (the conformance check's tiny copies shrink
# the same keys).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_ROUTER_NAME = re.compile(r"(gate|router)", re.IGNORECASE)


@dataclass
class TargetPlan:
    """Module paths that get adapters, and the linear layers left out: {reason: [paths]}."""

    paths: list[str]
    left_out: dict[str, list[str]] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)  # modules holding fused expert tensors

    def log_lines(self, experts_adapted: bool = False) -> list[str]:
        lines = [f"LoRA targets (all-linear, {len(self.paths)} layers): {summarise(self.paths)}"]
        for reason, paths in self.left_out.items():
            lines.append(f"  not adapted, {reason}: {summarise(paths)}")
        if self.experts and not experts_adapted:
            lines.append(
                f"  not adapted, the experts' fused tensors (parameters, not layers; --lora_target_experts True "
                f"adapts them): {summarise(self.experts)}"
            )
        return lines


def summarise(paths: list[str]) -> str:
    """Paths with layer indices folded into `*`, each pattern with its count: model.layers.*.self_attn.q_proj (32)."""
    counts = Counter(re.sub(r"\.\d+(?=\.|$)", ".*", p) for p in paths)
    return ", ".join(f"{p} ({n})" if n > 1 else p for p, n in sorted(counts.items())) or "none"


def num_experts(config) -> int:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in EXPERT_COUNT_KEYS:
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 1:
            return n
    return 0


def linear_classes() -> tuple[type, ...]:
    """The layers taken as linear (by all-linear, and by 4-bit quantization): nn.Linear and GPT-2's Conv1D."""
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
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, linear_classes())]
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


# ---------------------------------------------------------------- parameters: experts and routers

# Words of --lora_target_parameters that stand for every parameter of a kind (--lora_target_experts True: experts).
EXPERTS, ROUTERS = "experts", "routers"


@dataclass
class ParameterPlan:
    """PEFT target_parameters: parameter names (paths with the block index dropped, which PEFT matches as a path
    ending), and what each word stood for."""

    names: list[str]
    words: dict[str, list[str]] = field(default_factory=dict)

    def log_lines(self) -> list[str]:
        return [f"LoRA on parameters ({word}): {', '.join(names)}" for word, names in self.words.items()]


def _suffix(path: str) -> str:
    """model.layers.3.mlp.experts.gate_up_proj -> mlp.experts.gate_up_proj (the part after the last index)."""
    parts = path.split(".")
    last = max((i for i, p in enumerate(parts) if p.isdigit()), default=-1)
    return ".".join(parts[last + 1 :])


def expert_parameters(model: nn.Module) -> list[str]:
    """Paths of every fused expert tensor (3-D, one slice per expert) of a mixture of experts."""
    n_experts = num_experts(model.config) if hasattr(model, "config") else 0
    out = []
    for name in expert_modules(model, n_experts):
        module = model.get_submodule(name)
        out += [f"{name}.{p}" for p, t in module.named_parameters(recurse=False) if t.ndim == 3]
    return out


def router_parameters(model: nn.Module) -> list[str]:
    """Paths of every router weight held as a parameter (E, hidden) by a router module (transformers 5's
    *TopKRouter and its kin); routers that are linear layers are modules: --lora_target_modules names them."""
    n_experts = num_experts(model.config) if hasattr(model, "config") else 0
    out = []
    for name, module in model.named_modules():
        if not n_experts or isinstance(module, linear_classes()):
            continue
        weight = module._parameters.get("weight")
        routes = "router" in type(module).__name__.lower() or _ROUTER_NAME.search(name.rpartition(".")[2])
        if routes and weight is not None and weight.ndim == 2 and weight.shape[0] == n_experts:
            out.append(f"{name}.weight")
    return out


def plan_parameters(model: nn.Module, spec: str | None, *, experts: bool) -> ParameterPlan:
    """What --lora_target_parameters (and --lora_target_experts) adapt on `model`: PEFT's names, each checked to
    match a parameter of the right kind; raises ValueError naming the flag and what the model has."""
    words = [s.strip() for s in (spec or "").split(",") if s.strip()]
    if experts and EXPERTS not in words:
        words.append(EXPERTS)
    plan = ParameterPlan(names=[])
    if not words:  # every run without parameter targets: nothing to look up
        return plan
    named = dict(model.named_parameters())
    for word in words:
        if word in (EXPERTS, ROUTERS):
            found = expert_parameters(model) if word == EXPERTS else router_parameters(model)
            if not found:
                raise ValueError(_no_parameters_message(model, word, experts))
            names = sorted({_suffix(p) for p in found})
            plan.words[word] = names
        else:
            if not any(p == word or p.endswith("." + word) for p in named):
                raise ValueError(_no_parameters_message(model, word, experts))
            names = [word]
        plan.names += [n for n in names if n not in plan.names]
    return plan


def _no_parameters_message(model: nn.Module, word: str, experts: bool) -> str:
    flag = "--lora_target_experts True" if word == EXPERTS and experts else f"--lora_target_parameters {word}"
    have = sorted({_suffix(p) for p in [*expert_parameters(model), *router_parameters(model)]})
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if word in (EXPERTS, ROUTERS):
        what = "fused expert tensors" if word == EXPERTS else "router weights held as parameters"
        tail = f"its expert and router parameters are {', '.join(have)}" if have else "it is not a mixture of experts"
        return f"{flag}: this {kind} model has no {what}; {tail}."
    tail = f" (its expert and router parameters: {', '.join(have)})" if have else ""
    return f"{flag}: no parameter of this {kind} model is named {word} or ends in .{word}{tail}."


def parameter_target_problems(model: nn.Module, spec: str | None, *, experts: bool) -> list[str]:
    """plan_parameters' refusal as a preflight problem (on the meta skeleton, before any weight is read)."""
    if not spec and not experts:
        return []
    try:
        plan_parameters(model, spec, experts=experts)
    except ValueError as e:
        return [str(e)]
    return []


# ---------------------------------------------------------------- a tied head in --modules_to_save
# Checked against the model: from its meta skeleton before loading (models.preflight), and where the adapter is
# attached (models.adapter), which knows every added row.
#
# On a model whose output head is its input embedding (tie_word_embeddings), the rows of added tokens are trained as
# PEFT trainable tokens on the embedding, and PEFT ties them to the head by wrapping the head too. A head that
# --modules_to_save also trains in full is a wrapper PEFT cannot wrap: it failed inside PEFT at the first step
# ("TrainableTokensLayer wraps an unknown layer type"). With the embedding saved in full as well, no token rows are
# needed (both are trained in full, as two copies; a merged model is untied), and without added rows the head alone
# is trained in full as PEFT does on any model.


def tied_head_saved_problem(model, modules_to_save: list[str] | None, *, adds_rows: bool) -> str | None:
    """Why --modules_to_save cannot train this model's output head in full, or None.

    model: the base before the adapter (a meta skeleton is enough); adds_rows: the run adds embedding rows (new
    tokens, or padding to a multiple of 8)."""
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if not adds_rows or out is None or out.weight is not emb.weight:
        return None
    names = {id(m): n.split(".")[-1] for n, m in model.named_modules() if m is emb or m is out}
    emb_name, out_name = names.get(id(emb), "embed_tokens"), names.get(id(out), "lm_head")
    full = set(modules_to_save or [])
    if out_name not in full or emb_name in full:
        return None
    return (
        f"--modules_to_save {out_name}: this model ties its output head to its input embedding, and the added "
        f"tokens' rows are trained on the tied {emb_name} and {out_name} (PEFT trainable tokens), which cannot also "
        f"train {out_name} in full. Use --modules_to_save {emb_name},{out_name} (both trained in full and saved in "
        f"the adapter; a merged model is untied), or leave {out_name} out (the new tokens' rows are still trained)."
    )


def chat_format_problem(model, modules_to_save: str | None, chat_template_format: str) -> str | None:
    """tied_head_saved_problem for a run whose --chat_template_format chatml or zephyr adds its tokens."""
    names = [s.strip() for s in (modules_to_save or "").split(",") if s.strip()]
    return tied_head_saved_problem(model, names, adds_rows=chat_template_format in CHAT_FORMATS)


# ---------------------------------------------------------------- a regular expression in --lora_target_modules


def _alternations(pattern: str) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Each alternation of `pattern` (the whole pattern, or a group holding `|`): (where its alternatives begin,
    where they end, each alternative's span). Escapes and character classes are skipped, as re reads them."""
    stack: list[tuple[int, list[int]]] = [(-1, [])]  # (position of the group's "(", its "|" positions)
    found, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 if pattern[i + 1 : i + 2] != "]" else 2  # "[]...]": the first ] is a member
            continue
        elif c == "(":
            stack.append((i, []))
        elif c == ")" and len(stack) > 1:
            start, bars = stack.pop()
            if bars:
                found.append((start, i, bars))
        elif c == "|":
            stack[-1][1].append(i)
        i += 1
    if stack[0][1]:
        found.append((-1, len(pattern), stack[0][1]))
    out = []
    for start, end, bars in found:
        body = start + 1  # where the alternatives begin: after "(" (and "?:"), or at 0 for the whole pattern
        if start >= 0 and pattern.startswith("?:", body):
            body += 2
        edges = [body, *(b + 1 for b in bars)]
        ends = [*bars, end]
        out.append((body, end, list(zip(edges, ends, strict=True))))
    return out


def regex_alternative_warnings(pattern: str, module_names: list[str], leaf_names: list[str]) -> list[str]:
    """One line per alternative of a --lora_target_modules regular expression that makes no module match (PEFT
    full-matches the expression against module paths, so a misspelt alternative is skipped silently): the
    expression with only that alternative left in its place matches none of `module_names`."""

    out = []
    for body, end, spans in _alternations(pattern):
        for a, b in spans:
            alone = pattern[:body] + pattern[a:b] + pattern[end:]
            try:
                compiled = re.compile(alone)
            except re.error:
                continue
            if not any(compiled.fullmatch(n) for n in module_names):
                out.append(
                    f"--lora_target_modules '{pattern}': its alternative '{pattern[a:b]}' matches no module (PEFT "
                    f"skips it); the model's layers are named {', '.join(leaf_names)}."
                )
    return out


def unmatched_alternatives_warned(pattern: str, module_names: list[str], leaf_names: list[str]) -> list[str]:
    """Warn of regex_alternative_warnings' lines; an expression that matches some module has no problem ([])."""
    for line in regex_alternative_warnings(pattern, module_names, leaf_names):
        warn0(line)
    return []
