"""The FSDP settings of a run (what accelerate's `fsdp_config` says) and how `shardtune train` reads them from the
FSDP_*/ACCELERATE_* environment that `accelerate launch` or `shardtune launch` sets.

Reading the accelerate YAML itself is shardtune.config.accelerate; starting the processes is shardtune.commands.launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardtune.config.errors import ConfigError
from shardtune.parallel.dims import STRATEGIES, STRATEGY_BY_NUMBER, ParallelDims


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
    # accelerate's parallelism_config (PARALLELISM_CONFIG_* variables): {"dp_replicate_size": "2", ...} as given,
    # checked and mapped onto the sharding strategy by parallelism_plan; None when the launch has none.
    parallelism: dict[str, str] | None = None
    # One process (world size 1), SHARDTUNE_FSDP_SINGLE_PROCESS: "auto" trains the plain module without fully_shard
    # where that path is verified and saves memory (not with fsdp_offload_params, which is FSDP2's offload, nor for
    # mixed-precision full fine-tuning: shardtune.parallel.parallelize.use_fsdp); "fsdp" keeps FSDP; "no_fsdp" skips it
    # but with fsdp_offload_params.
    single_process: str = "auto"


# ---------------------------------------------------------------------------------------------------------------
# Values as accelerate writes them


def env_bool(v: str | None, default: bool) -> bool:
    """An environment value ("true", "1", "yes", ...) as a bool; unset or empty: `default`."""
    if v is None or v == "":
        return default
    return v.strip().lower() in ("1", "true", "yes", "y", "on")


def as_bool(v: Any) -> bool:
    """A YAML value (bool, or a string such as accelerate's own defaults) as a bool."""
    return v if isinstance(v, bool) else env_bool(str(v), False)


def strategy_name(v: Any) -> str | None:
    """FULL_SHARD, ... or accelerate's numbers 1..5 as a strategy name (parallel.dims); None if v is not one."""
    s = str(v).strip().upper()
    s = STRATEGY_BY_NUMBER.get(s, s)
    return s if s in STRATEGIES else None


def mixed_precision_value(v: Any) -> str:
    """The YAML's mixed_precision as accelerate passes it on (lower case); an unquoted `no` is YAML's False."""
    return "no" if v is None or v is False else str(v).lower()


def reshard_setting(value: str, version: str) -> tuple[str | None, bool | None]:
    """FSDP_RESHARD_AFTER_FORWARD → (sharding strategy it names, reshard_after_forward).

    `accelerate config` writes the FSDP1 strategy under fsdp_reshard_after_forward (it deprecates
    fsdp_sharding_strategy), so a strategy name there wins. A boolean counts only under FSDP_VERSION 2: under
    FSDP1 the launcher always sets "true" next to the strategy, which alone decides.
    """
    strategy = strategy_name(value)
    if strategy is not None:
        return strategy, None
    return None, (env_bool(value, True) if version.strip() == "2" else None)


# ---------------------------------------------------------------------------------------------------------------
# Environment → settings


def fsdp_settings_from_env(env: Mapping[str, str]) -> FSDPSettings:
    """Read the variables that `accelerate launch` (or `shardtune launch`) sets from an FSDP config."""
    s = FSDPSettings()
    s.enabled = env_bool(env.get("ACCELERATE_USE_FSDP"), False)
    strategy = env.get("FSDP_SHARDING_STRATEGY", s.sharding_strategy).strip().upper()
    s.sharding_strategy = STRATEGY_BY_NUMBER.get(strategy, strategy)
    if env.get("FSDP_RESHARD_AFTER_FORWARD"):
        named, s.reshard_after_forward = reshard_setting(
            env["FSDP_RESHARD_AFTER_FORWARD"], env.get("FSDP_VERSION", "1")
        )
        s.sharding_strategy = named or s.sharding_strategy
    s.offload_params = env_bool(env.get("FSDP_OFFLOAD_PARAMS"), s.offload_params)
    s.cpu_ram_efficient_loading = env_bool(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING"), s.cpu_ram_efficient_loading)
    s.sync_module_states = env_bool(env.get("FSDP_SYNC_MODULE_STATES"), s.sync_module_states)
    s.state_dict_type = env.get("FSDP_STATE_DICT_TYPE", s.state_dict_type).upper()
    s.backward_prefetch = env.get("FSDP_BACKWARD_PREFETCH", s.backward_prefetch).upper()
    s.forward_prefetch = env_bool(env.get("FSDP_FORWARD_PREFETCH"), s.forward_prefetch)
    s.auto_wrap_policy = env.get("FSDP_AUTO_WRAP_POLICY", s.auto_wrap_policy).upper()
    s.transformer_cls_to_wrap = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
    if "FSDP_USE_ORIG_PARAMS" in env:
        s.use_orig_params = env_bool(env["FSDP_USE_ORIG_PARAMS"], False)
    s.activation_checkpointing = env_bool(env.get("FSDP_ACTIVATION_CHECKPOINTING"), False)
    s.mixed_precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    s.parallelism = parallelism_from_env(env)
    s.single_process = single_process_setting(env.get(SINGLE_PROCESS_ENV, "auto"))
    return s


SINGLE_PROCESS_ENV = "SHARDTUNE_FSDP_SINGLE_PROCESS"
SINGLE_PROCESS_CHOICES = ("auto", "fsdp", "no_fsdp")


def single_process_fsdp_reason(setting: str, *, offload: bool, full_mixed_precision: bool) -> str | None:
    """Why one process keeps FSDP, or None when it trains the plain module (the rule `shardtune train` applies,
    shardtune.parallel.parallelize.use_fsdp, and the planner plans): "setting" (SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp),
    "offload" (fsdp_offload_params is FSDP2's CPUOffloadPolicy), "full_mixed_precision" (auto, full fine-tuning
    computing fp32 weights in bf16/fp16: FSDP holds one block's copy at a time, the plain module all of them)."""
    if setting == "fsdp":
        return "setting"
    if offload:
        return "offload"
    if setting == "auto" and full_mixed_precision:
        return "full_mixed_precision"
    return None


def fsdp_reason(world_size: int, setting: str, *, offload: bool, full_mixed_precision: bool) -> str | None:
    """Why a run shards with FSDP, or None when its one process trains the plain module: "processes" (several
    processes always shard), else single_process_fsdp_reason's. The one rule `shardtune train`
    (parallel.parallelize.use_fsdp) and the planner (PlanInputs.fsdp) apply; `full_mixed_precision` is
    config.precision.casts_every_weight."""
    if world_size > 1:
        return "processes"
    return single_process_fsdp_reason(setting, offload=offload, full_mixed_precision=full_mixed_precision)


def single_process_setting(value: str) -> str:
    """SHARDTUNE_FSDP_SINGLE_PROCESS as one of SINGLE_PROCESS_CHOICES (empty: auto); anything else is refused."""
    v = value.strip().lower() or "auto"
    if v not in SINGLE_PROCESS_CHOICES:
        why = (
            f"{SINGLE_PROCESS_ENV}={value!r} is not a choice; set it to auto (one process trains without FSDP "
            "where it can), fsdp (one process keeps FSDP) or no_fsdp (one process never uses FSDP, but with "
            "fsdp_offload_params)."
        )
        raise ConfigError([why])
    return v


# ---------------------------------------------------------------------------------------------------------------
# accelerate's parallelism_config: the sizes of the mesh's axes


# The sizes `accelerate launch` passes as PARALLELISM_CONFIG_<NAME> (accelerate/utils/launch.py), its defaults 1.
PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
_NOT_IMPLEMENTED = {
    "sp_size": "sequence parallelism (accelerate's DeepSpeed Ulysses) is not implemented in shardtune",
}
# The context-parallel choices accelerate passes beside the sizes, and the one shardtune runs: its context
# parallelism all-gathers each row's keys and values (docs/long_context.md, "Why all-gather of K/V"), in its own
# attention (not torch's context_parallel, accelerate's "torch" backend, whose hook forces one causal mask per row).
CP_OPTIONS = {"cp_comm_strategy": "allgather", "cp_backend": "torch"}
# FSDP2 with a replicate axis: a strategy that shards everywhere becomes its hybrid variant.
_HYBRID_OF = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "HYBRID_SHARD_ZERO2"}


def parallelism_from_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The PARALLELISM_CONFIG_* sizes `accelerate launch` sets for a YAML's parallelism_config (with
    ACCELERATE_USE_PARALLELISM_CONFIG), or None when there are none."""
    given = {
        k: env[f"PARALLELISM_CONFIG_{k.upper()}"] for k in PARALLELISM_SIZES if f"PARALLELISM_CONFIG_{k.upper()}" in env
    }
    if not given and not env_bool(env.get("ACCELERATE_USE_PARALLELISM_CONFIG"), False):
        return None
    options = {
        k: env[f"PARALLELISM_CONFIG_{k.upper()}"] for k in CP_OPTIONS if f"PARALLELISM_CONFIG_{k.upper()}" in env
    }
    return {**{k: given.get(k, "1") for k in PARALLELISM_SIZES}, **options}


def parallelism_plan(settings: FSDPSettings, world_size: int, local_world_size: int) -> tuple[str, list[str]]:
    """The sharding strategy that builds the mesh the parallelism_config asks for, and the problems (each naming the
    keys and the fix): a sequence parallel size above 1 is refused; dp_replicate_size × dp_shard_size ×
    cp_size × tp_size must be the processes (cp_size: config.fsdp.context_parallel_size), replicated across machines and sharded within one (HYBRID_SHARD), all
    sharded (FULL_SHARD) or all replicated (NO_SHARD)."""
    strategy, sizes = settings.sharding_strategy, settings.parallelism
    if not sizes:
        return strategy, []
    key = "parallelism_config_{}".format
    n, p = {}, []
    for k, v in ((k, sizes[k]) for k in PARALLELISM_SIZES):
        try:
            n[k] = int(v)
        except ValueError:
            p.append(f"{key(k)} {v!r} is not a whole number; give a size such as 1.")
    if p:
        return strategy, p
    p += [f"{key(k)} {n[k]}: {why}; set {key(k)}: 1." for k, why in _NOT_IMPLEMENTED.items() if n[k] > 1]
    if p:  # the data-parallel sizes follow once these are 1
        return strategy, p
    r, s, cp, tp = n["dp_replicate_size"], n["dp_shard_size"], n["cp_size"], n["tp_size"]
    if cp > 1:
        p += _cp_option_problems(sizes)
    if min(r, s, cp, tp) < 1 or r * s * cp * tp != world_size:
        tp_term = f" × {key('tp_size')} {tp}" if tp != 1 else ""
        p.append(
            f"{key('dp_replicate_size')} {r} × {key('dp_shard_size')} {s} × {key('cp_size')} {cp}{tp_term} = "
            f"{r * s * cp * tp}, but the run has {world_size} processes; make the product {world_size} (e.g. "
            f"{key('dp_shard_size')}: {max(world_size // max(cp * tp, 1), 1)})."
        )
    if p:
        return strategy, p
    # the data-parallel ranks, each group of cp × tp ranks sharing a batch (config.run checks they fit a machine)
    world_size, local_world_size = world_size // (cp * tp), max(local_world_size // (cp * tp), 1)
    # The sizes decide the mesh (as accelerate's FSDP2 builds it from them); the strategy keeps its resharding.
    if r * s == 1:
        return strategy, []
    if r > 1 and s == 1:
        wanted = "NO_SHARD"
    elif strategy == "NO_SHARD":
        return strategy, [_layout_problem(r, s, strategy, world_size, local_world_size)]
    elif r > 1:
        wanted = _HYBRID_OF.get(strategy, strategy)
    else:
        wanted = {v: k for k, v in _HYBRID_OF.items()}.get(strategy, strategy)
    try:
        dims = ParallelDims.build(
            world_size=world_size, local_world_size=local_world_size, rank=0, sharding_strategy=wanted
        )
    except ValueError:  # HYBRID_SHARD over machines of unequal process counts
        dims = None
    if dims is None or (dims.dp_replicate, dims.dp_shard) != (r, s):
        return strategy, [_layout_problem(r, s, strategy, world_size, local_world_size)]
    return wanted, []


def _cp_option_problems(sizes: Mapping[str, str]) -> list[str]:
    """accelerate's cp_comm_strategy and cp_backend, where they ask for what shardtune does not run (CP_OPTIONS)."""
    return [
        f"parallelism_config_{k} {sizes[k]!r}: shardtune's context parallelism all-gathers each row's keys and "
        f"values in its own attention (docs/long_context.md); set parallelism_config_{k}: {want}."
        for k, want in CP_OPTIONS.items()
        if sizes.get(k, want).strip().lower() != want
    ]


def tensor_parallel_size(settings: FSDPSettings) -> int:
    """The parallelism_config's tp_size (1 without one); a whole number once parallelism_plan has passed."""
    sizes = settings.parallelism or {}
    return int(sizes.get("tp_size", "1"))


def context_parallel_size(settings: FSDPSettings) -> int:
    """The parallelism_config's cp_size (1 without one); a whole number once parallelism_plan has passed."""
    sizes = settings.parallelism or {}
    return int(sizes.get("cp_size", "1"))


def _layout_problem(r: int, s: int, strategy: str, world: int, local: int) -> str:
    machines = max(1, world // max(local, 1))
    return (
        f"parallelism_config_dp_replicate_size {r} and parallelism_config_dp_shard_size {s} do not fit "
        f"fsdp_sharding_strategy {strategy} on {machines} machine(s) of {local} processes: shardtune shards within a "
        f"machine and replicates across machines (HYBRID_SHARD: dp_shard_size {local}, dp_replicate_size "
        f"{machines}), shards over all processes (dp_shard_size {world}, dp_replicate_size 1) or, with NO_SHARD, "
        f"replicates on all (dp_replicate_size {world}, dp_shard_size 1); set the sizes to one of these."
    )


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
