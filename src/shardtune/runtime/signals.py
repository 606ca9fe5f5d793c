"""Where a signal handler may raise: the stop (SIGTERM, Ctrl-C) must reach the command, wherever it arrives.

Python runs a signal handler in the main thread at the next bytecode, wherever that is. Two places there cannot pass
an exception on:

- **An import.** Module code run by a C extension's initialiser (torch's and bitsandbytes' operator registrations,
  through pybind11): an exception raised there becomes a C++ exception nothing catches, and the process aborts
  ("terminate called after throwing an instance of 'pybind11::error_already_set'", exit -6) instead of stopping.
- **A finalizer or a weakref callback** (the garbage collector runs them between any two bytecodes): Python prints
  the exception as "Exception ignored in ..." with its traceback and goes on, so the stop is lost.

`Redelivery` sends such a signal again to the main thread: after the import has ended (`put_off`, asked by the
handler before it raises), or at once for one a finalizer swallowed (`again`, from `sys.unraisablehook`). The
signal, not a flag, so that a blocking call in the main thread returns to run the handler, as it would have.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

# The import system's own frames: a frame below one of them runs inside an import.
_IMPORT_MACHINERY = frozenset({"<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>"})
# How often the thread waiting for an import to end looks at the main thread: a stop put off lands within this
# time of the import's end.
_POLL_S = 0.01
# Two stop signals this close together are one stop (torchrun forwards a signal it got twice, and SIGTERM after a
# Ctrl-C); a later one means the user insists: it ends the run at once (runtime.stop, training.trainer.StopFlag),
# or is taken at once while an import has one put off.
SAME_STOP_WITHIN_S = 2.0


def importing(frame) -> bool:
    """Whether `frame` (a signal handler's: what the main thread was running) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


class Redelivery:
    """Signals a handler did not raise for where they arrived, sent again to the main thread once it is out of any
    import; `cancel` (when the handler is taken down) drops those not yet sent."""

    def __init__(self):
        self._pending: dict[int, tuple[float, threading.Event]] = {}

    def put_off(self, signum: int, frame) -> bool:
        """Whether the handler of `signum`, which interrupted `frame`, must not raise now: an import is running.
        Then `signum` is sent again once it has ended. Another `signum` while one is put off is the same stop, or
        after SAME_STOP_WITHIN_S taken at once."""
        if signum in self._pending:
            since, _ = self._pending[signum]
            return time.monotonic() - since <= SAME_STOP_WITHIN_S
        if not importing(frame):
            return False
        self.again(signum)
        return True

    def again(self, signum: int) -> None:
        """Send `signum` to the main thread again, as soon as it is out of any import."""
        cancelled = threading.Event()
        self._pending[signum] = (time.monotonic(), cancelled)
        threading.Thread(target=self._send, args=(signum, cancelled), daemon=True, name="shardtune-signal").start()

    def cancel(self) -> None:
        for _, cancelled in self._pending.values():
            cancelled.set()
        self._pending.clear()

    def _send(self, signum: int, cancelled: threading.Event) -> None:
        main = threading.main_thread().ident
        while not cancelled.wait(_POLL_S):
            frame = sys._current_frames().get(main)
            if frame is None:  # the main thread has ended
                return
            if not importing(frame):
                self._pending.pop(signum, None)
                signal.pthread_kill(main, signum)
                return
