"""Testing hooks: named points where tests inject faults or observe shardtune from outside, through the
environment, without the training loop or the writers knowing what a test does there.

A component announces a point with `at(point, **where)`; nothing happens unless a hook is registered for it.
Hooks come from the environment, read each time a point is reached (so torchrun's workers need no setup):

- `SHARDTUNE_FAULT=<point>:<step>:<rank>[:<KILL|TERM|INT|ENOSPC|PARENT_TERM|PARENT_INT>]` (KILL by default): that
  rank sends itself the signal, or raises "No space left on device" (ENOSPC), at the point; PARENT_<SIG> sends the
  signal to its parent process instead, the launcher (torchrun's agent), which forwards it to every worker as it
  does on a preemption or a Ctrl-C. Points: `step` (after optimizer step `step`
  and its log line; reached through the loop's step callbacks, `step_callbacks`), `save` (mid-save: this rank's
  files of checkpoint-<step> written, the folder not yet renamed), `export` (the final adapter or model files
  written to their temporary folder, not yet moved into place; `step` is the last step), `tokenize` (a split's
  tokenizing tasks handed to the worker processes, which are running; `step` is 0) and `load` (the data prepared,
  the model about to be loaded; `step` is 0). KILL, TERM and INT test what a signal does at that stage.
- `SHARDTUNE_LOAD_LOG=<dir>`: a rank that reads the model's checkpoint files touches `<dir>/loaded-rank<r>`
  (point `checkpoint_read`), so that tests can see which ranks read the weights.

Tests may also `register` a hook directly in-process. docs/testing.md lists the points.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

FAULT_ENV = "SHARDTUNE_FAULT"
LOAD_LOG_ENV = "SHARDTUNE_LOAD_LOG"
POINTS = ("step", "save", "export", "tokenize", "load", "checkpoint_read")
FAULT_POINTS = ("step", "save", "export", "tokenize", "load")  # where SHARDTUNE_FAULT may inject

_hooks: dict[str, list[Callable[..., None]]] = {}


def register(point: str, fn: Callable[..., None]) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown hook point {point!r}: one of {', '.join(POINTS)}")
    _hooks.setdefault(point, []).append(fn)


def clear() -> None:
    """Forget the hooks registered in-process (the environment's are read at each point)."""
    _hooks.clear()


def at(point: str, **where) -> None:
    """Announce that this process reached `point` (keywords such as step= and rank=)."""
    for fn in (*_hooks.get(point, ()), *_from_env(point)):
        fn(**where)


def step_callbacks() -> list[Callable]:
    """The training loop's end-of-step callbacks that reach the `step` point: fn(state, rank)."""
    return [lambda state, rank: at("step", step=state.step, rank=rank)]


def _from_env(point: str) -> list[Callable[..., None]]:
    """The environment's hooks for `point`, read each time (a few string operations; tests set it per run)."""
    out = []
    if spec := os.environ.get(FAULT_ENV):
        fault_at, inject = _fault(spec)
        if fault_at == point:
            out.append(inject)
    if point == "checkpoint_read" and (folder := os.environ.get(LOAD_LOG_ENV)):

        def touch(rank: int, **_) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"loaded-rank{rank}").touch()

        out.append(touch)
    return out


def _fault(spec: str) -> tuple[str, Callable[..., None]]:
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[0] not in FAULT_POINTS:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected <{'|'.join(FAULT_POINTS)}>:<step>:<rank>"
            "[:<KILL|TERM|INT|ENOSPC|PARENT_TERM|PARENT_INT>]."
        )
    point, at_step, at_rank = parts[0], int(parts[1]), int(parts[2])
    what = parts[3] if len(parts) == 4 else "KILL"

    def inject(step: int, rank: int, **_) -> None:
        if step != at_step or rank != at_rank:
            return
        print(f"{FAULT_ENV}: rank {rank} injects {what} at {point} {step}.", file=sys.stderr, flush=True)
        if what == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        target = os.getppid() if what.startswith("PARENT_") else os.getpid()
        os.kill(target, getattr(signal, "SIG" + what.removeprefix("PARENT_")))

    return point, inject
