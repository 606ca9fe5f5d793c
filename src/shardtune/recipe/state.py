"""A run's checkpoints: what a save records, saving (with hub uploads), and resuming exactly where it stopped."""

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
            warn0(f"Resuming {path} with settings that differ from its run: " + "; ".join(changed))
    meta = checkpoint.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
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
