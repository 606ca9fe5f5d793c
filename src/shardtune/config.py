"""Typed run configuration: command-line flags (named as in the reference training script), a single
.json/.yaml file, and the FSDP settings that `accelerate launch` or `shardtune launch` pass through the
environment. `load_run_config` returns one validated `RunConfig` and reports every problem at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from shardtune.precision import Precision, resolve_precision


def _f(default: Any, help: str, aliases: list[str] | None = None, choices: list[str] | None = None):
    meta: dict[str, Any] = {"help": help}
    if aliases:
        meta["aliases"] = aliases
    if choices:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = _f(None, "Base model: a hub id or a local folder with config.json and weights.")
    tokenizer_name_or_path: str | None = _f(None, "Tokenizer to use if not the model's own.")
    chat_template_format: str = _f(
        "none",
        "chatml or zephyr: add that format's special tokens and template (embeddings resized to a multiple "
        "of 8, new rows trained and saved with the adapter); auto: the tokenizer's own template; none: train on "
        "--dataset_text_field as plain text.",
        choices=["chatml", "zephyr", "auto", "none"],
    )
    use_peft_lora: bool = _f(False, "Train a LoRA adapter (False: full fine-tuning of all weights).")
    lora_r: int = _f(64, "LoRA rank.")
    lora_alpha: float = _f(16, "LoRA alpha (scaling is alpha / r).")
    lora_dropout: float = _f(0.1, "Dropout on the LoRA input.")
    lora_target_modules: str = _f(
        "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj",
        "Comma-separated module names to adapt, or all-linear for every linear layer but the output head.",
    )
    use_dora: bool = _f(False, "Weight-decomposed LoRA (DoRA).")
    dora_dropout: str = _f(
        "lora_path",
        "Where --lora_dropout acts in DoRA layers. lora_path: on the low-rank path's input only, the magnitude "
        "scaling the undropped base output (as torchtune's DoRALinear); no extra work. peft: also on the input of "
        "the base product that the magnitude scales (peft's definition), one more product with the frozen weight "
        "per layer. The same without dropout and at inference.",
        choices=["lora_path", "peft"],
    )
    modules_to_save: str | None = _f(
        None, "Comma-separated modules trained in full and saved with the adapter, e.g. embed_tokens,lm_head."
    )
    adapter_name: str = _f("default", "Name of the adapter being trained.")
    adapter_path: str | None = _f(None, "Continue training an existing PEFT adapter folder.")
    use_nested_quant: bool = _f(False, "Double quantization of the 4-bit quantization constants.")
    bnb_4bit_compute_dtype: str = _f("float16", "Compute dtype of 4-bit layers.")
    bnb_4bit_quant_storage_dtype: str = _f(
        "uint8",
        "Storage dtype of packed 4-bit weights; under FSDP it must "
        "equal the parameter dtype (bfloat16 with --bf16 True).",
    )
    bnb_4bit_quant_type: str = _f("nf4", "4-bit quantization type.", choices=["nf4", "fp4"])
    use_flash_attn: bool = _f(False, "Use flash_attention_2 where installed on CUDA, otherwise SDPA.")
    use_8bit_quantization: bool = _f(
        False, "Refused: 8-bit bitsandbytes layers cannot be sharded by FSDP2; use --use_4bit_quantization (QLoRA)."
    )
    use_4bit_quantization: bool = _f(False, "Load the frozen base in 4-bit (bitsandbytes, QLoRA).")
    use_reentrant: bool = _f(False, "Reentrant activation checkpointing.")
    use_unsloth: bool = _f(False, "Accepted for compatibility with the reference script; not supported.")
    trust_remote_code: bool = _f(False, "Run model code from the hub repository (off by default).")


@dataclass
class DataArguments:
    dataset_name: str | None = _f(
        None,
        "Hub dataset id, a local save_to_disk folder (a DatasetDict or one folder "
        "per split), a folder of data files, or a .jsonl/.json/.parquet/.csv file.",
    )
    splits: str = _f("train,test", "Comma-separated splits: the first is trained on, the second evaluated.")
    dataset_text_field: str = _f("text", "Column with the text when rows have no `messages` column.")
    max_length: int = _f(2048, "Tokens per training row.", aliases=["--max_seq_len", "--max_seq_length"])
    packing: bool = _f(False, "Pack several documents per row; documents never attend to each other.")
    append_concat_token: bool = _f(False, "Append EOS after each document before packing.")
    add_special_tokens: bool = _f(False, "Let the tokenizer add its special tokens (BOS) to each document.")
    assistant_only_loss: bool = _f(False, "Compute the loss on assistant turns only.")
    drop_long_samples: bool = _f(False, "Drop documents longer than max_length instead of truncating them.")
    dataset_cache_dir: str | None = _f(
        None, "Where tokenized data is cached (default: <output_dir>/../.shardtune_cache)."
    )
    max_train_samples: int | None = _f(None, "Use only the first N training rows.")
    max_eval_samples: int | None = _f(None, "Use only the first N evaluation rows.")
    # Corpora larger than memory (docs/data.md).
    streaming: bool = _f(
        False,
        "Read the training split as a stream and pack it --packing_window rows at a time while training; needs "
        "--max_steps. The evaluation split is still prepared into the cache.",
    )
    packing_window: int = _f(
        10_000, "With --streaming: rows read, tokenized and packed best-fit together (more: fuller rows, more memory)."
    )
    dataset_num_proc: int | None = _f(
        None, "Processes that tokenize a split into the cache (default: one per CPU, at most 16)."
    )


@dataclass
class TrainArguments:
    output_dir: str = _f("output", "Where the adapter or model, metrics and checkpoints are written.")
    seed: int = _f(42, "Random seed.")
    num_train_epochs: float = _f(1.0, "Epochs to train.")
    max_steps: int = _f(-1, "Optimizer steps to train; overrides --num_train_epochs when > 0.")
    per_device_train_batch_size: int = _f(8, "Rows per process per micro-batch.")
    per_device_eval_batch_size: int = _f(8, "Rows per process per evaluation batch.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.")
    learning_rate: float = _f(5e-5, "Peak learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm (across shards) to this; 0 disables.")
    lr_scheduler_type: str = _f("linear", "Any transformers scheduler: linear, cosine, constant, ...")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps (used when --warmup_steps is 0).")
    optim: str = _f("adamw_torch", "adamw_torch, adamw_torch_fused, adamw_8bit or paged_adamw_8bit.")
    bf16: bool = _f(False, "bf16 weights and compute (the frozen base is held in bf16).")
    fp16: bool = _f(False, "fp16 compute.")
    gradient_checkpointing: bool = _f(False, "Recompute each decoder block's activations in backward.")
    checkpoint_every_n_layers: int = _f(
        1,
        "With --gradient_checkpointing (or fsdp_activation_checkpointing): recompute only every N-th decoder "
        "block; the others keep their activations. Faster, and the memory grows with the blocks not recomputed.",
    )
    torch_compile: bool = _f(False, "Compile each decoder block with torch.compile.")
    logging_steps: float = _f(10, "Log every N optimizer steps.")
    logging_strategy: str = _f("steps", "steps, epoch or no.", choices=["steps", "epoch", "no"])
    log_level: str = _f("passive", "debug, info, warning, error, critical or passive (= info).")
    eval_strategy: str = _f(
        "no", "no, steps or epoch.", aliases=["--evaluation_strategy"], choices=["no", "steps", "epoch"]
    )
    eval_steps: float | None = _f(None, "Evaluate every N steps (default: --logging_steps).")
    save_strategy: str = _f("steps", "no, steps or epoch.", choices=["no", "steps", "epoch"])
    save_steps: float = _f(500, "Save a checkpoint every N steps.")
    save_total_limit: int | None = _f(None, "Keep at most N checkpoints.")
    resume_from_checkpoint: str | None = _f(None, "A checkpoint folder, or `latest`.")
    push_to_hub: bool = _f(False, "Upload the result to the Hugging Face Hub.")
    hub_model_id: str | None = _f(None, "Hub repository (default: the output_dir's name).")
    hub_private_repo: bool | None = _f(None, "Create the hub repository as private.")
    hub_strategy: str = _f(
        "every_save",
        "end, every_save, checkpoint or all_checkpoints.",
        choices=["end", "every_save", "checkpoint", "all_checkpoints"],
    )
    hub_token: str | None = _f(None, "Hub token (default: the logged-in token).")
    report_to: str = _f(
        "none",
        "Experiment trackers, as transformers: none, all (every installed one), or a comma list of tensorboard, "
        "wandb, mlflow. W&B and MLflow read their usual environment (WANDB_PROJECT, WANDB_MODE, "
        "MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...); see docs/monitoring.md.",
    )
    merge_adapter: bool = _f(False, "Also write the base model with the adapter merged into output_dir/merged.")
    eval_harness_tasks: str | None = _f(
        None,
        "After training, run these lm-evaluation-harness tasks (comma-separated) on the result, as `shardtune eval` "
        "does: results in output_dir/eval_results.json/.md and the model card (docs/eval.md).",
    )
    eval_harness_include_path: str | None = _f(None, "A folder of local lm_eval task YAMLs for --eval_harness_tasks.")
    max_nonfinite_steps: int = _f(3, "Stop after this many skipped steps with a non-finite loss or gradient norm.")
    run_name: str | None = _f(None, "A name for the run in logs.")
    ddp_timeout: int = _f(
        1800,
        "Seconds a collective waits for the other ranks before failing; lower it so that a "
        "hung or lost rank stops the run sooner.",
    )
    # Preference tuning: what is minimised, with TRL's DPOConfig/CPOConfig names for the knobs (docs/preference.md).
    objective: str = _f(
        "sft",
        "sft: cross-entropy on the text; dpo, simpo, orpo: preference tuning on prompt/chosen/rejected pairs; "
        "kto: on unpaired prompt/completion/label rows.",
        choices=["sft", "dpo", "simpo", "orpo", "kto"],
    )
    beta: float = _f(0.1, "Preference objectives: DPO's KL strength (IPO's tau), SimPO's, ORPO's and KTO's beta.")
    loss_type: str = _f("sigmoid", "--objective dpo: sigmoid (DPO) or ipo.", choices=["sigmoid", "ipo"])
    simpo_gamma: float = _f(0.5, "--objective simpo: the target reward margin.")
    desirable_weight: float = _f(1.0, "--objective kto: the weight of the desirable examples' losses (TRL's name).")
    undesirable_weight: float = _f(1.0, "--objective kto: the weight of the undesirable examples' losses.")
    precompute_ref_log_probs: bool = _f(
        False,
        "--objective dpo or kto with an adapter: compute the reference log-probs once before training (stored with the "
        "data cache) instead of a forward with the adapter disabled every step. Always on for full fine-tuning "
        "and with --adapter_path.",
    )
    disable_dropout: bool = _f(True, "Preference objectives: turn dropout off in the model, as TRL does.")
    # Accepted so that command lines written for transformers' Trainer keep working.
    overwrite_output_dir: bool = _f(
        False,
        "Train into an --output_dir that holds another run: its checkpoints, metrics.jsonl and summary are removed "
        "first (without it such a folder is refused unless the run resumes).",
    )
    dataloader_num_workers: int = _f(0, "Accepted for compatibility; rows are pre-tokenized and packed.")
    remove_unused_columns: bool = _f(True, "Accepted for compatibility.")
    do_train: bool = _f(True, "Accepted for compatibility.")
    do_eval: bool = _f(False, "Accepted for compatibility.")


@dataclass
class FSDPSettings:
    """What accelerate's YAML (fsdp_config) says, read from the FSDP_*/ACCELERATE_* environment or the file."""

    enabled: bool = False
    sharding_strategy: str = "FULL_SHARD"
    offload_params: bool = False
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    state_dict_type: str = "SHARDED_STATE_DICT"
    backward_prefetch: str = "BACKWARD_PRE"
    forward_prefetch: bool = False
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    transformer_cls_to_wrap: str | None = None
    use_orig_params: bool | None = None
    activation_checkpointing: bool = False
    reshard_after_forward: bool | None = None
    mixed_precision: str = "no"


@dataclass
class RunConfig:
    model: ModelArguments
    data: DataArguments
    train: TrainArguments
    fsdp: FSDPSettings

    # Flags given on the command line or keys of the run file (canonical names), as opposed to defaults.
    explicit: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {k: dataclasses.asdict(getattr(self, k)) for k in ("model", "data", "train", "fsdp")}

    @property
    def precision(self) -> Precision:
        """Compute, storage and export dtypes: --bf16/--fp16 or the YAML's mixed_precision, decided here only."""
        t = self.train
        return resolve_precision(
            bf16=t.bf16, fp16=t.fp16, mixed_precision=self.fsdp.mixed_precision, peft=self.model.use_peft_lora
        )


ARG_CLASSES = (ModelArguments, DataArguments, TrainArguments)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainArguments)}


def _aliases() -> dict[str, str]:
    out = {}
    for cls in ARG_CLASSES:
        for f in dataclasses.fields(cls):
            for a in f.metadata.get("aliases", []):
                out[a.lstrip("-")] = f.name
    return out


def known_flags(extra: tuple = ()) -> list[str]:
    names = [f.name for cls in (*ARG_CLASSES, *extra) for f in dataclasses.fields(cls)]
    return names + list(_aliases())


class ConfigError(ValueError):
    """A user's configuration mistake; the message lists every problem with the flag and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("Invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def _unknown_flag_problems(remaining: list[str], extra: tuple = ()) -> list[str]:
    known = known_flags(extra)
    problems = []
    for i, tok in enumerate(remaining):
        if not tok.startswith("--"):
            if i == 0 or not remaining[i - 1].startswith("--"):
                problems.append(f"unexpected argument {tok!r}")
            continue
        name = tok[2:].split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean --{close[0]}?" if close else ""
        problems.append(f"unknown flag --{name}{hint}")
    return problems


_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")
# Fields that hold a comma-separated list: a run file may give them as a YAML/JSON list.
_LIST_FIELDS = ("lora_target_modules", "modules_to_save", "splits")


def _field_types(classes: tuple) -> dict[str, set[str]]:
    """Each field's type names, e.g. {"max_train_samples": {"int", "None"}}."""
    import typing

    out = {}
    for cls in classes:
        for name, hint in typing.get_type_hints(cls).items():
            out[name] = {"None" if a is type(None) else a.__name__ for a in typing.get_args(hint) or (hint,)}
    return out


def _coerce(key: str, value: Any, types: set[str]) -> tuple[Any, str | None]:
    """A run file's value as its field's type, or a problem naming the key. Strings are read as the command
    line reads them (`"false"` is false, `"1e-4"` a float: YAML reads 1e-4 without a dot as a string); anything
    else of the wrong type is refused instead of reaching the parser (a TypeError) or being read as true."""
    if value is None:
        return value, None if "None" in types else f"{key}: null is not allowed; give a value or remove the key."
    if "bool" in types:
        if isinstance(value, bool):
            return value, None
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE, None
        return value, f"{key}: {value!r} is not a boolean; write true or false."
    for name, cast in (("int", int), ("float", float)):
        if name in types:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                return value, f"{key}: {value!r} is not a number; write e.g. {key}: {cast(1)}."
            try:
                number = cast(value) if isinstance(value, str) or name == "float" else value
            except ValueError:
                return value, f"{key}: {value!r} is not {'an integer' if name == 'int' else 'a number'}."
            if name == "int" and isinstance(value, float):
                return value, f"{key}: {value!r} is not an integer; write e.g. {key}: {int(value)}."
            return number, None
    if key in _LIST_FIELDS and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value), None
    if not isinstance(value, str):
        return value, f"{key}: {value!r} is not a string; quote it."
    return value, None


def _read_file(path: str) -> Any:
    import json

    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {path} does not exist"])
    try:
        return json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (ValueError, yaml.YAMLError) as e:
        first = " ".join(str(e).split())[:200]
        raise ConfigError([f"config file {path} cannot be parsed ({first}); fix its syntax."]) from None


def _parse_file(parser: HfArgumentParser, path: str, extra: tuple) -> tuple:
    data = _read_file(path)
    if not isinstance(data, dict):
        raise ConfigError([f"config file {path} must hold a mapping of flag names to values"])
    aliases = _aliases()
    data = {aliases.get(k, k): v for k, v in data.items()}
    unknown = [k for k in data if k not in known_flags(extra)]
    if unknown:
        raise ConfigError(
            [
                p.replace("unknown flag", f"unknown key in {path}:")
                for p in _unknown_flag_problems([f"--{k}" for k in unknown], extra)
            ]
        )
    types, problems = _field_types((*ARG_CLASSES, *extra)), []
    for key in list(data):
        data[key], problem = _coerce(key, data[key], types[key])
        if problem:
            problems.append(f"{path}: {problem}")
    if problems:
        raise ConfigError(problems)
    return parser.parse_dict(data)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--learning_rate -1e-4` → `--learning_rate=-1e-4`: argparse takes a value starting with "-" for a flag
    unless it looks like a plain negative number (-1e-4 does not), and stops with "expected one argument"; joined,
    the value reaches validation, which names the flag and the allowed range."""
    out: list[str] = []
    for tok in argv:
        prev = out[-1] if out else ""
        if tok.startswith("-") and _is_number(tok) and prev.startswith("--") and "=" not in prev:
            out[-1] = f"{prev}={tok}"
        else:
            out.append(tok)
    return out


def explicit_flags(argv: list[str]) -> frozenset[str]:
    """Canonical names of the flags that argv (or its run file) gives, as opposed to the defaults."""
    aliases = _aliases()
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        data = _read_file(argv[0])
        names = list(data) if isinstance(data, dict) else []
    else:
        names = [tok[2:].split("=", 1)[0] for tok in argv if tok.startswith("--")]
    return frozenset(aliases.get(n, n) for n in names)


def parse_args(argv: list[str] | None = None, extra: tuple = (), prog: str = "shardtune train") -> tuple:
    """Parse flags (or a single .json/.yaml file) into (ModelArguments, DataArguments, TrainArguments, *extra)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((*ARG_CLASSES, *extra), prog=prog, allow_abbrev=False)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        return _parse_file(parser, argv[0], extra)
    *parsed, remaining = parser.parse_args_into_dataclasses(
        args=_join_negative_values(argv), return_remaining_strings=True
    )
    if remaining:
        raise ConfigError(_unknown_flag_problems(remaining, extra))
    return tuple(parsed)


def load_run_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> RunConfig:
    """Flags + environment → validated RunConfig (raises ConfigError listing every problem)."""
    from shardtune.launcher import fsdp_settings_from_env

    argv = list(sys.argv[1:] if argv is None else argv)
    model, data, train = parse_args(argv)
    fsdp = fsdp_settings_from_env(os.environ if env is None else env)
    cfg = RunConfig(model, data, train, fsdp, explicit=explicit_flags(argv))
    validate(cfg)
    return cfg


def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def validate(cfg: RunConfig, check_paths: bool = True) -> None:
    """Report every problem at once, each naming its flag and the fix."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p: list[str] = []
    if not m.model_name_or_path:
        p.append("--model_name_or_path is required: a hub id or a local model folder.")
    if not d.dataset_name:
        p.append("--dataset_name is required: a hub id, a save_to_disk folder or a .jsonl/.json/.parquet/.csv file.")
    if m.use_4bit_quantization and m.use_8bit_quantization:
        p.append("--use_4bit_quantization and --use_8bit_quantization are both set; choose one.")
    if t.bf16 and t.fp16:
        p.append("--bf16 and --fp16 are both set; choose one.")
    if m.use_peft_lora:
        if m.lora_r <= 0:
            p.append(f"--lora_r must be > 0 (got {m.lora_r}).")
        if m.lora_alpha <= 0:
            p.append(f"--lora_alpha must be > 0 (got {m.lora_alpha}).")
        if not 0 <= m.lora_dropout < 1:
            p.append(f"--lora_dropout must be in [0, 1) (got {m.lora_dropout}).")
        if not _split(m.lora_target_modules):
            p.append("--lora_target_modules is empty; give module names or all-linear.")
    elif m.use_4bit_quantization or m.use_8bit_quantization:
        p.append("a quantized base cannot be fully fine-tuned: add --use_peft_lora True.")
    else:
        ignored = [f"--{n}" for n in ADAPTER_FLAGS if n in cfg.explicit]
        if ignored:
            p.append(
                f"{', '.join(ignored)} set an adapter, but --use_peft_lora is False (full fine-tuning, where they "
                "would be ignored): add --use_peft_lora True, or remove them."
            )
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
    if t.max_steps <= 0 and t.num_train_epochs <= 0:
        p.append("set --num_train_epochs > 0 or --max_steps > 0.")
    if not 0 <= t.warmup_ratio < 1:
        p.append(f"--warmup_ratio must be in [0, 1) (got {t.warmup_ratio}).")
    if t.optim not in ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit"):
        p.append(
            f"--optim {t.optim!r} is not supported; use adamw_torch, adamw_torch_fused, adamw_8bit or paged_adamw_8bit."
        )
    p += _corpus_problems(d, t)
    p += _report_to_problems(t.report_to)
    p += _eval_harness_problems(t.eval_harness_tasks, t.eval_harness_include_path)
    if t.log_level not in ("debug", "info", "warning", "error", "critical", "passive"):
        p.append(f"--log_level {t.log_level!r}: use debug, info, warning, error, critical or passive.")
    if len(_split(d.splits)) not in (1, 2):
        p.append(
            f"--splits {d.splits!r}: give the training split and optionally the evaluation split, e.g. train,test."
        )
    if t.eval_strategy != "no" and len(_split(d.splits)) < 2:
        p.append(f"--eval_strategy {t.eval_strategy} needs an evaluation split in --splits (e.g. train,test).")
    p += _preference_problems(cfg)
    if m.adapter_path and not m.use_peft_lora:
        p.append("--adapter_path needs --use_peft_lora True.")
    from shardtune.quant import quantization_problems

    p += quantization_problems(
        use_4bit=m.use_4bit_quantization,
        use_8bit=m.use_8bit_quantization,
        quant_storage_dtype=m.bnb_4bit_quant_storage_dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        fsdp_enabled=cfg.fsdp.enabled,
        mixed_precision=cfg.fsdp.mixed_precision,
    )
    if check_paths:
        p += _path_problems(cfg)
    if p:
        raise ConfigError(p)


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
    from shardtune.trackers import missing_packages, parse_report_to

    try:
        return missing_packages(parse_report_to(report_to))
    except ValueError as e:
        return [str(e)]


def _eval_harness_problems(tasks: str | None, include_path: str | None) -> list[str]:
    """--eval_harness_*: lm_eval installed and the task folder there (task names are checked in the preflight)."""
    import importlib.util

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


# Flags that only mean something for an adapter; refused when given explicitly with full fine-tuning.
ADAPTER_FLAGS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "use_dora",
    "dora_dropout",
    "modules_to_save",
    "adapter_name",
)
# (flag, lowest, highest, lowest allowed itself, highest allowed itself); None: unbounded on that side.
_RANGES = (
    ("train", "desirable_weight", 0, None, False, False),
    ("train", "undesirable_weight", 0, None, False, False),
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
    import math

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
    if t.objective == "sft":
        return p
    if t.beta <= 0:
        p.append(f"--beta must be > 0 (got {t.beta}).")
    if d.streaming:
        p.append(f"--streaming True is not supported with --objective {t.objective} yet; set --streaming False.")
    for flag in ("packing", "assistant_only_loss", "append_concat_token"):
        if getattr(d, flag):
            p.append(
                f"--{flag} does not apply to --objective {t.objective} (pairs are rows of their own and only the "
                f"completions count); set --{flag} False."
            )
    return p


def _looks_local(s: str) -> bool:
    return s.startswith((".", "/", "~")) or os.sep in s.strip("/") and s.count("/") != 1 or Path(s).exists()


def _path_problems(cfg: RunConfig) -> list[str]:
    p = []
    mp, dn = cfg.model.model_name_or_path, cfg.data.dataset_name
    if mp and _looks_local(mp) and not (Path(mp).expanduser() / "config.json").exists():
        p.append(f"--model_name_or_path {mp}: no config.json there; give a model folder or a hub id.")
    if dn and _looks_local(dn) and not Path(dn).expanduser().exists():
        p.append(f"--dataset_name {dn}: no such file or folder.")
    ap = cfg.model.adapter_path
    if ap and not (Path(ap).expanduser() / "adapter_config.json").exists():
        p.append(f"--adapter_path {ap}: no adapter_config.json there.")
    return p
