"""`shardtune <command>`: each command lives in its own module and is imported only when used.

Every command starts through `run_command`: the `shardtune` script and `python -m shardtune` (`main` here), and a
command's `main` called in another program's process (`shardtune.train.main`, as bench/speed.py and the device
check run it). It is the one place that sets up the process before the command touches CUDA.
"""

from __future__ import annotations

import importlib
import sys

from shardtune import cuda_allocator
from shardtune.log import warn0

COMMANDS = {
    "train": ("shardtune.train", "command", "Fine-tune a model (LoRA, QLoRA, DoRA or full) on FSDP2."),
    "launch": ("shardtune.launch", "main", "Start `shardtune train` on N processes from an accelerate YAML."),
    "plan": ("shardtune.plan", "main", "Estimate per-GPU memory of a run from the model's config alone."),
    "merge": ("shardtune.merge", "main", "Merge a LoRA/DoRA adapter into its base, one shard at a time."),
    "chat": ("shardtune.chat", "main", "Chat with a base model + adapter, or a merged model."),
    "report": ("shardtune.metrics", "report_main", "Print a run's summary and draw its loss plot."),
    "eval": ("shardtune.evaluate_harness", "main", "Run lm-evaluation-harness tasks on an adapter or a model."),
    "demo": ("shardtune.demo", "main", "Build the demo model and data, and fine-tune it on 2 CPU processes."),
}


def _usage() -> str:
    lines = ["usage: shardtune <command> [flags]   (shardtune <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def prepare_process() -> None:
    """What a process needs before anything touches CUDA: shardtune's allocator settings unless the user chose
    theirs (child processes, torchrun's and accelerate's workers, inherit them)."""
    if not cuda_allocator.apply_default():
        return
    # The caching allocator reads its settings once, when CUDA starts; a program that started it before calling a
    # command in its own process keeps torch's defaults (its child processes still get the setting).
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        warn0(f"CUDA started before shardtune set {cuda_allocator.describe()}: this process keeps torch's defaults.")


def run_command(name: str, argv: list[str]) -> int:
    """Run the command `name` (a key of COMMANDS) with its flags, in this process."""
    prepare_process()
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean `shardtune {close[0]}`?" if close else ""
        print(f"shardtune: unknown command {name!r}.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return run_command(name, rest)
    except Exception as e:  # a library's lazy import wraps a Ctrl-C that hits it in its own error
        if not _interrupted(e):
            raise
    except KeyboardInterrupt:
        pass
    # Ctrl-C before a command installs its own handlers (torch and transformers take seconds to import): one line,
    # the interrupted run's exit code, nothing written yet.
    print(f"shardtune {name}: interrupted while starting; nothing was written.", file=sys.stderr)
    return 3


def _interrupted(error: BaseException | None) -> bool:
    """Whether a KeyboardInterrupt is among the causes of `error`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
