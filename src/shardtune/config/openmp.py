"""How shardtune's CPU threads wait at OpenMP's barriers when another job shares the machine.

torch's CPU kernels run each operation on OpenMP threads that meet at a barrier when it ends. A thread that arrives
first spins there (libgomp's default: up to 300,000 polls) before it sleeps. On cores another job is using, the
thread it waits for is often descheduled, and the spinning one burns the core that thread needs: on the speed
bench's run (2 threads on 2 cores) with one other one-thread job, shardtune trained at 185 tokens/s with the
default, 260 with 5,000 polls and 320 with no spinning (OMP_WAIT_POLICY=PASSIVE); on the idle machine at 580, 535
and 445 (docs/speed.md, "The whole process against TRL + PEFT"). Neither setting is best on both, so it is chosen
at start: when other processes keep a quarter of the CPUs or more busy over a short sample (Linux's /proc/stat),
the threads sleep at once; otherwise OpenMP's default stays.

Set before torch loads libgomp (`shardtune.cli.prepare_process`, the entry of every command), unless the user
chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT, kept as they are). Child processes (torchrun's workers, the
data processes) inherit it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, MutableMapping

VARIABLE = "OMP_WAIT_POLICY"
SHARED = "PASSIVE"
# Either one is the user's choice of how threads wait: shardtune then sets nothing.
USER_CHOICES = (VARIABLE, "GOMP_SPINCOUNT")
# Other processes' share of the CPUs from which the machine counts as shared: one busy core of four, or of two.
SHARED_FRACTION = 0.25
SAMPLE_S = 0.1  # 10 clock ticks per CPU at Linux's 100 Hz: enough to tell a busy core from an idle one


def cpu_ticks(path: str = "/proc/stat") -> tuple[int, int]:
    """(all, idle) clock ticks of every CPU since boot, from the first line of /proc/stat."""
    with open(path) as f:
        fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(fields), fields[3] + fields[4]


def busy_fraction(read: Callable[[], tuple[int, int]] = cpu_ticks, sample_s: float = SAMPLE_S) -> float | None:
    """The CPUs' busy share over `sample_s` seconds while this process sleeps (so: other processes'), or None
    where it cannot be read (not Linux)."""
    try:
        total0, idle0 = read()
        time.sleep(sample_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return None if total <= 0 else 1 - (idle1 - idle0) / total


def apply_default(
    env: MutableMapping[str, str] | None = None, busy: Callable[[], float | None] = busy_fraction
) -> bool:
    """Let the threads sleep at once on a machine other processes keep busy, unless the user chose how OpenMP
    threads wait or torch is loaded already (then nothing would read it: a program calling a command in its own
    process; its child processes decide for themselves); True when it set it."""
    env = os.environ if env is None else env
    if any(env.get(name, "").strip() for name in USER_CHOICES):
        return False
    if "torch" in sys.modules:  # libgomp read its settings when torch loaded it (a caller running a command)
        return False
    if int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
        # one of several ranks on this machine: its siblings, starting beside it, would count as other jobs. A
        # launcher that sampled before starting them (`shardtune launch`) passed its choice down.
        return False
    share = busy()
    if share is None or share < SHARED_FRACTION:
        return False
    env[VARIABLE] = SHARED
    return True
