"""SIGTERM and SIGINT (preemption, Ctrl-C) outside the training loop.

Inside the loop, `trainer.StopFlag` lets the current step finish, saves a checkpoint and the run exits with code 3.
Before the loop (the checks, tokenizing, loading the model or a checkpoint) there is nothing to save yet, so the
run stops at once: the handler installed here raises `Stopped` in the main thread, the `with`/`finally` blocks on
the way remove what they were writing (a cache's or an output's temporary folder) and end their helper processes
(the tokenizer's workers), and `train.main` prints one line and returns the same code 3. `Stopped` derives from
BaseException, as KeyboardInterrupt does, so that no `except Exception` on the way swallows it.

torchrun forwards the signal it receives to every worker, and after a Ctrl-C sends SIGTERM too: a second signal
within `signals.SAME_STOP_WITHIN_S` is the same stop; one later than that ends the process at once, as with StopFlag.

The handler raises only where the exception can propagate (`runtime.signals`): inside an import it waits for the
import's end, and a `Stopped` that a finalizer swallowed is raised again.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from shardtune.runtime.signals import SAME_STOP_WITHIN_S, Redelivery

# The exit code of a run (or a launch) stopped by a signal (docs/errors.md).
STOPPED_EXIT_CODE = 3


class Stopped(BaseException):
    """A stop signal arrived while the run was at `stage` (no training step had to be finished)."""

    def __init__(self, signal_name: str, stage: str):
        self.signal_name, self.stage = signal_name, stage
        super().__init__(f"{signal_name} while {stage}")


class StopHandler:
    """Raise Stopped on the first SIGTERM/SIGINT; `stage` says what the run is doing, for the message."""

    def __init__(self):
        self.stage, self.signal_name, self._first, self._before = "starting", None, None, {}
        self._redelivery, self._hook_before = Redelivery(), None

    def install(self) -> StopHandler:
        self.stage, self.signal_name, self._first = "starting", None, None
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._before[sig] = signal.signal(sig, self._handler)
        self._hook_before, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def restore(self) -> None:
        """Put back the handlers from before `install` (the loop's own replaced them meanwhile), so that a caller
        of `shardtune.cli.main` in its own process (a test, a plugin script) gets its Ctrl-C back."""
        self._redelivery.cancel()
        for sig, handler in self._before.items():
            signal.signal(sig, handler)
        self._before.clear()
        if self._hook_before is not None:
            sys.unraisablehook, self._hook_before = self._hook_before, None

    def at(self, stage: str) -> None:
        self.stage = stage

    @property
    def received(self) -> bool:
        return self._first is not None

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first is None and self._redelivery.put_off(signum, frame):
            return
        if self._first is None:
            self._first, self.signal_name = now, signal.Signals(signum).name
            raise Stopped(self.signal_name, self.stage)
        if now - self._first > SAME_STOP_WITHIN_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # else: the same stop, forwarded once more by the launcher

    def _unraisable(self, info) -> None:
        """`Stopped` raised in a finalizer or a weakref callback, which cannot pass it on: raise it again."""
        if not isinstance(info.exc_value, Stopped):
            self._hook_before(info)
            return
        self._first = None
        self._redelivery.again(signal.Signals[info.exc_value.signal_name])


def stopped_message(e: BaseException, *, resuming: bool) -> str:
    """The one line a run stopped outside the loop prints: what it was doing, that nothing is left half-written,
    and how to go on."""
    what = f"{e.signal_name} while {e.stage}" if isinstance(e, Stopped) else "SIGINT"
    again = (
        "run the same command again to continue from the same checkpoint"
        if resuming
        else ("nothing was trained, so there is nothing to resume; run the same command again to start")
    )
    return f"Stopped by {what}, before the first training step: {again}. No temporary files were left."
