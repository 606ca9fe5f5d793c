"""Python's cyclic garbage collector over a command's life.

A start-up imports torch, transformers and peft and builds the model: some 800,000 Python objects, nearly all of
them kept for the whole run. While they are made, CPython's oldest-generation collections scan all of them again
and again as the heap grows (7 passes, 0.5 s of a 5 s start-up on a 2-core Xeon), and the interpreter's exit
scans them again (0.9 s of its 1.1 s), to find little: what a start-up makes it keeps. So:

- while a command starts (`during_command`), only the young generations are collected: the short-lived cycles
  start-up code leaves still go at once, the oldest generation waits;
- when training starts (`training_starts`), one full collection frees what start-up left behind, and the
  survivors are frozen (gc.freeze: left out of every later scan), so that a step's collections scan only what
  the steps make. torchtitan's `GarbageCollection` and Megatron's manual GC schedule collections for the same
  reason (a multi-second full pass in one rank's step stalls every rank); here collection stays automatic;
- at the end, a program (`shardtune ...`, `python -m shardtune`) exits with everything frozen; a caller running a
  command in its own process gets its collector back as it was, frozen objects included.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# A threshold for the oldest generation that start-up never reaches (CPython counts young collections against it).
NEVER = 2**30
# The thresholds each running command found (a command may run another in its process: the demo runs train).
_RUNNING: list[tuple[int, int, int]] = []


@contextlib.contextmanager
def during_command(program: bool) -> Iterator[None]:
    """Around one command: the oldest generation waits until `training_starts` (or the end); at the end, a
    `program` freezes everything for the interpreter's exit, otherwise the collector is put back as it was."""
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.set_threshold(thresholds[0], thresholds[1], NEVER)
    _RUNNING.append(thresholds)
    try:
        yield
    finally:
        _RUNNING.pop()
        if program:
            gc.freeze()  # the process ends with this command: nothing left to collect but its exit's scans
        else:
            if frozen == 0:  # what training_starts froze goes back to the collector (the caller froze nothing)
                gc.unfreeze()
            gc.set_threshold(*thresholds)


def training_starts() -> None:
    """Once the run is built: collect what start-up left behind, freeze what it keeps, and let the oldest
    generation be collected again (at the threshold the command found), now over what the steps make only.
    Outside a command (a test driving the recipe directly) it does nothing: nothing would unfreeze."""
    if not _RUNNING:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_RUNNING[-1])
