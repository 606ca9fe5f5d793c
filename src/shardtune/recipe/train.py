"""`shardtune train`'s spine on every rank, top to bottom: the processes started, the checks that fail fast, the
planner's one pass, the trackers' runs; then build (recipe.build) → the training loop → export → the summary, the
cards and the uploads. Each step is a call into the part that owns it (docs/architecture.md). It returns the run's
exit code; the command (shardtune.commands.train) reads the flags, maps what is raised to exit codes and ends the
processes.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shardtune.config import cuda_allocator
from shardtune.config.arguments import RunConfig
from shardtune.inference.harness import EvalArguments, evaluate_model
from shardtune.parallel import checkpoint
from shardtune.parallel.fsdp import local_state_bytes
from shardtune.parallel.mesh import all_gather_objects, init_distributed
from shardtune.planning.fit import RunFit
from shardtune.recipe import build, checks, output, settings, state
from shardtune.runtime import collector, hooks
from shardtune.runtime.atomic import is_disk_full
from shardtune.runtime.cpu import bf16_check
from shardtune.runtime.log import error, print0, warn0
from shardtune.runtime.stop import STOPPED_EXIT_CODE, StopHandler
from shardtune.training.metrics import RunLogger
from shardtune.training.trainer import LoopState, NonFiniteError, StopFlag, train

# docs/errors.md: 0 done, 1 failed, 2 a mistake in the input, 3 stopped by a signal.
EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_FAILED = 2, STOPPED_EXIT_CODE, 1


def run(cfg: RunConfig, stop: StopHandler) -> int:
    """The run on this rank: its process group, the start-up checks and plan, then `_run`. `stop` is the handler
    the command installed until the loop installs its own; it is told each stage."""
    stop.at("starting the processes")
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
        return _run(cfg, info, repo_id, trackers, fit, stop)
    except BaseException:
        for tracker in trackers:  # a W&B/MLflow run of a failed run is marked failed, not left running
            tracker.close(finished=False)
        raise


def _run(cfg: RunConfig, info, repo_id: str | None, trackers: list, fit: RunFit, stop: StopHandler) -> int:
    """Build, train, export."""
    built = build.build(cfg, info, fit, stop)
    logger = _logger(cfg, info, built.model, built.settings.total_steps, trackers)
    collector.training_starts()  # start-up's objects out of the steps' collections
    start = time.perf_counter()
    try:
        try:
            loop_state = _train_loop(cfg, info, built, logger, repo_id)
        finally:
            if hasattr(built.train_split, "close"):  # online RL: its rollout engine (a server's adapters)
                built.train_split.close()
    except NonFiniteError as e:
        error(str(e))
        logger.close()
        return EXIT_FAILED
    except OSError as e:
        return _output_not_written(logger, e, info)
    if loop_state.step < built.settings.total_steps:
        return _interrupted(cfg, logger, loop_state.step, built.settings.total_steps)
    try:
        out = output.export(cfg, built.model, built.tokenizer, info, loop_state.step)
    except OSError as e:
        return _output_not_written(logger, e, info)
    if built.stop.signal and not built.stop.announced:  # the work was done: finishing the save lost nothing
        print0(f"{built.stop.signal} arrived during the final save, which was let finish: {out} is complete.")
    runtime = time.perf_counter() - start
    summary = output.finish(
        logger, cfg, built.model, built.eval_split, info, built.settings, loop_state, runtime, out, built.objective
    )
    output.publish(cfg, info, logger, out, summary, repo_id, loop_state.step)
    return 0


def _train_loop(cfg: RunConfig, info, built: build.Built, logger, repo_id: str | None) -> LoopState:
    built.stop = StopFlag(info.device)

    def save(s: LoopState) -> None:
        state.save_checkpoint(
            cfg,
            s,
            data_digest=getattr(built.train_split, "digest", None),
            model=built.model,
            optimizer=built.optimizer,
            scheduler=built.scheduler,
            tokenizer=built.tokenizer,
            info=info,
            repo_id=repo_id,
        )

    return train(
        built.model,
        built.optimizer,
        built.scheduler,
        train_split=built.train_split,
        eval_split=built.eval_split,
        info=info,
        settings=built.settings,
        state=built.loop_state,
        logger=logger,
        objective=built.objective,
        # Also with --save_strategy no: a signal still saves a checkpoint to resume from.
        save_fn=save,
        stop_requested=built.stop,
        callbacks=hooks.step_callbacks(),
    )


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


def eval_harness(cfg: RunConfig) -> int:
    """--eval_harness_tasks: lm-evaluation-harness on the finished run, on the main process alone. The command runs
    it after the process group is gone and the sharded model freed, so that the other ranks are not held in a
    collective (a long evaluation would exceed --ddp_timeout) and the main device holds only the evaluated model."""

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
