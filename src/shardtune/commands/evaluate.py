"""`shardtune eval`: EleutherAI's lm-evaluation-harness (`lm_eval`) on a trained adapter with its base, or on a
merged or fully fine-tuned model folder.

The flags and the command; the harness run is shardtune.inference.harness's.
"""

from __future__ import annotations

import importlib.util
import sys

from shardtune.inference.harness import EVAL_EXTRA, EvalArguments, evaluate_model
from shardtune.runtime.log import error, setup_logging


def parse_eval_args(argv: list[str]) -> EvalArguments:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(EvalArguments, prog="shardtune eval", allow_abbrev=False)
    parser.description = __doc__.split("\n\n")[0]
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging("info")
    args = parse_eval_args(argv)

    if importlib.util.find_spec("lm_eval") is None:
        error(
            f"shardtune eval needs the `lm_eval` package (lm-evaluation-harness), which is not installed: {EVAL_EXTRA}"
        )
        return 2
    try:
        return evaluate_model(args)
    except (ValueError, FileNotFoundError) as e:
        error(f"shardtune eval: {e}")
        return 2
