"""accelerate's FSDP config files: checked (every unknown key or invalid value named at once), turned into the
FSDP_*/ACCELERATE_* environment `accelerate launch --config_file X` sets (`accelerate_env`), and read as the
FSDPSettings that environment means (`fsdp_settings_from_yaml`), for `shardtune launch` and `shardtune plan`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import (
    FSDPSettings,
    as_bool,
    mixed_precision_value,
    parallelism_from_env,
    parallelism_plan,
    reshard_setting,
    strategy_name,
)
from shardtune.config.precision import MIXED_PRECISION
from shardtune.parallel.dims import STRATEGIES

_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")

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
# `accelerate launch`'s parallelism_config_* flags and their defaults (accelerate/commands/launch.py).
PARALLELISM_LAUNCH_DEFAULTS: dict[str, Any] = {
    "parallelism_config_dp_replicate_size": 1,
    "parallelism_config_dp_shard_size": 1,
    "parallelism_config_tp_size": 1,
    "parallelism_config_cp_size": 1,
    "parallelism_config_cp_backend": "torch",
    "parallelism_config_cp_comm_strategy": "allgather",
    "parallelism_config_sp_size": 1,
    "parallelism_config_sp_backend": "deepspeed",
    "parallelism_config_sp_seq_length": None,
    "parallelism_config_sp_seq_length_is_variable": True,
    "parallelism_config_sp_attn_implementation": "sdpa",
}
_DYNAMO_DEFAULTS = {
    "dynamo_backend": "no",
    "dynamo_mode": "default",
    "dynamo_use_fullgraph": False,
    "dynamo_use_dynamic": False,
    "dynamo_use_regional_compilation": False,
}


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
    if strategy is not None and strategy_name(strategy) is None:
        p.append(f"{where}fsdp_sharding_strategy {strategy!r} is not one of {', '.join(STRATEGIES)} or 1-5")
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if reshard is not None and strategy_name(reshard) is None and str(reshard).lower() not in ("true", "false"):
        p.append(f"{where}fsdp_reshard_after_forward {reshard!r}: use true/false (FSDP2) or a sharding strategy")
    if str(fsdp.get("fsdp_version", "1")) not in ("1", "2"):
        p.append(f"{where}fsdp_version {fsdp['fsdp_version']!r}: use 1 or 2")
    p += _choice(fsdp.get("fsdp_backward_prefetch"), _BACKWARD_PREFETCH, "fsdp_backward_prefetch", where[:-1])
    p += _choice(fsdp.get("fsdp_state_dict_type"), _STATE_DICT_TYPES, "fsdp_state_dict_type", where[:-1])
    p += _choice(fsdp.get("fsdp_auto_wrap_policy"), _AUTO_WRAP_POLICIES, "fsdp_auto_wrap_policy", where[:-1])
    values = {**FSDP_LAUNCH_DEFAULTS, **fsdp}
    if as_bool(values["fsdp_cpu_ram_efficient_loading"]) and not as_bool(values["fsdp_sync_module_states"]):
        p.append(
            f"{where}fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true (as accelerate "
            "requires); set it to true, or set fsdp_cpu_ram_efficient_loading: false"
        )
    return p


def _parallelism_problems(cfg: Mapping[str, Any], path: str) -> list[str]:
    """parallelism_config's keys (accelerate's, with their parallelism_config_ prefix, which accelerate does not add)
    and accelerate's own rule that it needs fsdp_version 2; the sizes are checked against the processes by
    fsdp_settings.parallelism_plan, where every launcher's run reads them."""
    pc = cfg.get("parallelism_config")
    if not pc:
        return []
    if not isinstance(pc, Mapping):
        return [f"{path}: parallelism_config must be a mapping of parallelism_config_* keys to values"]
    p = _unknown([k for k in pc if k not in PARALLELISM_LAUNCH_DEFAULTS], list(PARALLELISM_LAUNCH_DEFAULTS),
                 f"{path}: parallelism_config")  # fmt: skip
    for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        v = pc.get(f"parallelism_config_{k}", 1)
        if isinstance(v, bool) or not str(v).strip().isdigit():
            p.append(f"{path}: parallelism_config.parallelism_config_{k} {v!r} is not a whole number; give a size")
    version = str(_normalize_fsdp(cfg.get("fsdp_config") or {}).get("fsdp_version", "1"))
    if version != "2":
        p.append(
            f"{path}: parallelism_config needs fsdp_config.fsdp_version: 2 (accelerate refuses it with FSDP1); set "
            "fsdp_version: 2, or remove parallelism_config and set fsdp_sharding_strategy"
        )
    return p


def _parallelism_env(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The PARALLELISM_CONFIG_* variables `accelerate launch` sets for a parallelism_config
    (prepare_extend_env_parallelism_config): every size with its default, the backends, and the cp/sp extras."""
    pc = cfg.get("parallelism_config") or {}
    if not pc:
        return {}
    v = {**PARALLELISM_LAUNCH_DEFAULTS, **pc}
    names = ["dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend"]
    if int(v["parallelism_config_cp_size"]) > 1:
        names.append("cp_comm_strategy")
    if int(v["parallelism_config_sp_size"]) > 1:
        names += ["sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"]
    env = {f"PARALLELISM_CONFIG_{n.upper()}": str(v[f"parallelism_config_{n}"]) for n in names}
    return {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", **env}


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
    mp = mixed_precision_value(cfg.get("mixed_precision"))
    if mp not in MIXED_PRECISION:
        p.append(f"{path}: mixed_precision {mp!r} is not supported; use 'no', fp16 or bf16")
    p += _parallelism_problems(cfg, path)
    fsdp = cfg.get("fsdp_config") or {}
    if not isinstance(fsdp, Mapping):
        return p + [f"{path}: fsdp_config must be a mapping of fsdp_* keys to values"]
    return p + _fsdp_problems(_normalize_fsdp(fsdp), path)


def read_accelerate_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Load and check an accelerate FSDP config file; fsdp_config keys come back with their fsdp_ prefix.

    Raises ConfigError listing every problem (missing file, not FSDP, unknown keys, invalid values).
    """

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
    env = {"ACCELERATE_MIXED_PRECISION": mixed_precision_value(cfg.get("mixed_precision")), **_dynamo_env(cfg)}
    if cfg.get("debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    env["ACCELERATE_USE_FSDP"] = "true"
    values = _fsdp_values(cfg)
    for key, var, lower in _FSDP_ENV:
        if values[key] is not None:
            env[var] = str(values[key]).lower() if lower else str(values[key])
    return {**env, **_parallelism_env(cfg)}


def fsdp_settings_from_yaml(path: str | os.PathLike) -> FSDPSettings:
    """The FSDPSettings an accelerate FSDP config file means (equal to reading `accelerate launch`'s environment)."""
    cfg = read_accelerate_yaml(path)
    v = _fsdp_values(cfg)
    s = FSDPSettings(enabled=True)
    s.sharding_strategy = strategy_name(v["fsdp_sharding_strategy"]) or s.sharding_strategy
    named, s.reshard_after_forward = reshard_setting(
        str(v["fsdp_reshard_after_forward"]).lower(), str(v["fsdp_version"])
    )
    s.sharding_strategy = named or s.sharding_strategy
    s.offload_params = as_bool(v["fsdp_offload_params"])
    s.cpu_ram_efficient_loading = as_bool(v["fsdp_cpu_ram_efficient_loading"])
    s.sync_module_states = as_bool(v["fsdp_sync_module_states"])
    s.forward_prefetch = as_bool(v["fsdp_forward_prefetch"])
    s.use_orig_params = as_bool(v["fsdp_use_orig_params"])
    s.activation_checkpointing = as_bool(v["fsdp_activation_checkpointing"])
    for field_, key in (
        ("state_dict_type", "fsdp_state_dict_type"),
        ("backward_prefetch", "fsdp_backward_prefetch"),
        ("auto_wrap_policy", "fsdp_auto_wrap_policy"),
    ):
        if v[key] is not None:
            setattr(s, field_, str(v[key]).upper())
    s.transformer_cls_to_wrap = v["fsdp_transformer_layer_cls_to_wrap"] or None
    s.mixed_precision = mixed_precision_value(cfg.get("mixed_precision"))
    s.parallelism = parallelism_from_env(_parallelism_env(cfg))
    if s.parallelism:  # the strategy its sizes map to on the file's processes, as `shardtune train` maps it
        world = int(cfg.get("num_processes") or 1)
        s.sharding_strategy, problems = parallelism_plan(s, world, world // max(int(cfg.get("num_machines") or 1), 1))
        if problems:
            raise ConfigError([f"{path}: {p}" for p in problems])
    return s
