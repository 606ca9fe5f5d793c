"""Former home of the accelerate-config reading and `shardtune launch`, split into shardtune.fsdp_settings (the
settings and the environment), shardtune.accelerate_config (the YAML) and shardtune.launch (the command).

Only re-exports, for the importers not yet moved to those modules (shardtune.plan, shardtune.train); remove this
module once they import from the new ones.
"""

from shardtune.accelerate_config import accelerate_env, fsdp_settings_from_yaml, read_accelerate_yaml
from shardtune.fsdp_settings import fsdp1_only_notes, fsdp_settings_from_env
from shardtune.launch import build_launch, main, torchrun_args
from shardtune.parallel import STRATEGIES
from shardtune.parallel import STRATEGY_BY_NUMBER as _STRATEGY_BY_NUMBER

__all__ = [
    "STRATEGIES",
    "_STRATEGY_BY_NUMBER",
    "accelerate_env",
    "build_launch",
    "fsdp1_only_notes",
    "fsdp_settings_from_env",
    "fsdp_settings_from_yaml",
    "main",
    "read_accelerate_yaml",
    "torchrun_args",
]
