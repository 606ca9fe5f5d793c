"""Whether a training run fits its GPU: a `shardtune train` run's configuration and launch as the planner's inputs
(`plan_inputs`, `plan_shape`, `launch_from_settings`), read by `shardtune plan` too, and `fit_run`, the planner's
one pass when `shardtune train` starts on a GPU (the frozen base's placement and `warn_if_too_small`'s warning,
from one reading of the model's shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from shardtune.config import cuda_allocator, dtypes
from shardtune.config.arguments import DataArguments, RunConfig, TrainArguments
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import FSDPSettings, fsdp_reason
from shardtune.config.precision import casts_every_weight
from shardtune.data.templates import padded_rows
from shardtune.models import families, fastpath, training_module
from shardtune.models.builder import ModelSpec, model_facts
from shardtune.objectives.loss import dropout_off, objective_spec, rows_per_example
from shardtune.parallel import dims
from shardtune.parallel.dims import ZERO2_OF
from shardtune.parallel.tensor import family_plan
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import load_model_config
from shardtune.planning.recommend import recommend
from shardtune.planning.report import Launch, recommendation_lines
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import GiB

# chatml and zephyr add up to five tokens; the embeddings are then padded (data.templates.padded_rows).
CHAT_NEW_TOKENS = 5
# frozen_base_choice and warn_if_too_small read the model's shape themselves unless the caller passes it.
_UNREAD = object()


def launch_from_settings(
    s: FSDPSettings, world_size: int, num_nodes: int, env: Mapping[str, str] | None = None
) -> Launch:
    """The planner's `Launch` of a run: its FSDP settings as the run decided them (`RunConfig.fsdp`: from the
    launcher's environment with accelerate's parallelism_config mapped onto the strategy, or `shardtune plan`'s
    from the YAML and its flags) on `world_size` processes over `num_nodes` machines, with the CUDA allocator's
    settings of `env` (default: this process's). `shardtune train` and `shardtune plan` both build it here."""
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
        expandable_segments=cuda_allocator.expandable_segments(env),
        single_process=s.single_process,
    )


def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def plan_shape(config: Any, chat_template_format: str = "none") -> ModelShape:
    """The model's shapes, with the embeddings resized as shardtune does when it adds chat tokens, whether the
    family trains on shardtune's per-document attention (trains_per_document), and whether it has the verified
    tensor-parallel plan (shardtune.parallel.tensor.family_plan; a dict: shardtune's Llama-style default)."""
    from shardtune.models import families  # the family rules load transformers' model classes: only when planning one

    shape = replace(
        ModelShape.from_config(config),
        per_document_attention=trains_per_document(config),
        plain_mask=isinstance(config, dict) or families.plain_causal(config),
        tensor_parallel_plan=isinstance(config, dict) or family_plan(config) is not None,
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


def lora_target_parameters(spec: ModelSpec) -> tuple[str, ...]:
    """The parameters LoRA adapts besides its target modules: --lora_target_parameters, and "experts" with
    --lora_target_experts, as the spec holds them."""
    words = [w.strip() for w in (spec.lora_target_parameters or "").split(",") if w.strip()]
    if spec.lora_target_experts and "experts" not in words:
        words.append("experts")
    return tuple(words)


def plan_inputs(
    cfg: RunConfig, launch: Launch, attn_implementation: str | None = None, loss_chunk_tokens: int | None = None
) -> PlanInputs:
    """The planner's inputs for a run's configuration and launch: the one place a run becomes PlanInputs (the
    fields of planning.inputs.RUN_FIELDS and lora_target_parameters; the others keep shardtune's defaults). The
    model's facts are read off the model the run builds (models.builder.model_facts, by `model_inputs`), never off
    the flags again; the flags give what is not the model's (the batch, the rows' length, the objective, the
    optimizer, the tensor-parallel size), and the launch FSDP's settings. FSDP or the plain module is
    `config.fsdp.fsdp_reason`'s rule.
    `attn_implementation` and `loss_chunk_tokens` (`shardtune plan`'s flags) override the spec's."""
    data, train = cfg.data, cfg.train
    spec = model_facts(cfg)
    generates = objective_spec(train.objective).data == "prompts"  # online RL: the run samples its completions
    fsdp = fsdp_reason(
        launch.world_size,
        launch.single_process,
        offload=launch.offload,
        full_mixed_precision=casts_every_weight(spec.use_peft_lora, spec.param_dtype),
    )
    return PlanInputs(
        world_size=launch.world_size,
        num_nodes=launch.num_nodes,
        sharding_strategy=launch.sharding_strategy,
        expandable_segments=launch.expandable_segments,
        offload=launch.offload,
        fsdp=fsdp is not None,
        **model_inputs(spec, drops_dropout=dropout_off(train.objective, train.disable_dropout)),
        attn_implementation=attn_implementation or spec.attn_impl,
        loss_chunk_tokens=spec.loss_chunk_size if loss_chunk_tokens is None else loss_chunk_tokens,
        replicate_base=replicates_base(cfg.model.frozen_base, spec.use_peft_lora, launch.world_size, launch.offload),
        tensor_parallel=train.tensor_parallel_size,
        batch_size=train.per_device_train_batch_size,
        rows_per_example=rows_per_example(train.objective),
        seq_len=rollout_row_length(data, train) if generates else data.max_length,
        optim=train.optim,
        grad_accum=train.gradient_accumulation_steps,
        activation_offloading=train.enable_activation_offloading,
        **(generation_inputs(train) if generates else {}),
    )


def model_inputs(spec: ModelSpec, *, drops_dropout: bool) -> dict[str, Any]:
    """PlanInputs' fields that are facts of the model a run builds, from its spec alone: the compute dtype, the
    quantized base, the adapter, checkpointing, packed rows, the context-parallel split, attention per document
    (compiled blocks take transformers' masked attention: training_module.CausalLMForTraining). `drops_dropout`:
    the objective turns the model's dropout off (objectives.loss.dropout_off)."""
    q = spec.quantization_config
    four_bit = q is not None and q.load_in_4bit
    compute = "float32" if spec.param_dtype is None else dtypes.name_of(spec.param_dtype)
    storage = dtypes.name_of(q.bnb_4bit_quant_storage) if four_bit else None
    return {
        "bf16": compute == "bfloat16",
        "fp16": compute == "float16",
        "use_4bit": four_bit,
        "use_8bit": q is not None and q.load_in_8bit,
        "nested_quant": four_bit and q.bnb_4bit_use_double_quant,
        # Under FSDP shardtune stores 4-bit weights in a floating dtype; uint8 is the non-FSDP default, planned as
        # the compute dtype.
        "quant_storage_dtype": storage if storage in dtypes.FLOATING else compute,
        "use_peft_lora": spec.use_peft_lora,
        "lora_r": spec.lora_r,
        "lora_target_modules": spec.lora_target_modules,
        "lora_target_parameters": lora_target_parameters(spec),
        "lora_dropout": 0.0 if drops_dropout else spec.lora_dropout,
        "use_dora": spec.use_dora,
        "modules_to_save": tuple(_split(spec.modules_to_save)),
        "gradient_checkpointing": spec.gradient_checkpointing,
        "packing": spec.packing,
        "context_parallel": spec.context_parallel,
        "per_document_attention": not spec.torch_compile,
    }


def generation_inputs(train: TrainArguments) -> dict[str, Any]:
    """PlanInputs' online-RL fields from the flags (plan_inputs); steps_per_generation is
    TrainArguments.generation_steps, as recipe.rl.rollout_settings reads it."""
    return {
        "rollout_engine": train.rollout_engine,
        "num_generations": train.num_generations,
        "steps_per_generation": train.generation_steps,
        "max_prompt_length": train.max_prompt_length,
        "max_completion_length": train.max_completion_length,
        "gather_for_generation": train.gather_for_generation,
    }


def rollout_row_length(data: DataArguments, train: TrainArguments) -> int:
    """An online-RL run's training rows: the longest prompt (--max_prompt_length, else planned at --max_length)
    and the longest completion."""
    prompt = train.max_prompt_length if train.max_prompt_length is not None else data.max_length
    return prompt + train.max_completion_length


def replicates_base(frozen_base: str, use_peft_lora: bool, world_size: int, offload: bool) -> bool:
    """Whether --frozen_base replicated applies: LoRA on several ranks without offload (validation refuses it with
    offload; one process holds the whole base either way). auto is planned sharded: `frozen_base_choice` decides
    it for a GPU."""
    return frozen_base == "replicated" and use_peft_lora and world_size > 1 and not offload


# --frozen_base auto replicates only where the plan fits this much under the GPU's memory: the planner's largest
# leave-one-out error on the published runs (12.9%, bench/plan_loo.py; docs/plan.md), rounded up. A run that auto
# made run out of memory would be worse than one that gathers its base.
AUTO_REPLICATE_MARGIN = 0.13


def frozen_base_choice(
    cfg: RunConfig, launch: Launch, gpu_bytes: int | None, shape: Any = _UNREAD
) -> tuple[str, str | None]:
    """--frozen_base as a run on `launch` applies it: "sharded" or "replicated", and the line saying why (None:
    nothing to say, as for full fine-tuning, which has no frozen base, or one process, which holds the whole base
    either way). auto plans the replicated run against `gpu_bytes`, one GPU's memory (None: no GPU), on `shape`
    where the caller has read it (`run_shape`; None: unreadable), else reading it here."""
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
    if (tp := cfg.train.tensor_parallel_size) > 1:  # parallel.setup replicates no frozen slice
        return "sharded", (
            f"Frozen base sharded (--frozen_base auto): with --tensor_parallel_size {tp} FSDP shards each rank's "
            f"frozen slices over its data-parallel ranks; {gathered}."
        )
    if launch.offload:
        return "sharded", "Frozen base sharded (--frozen_base auto): fsdp_offload_params keeps the shards in host RAM."
    if not dims.strategy(launch.sharding_strategy).sharded:
        return "sharded", None  # NO_SHARD: FSDP replicates everything already
    if gpu_bytes is None:
        return "sharded", (
            f"Frozen base sharded (--frozen_base auto): no GPU memory to plan a replicated base against; {gathered} "
            "(--frozen_base replicated holds it whole on every rank)."
        )
    need = _replicated_need(cfg, launch, run_shape(cfg) if shape is _UNREAD else shape)
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


def _replicated_need(cfg: RunConfig, launch: Launch, shape: ModelShape | None) -> int | None:
    """The planned bytes per GPU of this run with its frozen base replicated (None: the config cannot be read)."""
    if shape is None:
        return None
    return estimate_memory(shape, replace(plan_inputs(cfg, launch), replicate_base=True)).total


def run_shape(cfg: RunConfig) -> ModelShape | None:
    """The run's model as the planner reads it (its config.json, the rows the chat tokens add, the family's
    attention: plan_shape); None when the config cannot be read (loading the model reports it). The costly part of
    planning a run (a model class built on meta, the family's conformance check): read once per start-up."""
    try:
        config = load_model_config(cfg.model.model_name_or_path, cfg.model.trust_remote_code)
        return plan_shape(config, cfg.model.chat_template_format)
    except ConfigError:
        return None


@dataclass(frozen=True)
class RunFit:
    """What the planner says of a run about to start: where its frozen base lives ("sharded" or "replicated") and the
    line saying why, and the warning when the run as placed will not fit its GPU."""

    frozen_base: str = "sharded"
    why: str | None = None
    warning: str | None = None


def fit_run(cfg: RunConfig, launch: Launch, gpu_bytes: int | None) -> RunFit:
    """The planner's one pass for `shardtune train` at start-up on a GPU of `gpu_bytes` (None: no GPU, and nothing is
    planned): the model's shape read once (run_shape), the frozen base placed (frozen_base_choice), then the run as
    placed checked against the GPU (warn_if_too_small)."""
    if gpu_bytes is None:
        return RunFit(*frozen_base_choice(cfg, launch, None))
    shape = run_shape(cfg)
    placement, why = frozen_base_choice(cfg, launch, gpu_bytes, shape)
    warning = warn_if_too_small(cfg, gpu_bytes, launch, shape, replicated=placement == "replicated")
    return RunFit(placement, why, warning)


def warn_if_too_small(
    cfg: RunConfig, gpu_bytes: int, launch: Launch, shape: Any = _UNREAD, *, replicated: bool = False
) -> str | None:
    """A warning for `shardtune train` to print before loading when the planner's estimate exceeds `gpu_bytes`;
    `shape` as frozen_base_choice's, `replicated`: the frozen base as --frozen_base auto placed it."""
    shape = run_shape(cfg) if shape is _UNREAD else shape
    if shape is None:
        return None  # loading the model will report it
    inputs = plan_inputs(cfg, launch)
    if replicated:
        inputs = replace(inputs, replicate_base=True)
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
