"""The CUDA caching allocator settings shardtune's processes run with.

When PYTORCH_CUDA_ALLOC_CONF is not set, shardtune sets it to `expandable_segments:True` before anything touches
CUDA (`shardtune <command>` does it first, and torchrun/accelerate workers inherit or redo it). With expandable
segments each stream's large pool grows one mapping in 20 MiB pages instead of taking a new cudaMalloc segment
whenever no cached block is large enough, so blocks freed in one size serve later requests of another. Replaying
the allocation history of shardtune's own steps through the allocator's rules (bench/allocator_replay.py,
docs/plan.md "The caching allocator") reserves 1-9% less with it over the calibration runs, and the fragmentation
left is about half. A PYTORCH_CUDA_ALLOC_CONF the user set is kept as it is; `expandable_segments:False` turns
this off. `shardtune plan` estimates for the setting the run will have.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def apply_default(env: MutableMapping[str, str] | None = None) -> bool:
    """Set shardtune's allocator settings unless the user chose theirs; True when it set them."""
    env = os.environ if env is None else env
    if env.get(VARIABLE, "").strip():
        return False
    env[VARIABLE] = DEFAULT
    return True


def expandable_segments(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether a process started with `env` (after apply_default) runs with expandable segments: the last
    `expandable_segments:<bool>` of PYTORCH_CUDA_ALLOC_CONF (comma-separated `key:value` options, as torch parses
    them); shardtune's default when the variable is unset."""
    env = os.environ if env is None else env
    conf = env.get(VARIABLE, "").strip() or DEFAULT
    value = None
    for option in conf.split(","):
        key, _, val = option.partition(":")
        if key.strip() == "expandable_segments":
            value = val.strip().lower() == "true"
    return bool(value)
