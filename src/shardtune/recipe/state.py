"""A run's checkpoints: what a save records, saving (with hub uploads), and resuming exactly where it stopped.

A resumed run whose flags differ from its checkpoint's run (docs/checkpoints.md, "Changed settings") either refuses
(`REFUSED_ON_RESUME`: one line naming the flag, both values and the fix, before anything loads) or trains with the new
value from the resumed step: the optimizer's hyperparameters and the learning-rate schedule are this run's, at the
checkpoint's step (`run_settings` taken before the checkpoint loads, `restore_run_settings` after), so that the rate
of every later step is what a fresh run with these flags has there. Only the optimizer's moments, the weights, the
step and the random states come from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardtune.config.arguments import RunConfig
from shardtune.parallel import checkpoint
from shardtune.recipe.output import write_weights
from shardtune.runtime import hub
from shardtune.runtime.log import print0, warn0
from shardtune.training.run_dir import run_identity, trim_metrics
from shardtune.training.trainer import LoopState


def config_record(cfg: RunConfig) -> dict:
    """The run's settings as saved in metrics.jsonl and checkpoints (which may be uploaded): no hub token."""
    d = cfg.to_dict()
    if d["train"].get("hub_token"):
        d["train"]["hub_token"] = "<redacted>"
    return d


def saved_record(cfg: RunConfig) -> dict:
    """config_record as a checkpoint's config.json reads back (tuples as lists, paths as strings), to compare with
    what a checkpoint saved."""
    return json.loads(json.dumps(config_record(cfg), default=str))


def save_checkpoint(
    cfg: RunConfig, s, *, data_digest: str | None, model, optimizer, scheduler, tokenizer, info, repo_id: str | None
) -> None:
    """Save a checkpoint; with a hub repository, upload as --hub_strategy says (rank 0). The training rows' content
    digest goes into its config.json, so that a resume recognises the same data under another path."""
    t = cfg.train
    path = checkpoint.save(
        t.output_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loop_state=_loop_dict(s, t, info),
        config={**config_record(cfg), "data_digest": data_digest},
        state_dict_type=cfg.fsdp.state_dict_type,
        save_total_limit=t.save_total_limit,
    )
    if not repo_id or t.hub_strategy == "end":
        return
    if t.hub_strategy == "every_save":
        write_weights(cfg, model, tokenizer, info, s.step)  # the adapter (or model) as of this step, for the upload
    if info.is_main:
        try:
            hub.push_checkpoint(
                repo_id, path, t.output_dir, strategy=t.hub_strategy, hub_token=t.hub_token, step=s.step
            )
        except ValueError as e:  # a hub outage must not end a run whose checkpoint is safe on disk
            warn0(str(e))
            return
        print0(f"Pushed step {s.step} to https://huggingface.co/{repo_id} (--hub_strategy {t.hub_strategy}).")


def _loop_dict(s, t, info) -> dict:
    """The loop state to save; the data position is also recorded in samples, which survive a change of ranks."""
    d = s.to_dict()
    dp = info.dims.dp_size
    d["samples_in_epoch"] = s.batch_in_epoch * t.per_device_train_batch_size * dp
    d["global_batch"] = t.per_device_train_batch_size * dp * t.gradient_accumulation_steps
    return d


# The flags a resumed run cannot change, and why; every other optimizer, schedule, length and batch flag takes its
# new value from the resumed step (the data source is refused by run_dir.identity_problem and check_resumed_data).
REFUSED_ON_RESUME = {
    ("train", "seed"): "the packing of the rows and their order in every epoch depend on it",
}


def resume_refusal(path: Path, saved: dict, now: dict, resume_from: str) -> str | None:
    """One line for a changed flag the resume cannot take (saved and now: config records), or None."""
    for (part, key), why in REFUSED_ON_RESUME.items():
        before, after = (saved.get(part) or {}).get(key), (now.get(part) or {}).get(key)
        if key in (saved.get(part) or {}) and before != after:
            return (
                f"--{key} {after} differs from the checkpoint's {before} ({path}): {why}; resume with --{key} "
                f"{before}, or start afresh with another --output_dir or --overwrite_output_dir."
            )
    max_steps, step = (now.get("train") or {}).get("max_steps") or 0, int(checkpoint.read_meta(path)["loop"]["step"])
    if 0 < max_steps < step:
        return (
            f"--max_steps {max_steps} is below the step of {path} ({step}): the run would end before where it "
            f"resumes; give --max_steps {step} or more, or resume from an earlier checkpoint."
        )
    return None


def run_settings(optimizer, scheduler) -> tuple[list[dict], dict]:
    """This run's optimizer hyperparameters (per parameter group) and schedule, as its flags built them: taken
    before a checkpoint loads over them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups], scheduler.state_dict()


def restore_run_settings(optimizer, scheduler, fresh: tuple[list[dict], dict]) -> None:
    """After a checkpoint loaded: this run's hyperparameters (learning rate, weight decay, betas, eps) and schedule
    (type, warmup, length) over the checkpoint's, at the checkpoint's step; each group's rate is what this run's
    schedule gives at that step. A scheduler that is not a LambdaLR (every transformers schedule but
    reduce_lr_on_plateau) keeps the checkpoint's rates."""
    groups, schedule = fresh
    step, count = scheduler.last_epoch, getattr(scheduler, "_step_count", None)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    for group, mine in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in mine.items() if lambdas is not None or k not in ("lr", "initial_lr")})
    if lambdas is None:
        return
    scheduler.load_state_dict({**schedule, "last_epoch": step, **({"_step_count": count} if count else {})})
    rates = [base * fn(step) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() reads, as LRScheduler.step sets it


def check_resumed_data(cfg: RunConfig, train_split) -> None:
    """The checkpoint's training rows must be this run's: compared by content (the cache digest) when both have
    one, so that data moved to another path (another node, another machine) still resumes, and other data under
    the same path does not. The preflight compared the paths where no digest was saved."""
    t = cfg.train
    path = checkpoint.resolve(t.resume_from_checkpoint, t.output_dir)
    try:
        record = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # no readable config: the checkpoint's own checks name the file
    saved, now = record.get("data_digest"), getattr(train_split, "digest", None)
    if saved and not now:  # this run's rows have no digest (streamed, pairs): the paths must match after all
        key = "data.dataset_name"
        before, after = (
            run_identity(record)[key],
            run_identity(saved_record(cfg))[key],
        )
        if before != after:
            raise ValueError(
                f"--resume_from_checkpoint {t.resume_from_checkpoint}: {path} belongs to another run (dataset_name "
                f"{before!r} there, {after!r} now); resume with that run's settings, or start afresh with another "
                "--output_dir or --overwrite_output_dir."
            )
    if saved and now and saved != now:
        raise ValueError(
            f"--resume_from_checkpoint {t.resume_from_checkpoint}: {path} was trained on other rows than "
            f"--dataset_name {cfg.data.dataset_name} gives now (tokenized content differs: the data, the tokenizer "
            "or a data flag changed); resume with that run's data, or start afresh with another --output_dir or "
            "--overwrite_output_dir."
        )


def resume(cfg, model, optimizer, scheduler, info):
    t = cfg.train
    path = checkpoint.resolve(t.resume_from_checkpoint, t.output_dir, announce=True)
    saved_cfg = path / "config.json"
    if saved_cfg.exists():
        changed = checkpoint.changed_settings(json.loads(saved_cfg.read_text()), saved_record(cfg))
        if changed:
            warn0(
                f"Resuming {path} with settings that differ from its run (this run's values apply from the resumed "
                "step on): " + "; ".join(changed)
            )
    fresh = run_settings(optimizer, scheduler)
    meta = checkpoint.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    restore_run_settings(optimizer, scheduler, fresh)
    loop, notes = checkpoint.resume_position(
        meta,
        per_device=t.per_device_train_batch_size,
        world=info.dims.dp_size,
        grad_accum=t.gradient_accumulation_steps,
    )
    for note in notes:
        warn0(note)
    state = LoopState(**loop)
    if info.is_main:
        dropped = trim_metrics(t.output_dir, state.step)
        if dropped:
            print0(f"metrics.jsonl: dropped {dropped} record(s) after step {state.step}, which this run redoes.")
    newer = [c.name for c in checkpoint.list_checkpoints(t.output_dir) if int(c.name.split("-")[-1]) > state.step]
    if newer:
        warn0(
            f"{Path(t.output_dir) / 'checkpoints'} holds checkpoints from after step {state.step} "
            f"({', '.join(newer)}), left by the run being redone: each is replaced when this run saves that step; "
            "until then --resume_from_checkpoint latest would pick them."
        )
    print0(
        f"Resumed from {path} at step {state.step} (epoch {state.epoch}, "
        f"sample {meta['loop'].get('samples_in_epoch', 0)} of the epoch)."
    )
    return state
