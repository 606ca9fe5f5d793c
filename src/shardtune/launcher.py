"""Accelerate's FSDP config files, the FSDP_*/ACCELERATE_* environment its launcher sets, and `shardtune launch`.

`accelerate launch --config_file X script.py` turns the YAML into environment variables and starts the script
through torchrun. `shardtune launch --config_file X [train flags]` does the same without accelerate: it reads the
YAML, sets the same variables (`accelerate_env`) and starts `python -m shardtune train` through
`torch.distributed.run`. Either way `shardtune train` reads its FSDP settings with `fsdp_settings_from_env`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.config import ConfigError, FSDPSettings

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_STRATEGY_BY_NUMBER = {str(i + 1): name for i, name in enumerate(STRATEGIES)}
_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_MIXED_PRECISION = ("no", "fp16", "bf16")
_RDZV_BACKENDS = ("static", "c10d")

# Top-level keys of accelerate's ClusterConfig (accelerate/commands/config/config_args.py), plus two legacy keys
# it still converts (fp16, dynamo_backend).
_TOP_KEYS = frozenset(
    [
        "compute_environment",
        "distributed_type",
        "mixed_precision",
        "use_cpu",
        "debug",
        "num_processes",
        "machine_rank",
        "num_machines",
        "gpu_ids",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "main_training_function",
        "enable_cpu_affinity",
        "fp8_config",
        "deepspeed_config",
        "fsdp_config",
        "parallelism_config",
        "megatron_lm_config",
        "mpirun_config",
        "downcast_bf16",
        "tpu_name",
        "tpu_zone",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "command_file",
        "commands",
        "tpu_vm",
        "tpu_env",
        "dynamo_config",
        "fp16",
        "dynamo_backend",
    ]
)

# `accelerate launch`'s defaults for the fsdp_* flags (accelerate/commands/launch.py); None: the variable is
# only set when the YAML has the key.
FSDP_LAUNCH_DEFAULTS: dict[str, Any] = {
    "fsdp_version": "1",
    "fsdp_offload_params": "false",
    "fsdp_min_num_params": 100_000_000,
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_reshard_after_forward": "true",
    "fsdp_auto_wrap_policy": None,
    "fsdp_transformer_layer_cls_to_wrap": None,
    "fsdp_backward_prefetch": None,
    "fsdp_state_dict_type": None,
    "fsdp_forward_prefetch": "false",
    "fsdp_use_orig_params": "true",
    "fsdp_cpu_ram_efficient_loading": "true",
    "fsdp_sync_module_states": "true",
    "fsdp_activation_checkpointing": "false",
    "fsdp_activation_checkpointing_offload": "false",
    "fsdp_ignored_modules": None,
}
# fsdp_config key -> environment variable; `lower`: accelerate writes str(value).lower() (booleans).
_FSDP_ENV: tuple[tuple[str, str, bool], ...] = (
    ("fsdp_version", "FSDP_VERSION", False),
    ("fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY", False),
    ("fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", True),
    ("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", True),
    ("fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS", False),
    ("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", False),
    ("fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", False),
    ("fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH", False),
    ("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", False),
    ("fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH", True),
    ("fsdp_use_orig_params", "FSDP_USE_ORIG_PARAMS", True),
    ("fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", True),
    ("fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES", True),
    ("fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", True),
    ("fsdp_activation_checkpointing_offload", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", True),
    ("fsdp_ignored_modules", "FSDP_IGNORED_MODULES", False),
)
_DYNAMO_DEFAULTS = {
    "dynamo_backend": "no",
    "dynamo_mode": "default",
    "dynamo_use_fullgraph": False,
    "dynamo_use_dynamic": False,
    "dynamo_use_regional_compilation": False,
}


# ---------------------------------------------------------------------------------------------------------------
# Values


def _bool(v: str | None, default: bool) -> bool:
    if v is None or v == "":
        return default
    return v.strip().lower() in ("1", "true", "yes", "y", "on")


def _as_bool(v: Any) -> bool:
    """A YAML value (bool, or a string such as accelerate's own defaults) as a bool."""
    return v if isinstance(v, bool) else _bool(str(v), False)


def _strategy_name(v: Any) -> str | None:
    """FULL_SHARD, ... or accelerate's numbers 1..5 as a strategy name; None if v is not a strategy."""
    s = str(v).strip().upper()
    s = _STRATEGY_BY_NUMBER.get(s, s)
    return s if s in STRATEGIES else None


def _precision(v: Any) -> str:
    # An unquoted `no` in YAML is the boolean False.
    return "no" if v is None or v is False else str(v).lower()


def _reshard(value: str, version: str) -> tuple[str | None, bool | None]:
    """FSDP_RESHARD_AFTER_FORWARD → (sharding strategy it names, reshard_after_forward).

    `accelerate config` writes the FSDP1 strategy under fsdp_reshard_after_forward (it deprecates
    fsdp_sharding_strategy), so a strategy name there wins. A boolean counts only under FSDP_VERSION 2: under
    FSDP1 the launcher always sets "true" next to the strategy, which alone decides.
    """
    strategy = _strategy_name(value)
    if strategy is not None:
        return strategy, None
    return None, (_bool(value, True) if version.strip() == "2" else None)


# ---------------------------------------------------------------------------------------------------------------
# Environment → settings


def fsdp_settings_from_env(env: Mapping[str, str]) -> FSDPSettings:
    """Read the variables that `accelerate launch` (or `shardtune launch`) sets from an FSDP config."""
    s = FSDPSettings()
    s.enabled = _bool(env.get("ACCELERATE_USE_FSDP"), False)
    strategy = env.get("FSDP_SHARDING_STRATEGY", s.sharding_strategy).strip().upper()
    s.sharding_strategy = _STRATEGY_BY_NUMBER.get(strategy, strategy)
    if env.get("FSDP_RESHARD_AFTER_FORWARD"):
        named, s.reshard_after_forward = _reshard(env["FSDP_RESHARD_AFTER_FORWARD"], env.get("FSDP_VERSION", "1"))
        s.sharding_strategy = named or s.sharding_strategy
    s.offload_params = _bool(env.get("FSDP_OFFLOAD_PARAMS"), s.offload_params)
    s.cpu_ram_efficient_loading = _bool(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING"), s.cpu_ram_efficient_loading)
    s.sync_module_states = _bool(env.get("FSDP_SYNC_MODULE_STATES"), s.sync_module_states)
    s.state_dict_type = env.get("FSDP_STATE_DICT_TYPE", s.state_dict_type).upper()
    s.backward_prefetch = env.get("FSDP_BACKWARD_PREFETCH", s.backward_prefetch).upper()
    s.forward_prefetch = _bool(env.get("FSDP_FORWARD_PREFETCH"), s.forward_prefetch)
    s.auto_wrap_policy = env.get("FSDP_AUTO_WRAP_POLICY", s.auto_wrap_policy).upper()
    s.transformer_cls_to_wrap = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
    if "FSDP_USE_ORIG_PARAMS" in env:
        s.use_orig_params = _bool(env["FSDP_USE_ORIG_PARAMS"], False)
    s.activation_checkpointing = _bool(env.get("FSDP_ACTIVATION_CHECKPOINTING"), False)
    s.mixed_precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return s


# ---------------------------------------------------------------------------------------------------------------
# YAML


def _unknown(keys: Sequence[str], known: Sequence[str], where: str) -> list[str]:
    out = []
    for k in keys:
        close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "remove it"
        out.append(f"{where}: unknown key {k!r}; {hint}")
    return out


def _choice(value: Any, choices: Sequence[str], key: str, path: str) -> list[str]:
    if value is None or str(value).upper() in choices:
        return []
    return [f"{path}: {key} {value!r} is not one of {', '.join(choices)}"]


def _normalize_fsdp(fsdp: Mapping[str, Any]) -> dict[str, Any]:
    # accelerate accepts fsdp_config keys with or without the fsdp_ prefix.
    return {(k if k.startswith("fsdp_") else f"fsdp_{k}"): v for k, v in fsdp.items()}


def _fsdp_problems(fsdp: Mapping[str, Any], path: str) -> list[str]:
    p = _unknown([k for k in fsdp if k not in FSDP_LAUNCH_DEFAULTS], list(FSDP_LAUNCH_DEFAULTS), f"{path}: fsdp_config")
    where = f"{path}: fsdp_config."
    strategy = fsdp.get("fsdp_sharding_strategy")
    if strategy is not None and _strategy_name(strategy) is None:
        p.append(f"{where}fsdp_sharding_strategy {strategy!r} is not one of {', '.join(STRATEGIES)} or 1-5")
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if reshard is not None and _strategy_name(reshard) is None and str(reshard).lower() not in ("true", "false"):
        p.append(f"{where}fsdp_reshard_after_forward {reshard!r}: use true/false (FSDP2) or a sharding strategy")
    if str(fsdp.get("fsdp_version", "1")) not in ("1", "2"):
        p.append(f"{where}fsdp_version {fsdp['fsdp_version']!r}: use 1 or 2")
    p += _choice(fsdp.get("fsdp_backward_prefetch"), _BACKWARD_PREFETCH, "fsdp_backward_prefetch", where[:-1])
    p += _choice(fsdp.get("fsdp_state_dict_type"), _STATE_DICT_TYPES, "fsdp_state_dict_type", where[:-1])
    p += _choice(fsdp.get("fsdp_auto_wrap_policy"), _AUTO_WRAP_POLICIES, "fsdp_auto_wrap_policy", where[:-1])
    values = {**FSDP_LAUNCH_DEFAULTS, **fsdp}
    if _as_bool(values["fsdp_cpu_ram_efficient_loading"]) and not _as_bool(values["fsdp_sync_module_states"]):
        p.append(
            f"{where}fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true (as accelerate "
            "requires); set it to true, or set fsdp_cpu_ram_efficient_loading: false"
        )
    return p


def _yaml_problems(cfg: Mapping[str, Any], path: str) -> list[str]:
    p = _unknown([k for k in cfg if k not in _TOP_KEYS], sorted(_TOP_KEYS), path)
    env = cfg.get("compute_environment", "LOCAL_MACHINE")
    if env != "LOCAL_MACHINE":
        p.append(f"{path}: compute_environment {env!r}: shardtune launch runs on LOCAL_MACHINE only")
    dist = cfg.get("distributed_type")
    if dist != "FSDP":
        p.append(
            f"{path}: distributed_type is {dist!r}; shardtune launch needs distributed_type: FSDP with an "
            "fsdp_config section (see configs/fsdp_config.yaml)"
        )
    mp = _precision(cfg.get("mixed_precision"))
    if mp not in _MIXED_PRECISION:
        p.append(f"{path}: mixed_precision {mp!r} is not supported; use 'no', fp16 or bf16")
    if cfg.get("parallelism_config"):
        p.append(
            f"{path}: parallelism_config is not supported; remove it and set fsdp_config.fsdp_sharding_strategy"
            " (HYBRID_SHARD shards within a machine and replicates across machines)"
        )
    fsdp = cfg.get("fsdp_config") or {}
    if not isinstance(fsdp, Mapping):
        return p + [f"{path}: fsdp_config must be a mapping of fsdp_* keys to values"]
    return p + _fsdp_problems(_normalize_fsdp(fsdp), path)


def read_accelerate_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load and check an accelerate FSDP config file; fsdp_config keys come back with their fsdp_ prefix.

    Raises ConfigError listing every problem (missing file, not FSDP, unknown keys, invalid values).
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        hint = "give an accelerate config such as configs/fsdp_config.yaml (or `accelerate config --config_file F`)"
        raise ConfigError([f"--config_file {path}: no such file; {hint}"])
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML ({e})"]) from e
    if not isinstance(cfg, dict):
        raise ConfigError(
            [f"{path}: an accelerate config is a mapping of keys to values (see configs/fsdp_config.yaml)"]
        )
    problems = _yaml_problems(cfg, str(path))
    if problems:
        raise ConfigError(problems)
    cfg = dict(cfg)
    cfg["fsdp_config"] = _normalize_fsdp(cfg.get("fsdp_config") or {})
    return cfg


def _fsdp_values(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {**FSDP_LAUNCH_DEFAULTS, **_normalize_fsdp(cfg.get("fsdp_config") or {})}


def _dynamo_env(cfg: Mapping[str, Any]) -> dict[str, str]:
    d = {
        **_DYNAMO_DEFAULTS,
        **{(k if k.startswith("dynamo_") else f"dynamo_{k}"): v for k, v in (cfg.get("dynamo_config") or {}).items()},
    }
    if "dynamo_backend" in cfg:  # legacy top-level key
        d["dynamo_backend"] = cfg["dynamo_backend"]
    return {
        "ACCELERATE_DYNAMO_BACKEND": str(d["dynamo_backend"]).upper(),
        "ACCELERATE_DYNAMO_MODE": str(d["dynamo_mode"]),
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": str(d["dynamo_use_fullgraph"]),
        "ACCELERATE_DYNAMO_USE_DYNAMIC": str(d["dynamo_use_dynamic"]),
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": str(d["dynamo_use_regional_compilation"]),
    }


def accelerate_env(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The FSDP_*/ACCELERATE_* variables `accelerate launch --config_file X` sets for an FSDP config.

    Names and value formats follow accelerate's `prepare_multi_gpu_env` (accelerate/utils/launch.py), including
    the launcher's defaults for keys the file leaves out (FSDP_VERSION "1", FSDP_USE_ORIG_PARAMS "true", ...).
    """
    env = {"ACCELERATE_MIXED_PRECISION": _precision(cfg.get("mixed_precision")), **_dynamo_env(cfg)}
    if cfg.get("debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    env["ACCELERATE_USE_FSDP"] = "true"
    values = _fsdp_values(cfg)
    for key, var, lower in _FSDP_ENV:
        if values[key] is not None:
            env[var] = str(values[key]).lower() if lower else str(values[key])
    return env


def fsdp_settings_from_yaml(path: str | os.PathLike) -> FSDPSettings:
    """The FSDPSettings an accelerate FSDP config file means (equal to reading `accelerate launch`'s environment)."""
    cfg = read_accelerate_yaml(path)
    v = _fsdp_values(cfg)
    s = FSDPSettings(enabled=True)
    s.sharding_strategy = _strategy_name(v["fsdp_sharding_strategy"]) or s.sharding_strategy
    named, s.reshard_after_forward = _reshard(str(v["fsdp_reshard_after_forward"]).lower(), str(v["fsdp_version"]))
    s.sharding_strategy = named or s.sharding_strategy
    s.offload_params = _as_bool(v["fsdp_offload_params"])
    s.cpu_ram_efficient_loading = _as_bool(v["fsdp_cpu_ram_efficient_loading"])
    s.sync_module_states = _as_bool(v["fsdp_sync_module_states"])
    s.forward_prefetch = _as_bool(v["fsdp_forward_prefetch"])
    s.use_orig_params = _as_bool(v["fsdp_use_orig_params"])
    s.activation_checkpointing = _as_bool(v["fsdp_activation_checkpointing"])
    for field_, key in (
        ("state_dict_type", "fsdp_state_dict_type"),
        ("backward_prefetch", "fsdp_backward_prefetch"),
        ("auto_wrap_policy", "fsdp_auto_wrap_policy"),
    ):
        if v[key] is not None:
            setattr(s, field_, str(v[key]).upper())
    s.transformer_cls_to_wrap = v["fsdp_transformer_layer_cls_to_wrap"] or None
    s.mixed_precision = _precision(cfg.get("mixed_precision"))
    return s


def fsdp1_only_notes(settings: FSDPSettings) -> list[str]:
    """One line per FSDP1-only option in `settings` that has no effect under FSDP2 (for a warning at start-up).

    fsdp_forward_prefetch and fsdp_backward_prefetch NO_PREFETCH are not listed: shardtune maps them to FSDP2's
    explicit prefetch settings.
    """
    if not settings.enabled:
        return []
    notes = []
    if settings.use_orig_params is False:
        notes.append(
            "fsdp_use_orig_params: false is FSDP1-only; FSDP2 always keeps the original parameters, so "
            "frozen and trainable weights share a block and no PEFT-specific wrap policy is needed."
        )
    if settings.sync_module_states:
        notes.append(
            "fsdp_sync_module_states: true is FSDP1-only; shardtune fills each rank's FSDP2 shards from "
            "the same checkpoint (from rank 0 with fsdp_cpu_ram_efficient_loading), so all ranks agree."
        )
    if settings.backward_prefetch == "BACKWARD_POST":
        notes.append(
            "fsdp_backward_prefetch: BACKWARD_POST is FSDP1-only; FSDP2 prefetches before each block's backward "
            "(as BACKWARD_PRE does)."
        )
    if settings.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
        notes.append(
            f"fsdp_auto_wrap_policy: {settings.auto_wrap_policy} is FSDP1-only; shardtune shards each "
            "decoder block, then the root (as TRANSFORMER_BASED_WRAP does)."
        )
    if settings.state_dict_type == "LOCAL_STATE_DICT":
        notes.append(
            "fsdp_state_dict_type: LOCAL_STATE_DICT is FSDP1-only; checkpoints are saved as "
            "SHARDED_STATE_DICT (torch.distributed.checkpoint)."
        )
    return notes


# ---------------------------------------------------------------------------------------------------------------
# shardtune launch

_LAUNCH_FLAGS = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
)

_EPILOG = """\
Every flag not listed above goes to `shardtune train`, e.g.:
  shardtune launch --config_file configs/fsdp_config.yaml --seed 100 --model_name_or_path MODEL ...
Two machines with 8 processes each (run on each machine, with its own --machine_rank):
  shardtune launch --config_file configs/fsdp_config.yaml --num_machines 2 --num_processes 16 \\
      --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500 [train flags]
The processes see the FSDP_*/ACCELERATE_* variables `accelerate launch --config_file FILE` would set, and
ACCELERATE_USE_CPU from use_cpu.
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardtune launch",
        allow_abbrev=False,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start `shardtune train` on every process of one or more machines through torchrun, with the "
        "settings of an accelerate FSDP config file. Flags override the file.",
    )

    def add(name: str, **kw: Any) -> None:
        ap.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kw)

    add("config_file", required=True, metavar="FILE", help="accelerate config YAML (distributed_type: FSDP).")
    add("num_processes", type=int, metavar="N", help="Total processes over all machines (accelerate's meaning).")
    add("num_machines", type=int, metavar="M", help="Number of machines.")
    add("machine_rank", type=int, metavar="R", help="This machine's rank, 0..M-1 (static rendezvous).")
    add("main_process_ip", metavar="IP", help="Address of machine 0 (multi-machine runs).")
    add(
        "main_process_port",
        type=int,
        metavar="P",
        help="Port on machine 0 (multi-machine default 29500; one machine: a free port when unset or 0).",
    )
    add(
        "rdzv_backend",
        choices=_RDZV_BACKENDS,
        help="static: ranks from --machine_rank; c10d: torchrun's "
        "dynamic rendezvous at IP:P (machine ranks assigned on arrival).",
    )
    add("nproc_per_node", type=int, metavar="K", help="Processes per machine (default: num_processes / num_machines).")
    add("dry_run", action="store_true", help="Print the torchrun command and environment, start nothing.")
    return ap


@dataclass
class LaunchPlan:
    """What `shardtune launch` runs: the command and the variables it adds to the environment."""

    cmd: list[str]
    env: dict[str, str]
    dry_run: bool = False


def _topology(cfg: dict[str, Any], ns: argparse.Namespace, path: str) -> dict[str, Any]:
    """The YAML's launch keys with the flags given on the command line applied; check them together."""
    given = {k for k in _LAUNCH_FLAGS if getattr(ns, k) is not None}
    t = {k: (getattr(ns, k) if k in given else cfg.get(k)) for k in _LAUNCH_FLAGS}
    src = {k: (f"--{k}" if k in given else f"{k} in {path}") for k in _LAUNCH_FLAGS}
    defaults = {"num_machines": 1, "machine_rank": 0, "rdzv_backend": "static"}
    t.update({k: v for k, v in defaults.items() if t[k] is None})
    problems = []
    for k in ("num_processes", "num_machines", "machine_rank", "main_process_port"):
        if t[k] is not None:
            try:
                t[k] = int(t[k])
            except (TypeError, ValueError):
                problems.append(f"{k} {t[k]!r} ({src[k]}) must be a whole number")
    if problems:
        raise ConfigError(problems)
    if ns.nproc_per_node is not None and "num_processes" not in given:
        t["num_processes"] = ns.nproc_per_node * t["num_machines"]
        src["num_processes"] = "--nproc_per_node × num_machines"
    problems = _topology_problems(t, src, ns.nproc_per_node)
    if problems:
        raise ConfigError(problems)
    t["nproc_per_node"] = ns.nproc_per_node or t["num_processes"] // t["num_machines"]
    return t


def _topology_problems(t: dict[str, Any], src: dict[str, str], nproc_per_node: int | None) -> list[str]:
    n, m, r, port = t["num_processes"], t["num_machines"], t["machine_rank"], t["main_process_port"]
    if n is None or n < 1:
        hint = "give the total number of processes over all machines, e.g. --num_processes 8"
        return [f"num_processes {n!r} ({src['num_processes']}): {hint}"]
    p = []
    if m < 1:
        p.append(f"num_machines {m} ({src['num_machines']}) must be >= 1")
    elif n % m:
        p.append(
            f"num_processes {n} ({src['num_processes']}) is not divisible by num_machines {m} "
            f"({src['num_machines']}): num_processes is the total over all machines; use a multiple of {m}, "
            f"e.g. {m * max(1, n // m)}"
        )
    elif nproc_per_node is not None and nproc_per_node * m != n:
        p.append(
            f"--nproc_per_node {nproc_per_node} × num_machines {m} != num_processes {n} "
            f"({src['num_processes']}); drop one of --nproc_per_node/--num_processes"
        )
    if not 0 <= r < max(m, 1):
        p.append(f"machine_rank {r} ({src['machine_rank']}) must be in 0..{m - 1}; give each machine its own rank")
    if m > 1 and not t["main_process_ip"]:
        p.append(
            f"main_process_ip is required with num_machines {m}: pass --main_process_ip with the address of "
            "machine 0 (the same on every machine)"
        )
    if port is not None and not 0 <= port < 65536:
        p.append(f"main_process_port {port} ({src['main_process_port']}) must be a port number (0 = pick a free one)")
    if t["rdzv_backend"] not in _RDZV_BACKENDS:
        p.append(f"rdzv_backend {t['rdzv_backend']!r} ({src['rdzv_backend']}): use static or c10d")
    return p


def torchrun_args(t: Mapping[str, Any]) -> list[str]:
    """torch.distributed.run options for a topology (accelerate's num_processes/num_machines/... keys)."""
    m, port, ip = t["num_machines"], t["main_process_port"], t["main_process_ip"]
    args = ["--nnodes", str(m), "--nproc-per-node", str(t["nproc_per_node"])]
    c10d = t["rdzv_backend"] == "c10d"
    if m > 1:
        port = port or 29500
        if c10d:
            return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ip}:{port}"]
        return args + ["--node-rank", str(t["machine_rank"]), "--master-addr", str(ip), "--master-port", str(port)]
    if not port:  # torchrun picks a free port on one machine (static, no port → c10d on localhost:0)
        return args + (["--standalone"] if c10d else [])
    if c10d:
        return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ip or 'localhost'}:{port}"]
    return args + ["--master-addr", str(ip or "127.0.0.1"), "--master-port", str(port)]


def _omp_threads(use_cpu: bool, nproc_per_node: int) -> str:
    """OMP_NUM_THREADS as `accelerate launch` sets it: the caller's value, else the physical cores shared by the
    processes of a CPU run, else 1."""
    if os.environ.get("OMP_NUM_THREADS"):
        return os.environ["OMP_NUM_THREADS"]
    if use_cpu:
        import psutil

        return str(max(1, (psutil.cpu_count(logical=False) or 1) // nproc_per_node))
    return "1"


def build_launch(argv: Sequence[str], entry: Sequence[str] = ("-m", "shardtune", "train")) -> LaunchPlan:
    """Parse `shardtune launch` flags; the rest are appended to `entry` (a module with -m, or a script)."""
    ns, train_args = _parser().parse_known_args(list(argv))
    cfg = read_accelerate_yaml(ns.config_file)
    t = _topology(cfg, ns, ns.config_file)
    use_cpu = bool(cfg.get("use_cpu", False))
    env = {**accelerate_env(cfg), "ACCELERATE_USE_CPU": str(use_cpu)}
    env["OMP_NUM_THREADS"] = _omp_threads(use_cpu, t["nproc_per_node"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(t), *entry, *train_args]
    return LaunchPlan(cmd=cmd, env=env, dry_run=ns.dry_run)


def main(argv: Sequence[str] | None = None, entry: Sequence[str] = ("-m", "shardtune", "train")) -> int:
    """`shardtune launch`: start `entry` with the train flags on N processes per machine through torchrun."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = build_launch(argv, entry)
    except ConfigError as e:
        print(f"shardtune launch: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help or a usage error
        return int(e.code or 0)
    if plan.dry_run:
        print("\n".join(f"{k}={v}" for k, v in sorted(plan.env.items())))
        print(shlex.join(plan.cmd))
        return 0
    if tuple(entry) == ("-m", "shardtune", "train"):
        from shardtune.preflight import launch_problems

        try:
            problems = launch_problems(_parser().parse_known_args(argv)[1], {**os.environ, **plan.env})
        except ConfigError as e:
            problems = e.problems
        if problems:
            print(f"shardtune launch: {ConfigError(problems)}", file=sys.stderr)
            return 2
    from shardtune.parent import child_preexec

    # torchrun gets SIGTERM if this process dies (kill -9 included), and forwards it to its workers. preexec_fn
    # is safe here: the launcher runs no other thread.
    preexec = child_preexec if os.name == "posix" else None
    proc = subprocess.Popen(plan.cmd, env={**os.environ, **plan.env}, preexec_fn=preexec)  # noqa: PLW1509
    try:
        return proc.wait()
    except KeyboardInterrupt:  # torchrun got the same SIGINT and stops its workers: wait, do not orphan them
        return proc.wait()
