"""`shardtune <command>`: each command lives in its own module and is imported only when used."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("shardtune.train", "main", "Fine-tune a model (LoRA, QLoRA, DoRA or full) on FSDP2."),
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
    module, func, _ = COMMANDS[name]
    # Before any command touches CUDA: the caching allocator reads its settings once, at its first use.
    from shardtune.cuda_allocator import apply_default

    apply_default()
    return int(getattr(importlib.import_module(module), func)(rest) or 0)
