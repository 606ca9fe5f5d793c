"""`shardtune merge`: fold a PEFT LoRA/DoRA adapter into its base model, one safetensors shard at a time.

The flags and the command; the merging itself is shardtune.merge.fold's (`merge_adapter`).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from typing import Any

from shardtune.config import dtypes
from shardtune.config.errors import ConfigError
from shardtune.merge.fold import merge_adapter
from shardtune.runtime import atomic
from shardtune.runtime.log import error, setup_logging
from shardtune.runtime.stop import StopHandler, Stopped

# --dtype: the floating dtypes, by name or alias (bf16, bfloat16, ...).
DTYPE_CHOICES = [n for n in (*dtypes.FLOATING, *dtypes.ALIASES) if dtypes.canonical(n) in dtypes.FLOATING]


def _arg(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class MergeArguments:
    base: str | None = _arg(
        None,
        "Base model in its original precision: a local folder with safetensors weights, or a hub id. For a QLoRA "
        "adapter, the unquantized model that was loaded in 4-bit for training.",
    )
    adapter: str | None = _arg(
        None, "PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or hub id."
    )
    output_dir: str | None = _arg(
        None, "Where the merged model is written; a model folder there is replaced only once the new one is complete."
    )
    dtype: str | None = _arg(
        None,
        "Dtype of the merged weights (default: the base config's). Merges are computed in fp32.",
        choices=DTYPE_CHOICES,
    )
    max_shard_size: str = _arg("5GB", "Largest output shard, e.g. 5GB or 500MB.")
    trust_remote_code: bool = _arg(False, "Run the base model's own code (config auto_map) to find its embeddings.")


# ---------------------------------------------------------------- command line


def parse_merge_args(argv: list[str] | None = None) -> MergeArguments:
    """Parse `shardtune merge` flags; raise ConfigError naming every missing or unknown flag."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        MergeArguments,
        prog="shardtune merge",
        allow_abbrev=False,
        description="Merge a LoRA/DoRA adapter into its base model, one shard at a time.",
    )
    args, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    known = [f.name for f in dataclasses.fields(MergeArguments)]
    problems = []
    for tok in remaining:
        name = tok[2:].split("=", 1)[0] if tok.startswith("--") else tok
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        problems.append(f"unknown argument {tok!r}" + (f"; did you mean --{close[0]}?" if close else ""))
    for name in ("base", "adapter", "output_dir"):
        if not getattr(args, name):
            problems.append(f"--{name} is required.")
    if problems:
        raise ConfigError(problems)
    return args


def main(argv: list[str] | None = None) -> int:
    """`shardtune merge --base MODEL --adapter DIR --output_dir OUT [--dtype bf16] [--max_shard_size 5GB]`."""
    setup_logging()
    stopper = StopHandler().install()  # SIGTERM/SIGINT: the partial output is removed on the way out
    try:
        args = parse_merge_args(list(sys.argv[1:] if argv is None else argv))
        merge_adapter(
            args.base,
            args.adapter,
            args.output_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            trust_remote_code=args.trust_remote_code,
        )
    except SystemExit as e:  # --help, or argparse's own usage errors
        return int(e.code or 0)
    except (Stopped, KeyboardInterrupt) as e:
        what = e.signal_name if isinstance(e, Stopped) else "SIGINT"
        error(f"shardtune merge: stopped by {what}; nothing was written (--output_dir is as it was). Run it again.")
        return 3
    except ConfigError as e:
        error(str(e))
        return 2
    except atomic.DiskFullError as e:  # before ValueError: an OSError, not a mistake in the input
        error(f"shardtune merge: {e}")
        return 1
    except ValueError as e:  # a folder, file or value of the input (docs/errors.md: exit 2)
        error(f"shardtune merge: {e}")
        return 2
    finally:
        stopper.restore()
    return 0


# ---------------------------------------------------------------- the merge
