"""Accelerate's FSDP settings (YAML file or the FSDP_*/ACCELERATE_* environment its launcher sets)."""

from __future__ import annotations

from collections.abc import Mapping

from shardtune.config import FSDPSettings

_STRATEGY_BY_NUMBER = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                       "5": "HYBRID_SHARD_ZERO2"}


def _bool(v: str | None, default: bool) -> bool:
    if v is None or v == "":
        return default
    return v.strip().lower() in ("1", "true", "yes", "y", "on")


def fsdp_settings_from_env(env: Mapping[str, str]) -> FSDPSettings:
    """Read the variables that `accelerate launch` (or `shardtune launch`) sets from an FSDP config."""
    s = FSDPSettings()
    s.enabled = _bool(env.get("ACCELERATE_USE_FSDP"), False)
    strategy = env.get("FSDP_SHARDING_STRATEGY", s.sharding_strategy)
    s.sharding_strategy = _STRATEGY_BY_NUMBER.get(strategy, strategy).upper()
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
    if env.get("FSDP_RESHARD_AFTER_FORWARD"):
        s.reshard_after_forward = _bool(env["FSDP_RESHARD_AFTER_FORWARD"], True)
    s.mixed_precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return s
