"""The PEFT adapter of a run: what it targets (all-linear by module path, expert and router parameters), its
dropout, the token rows it trains and saves, attached to the base model."""

from __future__ import annotations

import warnings

from torch import nn

from shardtune.models import quant_experts, targets
from shardtune.models.loading import BASE_ROWS_ATTR
from shardtune.runtime.log import print0


def _target_modules(spec: str, model: nn.Module | None = None, experts_adapted: bool = False) -> str | list[str]:
    """all-linear (given the model: the module paths of shardtune.models.targets.plan_all_linear, said in the log), one
    regular expression (peft full-matches a string against module names), or a list of names."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all-linear"]:
        if model is None:
            return "all-linear"
        plan = targets.plan_all_linear(model)
        for line in plan.log_lines(experts_adapted):
            print0(line)
        return plan.paths or "all-linear"
    if len(names) == 1 and any(c in names[0] for c in "*+?[](){}|^$\\"):
        return names[0]
    return names


@quant_experts.expert_stand_ins
def attach_adapter(
    model: nn.Module,
    *,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    target_modules: str,
    use_dora: bool,
    modules_to_save: str | None,
    new_token_ids: list[int],
    adapter_name: str = "default",
    adapter_path: str | None = None,
    target_parameters: str | None = None,
    target_experts: bool = False,
) -> nn.Module:
    """Wrap the base in a PEFT LoRA/DoRA adapter; rows of newly added tokens are trained as trainable tokens.

    target_parameters / target_experts: PEFT's target_parameters (expert tensors, router weights; see
    models.targets.plan_parameters). PEFT adapts a parameter as a weight delta, which has no input to drop, and
    refuses any lora_dropout then; so the adapter is made with none, and lora_dropout is put back on the linear
    layers' LoRA inputs (the saved adapter_config.json says 0.0, which is what PEFT needs to load it). 4-bit
    experts are modules, not parameters: PEFT wraps them as the 3-D parameters they stand for (expert_stand_ins)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path:
        with warnings.catch_warnings():
            # Ranks that do not read the weights hold a meta skeleton: torch warns, per tensor, that loading the
            # adapter onto it is a no-op. It is meant to be: the reading rank's shards fill those ranks.
            warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter .* to a meta parameter")
            model = PeftModel.from_pretrained(model, adapter_path, adapter_name=adapter_name, is_trainable=True)
        print0(f"Continuing training of the adapter in {adapter_path}.")
        if model.peft_config[adapter_name].target_parameters:
            _linear_dropout(model, lora_dropout, adapter_name)
        return model
    plan = targets.plan_parameters(model, target_parameters, experts=target_experts)
    for line in plan.log_lines():
        print0(line)
    params = plan.names or None
    mts = [s.strip() for s in (modules_to_save or "").split(",") if s.strip()] or None
    problem = targets.tied_head_saved_problem(model, mts, adds_rows=bool(new_token_ids))
    if problem:  # said by the preflight before loading when the chat format adds the rows; here for any other way
        raise ValueError(problem)
    tti = None
    if new_token_ids:
        tti = {name: sorted(set(new_token_ids) | set(grown)) for name, grown in _token_modules(model, mts).items()}
    modules = _target_modules(target_modules, model, experts_adapted=targets.EXPERTS in plan.words)
    converted = names_peft_adapts_as_experts(model, modules)[1]
    if converted:
        print0(f"--lora_target_modules {target_modules}: on {model.config.model_type}, PEFT adapts "
               f"{', '.join(sorted(converted))} as fused expert tensors for these names (a weight delta per expert).")  # fmt: skip
    params = params or (sorted(converted) if converted else None)
    cfg = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0 if params else lora_dropout,
        target_modules=modules,
        target_parameters=params,
        use_dora=use_dora,
        modules_to_save=mts,
        trainable_token_indices=tti or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, cfg, adapter_name=adapter_name)
    except ValueError as e:
        if "not found in the base model" in str(e) or "Target modules" in str(e):
            raise ValueError(f"--lora_target_modules {target_modules!r} matched no module of the model: {e}") from e
        raise
    if params and lora_dropout:
        _linear_dropout(model, lora_dropout, adapter_name)
        print0(
            f"--lora_dropout {lora_dropout} acts on the linear layers' LoRA inputs; a parameter's LoRA (a weight "
            "delta) has no input to drop, and adapter_config.json records lora_dropout 0.0 so that PEFT loads it."
        )
    return model


def names_peft_adapts_as_experts(model: nn.Module, modules: str | list[str]) -> tuple[set[str], set[str]]:
    """(the module names, the fused expert parameters) PEFT adapts them as, on a model whose experts transformers 5
    fused (Mixtral's w1/w3, Qwen3-MoE's gate/up/down_proj are now mlp.experts.gate_up_proj and down_proj): PEFT's
    own conversion, run on a probe config, so that shardtune knows before get_peft_model (whose parameter wrappers
    refuse a lora_dropout) and the preflight does not call those names unmatched."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
    except ImportError:  # a PEFT without the conversion converts nothing
        return set(), set()
    if not hasattr(getattr(model, "config", None), "model_type") or isinstance(modules, str):
        return set(), set()  # all-linear and a regular expression name module paths, not the old expert names
    probe = LoraConfig(r=8, target_modules=list(modules))
    convert_peft_config_for_transformers(probe, model=model, conversions=get_model_conversion_mapping(model))
    return set(modules) - set(probe.target_modules or ()), set(probe.target_parameters or ())


def _linear_dropout(model: nn.Module, p: float, adapter_name: str) -> None:
    """Dropout p on the input of every linear layer's LoRA of `adapter_name` whose adapter was made without one
    (an adapter that also adapts parameters: see attach_adapter); parameter wrappers have no input to drop."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    if not p:
        return
    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            drops = module.lora_dropout
            if adapter_name in drops and isinstance(drops[adapter_name], nn.Identity):
                drops[adapter_name] = nn.Dropout(p)


def _token_modules(model: nn.Module, modules_to_save: list[str] | None) -> dict[str, range]:
    """Modules whose new-token rows must be trained, unless saved in full: the input embedding, every other
    embedding looked up by token id, and an untied output head; each with the rows its resize added (Gemma 3n's
    per-layer table: from vocab_size_per_layer_input on), which are trained with the new tokens' rows.

    Token-indexed embeddings besides the input one (Gemma 4's and Gemma 3n's per-layer input embeddings,
    embed_tokens_per_layer) are the nn.Embedding modules that have as many rows as the input embedding after the
    resize: transformers' resize_token_embeddings grows them with it. Left out, their new rows would be a random
    resize that the adapter does not save, and the reloaded model would differ from the trained one on new tokens."""
    tables: dict[str, range] = {}
    full = set(modules_to_save or [])
    emb = model.get_input_embeddings()
    emb_name = _module_name(model, emb)
    if emb_name and emb_name.split(".")[-1] not in full:
        tables[emb_name.split(".")[-1]] = range(0)
    for name, mod in model.named_modules():
        leaf = name.split(".")[-1]
        if mod is emb or not isinstance(mod, nn.Embedding) or leaf in full or leaf in tables:
            continue
        if mod.num_embeddings == emb.num_embeddings:
            tables[leaf] = range(getattr(mod, BASE_ROWS_ATTR, mod.num_embeddings), mod.num_embeddings)
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb.weight
    if out is not None and not tied:
        out_name = _module_name(model, out)
        if out_name and out_name.split(".")[-1] not in full:
            tables[out_name.split(".")[-1]] = range(0)
    return tables


def _module_name(root: nn.Module, target: nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None
