"""Checks of a run's flags that need no files but the ones named (`validate`): every problem at once, each naming
its flag and the fix. The model's files are checked later, before loading, by shardtune.models.preflight; the rule for a
tied head in --modules_to_save (tied_head_saved_problem) lives here, checked against the model there and in modeling.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path

from shardtune.config.arguments import STEP_INTERVALS, DataArguments, RunConfig, TrainArguments
from shardtune.config.dtypes import canonical as dtype_canonical
from shardtune.config.errors import ConfigError
from shardtune.data.sources import ACCEPTED, is_hub_dataset
from shardtune.data.templates import CHAT_FORMATS
from shardtune.models.quant import quantization_problems
from shardtune.objectives.loss import OBJECTIVES
from shardtune.runtime.hub import is_hub_id
from shardtune.runtime.log import warn0
from shardtune.training import optimizers
from shardtune.training.trackers import missing_packages, parse_report_to

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainArguments)}


def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def validate(cfg: RunConfig, check_paths: bool = True) -> None:
    """Report every problem at once, each naming its flag and the fix."""
    p = _required_problems(cfg)
    p += _adapter_problems(cfg)
    p += _training_problems(cfg)
    p += _corpus_problems(cfg.data, cfg.train)
    p += _report_to_problems(cfg.train.report_to)
    p += _eval_harness_problems(cfg.train.eval_harness_tasks, cfg.train.eval_harness_include_path)
    p += _split_problems(cfg)
    p += _preference_problems(cfg)
    if cfg.model.adapter_path and not cfg.model.use_peft_lora:
        p.append("--adapter_path needs --use_peft_lora True.")
    p += _quantization_problems(cfg)
    p += _context_parallel_problems(cfg)
    if check_paths:
        p += _path_problems(cfg)
    if p:
        raise ConfigError(p)


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


def _required_problems(cfg: RunConfig) -> list[str]:
    """The model and the data, and flags that exclude each other."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p = []
    if not m.model_name_or_path:
        p.append("--model_name_or_path is required: a hub id or a local model folder.")
    if not d.dataset_name:
        p.append(f"--dataset_name is required: {ACCEPTED}.")
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
    """Batch sizes, lengths, numeric ranges, the length of the run and the optimizer (shardtune.training.optimizers)."""
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
    if t.optim not in optimizers.OPTIMIZERS:
        p.append(f"--optim {t.optim!r} is not supported; use {optimizers.names()}.")
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


def _quantization_problems(cfg: RunConfig) -> list[str]:
    m = cfg.model
    return quantization_problems(
        use_4bit=m.use_4bit_quantization,
        use_8bit=m.use_8bit_quantization,
        quant_storage_dtype=m.bnb_4bit_quant_storage_dtype,
        precision=cfg.precision,
        fsdp_enabled=cfg.fsdp.enabled,
    )


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


def _report_to_problems(report_to: str) -> list[str]:
    """--report_to: known tracker names, and their packages installed (checked here, before any loading)."""
    try:
        return missing_packages(parse_report_to(report_to))
    except ValueError as e:
        return [str(e)]


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
)
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


def _preference_problems(cfg: RunConfig) -> list[str]:
    d, t = cfg.data, cfg.train
    if t.objective not in OBJECTIVES:
        return [f"--objective {t.objective!r} is not one of {', '.join(OBJECTIVES)}."]
    p = []
    by_objective = {"dpo": ("loss_type",), "kto": ("desirable_weight", "undesirable_weight")}
    for objective, flags in by_objective.items():
        changed = [f"--{n}" for n in flags if getattr(t, n) != _DEFAULTS[n]]
        if changed and t.objective != objective:
            p.append(f"{', '.join(changed)} only apply to --objective {objective}; remove them or set it.")
    if t.objective not in ("dpo", "kto") and t.precompute_ref_log_probs:
        p.append(
            "--precompute_ref_log_probs only applies to --objective dpo or kto (the others need no reference); "
            "remove it."
        )
    if OBJECTIVES[t.objective].data == "rows":  # token rows, like SFT: the data flags all apply
        return p
    if t.beta <= 0:
        p.append(f"--beta must be > 0 (got {t.beta}).")
    if d.streaming:
        p.append(f"--streaming True is not supported with --objective {t.objective} yet; set --streaming False.")
    if d.completion_only_loss is False:
        p.append(
            f"--completion_only_loss False does not apply to --objective {t.objective} (only the completions count); "
            "remove it."
        )
    for flag in ("packing", "assistant_only_loss", "append_concat_token"):
        if getattr(d, flag):
            p.append(
                f"--{flag} does not apply to --objective {t.objective} (pairs are rows of their own and only the "
                f"completions count); set --{flag} False."
            )
    return p


def _path_problems(cfg: RunConfig) -> list[str]:
    p = []
    mp, dn = cfg.model.model_name_or_path, cfg.data.dataset_name
    if mp and not is_hub_id(mp) and not (Path(mp).expanduser() / "config.json").exists():
        p.append(f"--model_name_or_path {mp}: no config.json there; give a model folder or a hub id.")
    if dn and not is_hub_dataset(dn) and not Path(dn).expanduser().exists():
        p.append(f"--dataset_name {dn}: no such file or folder; give {ACCEPTED}.")
    ap = cfg.model.adapter_path
    if ap and not (Path(ap).expanduser() / "adapter_config.json").exists():
        p.append(f"--adapter_path {ap}: no adapter_config.json there.")
    return p


# ---------------------------------------------------------------- a tied head in --modules_to_save
# Checked against the model: from its meta skeleton before loading (models.preflight), and where the adapter is
# attached (shardtune.models.adapter), which knows every added row.
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
