"""Memory planning for shardtune runs: estimates from config.json alone (see docs/plan.md)."""

from shardtune.planning.estimate import MemoryEstimate, estimate_memory
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import load_model_config, lora_param_count, resolve_lora_targets
from shardtune.planning.shape import ModelShape, base_param_count
from shardtune.planning.state import model_state_bytes_per_rank

__all__ = [
    "MemoryEstimate",
    "ModelShape",
    "PlanInputs",
    "base_param_count",
    "estimate_memory",
    "load_model_config",
    "lora_param_count",
    "model_state_bytes_per_rank",
    "resolve_lora_targets",
]
