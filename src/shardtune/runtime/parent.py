"""Processes that stop when the process that started them dies.

`kill -9` of torchrun (or of `shardtune launch`, which starts torchrun) cannot be forwarded: the killed process
runs no code. Its workers would train on, holding their GPUs, with nobody to collect them. So:

- each worker (whose parent is the torchrun agent) calls `stop_with_parent()`: on Linux the kernel sends it
  SIGUSR2 when its parent dies (prctl PR_SET_PDEATHSIG); everywhere, a daemon thread polls os.getppid(), which
  changes when the parent dies (the orphan is re-parented to init or a subreaper). Either way the worker sends
  itself SIGTERM, which stops a run as a preemption does (the ranks agree on a step, save a checkpoint and exit
  with code 3, see docs/checkpoints.md), and it ends itself after `grace_s` if that has not happened;
- `shardtune launch` starts torchrun with `child_preexec` as preexec_fn, so that torchrun gets SIGTERM when
  the launcher dies and forwards it to its workers.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not only the process; the worker's
SIGUSR2 handler therefore checks that the parent process really is gone before stopping.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
# torchrun's own grace between SIGTERM and SIGKILL for its workers: a step plus a save must fit in it.
GRACE_S = 30.0


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_with_parent_process() -> None:
    """In a helper process (a tokenizer worker): SIGTERM when the process that started it dies, even by SIGKILL."""
    _set_pdeathsig(signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def child_preexec() -> None:
    """preexec_fn for a launched child (runs in the child before exec): SIGTERM when the launcher dies."""
    _set_pdeathsig(signal.SIGTERM)


def stop_with_parent(grace_s: float = GRACE_S, poll_s: float = 0.5) -> None:
    """Stop this process (SIGTERM, then exit after grace_s) once its parent process is gone."""
    parent = os.getppid()
    if parent <= 1:  # already orphaned, or started by init: nothing to watch
        return
    state = {"stopping": False}

    def lost() -> None:
        if state["stopping"]:
            return
        state["stopping"] = True
        print(
            f"shardtune: the launcher (pid {parent}) is gone; stopping this worker (pid {os.getpid()}).",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=_exit_after, args=(grace_s,), daemon=True).start()

    def on_signal(signum, frame) -> None:
        if os.getppid() != parent:
            lost()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, on_signal)
        _set_pdeathsig(signal.SIGUSR2)
    if os.getppid() != parent:  # died between getppid and prctl
        lost()
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        lost()

    threading.Thread(target=watch, daemon=True, name="shardtune-parent-watch").start()


def _exit_after(grace_s: float) -> None:
    time.sleep(grace_s)
    print(f"shardtune: still running {grace_s:.0f} s after the launcher died; exiting.", file=sys.stderr, flush=True)
    os._exit(1)
