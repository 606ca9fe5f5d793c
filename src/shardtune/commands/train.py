"""`shardtune train`, the recipe: parse the flags, check what can fail early, build the data, build the sharded
model, train, export. Each step is a call into the component that owns it (docs/architecture.md)."""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardtune.cli import run_command
from shardtune.config import cuda_allocator
from shardtune.config.arguments import RunConfig
from shardtune.config.errors import ConfigError
from shardtune.config.run import build_parser, precision_line
from shardtune.inference.harness import EvalArguments, evaluate_model
from shardtune.models import loading
from shardtune.models.preflight import model_input_problems, tokenizer_load_error
from shardtune.objectives.loss import objective_spec
from shardtune.parallel import checkpoint, setup
from shardtune.parallel.fsdp import local_state_bytes
from shardtune.parallel.mesh import all_gather_objects, init_distributed, is_peer_failure, shutdown
from shardtune.planning.fit import RunFit
from shardtune.recipe import checks, data, objective, output, rl, settings, state
from shardtune.recipe.run_config import flag_choices, load_run_config
from shardtune.rl.probe import SyncError
from shardtune.rl.rewards import RewardError
from shardtune.runtime import hooks, hub
from shardtune.runtime.atomic import DiskFullError, is_disk_full
from shardtune.runtime.cpu import bf16_check
from shardtune.runtime.log import error, print0, rank, setup_logging, warn0
from shardtune.runtime.stop import STOPPED_EXIT_CODE, StopHandler, Stopped, stopped_message
from shardtune.training.metrics import RunLogger
from shardtune.training.optimizers import build_optimizer
from shardtune.training.run_dir import release_output_dir
from shardtune.training.trainer import LoopSettings, LoopState, NonFiniteError, StopFlag, train

EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_FAILED = 2, STOPPED_EXIT_CODE, 1
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

    problems = model_input_problems(cfg)  # every rank reads the same configs and headers; no process group yet
    if problems:
        error(str(ConfigError(problems)))
        return EXIT_CONFIG
    rc = _train(cfg)
    if rc == 0 and cfg.train.eval_harness_tasks and rank() == 0:
        rc = _eval_harness(cfg)
    return rc


def _train(cfg: RunConfig) -> int:
    """The training run on every rank; all ranks leave the process group together at its end (a stopped run
    without waiting: its peers may be in another collective, and they were stopped too)."""
    stopped, rc = False, None
    try:
        rc = run(cfg)
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


def _eval_harness(cfg: RunConfig) -> int:
    """--eval_harness_tasks: lm-evaluation-harness on the finished run, on the main process alone. It runs after
    the process group is gone and the sharded model freed, so that the other ranks are not held in a collective
    (a long evaluation would exceed --ddp_timeout) and the main device holds only the evaluated model."""

    m, t = cfg.model, cfg.train
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out = Path(t.output_dir)
    args = EvalArguments(
        model_name_or_path=m.model_name_or_path if m.use_peft_lora else str(out),
        adapter=str(out) if m.use_peft_lora else None,
        tasks=t.eval_harness_tasks,
        include_path=t.eval_harness_include_path,
        batch_size=t.per_device_eval_batch_size,
        seed=t.seed,
        use_4bit_quantization=m.use_4bit_quantization,
        trust_remote_code=m.trust_remote_code,
    )
    print0(f"Running lm-evaluation-harness on {out}: {t.eval_harness_tasks}.")
    try:
        return evaluate_model(args)
    except (ValueError, FileNotFoundError) as e:
        error(f"error: the run finished and {out} is written, but --eval_harness_tasks failed: {e}")
        return EXIT_FAILED


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: RunConfig) -> int:
    STOP.at("starting the processes")
    info = init_distributed(
        cfg.fsdp.sharding_strategy,
        timeout_s=cfg.train.ddp_timeout,
        cp=cfg.train.context_parallel_size,
        tp=cfg.train.tensor_parallel_size,
    )
    if info.is_main and (msg := bf16_check(info.device.type, cfg.precision.bf16)):  # AVX2-only CPUs emulate bf16
        warn0(msg)
    if info.device.type == "cuda":
        print0(f"CUDA allocator: {cuda_allocator.describe()}")
    repo_id = checks.preflight_run(cfg, info)
    fit = settings.start_plan(cfg, info)  # the planner's one pass, before any data is read
    trackers = checks.open_trackers_for_run(cfg, info)
    try:
        return _run(cfg, info, repo_id, trackers, fit)
    except BaseException:
        for tracker in trackers:  # a W&B/MLflow run of a failed run is marked failed, not left running
            tracker.close(finished=False)
        raise


def _run(cfg: RunConfig, info, repo_id: str | None, trackers: list, fit: RunFit) -> int:
    """Build, train, export."""
    run = _build(cfg, info, fit)
    logger = _logger(cfg, info, run.model, run.settings.total_steps, trackers)
    start = time.perf_counter()
    try:
        try:
            loop_state = _train_loop(cfg, info, run, logger, repo_id)
        finally:
            if hasattr(run.train_split, "close"):  # online RL: its rollout engine (a server's adapters)
                run.train_split.close()
    except NonFiniteError as e:
        error(str(e))
        logger.close()
        return EXIT_FAILED
    except OSError as e:
        return _output_not_written(logger, e, info)
    if loop_state.step < run.settings.total_steps:
        return _interrupted(cfg, logger, loop_state.step, run.settings.total_steps)
    try:
        out = output.export(cfg, run.model, run.tokenizer, info, loop_state.step)
    except OSError as e:
        return _output_not_written(logger, e, info)
    if run.stop.signal and not run.stop.announced:  # the work was done: finishing the save lost nothing
        print0(f"{run.stop.signal} arrived during the final save, which was let finish: {out} is complete.")
    runtime = time.perf_counter() - start
    summary = output.finish(
        logger, cfg, run.model, run.eval_split, info, run.settings, loop_state, runtime, out, run.objective
    )
    _publish(cfg, info, logger, out, summary, repo_id, loop_state.step)
    return 0


@dataclass
class _Built:
    """What a run trains: its data, its sharded model, optimizer and schedule, objective and starting point."""

    tokenizer: object
    train_split: object
    eval_split: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    objective: object
    settings: LoopSettings
    loop_state: LoopState
    stop: StopFlag | None = None  # the loop's signal handler, which stays installed through the final save


def _build(cfg: RunConfig, info, fit: RunFit) -> _Built:
    """Data first (a bad dataset fails before the model loads), then the model (its frozen base where the start-up
    plan put it), optimizer, objective and state."""

    t = cfg.train
    _seed_everything(t.seed)
    STOP.at("preparing the data")
    tokenizer, new_ids = _load_tokenizer(cfg)
    train_split, eval_split = data.prepare_data(cfg, tokenizer, info)
    if objective_spec(t.objective).data == "prompts":  # online RL: the loop trains on rollouts of the prompts
        train_split = rl.rollouts(cfg, train_split, tokenizer, info, new_token_rows=bool(new_ids))
    if t.resume_from_checkpoint:  # before the model loads: another run's data is refused at no cost
        state.check_resumed_data(cfg, train_split)
    spe = data.steps_per_epoch_for(cfg, train_split, info)
    total = data.total_steps(cfg, spe)
    _seed_everything(t.seed)
    STOP.at("loading the model")
    hooks.at("load", step=0, rank=info.rank)
    spec = settings.model_settings(cfg, info, len(tokenizer), new_ids, fit)
    model = setup.build_sharded_model(spec, info, cfg.fsdp.single_process)
    optimizer, scheduler = _optimizer_and_scheduler(cfg, model, total)
    # Before a checkpoint is loaded: a precomputed reference is the run's starting point, also on resume.
    evaluated = eval_split if t.eval_strategy != "no" else None  # no reference pass for a split never evaluated
    goal = objective.setup_objective(cfg, model, [train_split, evaluated], info, tokenizer.pad_token_id)
    if hasattr(train_split, "attach"):
        rl.attach(cfg, train_split, model, info)
    STOP.at("loading the checkpoint")
    loop_state = state.resume(cfg, model, optimizer, scheduler, info) if t.resume_from_checkpoint else LoopState()
    loop = settings.loop_settings(cfg, total, spe, tokenizer.pad_token_id)
    global_batch = t.per_device_train_batch_size * info.dims.dp_size * t.gradient_accumulation_steps
    print0(f"Training {total} steps ({spe} per epoch), global batch {global_batch} rows.")
    return _Built(tokenizer, train_split, eval_split, model, optimizer, scheduler, goal, loop, loop_state)


def _train_loop(cfg: RunConfig, info, run: _Built, logger, repo_id: str | None) -> LoopState:
    run.stop = StopFlag(info.device)

    def save(s: LoopState) -> None:
        state.save_checkpoint(
            cfg,
            s,
            data_digest=getattr(run.train_split, "digest", None),
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            tokenizer=run.tokenizer,
            info=info,
            repo_id=repo_id,
        )

    return train(
        run.model,
        run.optimizer,
        run.scheduler,
        train_split=run.train_split,
        eval_split=run.eval_split,
        info=info,
        settings=run.settings,
        state=run.loop_state,
        logger=logger,
        objective=run.objective,
        # Also with --save_strategy no: a signal still saves a checkpoint to resume from.
        save_fn=save,
        stop_requested=run.stop,
        callbacks=hooks.step_callbacks(),
    )


def _load_tokenizer(cfg: RunConfig):
    m = cfg.model
    try:
        return loading.load_tokenizer(
            m.model_name_or_path,
            tokenizer_name_or_path=m.tokenizer_name_or_path,
            chat_template_format=m.chat_template_format,
            trust_remote_code=m.trust_remote_code,
        )
    except json.JSONDecodeError as e:  # a damaged file the preflight did not read
        raise _tokenizer_error(cfg, e) from e
    except ValueError:  # shardtune's own (a chat format the tokenizer cannot take): names its flag already
        raise
    except Exception as e:  # tokenizers raises bare Exceptions for files it cannot parse
        raise _tokenizer_error(cfg, e) from e


def _tokenizer_error(cfg: RunConfig, e: Exception) -> ValueError:
    m = cfg.model
    flag = "--tokenizer_name_or_path" if m.tokenizer_name_or_path else "--model_name_or_path"
    return tokenizer_load_error(m.tokenizer_name_or_path or m.model_name_or_path, flag, e)


def _optimizer_and_scheduler(cfg: RunConfig, model, total: int):
    from transformers import get_scheduler

    t = cfg.train
    optimizer = build_optimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        optim=t.optim,
        lr=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
    )
    warmup = t.warmup_steps or math.ceil(t.warmup_ratio * total)
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    return optimizer, scheduler


def _logger(cfg: RunConfig, info, model, total: int, trackers: list):
    # What each rank really holds for weights: recorded for `shardtune plan` to be checked against.
    run_info = {
        **state.config_record(cfg),
        "world_size": info.world_size,
        "param_bytes_per_rank": all_gather_objects(local_state_bytes(model)),
    }
    t = cfg.train
    return RunLogger(
        t.output_dir, is_main=info.is_main, report_to=t.report_to, total_steps=total, config=run_info, trackers=trackers
    )


def _interrupted(cfg: RunConfig, logger, step: int, total: int) -> int:
    last = checkpoint.list_checkpoints(cfg.train.output_dir)[-1]
    print0(
        f"Interrupted at step {step}/{total}; checkpoint saved in {last}. Resume with the same command "
        f"plus --resume_from_checkpoint latest (or --resume_from_checkpoint {last})."
    )
    logger.close()
    return EXIT_INTERRUPTED


def _publish(cfg: RunConfig, info, logger, out: Path, summary: dict, repo_id: str | None, step: int) -> None:
    """Model cards, the hub upload (--push_to_hub) and the trackers' model artifact, from the main process."""
    if info.is_main:
        output.write_cards(cfg, out, summary)
        if repo_id:
            hub.upload(
                repo_id,
                out,
                hub_token=cfg.train.hub_token,
                message=f"shardtune: end of training (step {step})",
                ignore=hub.END_IGNORE,
            )
            print0(f"Uploaded {out} to https://huggingface.co/{repo_id}.")
        logger.log_model(out, is_adapter=cfg.model.use_peft_lora)
    logger.close(finished=True)


def _output_not_written(logger, e: OSError, info) -> int:
    """A full disk during a checkpoint or the final save: one error line, a summary saying so, exit 1.
    (The writers have removed their temporary folders; earlier checkpoints and outputs are intact.)"""

    if not is_disk_full(e):
        raise e
    msg = e.strerror or str(e)
    if info.is_main:
        error(f"error: {msg}")
    try:  # the summary may not fit on the full disk either: the error line above already said it all
        logger.finish({"output_path": None, "output_error": msg, "interrupted": False})
    except OSError:
        pass
    logger.close()
    return EXIT_FAILED
