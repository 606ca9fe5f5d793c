"""`shardtune <command>`: each command lives in its own module and is imported only when used.

Every command starts through `run_command`: the `shardtune` script and `python -m shardtune` (`main` here), and a
command's `main` called in another program's process (`shardtune.commands.train.main`, as bench/speed.py and the device
check run it). It is the one place that sets up the process before the command touches CUDA.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import signal
import sys

from shardtune.config import cuda_allocator, openmp
from shardtune.runtime import collector
from shardtune.runtime.log import quiet_import_notices, warn0
from shardtune.runtime.signals import Redelivery

COMMANDS = {
    "train": ("shardtune.commands.train", "command", "Fine-tune a model (LoRA, QLoRA, DoRA or full) on FSDP2."),
    "launch": ("shardtune.commands.launch", "main", "Start `shardtune train` on N processes from an accelerate YAML."),
    "plan": ("shardtune.commands.plan", "main", "Estimate per-GPU memory of a run from the model's config alone."),
    "merge": ("shardtune.commands.merge", "main", "Merge a LoRA/DoRA adapter into its base, one shard at a time."),
    "chat": ("shardtune.commands.chat", "main", "Chat with a base model + adapter, or a merged model."),
    "report": ("shardtune.training.metrics", "report_main", "Print a run's summary and draw its loss plot."),
    "eval": ("shardtune.commands.evaluate", "main", "Run lm-evaluation-harness tasks on an adapter or a model."),
    "demo": ("shardtune.commands.demo", "main", "Build the demo model and data, and fine-tune it on 2 CPU processes."),
}


def _usage() -> str:
    lines = ["usage: shardtune <command> [flags]   (shardtune <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def prepare_process() -> None:
    """What a process needs before anything touches CUDA or loads OpenMP: shardtune's allocator settings and how
    OpenMP threads wait (config.openmp) unless the user chose theirs (child processes, torchrun's and accelerate's
    workers, inherit them); libraries' import notices quiet."""
    quiet_import_notices()
    # A program that loaded torch before calling a command keeps OpenMP's settings (read when torch loaded it);
    # only speed differs, so nothing is said.
    openmp.apply_default()
    if not cuda_allocator.apply_default():
        return
    # The caching allocator reads its settings once, when CUDA starts; a program that started it before calling a
    # command in its own process keeps torch's defaults (its child processes still get the setting).
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        warn0(f"CUDA started before shardtune set {cuda_allocator.describe()}: this process keeps torch's defaults.")


def run_command(name: str, argv: list[str], program: bool = False) -> int:
    """Run the command `name` (a key of COMMANDS) with its flags, in this process; `program`: the process ends
    with it (runtime.collector then leaves the interpreter's exit nothing to scan)."""
    prepare_process()
    module, func, _ = COMMANDS[name]
    with collector.during_command(program):
        return int(getattr(importlib.import_module(module), func)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # the `shardtune` script or `python -m shardtune`, not a caller in its own process
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean `shardtune {close[0]}`?" if close else ""
        print(f"shardtune: unknown command {name!r}.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    with _sigint_noted() as signalled:
        try:
            code = run_command(name, rest, program)
        except BaseException as e:
            # A Ctrl-C before the command installs its own handlers (torch and transformers take seconds to
            # import). Some libraries' lazy imports catch it and raise their own error without chaining it, so the
            # signal is recorded when it arrives rather than only read from the exception.
            if not (signalled() or _interrupted(e)):
                raise
        else:
            if not signalled():
                return code
            # A library caught the KeyboardInterrupt inside its import and the command went on to its end.
            return _interrupted_exit(
                f"shardtune {name}: interrupted while starting; the command had already finished.", program
            )
    return _interrupted_exit(f"shardtune {name}: interrupted while starting; nothing was written.", program)


def _interrupted_exit(line: str, program: bool) -> int:
    """Print the one line; as a program, leave at once with exit code 3. A library whose import the Ctrl-C cut
    short can end the interpreter's teardown with the KeyboardInterrupt again (the process then dies by SIGINT,
    not with 3); nothing was written yet, so its exit handlers have nothing to finish."""
    print(line, file=sys.stderr)
    if program:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    return 3


@contextlib.contextmanager
def _sigint_noted():
    """While the command runs, a SIGINT handler that records the signal and raises KeyboardInterrupt as Python's
    default does, where it can propagate (`runtime.signals`: after an import, again after a finalizer swallowed it);
    a command replaces it with its own once its run starts, and the caller's handler is put back after.
    Yields a function telling whether it fired."""
    fired, redelivery = [], Redelivery()

    def handler(signum, frame):
        fired.append(signum)
        if not redelivery.put_off(signum, frame):
            raise KeyboardInterrupt

    def unraisable(info):
        # A KeyboardInterrupt raised inside a finalizer (`__del__`) or a weakref callback cannot propagate: Python
        # would print it as "Exception ignored in ..." and go on. Raised again instead; other cases as before.
        if isinstance(info.exc_value, KeyboardInterrupt):
            redelivery.again(signal.SIGINT)
        else:
            hook_before(info)

    before, hook_before = signal.getsignal(signal.SIGINT), sys.unraisablehook
    ours = before is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, handler)
        sys.unraisablehook = unraisable
    try:
        yield lambda: bool(fired)
    finally:
        if ours:
            redelivery.cancel()
            signal.signal(signal.SIGINT, before)
            sys.unraisablehook = hook_before


def _interrupted(error: BaseException | None) -> bool:
    """Whether a KeyboardInterrupt is among the causes of `error`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
