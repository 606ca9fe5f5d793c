"""`shardtune train`: read and check the flags, run the recipe (shardtune.recipe.train: the processes, the checks,
data, the sharded model, the loop, the outputs) and turn what it raises into one line and an exit code (docs/errors.md);
then, with --eval_harness_tasks, evaluate the finished run."""

from __future__ import annotations

import re
import sys

from shardtune.cli import run_command
from shardtune.config.arguments import RunConfig
from shardtune.config.errors import ConfigError
from shardtune.config.run import build_parser, precision_line
from shardtune.models.preflight import model_input_problems
from shardtune.models.quant import bitsandbytes_for_peft
from shardtune.parallel.mesh import is_peer_failure, shutdown
from shardtune.recipe.run_config import flag_choices, load_run_config
from shardtune.recipe.train import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, eval_harness, run
from shardtune.rl.probe import SyncError
from shardtune.rl.rewards import RewardError
from shardtune.runtime.atomic import DiskFullError
from shardtune.runtime.log import error, print0, rank, setup_logging
from shardtune.runtime.stop import StopHandler, Stopped, stopped_message
from shardtune.training.run_dir import release_output_dir

# SIGTERM/SIGINT before (and after) the training loop; the loop has its own (trainer.StopFlag).
STOP = StopHandler()


def main(argv: list[str] | None = None) -> int:
    """`shardtune train` called in this process: through the entry every command starts by (shardtune.cli)."""

    return run_command("train", list(sys.argv[1:] if argv is None else argv))


def command(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        build_parser(choices=flag_choices()).print_help()
        return 0
    setup_logging("info")
    stopper = STOP.install()  # until the training loop installs its own: a signal stops the run at once
    resuming = any(a.startswith("--resume_from_checkpoint") for a in argv)
    try:
        return _main(argv, stopper)
    except (Stopped, KeyboardInterrupt) as e:
        print0(stopped_message(e, resuming=resuming))
        return EXIT_INTERRUPTED
    finally:
        stopper.restore()


def _main(argv: list[str], stopper: StopHandler) -> int:
    stopper.at("checking the inputs")
    try:
        cfg = load_run_config(argv)
    except ConfigError as e:
        error(str(e))
        return EXIT_CONFIG
    setup_logging(cfg.train.log_level)
    print0(precision_line(cfg))

    # Only a quantized base needs bitsandbytes, which peft would import for every run (models.quant).
    with bitsandbytes_for_peft(cfg.model.use_4bit_quantization or cfg.model.use_8bit_quantization):
        problems = model_input_problems(cfg)  # every rank reads the same configs and headers; no process group yet
        if problems:
            error(str(ConfigError(problems)))
            return EXIT_CONFIG
        rc = _train(cfg)
    if rc == 0 and cfg.train.eval_harness_tasks and rank() == 0:
        rc = eval_harness(cfg)
    return rc


def _train(cfg: RunConfig) -> int:
    """The training run on every rank; all ranks leave the process group together at its end (a stopped run
    without waiting: its peers may be in another collective, and they were stopped too)."""
    stopped, rc = False, None
    try:
        rc = run(cfg, STOP)
        return rc
    except (Stopped, KeyboardInterrupt):
        stopped = True
        raise
    except DiskFullError as e:  # the data cache (the writers during training return their own code)
        error(f"error: {e}")
        return EXIT_FAILED
    except (SyncError, RewardError) as e:  # online RL: every rank stops together, one line
        error(f"error: {e}")
        return EXIT_FAILED
    except (ValueError, FileNotFoundError) as e:
        error(f"error: {e}")
        return EXIT_CONFIG
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        if STOP.received:  # a peer stopped by the same signal left first
            stopped = True
            raise Stopped(STOP.signal_name, STOP.stage) from None
        # gloo's message: "[.../pair.cc:537] Read error [addr]: Connection reset by peer. This is typically ..."
        first = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        first = first.split(". ")[0]
        error(
            f"error: lost contact with another rank ({first}). Another process of this run has died: the "
            "launcher's report names it (shardtune launch: its 'torchrun: rank N' line; plain torchrun: 'Root "
            "Cause'). Fix its error, then resume with --resume_from_checkpoint latest."
        )
        return EXIT_FAILED
    finally:
        release_output_dir(cfg.train.output_dir)  # rank 0's lock on the folder; a no-op on the other ranks
        # Only a run that finished waits for its peers: a rank that failed (a full disk while it logs, an error of
        # its own) leaves at once, since its peers may already be in the next step's collective; they learn it
        # there (lost contact), and the launcher stops them, instead of both waiting out --ddp_timeout.
        shutdown(wait=rc == 0 and not stopped)
