"""The CUDA caching allocator settings shardtune's processes run with.

When the user has set no allocator configuration, shardtune sets PYTORCH_ALLOC_CONF=expandable_segments:True before
anything touches CUDA (`shardtune.cli.run_command`, the entry of every command, does it first, for the script,
`python -m shardtune` and a command's `main` called in process alike; torchrun/accelerate workers inherit it or
redo it). With expandable segments each stream's large pool grows one mapping in 20 MiB pages instead of taking a
new cudaMalloc segment whenever no cached block is large enough, so blocks freed in one size serve later requests
of another. Replaying the allocation history of shardtune's own steps through the allocator's rules
(bench/allocator_replay.py, docs/plan.md "The caching allocator") reserves 1-9% less with it over the calibration
runs.

torch reads PYTORCH_ALLOC_CONF, and when it is unset the older PYTORCH_CUDA_ALLOC_CONF (PYTORCH_HIP_ALLOC_CONF on
ROCm); a configuration the user set in any of them is kept as it is (`expandable_segments:False` turns this off).
`shardtune plan` estimates for the setting the run will have.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

VARIABLE = "PYTORCH_ALLOC_CONF"
# In the order torch reads them: the first one set is the configuration.
VARIABLES = (VARIABLE, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
DEFAULT = "expandable_segments:True"


def configuration(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, value) of the allocator configuration torch would read from `env`, or None."""
    env = os.environ if env is None else env
    for name in VARIABLES:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def apply_default(env: MutableMapping[str, str] | None = None) -> bool:
    """Set shardtune's allocator settings unless the user chose theirs; True when it set them."""
    env = os.environ if env is None else env
    if configuration(env) is not None:
        return False
    env[VARIABLE] = DEFAULT
    return True


def expandable_segments(env: Mapping[str, str] | None = None) -> bool:
    """Whether a process started with `env` (after apply_default) runs with expandable segments: the last
    `expandable_segments:<bool>` of the configuration (comma-separated `key:value` options, as torch parses them);
    shardtune's default when none is set."""
    found = configuration(env)
    conf = found[1] if found else DEFAULT
    value = False
    for option in conf.split(","):
        key, _, val = option.partition(":")
        if key.strip() == "expandable_segments":
            value = val.strip().lower() == "true"
    return value


def describe(env: Mapping[str, str] | None = None) -> str:
    """The configuration as a log line's `NAME=value`."""
    found = configuration(env)
    return f"{found[0]}={found[1]}" if found else "torch's defaults"
