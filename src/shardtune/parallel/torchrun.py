"""torchrun (`torch.distributed.run`) as shardtune's launchers start it (`shardtune launch`, the demo): the same agent,
arguments and reports, with one difference. On a stop signal torch's agent stops the workers, then ends with the
traceback of its own SignalException; here it ends with one line and exit code 3, a stopped run's
(runtime.stop.STOPPED_EXIT_CODE, docs/errors.md), whether the signal reached it through `shardtune launch` or
straight from a scheduler, since each worker has already said how it stopped (a checkpoint to resume, or nothing
trained yet). A worker that dies (a signal, an
error's exit code) ends torch's agent with the traceback of a ChildFailedError and a report; here with one line
naming the rank, its exit code or signal and where its output is (`failure_line`), and the exit code of that rank
(128 + the signal's number for a signal, as a shell reports it). The agent has stopped the other workers by then.

`command(args)` is the command line; `python -m shardtune.parallel.torchrun ARGS` takes torchrun's ARGS.
"""

from __future__ import annotations

import os
import signal
import sys

from shardtune.runtime.stop import STOPPED_EXIT_CODE

MODULE = "shardtune.parallel.torchrun"


def command(args: list[str]) -> list[str]:
    """The command line that runs torchrun with `args` in this Python."""
    return [sys.executable, "-m", MODULE, *args]


def run(argv: list[str] | None = None) -> int:
    # Imported here: the launchers import this module for `command` alone, and --dry_run and --help need no torch.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
    except SignalException as e:
        print(f"torchrun: stopped by {e.sigval.name}; its workers were stopped.", file=sys.stderr, flush=True)
        return STOPPED_EXIT_CODE
    except ChildFailedError as e:
        line, code = failure_line(e.failures)
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


def root_cause(failures: dict) -> tuple[int, object]:
    """The rank whose failure ended the run, from torchrun's {global rank: ProcessFailure}. torch's own pick is the
    earliest by whole seconds, which a rank that died and the peers that failed after it (exit code 1: lost contact)
    or that the agent stopped (SIGTERM) often share: a signal other than SIGTERM comes first, then an exit code,
    then SIGTERM; within each, the earliest, then the lowest rank."""

    def key(item):
        rank, f = item
        return (f.exitcode == -signal.SIGTERM, f.exitcode >= 0, f.timestamp, rank)

    return min(failures.items(), key=key)


def failure_line(failures: dict) -> tuple[str, int]:
    """One line for a run that lost a worker, and the exit code to end with: the rank, its exit code or signal,
    where its output or error is."""
    rank, f = root_cause(failures)
    how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
    code = 128 - f.exitcode if f.exitcode < 0 else f.exitcode or 1
    if os.path.isfile(f.error_file):  # a worker run under torch's @record wrote its exception there
        message = f.message.get("message", "") if isinstance(f.message, dict) else f.message  # its traceback
        last = (str(message).strip().splitlines() or ["(empty)"])[-1]
        where = f"its error: {last[:300]} (in {f.error_file})"
    else:  # torchrun passes each worker's stdout and stderr through to its own
        where = "its output (if it wrote any before it ended) is above in this output"
    line = (
        f"torchrun: rank {rank} (local rank {f.local_rank}, pid {f.pid}) {how}, and the other workers were stopped; "
        f"{where}. Fix its cause, then run again or resume with --resume_from_checkpoint latest."
    )
    return line, code


if __name__ == "__main__":
    sys.exit(run())
