"""Whether a training run fits its GPU: a `shardtune train` run's flags and launch as the planner's inputs
(`plan_inputs`, `plan_shape`, `launch_from_env`), read by `shardtune plan` too, and `warn_if_too_small`, which
`shardtune train` prints before loading when the estimate exceeds the GPU it found.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from shardtune.config import cuda_allocator, dtypes
from shardtune.config.arguments import (
    DataArguments,
    ModelArguments,
    RunConfig,
    TrainArguments,
    activation_checkpointing,
)
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import FSDPSettings, fsdp_settings_from_env, single_process_fsdp_reason
from shardtune.config.precision import resolve_precision
from shardtune.data.templates import padded_rows
from shardtune.models import families, fastpath, training_module
from shardtune.objectives.loss import dropout_off, objective_spec, rows_per_example
from shardtune.parallel import dims
from shardtune.parallel.dims import ZERO2_OF
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import load_model_config
from shardtune.planning.recommend import recommend
from shardtune.planning.report import Launch, recommendation_lines
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import GiB

# chatml and zephyr add up to five tokens; the embeddings are then padded (data.templates.padded_rows).
CHAT_NEW_TOKENS = 5


def launch_from_settings(s: FSDPSettings, world_size: int, num_nodes: int) -> Launch:
    """The planner's `Launch` for FSDP settings (from the environment or an accelerate YAML) and a world size."""
    strategy = s.sharding_strategy
    if s.reshard_after_forward is False:  # FSDP2's way of saying SHARD_GRAD_OP
        strategy = ZERO2_OF.get(strategy, strategy)
    return Launch(
        world_size=world_size,
        num_nodes=num_nodes,
        sharding_strategy=strategy,
        offload=s.offload_params,
        mixed_precision=s.mixed_precision,
        activation_checkpointing=s.activation_checkpointing,
        single_process=s.single_process,
    )


def launch_from_env(env: dict[str, str] | None = None) -> Launch:
    """What `accelerate launch`/torchrun put in the environment (used by `shardtune train`)."""
    env = dict(os.environ if env is None else env)
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)) or world)
    launch = launch_from_settings(fsdp_settings_from_env(env), world, max(1, world // max(local, 1)))
    launch.expandable_segments = cuda_allocator.expandable_segments(env)
    return launch


def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def plan_shape(config: Any, chat_template_format: str = "none") -> ModelShape:
    """The model's shapes, with the embeddings resized as shardtune does when it adds chat tokens, and whether the
    family trains on shardtune's per-document attention (trains_per_document)."""
    from shardtune.models import families  # the family rules load transformers' model classes: only when planning one

    shape = replace(
        ModelShape.from_config(config),
        per_document_attention=trains_per_document(config),
        plain_mask=isinstance(config, dict) or families.plain_causal(config),
    )
    if chat_template_format in ("chatml", "zephyr"):
        padded = padded_rows(shape.vocab_size + CHAT_NEW_TOKENS)
        shape = replace(shape.with_vocab(padded), new_token_rows=padded - shape.vocab_size)
    return shape


def trains_per_document(config: Any) -> bool:
    """Whether shardtune trains this family's attention per document (shardtune.models.fastpath.packed_sdpa_attention),
    decided as builder.training_layout decides it: the family's attention is shardtune's SDPA (not eager for a
    family that cannot run SDPA, nor attention classes chosen by name) and its conformance verdict trains packed
    rows on the fast path (not its own forward, whose attention sees transformers' whole-row mask). The verdict
    runs a tiny copy of the config once per process (cached; `shardtune train` reuses it). A config given as a
    dict cannot be checked: shardtune's Llama-style default."""
    if isinstance(config, dict):
        return True

    # families.family_attention's choice, without the log line it prints (plan's output may be JSON).
    attention = families._attention_choice(config, fastpath.register_attention())[0]
    if attention != fastpath.ATTENTION:
        return False
    verdict = families.verdict(config, attention, training_module.CausalLMForTraining)
    return verdict.layout(True).path == "fast"


def lora_target_parameters(model: ModelArguments) -> tuple[str, ...]:
    """The parameters LoRA adapts besides --lora_target_modules: --lora_target_parameters, and "experts" with
    --lora_target_experts."""
    words = [w.strip() for w in (model.lora_target_parameters or "").split(",") if w.strip()]
    if model.lora_target_experts and "experts" not in words:
        words.append("experts")
    return tuple(words)


def plan_inputs(
    model: ModelArguments,
    data: DataArguments,
    train: TrainArguments,
    launch: Launch,
    attn_implementation: str | None = None,
    loss_chunk_tokens: int = 1024,
) -> PlanInputs:
    """The planner's inputs for a run's flags and launch settings: the one place a run becomes PlanInputs (the
    fields of planning.inputs.RUN_FIELDS and lora_target_parameters; the others keep shardtune's defaults)."""
    precision = resolve_precision(
        bf16=train.bf16, fp16=train.fp16, mixed_precision=launch.mixed_precision, peft=model.use_peft_lora
    )
    storage = model.bnb_4bit_quant_storage_dtype
    # Under FSDP shardtune stores 4-bit weights in a floating dtype; uint8 is the non-FSDP default, planned as the
    # compute dtype.
    storage = storage if storage in dtypes.FLOATING else dtypes.name_of(precision.compute)
    generates = objective_spec(train.objective).data == "prompts"  # online RL: the run samples its completions
    return PlanInputs(
        world_size=launch.world_size,
        num_nodes=launch.num_nodes,
        sharding_strategy=launch.sharding_strategy,
        expandable_segments=launch.expandable_segments,
        offload=launch.offload,
        bf16=precision.bf16,
        fp16=precision.fp16,
        use_4bit=model.use_4bit_quantization,
        use_8bit=model.use_8bit_quantization,
        nested_quant=model.use_nested_quant,
        quant_storage_dtype=storage,
        use_peft_lora=model.use_peft_lora,
        lora_r=model.lora_r,
        lora_target_modules=model.lora_target_modules,
        lora_target_parameters=lora_target_parameters(model),
        lora_dropout=0.0 if dropout_off(train.objective, train.disable_dropout) else model.lora_dropout,
        use_dora=model.use_dora,
        modules_to_save=tuple(_split(model.modules_to_save)),
        batch_size=train.per_device_train_batch_size,
        rows_per_example=rows_per_example(train.objective),
        seq_len=rollout_row_length(data, train) if generates else data.max_length,
        gradient_checkpointing=activation_checkpointing(train, launch.activation_checkpointing),
        attn_implementation=attn_implementation or ("flash_attention_2" if model.use_flash_attn else "sdpa"),
        packing=data.packing and not generates,  # rollouts train on padded prompt + completion rows
        optim=train.optim,
        grad_accum=train.gradient_accumulation_steps,
        loss_chunk_tokens=loss_chunk_tokens,
        replicate_base=replicates_base(model, launch.world_size, launch.offload),
        context_parallel=train.context_parallel_size,
        # compiled blocks take transformers' masked attention (training_module.CausalLMForTraining, per_document_attention)
        per_document_attention=not train.torch_compile,
        fsdp=launch.world_size > 1
        or single_process_fsdp_reason(
            launch.single_process,
            offload=launch.offload,
            full_mixed_precision=not model.use_peft_lora and precision.param_dtype is not None,
        )
        is not None,
        **(generation_inputs(train) if generates else {}),
    )


def generation_inputs(train: TrainArguments) -> dict[str, Any]:
    """PlanInputs' online-RL fields from the flags (plan_inputs): steps_per_generation defaults to
    --gradient_accumulation_steps, as recipe.rl.rollout_settings reads it."""
    return {
        "rollout_engine": train.rollout_engine,
        "num_generations": train.num_generations,
        "steps_per_generation": train.steps_per_generation or train.gradient_accumulation_steps,
        "max_prompt_length": train.max_prompt_length,
        "max_completion_length": train.max_completion_length,
        "gather_for_generation": train.gather_for_generation,
    }


def rollout_row_length(data: DataArguments, train: TrainArguments) -> int:
    """An online-RL run's training rows: the longest prompt (--max_prompt_length, else planned at --max_length)
    and the longest completion."""
    prompt = train.max_prompt_length if train.max_prompt_length is not None else data.max_length
    return prompt + train.max_completion_length


def replicates_base(model: ModelArguments, world_size: int, offload: bool) -> bool:
    """Whether --frozen_base replicated applies: LoRA on several ranks without offload (validation refuses it with
    offload; one process holds the whole base either way). auto is planned sharded: `frozen_base_choice` decides
    it for a GPU."""
    return model.frozen_base == "replicated" and model.use_peft_lora and world_size > 1 and not offload


# --frozen_base auto replicates only where the plan fits this much under the GPU's memory: the planner's largest
# leave-one-out error on the published runs (12.9%, bench/plan_loo.py; docs/plan.md), rounded up. A run that auto
# made run out of memory would be worse than one that gathers its base.
AUTO_REPLICATE_MARGIN = 0.13


def frozen_base_choice(cfg: RunConfig, launch: Launch, gpu_bytes: int | None) -> tuple[str, str | None]:
    """--frozen_base as a run on `launch` applies it: "sharded" or "replicated", and the line saying why (None:
    nothing to say, as for full fine-tuning, which has no frozen base, or one process, which holds the whole base
    either way). auto plans the replicated run against `gpu_bytes`, one GPU's memory (None: no GPU)."""
    m, world_size = cfg.model, launch.world_size
    if not m.use_peft_lora:
        return "sharded", None
    if world_size == 1:
        why = (
            "--frozen_base replicated: one process holds the whole frozen base anyway."
            if m.frozen_base == "replicated"
            else None
        )
        return "sharded", why
    gathered = "each block's frozen weights are all-gathered for its forward and again for its backward"
    if m.frozen_base == "sharded":
        return "sharded", f"Frozen base sharded over {world_size} ranks (--frozen_base sharded): {gathered}."
    if m.frozen_base == "replicated":
        return "replicated", "Frozen base replicated on every rank (--frozen_base replicated): never all-gathered."
    if launch.offload:
        return "sharded", "Frozen base sharded (--frozen_base auto): fsdp_offload_params keeps the shards in host RAM."
    if not dims.strategy(launch.sharding_strategy).sharded:
        return "sharded", None  # NO_SHARD: FSDP replicates everything already
    if gpu_bytes is None:
        return "sharded", (
            f"Frozen base sharded (--frozen_base auto): no GPU memory to plan a replicated base against; {gathered} "
            "(--frozen_base replicated holds it whole on every rank)."
        )
    need = _replicated_need(cfg, launch)
    if need is not None and need * (1 + AUTO_REPLICATE_MARGIN) <= gpu_bytes:
        return "replicated", (
            f"Frozen base replicated on every rank (--frozen_base auto): the plan needs {need / GiB:.1f} GiB per GPU "
            f"of {gpu_bytes / GiB:.1f} GiB, within its {AUTO_REPLICATE_MARGIN:.0%} margin; the base is never "
            "all-gathered (--frozen_base sharded shards it)."
        )
    planned = "cannot be planned" if need is None else f"would need {need / GiB:.1f} GiB per GPU"
    return "sharded", (
        f"Frozen base sharded (--frozen_base auto): replicated it {planned}, of {gpu_bytes / GiB:.1f} GiB with a "
        f"{AUTO_REPLICATE_MARGIN:.0%} margin; {gathered}."
    )


def _replicated_need(cfg: RunConfig, launch: Launch) -> int | None:
    """The planned bytes per GPU of this run with its frozen base replicated (None: the config cannot be read)."""
    try:
        shape = plan_shape(
            load_model_config(cfg.model.model_name_or_path, cfg.model.trust_remote_code), cfg.model.chat_template_format
        )
    except ConfigError:
        return None
    inputs = replace(plan_inputs(cfg.model, cfg.data, cfg.train, launch), replicate_base=True)
    return estimate_memory(shape, inputs).total


def warn_if_too_small(cfg: RunConfig, gpu_bytes: int, env: dict[str, str] | None = None) -> str | None:
    """A warning for `shardtune train` to print before loading when the planner's estimate exceeds `gpu_bytes`."""
    launch = launch_from_env(env)
    try:
        shape = plan_shape(
            load_model_config(cfg.model.model_name_or_path, cfg.model.trust_remote_code), cfg.model.chat_template_format
        )
    except ConfigError:
        return None  # loading the model will report it
    inputs = plan_inputs(cfg.model, cfg.data, cfg.train, launch)
    est = estimate_memory(shape, inputs)
    if est.fits(gpu_bytes):
        return None
    rec = recommend(inputs, gpu_bytes, cfg.train.gradient_accumulation_steps, model=shape)
    lines = [
        (
            f"This run needs about {est.total / GiB:.1f} GiB per GPU (estimate of `shardtune plan`), more than "
            f"the {gpu_bytes / GiB:.1f} GiB this GPU has; it will likely run out of memory."
        )
    ]
    return "\n".join(lines + recommendation_lines(rec))
