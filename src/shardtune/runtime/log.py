"""One logging helper: rank 0 prints; other ranks print only errors, tagged with their rank."""

from __future__ import annotations

import logging
import os
import sys
import warnings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "passive": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

logger = logging.getLogger("shardtune")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def setup_logging(log_level: str = "info") -> None:
    """Configure shardtune's logger for this process and quiet libraries whose warnings tell users nothing."""
    level = _LEVELS.get(log_level, logging.INFO)
    r = rank()
    handler = logging.StreamHandler(sys.stderr)
    prefix = "" if r == 0 else f"[rank {r}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(level if r == 0 else logging.ERROR)
    _quiet_libraries()


def quiet_import_notices() -> None:
    """Before any library is imported (every command, shardtune.cli.run_command): bitsandbytes logs at import that an
    optional CPU kernel package is missing; its fallback works."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_import_notices()
    # peft reads transformers' deprecated `is_gradient_checkpointing` property when wrapping a model; the
    # deprecation is transformers' business with peft, not the user's.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    try:
        import datasets

        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass


def print0(msg: str) -> None:
    """Log an info line on rank 0 only."""
    logger.info(msg)


def warn0(msg: str) -> None:
    logger.warning(msg)


def error(msg: str) -> None:
    """Log an error on any rank, tagged with the rank when it is not 0."""
    logger.error(msg)
