"""The configuration's own checks of a run's flags (`flag_problems`): ranges, flags that exclude or need each other,
the files the flags name; each problem names its flag and the fix. A flag whose values a component defines (the
data formats, the objectives, the optimizers, the trackers, the 4-bit rules) is checked by that component, and
shardtune.recipe.run_config gathers every check, so that a run hears of every problem at once. The model's files are
checked later, before loading, by shardtune.models.preflight.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

from shardtune.config.arguments import FLAG_DEFAULTS, STEP_INTERVALS, DataArguments, RunConfig, TrainArguments
from shardtune.config.dtypes import canonical as dtype_canonical
from shardtune.runtime.hub import is_hub_id


def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def flag_problems(cfg: RunConfig, check_paths: bool = True) -> list[str]:
    """Every problem the configuration itself finds, each naming its flag and the fix; `check_paths`: also that
    the model and adapter folders the flags name exist."""
    p = _required_problems(cfg)
    p += _adapter_problems(cfg)
    p += _training_problems(cfg)
    p += _corpus_problems(cfg.data, cfg.train)
    p += _eval_harness_problems(cfg.train.eval_harness_tasks, cfg.train.eval_harness_include_path)
    p += _split_problems(cfg)
    if cfg.model.adapter_path and not cfg.model.use_peft_lora:
        p.append("--adapter_path needs --use_peft_lora True.")
    p += _context_parallel_problems(cfg)
    p += _tensor_parallel_problems(cfg)
    p += _activation_offloading_problems(cfg)
    p += _dependent_problems(cfg)
    if check_paths:
        p += _path_problems(cfg)
    return p


def _context_parallel_problems(cfg: RunConfig) -> list[str]:
    """What context parallelism (shardtune.parallel.split) does not run yet, each with the fix. The model-side
    checks (its attention, the router loss) are the builder's (shardtune.models.builder.check_context_parallel)."""
    t, cp = cfg.train, cfg.train.context_parallel_size
    if cp == 1:
        return []
    flag = f"--context_parallel_size {cp}"
    p = []
    if t.torch_compile:
        p.append(f"{flag} with --torch_compile True: compiled blocks take transformers' own attention, not the "
                 "context-parallel one; remove --torch_compile.")  # fmt: skip
    strategy = cfg.fsdp.sharding_strategy
    if strategy == "NO_SHARD":
        p.append(f"{flag} with fsdp_sharding_strategy {strategy}: context parallelism shards over its ranks; use "
                 "FULL_SHARD, SHARD_GRAD_OP or a HYBRID strategy.")  # fmt: skip
    return p


def _tensor_parallel_problems(cfg: RunConfig) -> list[str]:
    """What tensor parallelism (shardtune.parallel.tensor) does not run yet, each naming the flag and why. The
    model-side checks (the family's plan, heads and widths divisible) are the parallel setup's, from config.json
    before any weight is read (shardtune.parallel.tensor.check_model)."""
    m, t, tp = cfg.model, cfg.train, cfg.train.tensor_parallel_size
    if tp == 1:
        return []
    flag = f"--tensor_parallel_size {tp}"
    unsupported = [
        (m.use_4bit_quantization or m.use_8bit_quantization,
         "with a quantized base (QLoRA): the packed 4-/8-bit weights are not sliced yet; train in bf16"),
        (m.lora_target_experts or m.lora_target_parameters,
         "with expert or parameter LoRA targets: experts are not sliced yet"),
        (t.objective != "sft", f"with --objective {t.objective}: only sft is verified under tensor parallelism"),
        (t.torch_compile, "with --torch_compile True: compiled blocks are not verified with sliced layers"),
        (cfg.fsdp.offload_params, "with fsdp_offload_params: offloading sliced parameters is not verified"),
        (m.frozen_base == "replicated", "with --frozen_base replicated: the frozen slices are sharded by FSDP"),
        (cfg.fsdp.sharding_strategy == "NO_SHARD",
         "with fsdp_sharding_strategy NO_SHARD: use FULL_SHARD, SHARD_GRAD_OP or a HYBRID strategy"),
    ]  # fmt: skip
    return [f"{flag} {why}; set --tensor_parallel_size 1 or change it." for bad, why in unsupported if bad]


def _activation_offloading_problems(cfg: RunConfig) -> list[str]:
    """Where --enable_activation_offloading (torch's save_on_cpu around the training forward, training.trainer)
    cannot help or is not verified yet, each with why and the fix."""
    t = cfg.train
    if not t.enable_activation_offloading:
        return []
    flag = "--enable_activation_offloading True"
    if not cfg.activation_checkpointing:
        # torchtune refuses it too: without recomputation every tensor every op saves goes through the host.
        why = (
            "needs activation checkpointing: without it every tensor each block saves for backward, FSDP's "
            "gathered weights included, would be copied to host memory and back; add --gradient_checkpointing True "
            "(or fsdp_activation_checkpointing: true), or remove it"
        )
        return [f"{flag} {why}."]
    n, cp, tp = t.checkpoint_every_n_layers, t.context_parallel_size, t.tensor_parallel_size
    every = (
        f"with --checkpoint_every_n_layers {n}: the blocks not recomputed would copy every tensor they save to "
        "host memory, which is neither planned nor verified; use --checkpoint_every_n_layers 1"
    )
    compiled = (
        "with --torch_compile True: compiled blocks under saved-tensor hooks are not verified; use one of the two"
    )
    unverified = [
        (n > 1, every),
        (t.torch_compile, compiled),
        (cp > 1, f"with --context_parallel_size {cp}: not verified with split rows yet; use one of the two"),
        (tp > 1, f"with --tensor_parallel_size {tp}: not verified with sliced blocks yet; use one of the two"),
    ]
    return [f"{flag} {why}." for bad, why in unverified if bad]


def _required_problems(cfg: RunConfig) -> list[str]:
    """The model, and flags that exclude each other (the data is shardtune.data.sources.dataset_problems')."""
    m, t = cfg.model, cfg.train
    p = []
    if not m.model_name_or_path:
        p.append("--model_name_or_path is required: a hub id or a local model folder.")
    if m.use_4bit_quantization and m.use_8bit_quantization:
        p.append("--use_4bit_quantization and --use_8bit_quantization are both set; choose one.")
    if t.bf16 and t.fp16:
        p.append("--bf16 and --fp16 are both set; choose one.")
    mp = cfg.fsdp.mixed_precision
    if (t.bf16 and mp == "fp16") or (t.fp16 and mp == "bf16"):
        # resolve_precision would let bf16 win: a setting silently ignored.
        flag = "--bf16" if t.bf16 else "--fp16"
        p.append(
            f"{flag} True and the accelerate config's mixed_precision: {mp} disagree; set one of them "
            "(or make them the same)."
        )
    p += _precision_override_problems(cfg)
    if t.gradient_checkpointing_kwargs is not None and not cfg.activation_checkpointing:
        p.append(
            "--gradient_checkpointing_kwargs applies to activation checkpointing, which is off: add "
            "--gradient_checkpointing True (or fsdp_activation_checkpointing: true), or remove it."
        )
    return p


def _precision_override_problems(cfg: RunConfig) -> list[str]:
    """A flag that turns a precision off while the accelerate config's mixed_precision turns it on: the run would
    train in the YAML's precision, against the flag."""
    m, t, mp = cfg.model, cfg.train, cfg.fsdp.mixed_precision
    if mp == "no":
        return []
    said = [f"--{mp} False"] if mp in ("bf16", "fp16") and mp in cfg.explicit and not getattr(t, mp) else []
    if m.torch_dtype is not None and dtype_canonical(m.torch_dtype) == "float32":
        said.append(f"--torch_dtype {m.torch_dtype}")
    return [
        f"{flag} asks for float32, but the accelerate config's mixed_precision: {mp} trains in {mp}; set "
        f"mixed_precision: 'no' in the config, or remove {flag}."
        for flag in said
    ]


def _adapter_problems(cfg: RunConfig) -> list[str]:
    """The LoRA flags with --use_peft_lora; without it, a quantized base or adapter flags given for nothing."""
    m = cfg.model
    p = []
    if m.use_peft_lora:
        if m.lora_r <= 0:
            p.append(f"--lora_r must be > 0 (got {m.lora_r}).")
        if m.lora_alpha <= 0:
            p.append(f"--lora_alpha must be > 0 (got {m.lora_alpha}).")
        if not 0 <= m.lora_dropout < 1:
            p.append(f"--lora_dropout must be in [0, 1) (got {m.lora_dropout}).")
        if not _split(m.lora_target_modules):
            p.append("--lora_target_modules is empty; give module names or all-linear.")
        p += _parameter_target_problems(m)
        if m.adapter_path and (shaped := [f"--{n}" for n in NEW_ADAPTER_FLAGS if n in cfg.explicit]):
            p.append(
                f"{', '.join(shaped)} shape a new adapter, but --adapter_path {m.adapter_path} continues an adapter "
                "whose adapter_config.json decides them (they would be ignored): remove them."
            )
        if m.frozen_base == "replicated" and cfg.fsdp.offload_params:
            p.append(
                "--frozen_base replicated holds the frozen base whole on every GPU, while fsdp_offload_params keeps "
                "the sharded weights in host RAM: choose one (--frozen_base sharded, or fsdp_offload_params: false)."
            )
    elif m.use_4bit_quantization or m.use_8bit_quantization:
        p.append("a quantized base cannot be fully fine-tuned: add --use_peft_lora True.")
    else:
        ignored = [f"--{n}" for n in ADAPTER_FLAGS if n in cfg.explicit]
        if ignored:
            p.append(
                f"{', '.join(ignored)} set an adapter, but --use_peft_lora is False (full fine-tuning, where they "
                "would be ignored): add --use_peft_lora True, or remove them."
            )
    return p


def _training_problems(cfg: RunConfig) -> list[str]:
    """Batch sizes, lengths, numeric ranges and the length of the run."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p = []
    if m.use_unsloth:
        p.append("--use_unsloth is not supported by shardtune; remove it (FSDP2 is used instead).")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(t, name) < 1:
            p.append(f"--{name} must be >= 1 (got {getattr(t, name)}).")
    if t.checkpoint_every_n_layers < 1:
        p.append(f"--checkpoint_every_n_layers must be >= 1 (got {t.checkpoint_every_n_layers}); 1 checkpoints all.")
    if d.max_length < 8:
        p.append(f"--max_length/--max_seq_len must be >= 8 (got {d.max_length}).")
    p += _range_problems(cfg)
    p += _interval_problems(t)
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        p.append("set --num_train_epochs > 0 or --max_steps > 0.")
    if not 0 <= t.warmup_ratio < 1:
        p.append(f"--warmup_ratio must be in [0, 1) (got {t.warmup_ratio}).")
    return p


def _interval_problems(t: TrainArguments) -> list[str]:
    """--logging_steps/--eval_steps/--save_steps: a whole number of steps, or below 1 a ratio of the total steps (as
    transformers' TrainingArguments); 2.5 is neither."""
    p = []
    for name in STEP_INTERVALS:
        v = getattr(t, name)
        if v is not None and math.isfinite(v) and v >= 1 and not float(v).is_integer():
            p.append(
                f"--{name} {v}: from 1 up it is a number of steps and must be a whole number (e.g. {math.ceil(v)}); "
                "below 1 it is a ratio of the total steps (e.g. 0.1 for every tenth)."
            )
    return p


def _split_problems(cfg: RunConfig) -> list[str]:
    """--log_level, and --splits with what --eval_strategy needs of it."""
    d, t = cfg.data, cfg.train
    p = []
    if t.log_level not in ("debug", "info", "warning", "error", "critical", "passive"):
        p.append(f"--log_level {t.log_level!r}: use debug, info, warning, error, critical or passive.")
    if len(_split(d.splits)) not in (1, 2):
        p.append(
            f"--splits {d.splits!r}: give the training split and optionally the evaluation split, e.g. train,test."
        )
    if t.eval_strategy != "no" and len(_split(d.splits)) < 2:
        p.append(f"--eval_strategy {t.eval_strategy} needs an evaluation split in --splits (e.g. train,test).")
    return p


def _corpus_problems(d: DataArguments, t: TrainArguments) -> list[str]:
    """--streaming, --packing_window, --dataset_num_proc."""
    p = []
    if d.packing_window < 1:
        p.append(f"--packing_window must be >= 1 (got {d.packing_window}).")
    if d.dataset_num_proc is not None and d.dataset_num_proc < 1:
        p.append(f"--dataset_num_proc must be >= 1 (got {d.dataset_num_proc}); leave it unset for one per CPU.")
    if not d.streaming:
        return p
    if t.max_steps <= 0:
        p.append("--streaming True needs --max_steps > 0: the length of an epoch is unknown until the stream ends.")
    epoch_flags = [f for f in ("save_strategy", "eval_strategy", "logging_strategy") if getattr(t, f) == "epoch"]
    p += [
        f"--{f} epoch cannot be used with --streaming True (an epoch's end is not known ahead); use steps."
        for f in epoch_flags
    ]
    return p


def _eval_harness_problems(tasks: str | None, include_path: str | None) -> list[str]:
    """--eval_harness_*: lm_eval installed and the task folder there (task names are checked in the preflight)."""

    if not tasks:
        return ["--eval_harness_include_path needs --eval_harness_tasks."] if include_path else []
    p = []
    if importlib.util.find_spec("lm_eval") is None:
        p.append(
            "--eval_harness_tasks needs the `lm_eval` package (lm-evaluation-harness), which is not installed: "
            "pip install 'shardtune[eval]'"
        )
    if include_path and not Path(include_path).expanduser().is_dir():
        p.append(f"--eval_harness_include_path {include_path}: no such folder.")
    return p


def _parameter_target_problems(m) -> list[str]:
    """LoRA on parameters (expert tensors, routers) is PEFT's weight-delta LoRA, which has no DoRA form. (On 4-bit
    experts shardtune.models.quant_experts applies it beside the 4-bit matmul; 8-bit bases are refused on their own.)"""
    flags = [f for f, on in (("--lora_target_parameters", m.lora_target_parameters),
                             ("--lora_target_experts True", m.lora_target_experts)) if on]  # fmt: skip
    if not flags:
        return []
    p = []
    if m.use_dora:
        p.append(
            f"{' and '.join(flags)} with --use_dora: PEFT has no DoRA form for a parameter's LoRA (experts, "
            "routers); use plain LoRA there (--use_dora False), or DoRA on the linear layers only."
        )
    return p


# Flags that only mean something for an adapter; refused when given explicitly with full fine-tuning.
ADAPTER_FLAGS = (
    "frozen_base",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_target_experts",
    "use_dora",
    "dora_dropout",
    "modules_to_save",
    "adapter_name",
    "merge_adapter",  # recipe.output merges an adapter; a full fine-tune's model is written whole already
)
# Flags that shape a new adapter; with --adapter_path the adapter's own adapter_config.json decides them
# (models.adapter loads it with PeftModel.from_pretrained): refused when given explicitly.
NEW_ADAPTER_FLAGS = (
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_target_experts",
    "use_dora",
    "modules_to_save",
)
# Flags that mean something only while another setting is on: (part, flag, whether that setting is on, the flag
# that turns it on). Set away from its default while that setting is off, such a flag would change nothing
# (transformers and the reference script ignore it silently): refused with the fix.
_DEPENDENT: tuple[tuple[str, str, Callable[[RunConfig], bool], str], ...] = (
    ("model", "dora_dropout", lambda c: c.model.use_dora, "--use_dora True"),
    *(
        ("model", name, lambda c: c.model.use_4bit_quantization, "--use_4bit_quantization True")
        for name in (
            "use_nested_quant",
            "bnb_4bit_compute_dtype",
            "bnb_4bit_quant_storage_dtype",
            "bnb_4bit_quant_type",
        )
    ),
    *(
        (part, name, lambda c: c.activation_checkpointing, "--gradient_checkpointing True")
        for part, name in (("model", "use_reentrant"), ("train", "checkpoint_every_n_layers"))
    ),
    ("data", "packing_window", lambda c: c.data.streaming, "--streaming True"),
    ("train", "logging_steps", lambda c: c.train.logging_strategy == "steps", "--logging_strategy steps"),
    ("train", "eval_steps", lambda c: c.train.eval_strategy == "steps", "--eval_strategy steps"),
    ("train", "save_steps", lambda c: c.train.save_strategy == "steps", "--save_strategy steps"),
    ("train", "save_total_limit", lambda c: c.train.save_strategy != "no", "--save_strategy steps (or epoch)"),
    # The scheduler reads the ratio only when --warmup_steps is 0 (recipe.build's warmup).
    ("train", "warmup_ratio", lambda c: c.train.warmup_steps == 0, "--warmup_steps 0 (a step count wins over it)"),
    ("data", "max_eval_samples", lambda c: len(_split(c.data.splits)) > 1, "an evaluation split in --splits"),
    # Read only by the upload (runtime.hub.preflight returns at once without --push_to_hub).
    *(
        ("train", name, lambda c: c.train.push_to_hub, "--push_to_hub True")
        for name in ("hub_model_id", "hub_private_repo", "hub_strategy", "hub_token")
    ),
)


def _dependent_problems(cfg: RunConfig) -> list[str]:
    """A flag of _DEPENDENT set while the setting it belongs to is off, each naming what turns that on (an adapter's
    flags without an adapter are _adapter_problems')."""
    p = []
    for part, name, on, switch in _DEPENDENT:
        value = getattr(getattr(cfg, part), name)
        if value == FLAG_DEFAULTS[name] or on(cfg) or (name in ADAPTER_FLAGS and not cfg.model.use_peft_lora):
            continue
        shown = int(value) if isinstance(value, float) and value.is_integer() else value
        shown = "<redacted>" if name == "hub_token" else shown  # a secret is never printed
        p.append(f"--{name} {shown} only applies with {switch}: add it, or remove --{name}.")
    return p


# (flag, lowest, highest, lowest allowed itself, highest allowed itself); None: unbounded on that side.
_RANGES = (
    ("train", "desirable_weight", 0, None, False, False),
    ("train", "undesirable_weight", 0, None, False, False),
    ("train", "router_aux_loss_coef", 0, None, True, False),
    ("train", "learning_rate", 0, None, False, True),
    ("train", "weight_decay", 0, None, True, True),
    ("train", "adam_beta1", 0, 1, True, False),
    ("train", "adam_beta2", 0, 1, True, False),
    ("train", "adam_epsilon", 0, None, False, True),
    ("train", "max_grad_norm", 0, None, True, True),
    ("train", "warmup_steps", 0, None, True, True),
    ("train", "logging_steps", 0, None, False, True),
    ("train", "eval_steps", 0, None, False, True),
    ("train", "save_steps", 0, None, False, True),
    ("train", "save_total_limit", 1, None, True, True),
    ("train", "max_nonfinite_steps", 0, None, True, True),
    ("train", "ddp_timeout", 0, None, False, True),
    ("train", "seed", 0, 2**32 - 1, True, True),  # numpy's seed range
    ("train", "dataloader_num_workers", 0, None, True, True),
    ("data", "max_train_samples", 1, None, True, True),
    ("data", "max_eval_samples", 1, None, True, True),
)


def _range_problems(cfg: RunConfig) -> list[str]:
    """Numbers outside the range where they mean anything, each with the range (math.isfinite: nan passes < and >)."""

    out = []
    for part, name, lo, hi, lo_ok, hi_ok in _RANGES:
        v = getattr(getattr(cfg, part), name)
        if v is None:
            continue
        bad = (
            not math.isfinite(v)
            or (v < lo or (v == lo and not lo_ok))
            or hi is not None
            and (v > hi or v == hi and not hi_ok)
        )
        if bad:
            low = f"{'>=' if lo_ok else '>'} {lo}"
            rng = low if hi is None else f"in {'[' if lo_ok else '('}{lo}, {hi}{']' if hi_ok else ')'}"
            out.append(f"--{name} must be {rng} (got {v}).")
    return out


def _path_problems(cfg: RunConfig) -> list[str]:
    p = []
    mp = cfg.model.model_name_or_path
    if mp and not is_hub_id(mp) and not (Path(mp).expanduser() / "config.json").exists():
        p.append(f"--model_name_or_path {mp}: no config.json there; give a model folder or a hub id.")
    ap = cfg.model.adapter_path
    if ap and not (Path(ap).expanduser() / "adapter_config.json").exists():
        p.append(f"--adapter_path {ap}: no adapter_config.json there.")
    return p
