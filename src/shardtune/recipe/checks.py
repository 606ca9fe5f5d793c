"""Checks at the start of a run that fail fast, before data and model loading, and the trackers' runs. (Whether the
run fits its GPU is the start-up plan's: recipe.settings.start_plan.)"""

from __future__ import annotations

import json

from shardtune.config.arguments import RunConfig
from shardtune.config.fsdp import fsdp1_only_notes
from shardtune.inference.harness import check_tasks, split_tasks
from shardtune.parallel import checkpoint
from shardtune.parallel.mesh import broadcast_object
from shardtune.recipe.state import resume_refusal, saved_record
from shardtune.runtime import hub
from shardtune.runtime.log import print0
from shardtune.training import optimizers, run_dir
from shardtune.training.run_dir import identity_problem
from shardtune.training.trackers import open_trackers, parse_report_to


def preflight_run(cfg: RunConfig, info) -> str | None:
    """Checks that fail fast, before data and model loading: the output folder, hub access, FSDP1-only options,
    the optimizer on this device, the checkpoint to resume from. Rank 0 checks (the others would see its
    first files in output_dir) and, with --overwrite_output_dir, removes the previous run's state."""

    t = cfg.train
    repo_id, problem = None, None
    if info.is_main:
        for note in fsdp1_only_notes(cfg.fsdp) if cfg.fsdp.enabled else []:
            print0(note)
        resuming = bool(t.resume_from_checkpoint)
        # claim: the run's lock on output_dir, held until the run ends (released by commands.train._train).
        problem = run_dir.output_dir_problem(
            t.output_dir, overwrite=t.overwrite_output_dir, resuming=resuming, claim=True
        )
        try:
            if not problem:
                repo_id = hub.preflight(
                    push_to_hub=t.push_to_hub,
                    hub_model_id=t.hub_model_id,
                    output_dir=t.output_dir,
                    hub_token=t.hub_token,
                    hub_private_repo=t.hub_private_repo,
                )
        except ValueError as e:
            problem = str(e)
        if not problem:
            problem = _optimizer_and_resume_problem(cfg, info)
        if not problem and t.eval_harness_tasks:
            flags = ("--eval_harness_tasks", "--eval_harness_include_path")
            _, task_problems = check_tasks(split_tasks(t.eval_harness_tasks), t.eval_harness_include_path, flags)
            problem = "; ".join(task_problems) or None
        if not problem and t.overwrite_output_dir and not resuming:
            removed = run_dir.clear_previous_run(t.output_dir)
            if removed:
                print0(f"--overwrite_output_dir: removed the previous run's {', '.join(removed)} from {t.output_dir}.")
    repo_id, problem = broadcast_object((repo_id, problem))
    if problem:
        raise ValueError(problem)
    return repo_id


def _optimizer_and_resume_problem(cfg: RunConfig, info) -> str | None:
    t = cfg.train
    problems = optimizers.optimizer_problems(t.optim, info.device)
    if problems:
        return "; ".join(problems)
    if not t.resume_from_checkpoint:
        return None
    try:
        path = checkpoint.resolve(t.resume_from_checkpoint, t.output_dir)
        record = saved_record(cfg)
        other_run = identity_problem(path, record, t.resume_from_checkpoint)
        if other_run:
            return other_run
        saved = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        refused = resume_refusal(path, saved, record, t.resume_from_checkpoint)
        if refused:
            return refused
        checkpoint.check_resumable(
            path,
            checkpoint.read_meta(path),
            per_rank_optimizer=optimizers.get(t.optim).per_rank_state,
            optimizer_name=f"--optim {t.optim}",
            world=info.world_size,
        )
    except ValueError as e:
        return str(e)
    return None


def open_trackers_for_run(cfg: RunConfig, info) -> list:
    """The W&B/MLflow runs of --report_to, started on the main process before the data and model load, so that
    a tracker that cannot start stops every rank with its message (exit 2) and nothing has been spent."""

    trackers, problem = [], None
    if info.is_main:
        try:
            trackers = open_trackers(
                parse_report_to(cfg.train.report_to), output_dir=cfg.train.output_dir, run_name=cfg.train.run_name
            )
        except Exception as e:  # noqa: BLE001 - any tracker failure (bad URI, no login) is reported the same way
            problem = f"--report_to {cfg.train.report_to}: the tracker could not start: {type(e).__name__}: {e}"
    problem = broadcast_object(problem)
    if problem:
        raise ValueError(problem)
    return trackers
