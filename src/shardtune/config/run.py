"""Typed run configuration: command-line flags (named as in the reference training script), a single
.json/.yaml file, and the FSDP settings that `accelerate launch` or `shardtune launch` pass through the
environment. `parse_run_config` returns one `RunConfig`; shardtune.recipe.run_config.load_run_config checks it
whole (the configuration's own checks, shardtune.config.validation, and each component's of the flags it defines)
and reports every problem at once.

The flags are defined in shardtune.config.arguments, the FSDP settings in shardtune.config.fsdp; this module parses
and is the import point for both.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from shardtune.config import dtypes
from shardtune.config.arguments import ARG_CLASSES, DataArguments, ModelArguments, RunConfig, TrainArguments
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import (
    FSDPSettings,
    context_parallel_size,
    fsdp_settings_from_env,
    parallelism_plan,
    tensor_parallel_size,
)
from shardtune.runtime.log import warn0

__all__ = [
    "ARG_CLASSES",
    "ConfigError",
    "DataArguments",
    "FSDPSettings",
    "ModelArguments",
    "RunConfig",
    "TrainArguments",
    "explicit_flags",
    "join_negative_values",
    "known_flags",
    "parse_args",
    "parse_run_config",
]


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
_LIST_FIELDS = ("lora_target_modules", "lora_target_parameters", "modules_to_save", "splits", "report_to")
# List flags that the command line may give as several words, as transformers' and TRL's list flags are given
# (`--lora_target_modules q_proj v_proj`, `--report_to wandb tensorboard`): the words are joined with commas.
_LIST_FLAGS = (
    "lora_target_modules", "lora_target_parameters", "modules_to_save", "report_to", "reward_funcs", "reward_weights",
)  # fmt: skip
# Fields a run file may give as a mapping (transformers' dict fields); the flag takes its JSON text.
_JSON_FIELDS = ("gradient_checkpointing_kwargs",)


def _field_types(classes: tuple) -> dict[str, set[str]]:
    """Each field's type names, e.g. {"max_train_samples": {"int", "None"}}."""

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
    if key in _JSON_FIELDS and isinstance(value, dict):
        return json.dumps(value), None
    if not isinstance(value, str):
        return value, f"{key}: {value!r} is not a string; quote it."
    return value, None


def _read_file(path: str) -> Any:
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
    problems, notes = _repeated([(aliases.get(k, k), k, v) for k, v in data.items()], path)
    if problems:
        raise ConfigError(problems)
    for note in notes:
        warn0(note)
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


def join_negative_values(argv: list[str]) -> list[str]:
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


def join_list_values(argv: list[str]) -> list[str]:
    """`--lora_target_modules q_proj v_proj` → `--lora_target_modules q_proj,v_proj` (and --modules_to_save,
    --report_to): the words after a list flag, up to the next flag, are its items."""
    aliases, out, state = _aliases(), [], None  # state: None (not a list flag), "flag" (its value next), "value"
    for tok in argv:
        if tok.startswith("--"):
            name = tok[2:].split("=", 1)[0]
            state = ("value" if "=" in tok else "flag") if aliases.get(name, name) in _LIST_FLAGS else None
            out.append(tok)
        elif state == "value":
            out[-1] = f"{out[-1]},{tok}"
        else:
            state = "value" if state == "flag" else None
            out.append(tok)
    return out


def _bare_optional_bools(argv: list[str], classes: tuple) -> list[str]:
    """`--completion_only_loss` alone → `--completion_only_loss True`: argparse gives a plain boolean flag a value of
    its own, but wants one after a `bool | None` flag (unset means "decide from the data")."""
    aliases, types = _aliases(), _field_types(classes)
    optional = {n for n, t in types.items() if t == {"bool", "None"}}
    out = []
    for i, tok in enumerate(argv):
        out.append(tok)
        name = tok[2:] if tok.startswith("--") else ""
        nxt = argv[i + 1] if i + 1 < len(argv) else "--"
        if aliases.get(name, name) in optional and nxt.startswith("--"):
            out.append("True")
    return out


def _given(argv: list[str]) -> list[tuple[str, str, str]]:
    """(canonical name, spelling, value) of every flag of argv; a flag without a value is a boolean's True."""
    aliases, out = _aliases(), []
    for i, tok in enumerate(argv):
        if not tok.startswith("--"):
            continue
        name, eq, value = tok[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = nxt if nxt is not None and not nxt.startswith("--") else "True"
        out.append((aliases.get(name, name), name, value))
    return out


def _repeated(given: list[tuple[str, str, Any]], where: str = "the command line") -> tuple[list[str], list[str]]:
    """A setting given twice under two spellings (aliases): different values are an error (argparse would keep the
    last silently), the same value a note. One flag repeated keeps argparse's rule, the last wins (a command line
    that appends an override), said in a note."""
    by_name: dict[str, list[tuple[str, Any]]] = {}
    for canonical, spelling, value in given:
        by_name.setdefault(canonical, []).append((spelling, value))
    problems, notes = [], []
    for canonical, seen in by_name.items():
        if len(seen) < 2:
            continue
        said = " and ".join(f"--{s} {v}" for s, v in seen)
        values = {str(v).strip().lower() for _, v in seen}
        if len({s for s, _ in seen}) == 1:
            if len(values) > 1:
                notes.append(f"{where}: --{seen[0][0]} is given {len(seen)} times; the last, {seen[-1][1]}, is used.")
        elif len(values) > 1:
            problems.append(f"{where}: {said} both set --{canonical}, to different values; give it once.")
        else:
            notes.append(f"{where}: {said} both set --{canonical} (the same value); give it once.")
    return problems, notes


def explicit_flags(argv: list[str]) -> frozenset[str]:
    """Canonical names of the flags that argv (or its run file) gives, as opposed to the defaults."""
    aliases = _aliases()
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        data = _read_file(argv[0])
        names = list(data) if isinstance(data, dict) else []
    else:
        names = [tok[2:].split("=", 1)[0] for tok in argv if tok.startswith("--")]
    return frozenset(aliases.get(n, n) for n in names)


def build_parser(
    extra: tuple = (), prog: str = "shardtune train", choices: Mapping[str, str] | None = None
) -> HfArgumentParser:
    """The parser of the train flags (and `extra` argument classes). choices: {flag: its values, said in --help},
    for flags whose values a component's registry holds (the caller that knows the registries gives them:
    shardtune.recipe.run_config.flag_choices)."""
    parser = HfArgumentParser((*ARG_CLASSES, *extra), prog=prog, allow_abbrev=False)
    for action in parser._actions:  # argparse keeps no public list of the actions it was given
        if action.dest in (choices or {}):
            action.help = f"{action.help}: {choices[action.dest]}"
    return parser


def parse_args(
    argv: list[str] | None = None,
    extra: tuple = (),
    prog: str = "shardtune train",
    choices: Mapping[str, str] | None = None,
) -> tuple:
    """Parse flags (or a single .json/.yaml file) into (ModelArguments, DataArguments, TrainArguments, *extra).

    choices: as build_parser's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(extra, prog, choices)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        parsed = _parse_file(parser, argv[0], extra)
    else:
        argv = _bare_optional_bools(join_list_values(join_negative_values(argv)), (*ARG_CLASSES, *extra))
        problems, notes = _repeated(_given(argv))
        if problems:
            raise ConfigError(problems)
        for note in notes:
            warn0(note)
        *parsed, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        if remaining:
            raise ConfigError(_unknown_flag_problems(remaining, extra))
    apply_spellings(parsed[0], parsed[2], explicit_flags(argv))
    return tuple(parsed)


def apply_spellings(model: ModelArguments, train: TrainArguments, explicit: frozenset[str]) -> None:
    """TRL's and transformers' spellings mapped onto shardtune's flags (--torch_dtype onto --bf16/--fp16,
    --gradient_checkpointing_kwargs onto --use_reentrant), or refused with the fix; a clash is an error."""
    p = []
    if model.torch_dtype is not None:
        p += _torch_dtype_problems(model.torch_dtype, train)
    if train.gradient_checkpointing_kwargs is not None:
        p += _checkpointing_kwargs_problems(train.gradient_checkpointing_kwargs, model, explicit)
    if p:
        raise ConfigError(p)


def _torch_dtype_problems(value: str, train: TrainArguments) -> list[str]:
    name = dtypes.canonical(value)
    fix = "give bfloat16 (= --bf16 True), float16 (= --fp16 True) or float32"
    if name not in dtypes.FLOATING:
        why = "the dtype of the model's config" if name == "auto" else "not a training dtype"
        return [f"--torch_dtype {value}: {why}; shardtune trains in the precision you name: {fix}."]
    clash = {"bfloat16": train.fp16, "float16": train.bf16, "float32": train.bf16 or train.fp16}[name]
    if clash:
        other = "--fp16 True" if train.fp16 else "--bf16 True"
        return [f"--torch_dtype {value} and {other} disagree; give one of them."]
    train.bf16, train.fp16 = train.bf16 or name == "bfloat16", train.fp16 or name == "float16"
    return []


def _checkpointing_kwargs_problems(value: str, model: ModelArguments, explicit: frozenset[str]) -> list[str]:
    example = """'{"use_reentrant": false}'"""
    try:
        kwargs = json.loads(value)
    except ValueError:
        kwargs = None
    if not isinstance(kwargs, dict):
        return [f"--gradient_checkpointing_kwargs {value!r} is not a JSON object; write e.g. {example}."]
    other = sorted(k for k in kwargs if k != "use_reentrant")
    if other:
        msg = (
            f"--gradient_checkpointing_kwargs: {', '.join(other)} is not supported (shardtune's activation "
            f"checkpointing takes use_reentrant only); remove it, e.g. {example}."
        )
        return [msg]
    reentrant = kwargs.get("use_reentrant", model.use_reentrant)
    if not isinstance(reentrant, bool):
        return [f"--gradient_checkpointing_kwargs: use_reentrant must be true or false, got {reentrant!r}."]
    if "use_reentrant" in explicit and reentrant != model.use_reentrant:
        msg = (
            f"--gradient_checkpointing_kwargs use_reentrant {str(reentrant).lower()} and --use_reentrant "
            f"{model.use_reentrant} disagree; give one of them."
        )
        return [msg]
    model.use_reentrant = reentrant
    return []


def precision_line(cfg: RunConfig) -> str:
    """The one line every `train` run logs (commands.train): the dtypes it computes and stores weights in, and who
    asked for them."""
    pr, m = cfg.precision, cfg.model
    line = f"precision: compute {dtypes.name_of(pr.compute)}, storage {dtypes.name_of(pr.storage)} ({pr.flags}"
    if cfg.fsdp.enabled and pr.flags.startswith("--") and cfg.fsdp.mixed_precision == "no":
        line += "; overrides the accelerate config's mixed_precision: no"
    line += ")"
    if m.use_4bit_quantization:
        line += f"; the frozen base in 4-bit {m.bnb_4bit_quant_type}, computed in {m.bnb_4bit_compute_dtype}"
    return line


def parse_run_config(
    argv: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    choices: Mapping[str, str] | None = None,
) -> RunConfig:
    """Flags + the launcher's environment → RunConfig, with the launch's parallel sizes checked (ConfigError);
    every other check is shardtune.recipe.run_config.load_run_config's. `choices`: as parse_args'."""
    argv = list(sys.argv[1:] if argv is None else argv)
    model, data, train = parse_args(argv, choices=choices)
    env = os.environ if env is None else env
    fsdp = fsdp_settings_from_env(env)
    # accelerate's parallelism_config (PARALLELISM_CONFIG_*, from any launcher): the strategy its sizes mean, or why not.
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    fsdp.sharding_strategy, problems = parallelism_plan(fsdp, world, local)
    if problems:
        raise ConfigError([f"the accelerate config's {p}" for p in problems])
    explicit = explicit_flags(argv)
    problems = resolve_parallel_sizes(train, fsdp, world, local, explicit)
    if problems:
        raise ConfigError(problems)
    return RunConfig(model, data, train, fsdp, explicit=explicit)


def resolve_parallel_sizes(train, fsdp: FSDPSettings, world: int, local: int, explicit) -> list[str]:
    """The parallel axes' sizes of a run on `world` processes (`local` a machine's), from the flags or the
    accelerate config, into `train`, and their problems: the one place `shardtune train` (parse_run_config) and
    `shardtune plan` take them. The tensor axis is checked once the context axis is whole (its check reads
    both), so that one mistake is one line."""
    return resolve_context_parallel(train, fsdp, world, local, explicit) or resolve_tensor_parallel(
        train, fsdp, world, local, explicit
    )


def resolve_context_parallel(train, fsdp: FSDPSettings, world: int, local: int, explicit) -> list[str]:
    """--context_parallel_size, or the accelerate config's parallelism_config_cp_size (the same number when both
    are given), into train.context_parallel_size; it must divide the processes, and a machine's processes where
    a HYBRID strategy shards within each machine (a batch's cp ranks share one shard group). The one place the
    size is decided and checked, for `shardtune train` (from the launcher's environment) and `shardtune plan`
    (from its YAML and --num_processes) through resolve_parallel_sizes; the problems, each naming the flag."""
    from_config = context_parallel_size(fsdp)
    if from_config > 1:
        if "context_parallel_size" in explicit and train.context_parallel_size != from_config:
            given = train.context_parallel_size
            why = (f"--context_parallel_size {given} and the accelerate config's parallelism_config_cp_size "
                   f"{from_config} differ: give one of them.")  # fmt: skip
            return [why]
        train.context_parallel_size = from_config
    cp = train.context_parallel_size
    if cp < 1 or world % cp:
        why = f"--context_parallel_size {cp}: it must be a whole number ≥ 1 that divides the {world} processes."
        return [why]
    if fsdp.sharding_strategy.startswith("HYBRID") and world > local and local % cp:
        why = (f"--context_parallel_size {cp} with fsdp_sharding_strategy {fsdp.sharding_strategy}: it must divide "
               f"the {local} processes of a machine, where the strategy shards; use a divisor of {local}.")  # fmt: skip
        return [why]
    return []


def resolve_tensor_parallel(train, fsdp: FSDPSettings, world: int, local: int, explicit) -> list[str]:
    """--tensor_parallel_size, or the accelerate config's parallelism_config_tp_size (the same number when both
    are given; PARALLELISM_CONFIG_TP_SIZE from any launcher), into train.tensor_parallel_size; it must divide a
    machine's processes (its ranks exchange activations in every layer) and the processes with cp."""
    from_config = tensor_parallel_size(fsdp)
    flag = "--tensor_parallel_size"
    if from_config > 1:
        if "tensor_parallel_size" in explicit and train.tensor_parallel_size != from_config:
            why = (f"{flag} {train.tensor_parallel_size} and the accelerate config's parallelism_config_tp_size "
                   f"{from_config} differ: give one of them.")  # fmt: skip
            return [why]
        train.tensor_parallel_size = from_config
    tp, cp = train.tensor_parallel_size, train.context_parallel_size
    if tp < 1 or local % tp or world % (tp * cp):
        why = (f"{flag} {tp}: it must be a whole number ≥ 1 that divides the {local} processes of a machine "
               f"(and the {world} processes with --context_parallel_size {cp}); use a divisor of {local}.")  # fmt: skip
        return [why]
    return []
