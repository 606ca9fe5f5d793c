"""The run's training objective (--objective), with what a preference objective needs before the first step."""

from __future__ import annotations

from shardtune.config.arguments import RunConfig
from shardtune.config.dtypes import name_of
from shardtune.models import router_aux
from shardtune.objectives.loss import (
    build_objective,
    disable_dropout,
    dropout_off,
    kto_weight_advice,
    objective_spec,
)
from shardtune.objectives.reference import precompute_reference, weights_identity
from shardtune.runtime.log import print0


def _kto_advice(train_split, t) -> str | None:
    n_desirable = int(train_split.desirable.sum())
    return kto_weight_advice(n_desirable, len(train_split) - n_desirable, t.desirable_weight, t.undesirable_weight)


def _rl_knobs(cfg: RunConfig) -> dict:
    """What the GRPO objective reads beside beta and loss_type (the other objectives take none of it)."""
    t = cfg.train
    if objective_spec(t.objective).data != "prompts":
        return {}
    vllm_is = t.rollout_engine == "vllm" and t.vllm_importance_sampling_correction
    return {
        "epsilon": t.epsilon,
        "epsilon_high": t.epsilon_high,
        "max_completion_length": t.max_completion_length,
        "temperature": t.temperature,
        "importance_sampling_cap": t.vllm_importance_sampling_clip_max if vllm_is else None,
    }


def setup_objective(cfg: RunConfig, model, splits: list, info, pad_id: int):
    """The objective of --objective; for a preference objective, dropout off (as TRL) and the reference
    log-probs precomputed unless the reference is the base with a fresh adapter disabled, each step."""

    t, m = cfg.train, cfg.model
    objective = build_objective(
        t.objective,
        beta=t.beta,
        loss_type=t.loss_type,
        simpo_gamma=t.simpo_gamma,
        desirable_weight=t.desirable_weight,
        undesirable_weight=t.undesirable_weight,
        **_rl_knobs(cfg),
    )
    if line := router_aux.log_line(getattr(model, "router_aux", None)):
        print0(line)
    if dropout_off(t.objective, t.disable_dropout):
        disable_dropout(model)
    if t.objective == "kto" and (advice := _kto_advice(splits[0], t)):
        print0(advice)
    if not objective.needs_reference or objective_spec(t.objective).data == "prompts":
        return objective  # online RL: the rollouts score the reference as they are generated (shardtune.rl.rollout)
    if m.use_peft_lora and not m.adapter_path and not t.precompute_ref_log_probs:
        print0("Reference: the base model with the adapter disabled, run under no_grad each step (no second copy).")
        return objective
    identity = {  # what decides the reference's numbers: the weight files, how they are loaded, the precision
        "weights": weights_identity(m.model_name_or_path, m.adapter_path),
        "model": cfg.to_dict()["model"],
        "precision": name_of(cfg.precision.compute),
    }
    for split in (s for s in splits if s is not None):
        precompute_reference(
            model,
            split,
            batch_size=t.per_device_eval_batch_size,
            info=info,
            pad_id=pad_id,
            # With --adapter_path the reference is the model the run starts from: base plus that adapter.
            disable_adapter=m.use_peft_lora and not m.adapter_path,
            identity=identity,
        )
    return objective
