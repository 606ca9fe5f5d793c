"""torchrun (`torch.distributed.run`) as shardtune's launchers start it (`shardtune launch`, the demo): the same agent,
arguments and reports, with one difference. On a stop signal torch's agent stops the workers, then ends with the
traceback of its own SignalException; here it ends with one line and exit code 1 (torchrun's), since each worker
has already said how it stopped (a checkpoint to resume, or nothing trained yet). A failed worker still gets
torchrun's report naming the failed rank.

`command(args)` is the command line; `python -m shardtune.parallel.torchrun ARGS` takes torchrun's ARGS.
"""

from __future__ import annotations

import sys

MODULE = "shardtune.parallel.torchrun"


def command(args: list[str]) -> list[str]:
    """The command line that runs torchrun with `args` in this Python."""
    return [sys.executable, "-m", MODULE, *args]


def run(argv: list[str] | None = None) -> int:
    # Imported here: the launchers import this module for `command` alone, and --dry_run and --help need no torch.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(argv)
    except SignalException as e:
        print(f"torchrun: stopped by {e.sigval.name}; its workers were stopped.", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
