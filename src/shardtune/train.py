"""`shardtune train`: flags → data → sharded model → loop → adapter (or model) in output_dir."""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from shardtune import checkpoint, modeling
from shardtune.config import ConfigError, RunConfig, load_run_config
from shardtune.log import error, print0, rank, setup_logging, warn0

EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_FAILED = 2, 3, 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        from transformers import HfArgumentParser

        from shardtune.config import ARG_CLASSES

        HfArgumentParser(ARG_CLASSES, prog="shardtune train").print_help()
        return 0
    setup_logging("info")
    try:
        cfg = load_run_config(argv)
    except ConfigError as e:
        error(str(e))
        return EXIT_CONFIG
    setup_logging(cfg.train.log_level)
    from shardtune.preflight import model_input_problems

    problems = model_input_problems(cfg)  # every rank reads the same configs and headers; no process group yet
    if problems:
        error(str(ConfigError(problems)))
        return EXIT_CONFIG
    rc = _train(cfg)
    if rc == 0 and cfg.train.eval_harness_tasks and rank() == 0:
        rc = _eval_harness(cfg)
    return rc


def _train(cfg: RunConfig) -> int:
    """The training run on every rank; all ranks leave the process group together at its end."""
    try:
        return run(cfg)
    except (ValueError, FileNotFoundError) as e:
        error(f"error: {e}")
        return EXIT_CONFIG
    except RuntimeError as e:
        from shardtune.distributed.mesh import is_peer_failure

        if not is_peer_failure(e):
            raise
        # gloo's message: "[.../pair.cc:537] Read error [addr]: Connection reset by peer. This is typically ..."
        first = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        first = first.split(". ")[0]
        error(
            f"error: lost contact with another rank ({first}). Another process of this run has died: the "
            "launcher's report names it (torchrun: 'Root Cause'). Fix its error, then resume with "
            "--resume_from_checkpoint latest."
        )
        return EXIT_FAILED
    finally:
        from shardtune.distributed.mesh import shutdown

        shutdown()


def _eval_harness(cfg: RunConfig) -> int:
    """--eval_harness_tasks: lm-evaluation-harness on the finished run, on the main process alone. It runs after
    the process group is gone and the sharded model freed, so that the other ranks are not held in a collective
    (a long evaluation would exceed --ddp_timeout) and the main device holds only the evaluated model."""
    from shardtune.evaluate_harness import EvalArguments, evaluate_model

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


def _prepare_data(cfg: RunConfig, tokenizer, info):
    """Rank 0 prepares the cache first; then each other node's local rank 0 reads it (a shared file system) or
    prepares its own (node-local disks); then the remaining ranks read their node's cache. Every rank then checks
    that it holds the same rows as rank 0."""
    from shardtune.data import build_datasets
    from shardtune.distributed.mesh import barrier

    d = cfg.data
    cache = d.dataset_cache_dir or str(Path(cfg.train.output_dir).resolve().parent / ".shardtune_cache")
    kwargs = {
        "tokenizer": tokenizer,
        "dataset_name": d.dataset_name,
        "splits": d.splits,
        "dataset_text_field": d.dataset_text_field,
        "max_length": d.max_length,
        "packing": d.packing,
        "append_concat_token": d.append_concat_token,
        "add_special_tokens": d.add_special_tokens,
        "assistant_only_loss": d.assistant_only_loss,
        "drop_long_samples": d.drop_long_samples,
        "cache_dir": cache,
        "seed": cfg.train.seed,
        "max_train_samples": d.max_train_samples,
        "max_eval_samples": d.max_eval_samples,
        "chat_template_format": cfg.model.chat_template_format,
        "num_proc": d.dataset_num_proc,
        "streaming": d.streaming,
        "packing_window": d.packing_window,
    }
    if cfg.train.objective != "sft":
        build_datasets, kwargs = _preference_data_builder(kwargs)
        if cfg.train.objective == "kto":  # KL rows: completions rotated within each global micro-batch
            kwargs["kto_group"] = cfg.train.per_device_train_batch_size * info.world_size
    result = None
    for turn in (info.is_main, info.is_local_main and not info.is_main, not info.is_local_main):
        if turn:
            result = build_datasets(**kwargs)
        barrier()
    train, evals = result
    _check_same_rows(train, evals, d.dataset_name)
    if d.streaming:
        return train, evals
    st = train.stats
    if "pairs" in st:  # preference pairs (or KTO examples): their own log line said the rest
        unit = "examples" if "desirable" in st else "pairs"
        print0(f"Data: {st['pairs']} {unit}; eval {unit}: {len(evals) if evals is not None else 0}.")
        return train, evals
    print0(
        f"Data: {st.get('documents')} documents → {st.get('rows')} rows of up to {d.max_length} tokens "
        f"({st.get('truncated', 0)} truncated, {st.get('dropped', 0)} dropped); "
        f"eval rows: {len(evals.input_ids) if evals is not None else 0}."
    )
    return train, evals


def _check_same_rows(train, evals, dataset_name: str) -> None:
    """Nodes without a shared file system prepare their caches from their own copies of the data: compare the
    caches' content digests, so that a node with other files stops the run instead of training on other rows."""
    from shardtune.distributed.mesh import all_gather_objects

    mine = [getattr(train, "digest", None), getattr(evals, "digest", None)]  # None for a streamed split: not compared
    digests = all_gather_objects(mine)
    differ = [r for r, x in enumerate(digests) if x != digests[0]]
    if differ:
        raise ValueError(
            f"rank(s) {differ} prepared other training or evaluation rows than rank 0 from --dataset_name "
            f"{dataset_name}: each node tokenizes its own copy of the data into its own --dataset_cache_dir. Give "
            "every node identical data files and tokenizer."
        )


def _preference_data_builder(kwargs: dict):
    """build_preference_datasets and the subset of the SFT data arguments that applies to pairs."""
    from shardtune.data.preference import build_preference_datasets

    names = ("tokenizer", "dataset_name", "splits", "max_length", "add_special_tokens", "drop_long_samples")
    keep = {k: kwargs[k] for k in (*names, "cache_dir", "max_train_samples", "max_eval_samples")}
    return build_preference_datasets, keep


def _kto_advice(train_split, t) -> str | None:
    from shardtune.loss import kto_weight_advice

    n_desirable = int(train_split.desirable.sum())
    return kto_weight_advice(n_desirable, len(train_split) - n_desirable, t.desirable_weight, t.undesirable_weight)


def _setup_objective(cfg: RunConfig, model, splits: list, info, pad_id: int):
    """The objective of --objective; for a preference objective, dropout off (as TRL) and the reference
    log-probs precomputed unless the reference is the base with a fresh adapter disabled, each step."""
    from shardtune.loss import build_objective, disable_dropout
    from shardtune.reference import precompute_reference, weights_identity

    t, m = cfg.train, cfg.model
    objective = build_objective(
        t.objective,
        beta=t.beta,
        loss_type=t.loss_type,
        simpo_gamma=t.simpo_gamma,
        desirable_weight=t.desirable_weight,
        undesirable_weight=t.undesirable_weight,
    )
    if objective.paired and t.disable_dropout:
        disable_dropout(model)
    if t.objective == "kto" and (advice := _kto_advice(splits[0], t)):
        print0(advice)
    if not objective.needs_reference:
        return objective
    if m.use_peft_lora and not m.adapter_path and not t.precompute_ref_log_probs:
        print0("Reference: the base model with the adapter disabled, run under no_grad each step (no second copy).")
        return objective
    f = cfg.fsdp
    identity = {  # what decides the reference's numbers: the weight files, how they are loaded, the precision
        "weights": weights_identity(m.model_name_or_path, m.adapter_path),
        "model": cfg.to_dict()["model"],
        "precision": [t.bf16, t.fp16, f.mixed_precision],
    }
    for split in (s for s in splits if s is not None):
        precompute_reference(
            model,
            split,
            batch_size=t.per_device_eval_batch_size,
            info=info,
            pad_id=pad_id,
            # With --adapter_path the reference is the model the run starts from: base plus that adapter.
            disable_adapter=m.use_peft_lora and not m.adapter_path,
            identity=identity,
        )
    return objective


def _total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.num_train_epochs * steps_per_epoch))


def run(cfg: RunConfig) -> int:
    from shardtune.cpu import bf16_check
    from shardtune.distributed.mesh import init_distributed

    info = init_distributed(cfg.fsdp.sharding_strategy, timeout_s=cfg.train.ddp_timeout)
    bf16 = cfg.train.bf16 or cfg.fsdp.mixed_precision == "bf16"
    if info.is_main and (msg := bf16_check(info.device.type, bf16)):  # AVX2-only CPUs emulate bf16: say so
        warn0(msg)
    repo_id = _preflight(cfg, info)
    trackers = _open_trackers(cfg, info)
    try:
        return _run(cfg, info, repo_id, trackers)
    except BaseException:
        for tracker in trackers:  # a W&B/MLflow run of a failed run is marked failed, not left running
            tracker.close(finished=False)
        raise


def _open_trackers(cfg: RunConfig, info) -> list:
    """The W&B/MLflow runs of --report_to, started on the main process before the data and model load, so that
    a tracker that cannot start stops every rank with its message (exit 2) and nothing has been spent."""
    from shardtune.distributed.mesh import broadcast_object
    from shardtune.trackers import open_trackers, parse_report_to

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


def _run(cfg: RunConfig, info, repo_id: str | None, trackers: list) -> int:
    from transformers import get_scheduler

    from shardtune.builder import model_spec
    from shardtune.distributed.setup import build_sharded_model
    from shardtune.metrics import RunLogger
    from shardtune.trainer import (
        STREAMING_STEPS_PER_EPOCH,
        LoopSettings,
        LoopState,
        NonFiniteError,
        StopFlag,
        build_optimizer,
        steps_per_epoch,
        train,
    )

    m, t = cfg.model, cfg.train
    _seed_everything(t.seed)
    tokenizer, new_ids = modeling.load_tokenizer(
        m.model_name_or_path,
        tokenizer_name_or_path=m.tokenizer_name_or_path,
        chat_template_format=m.chat_template_format,
        trust_remote_code=m.trust_remote_code,
    )
    train_split, eval_split = _prepare_data(cfg, tokenizer, info)
    if t.resume_from_checkpoint:  # before the model loads: another run's data is refused at no cost
        _check_resumed_data(cfg, train_split)
    spe = (
        STREAMING_STEPS_PER_EPOCH
        if cfg.data.streaming
        else steps_per_epoch(
            train_split,
            batch_size=t.per_device_train_batch_size,
            world_size=info.world_size,
            grad_accum=t.gradient_accumulation_steps,
        )
    )
    if spe < 1:
        unit = {"sft": "rows", "kto": "examples"}.get(t.objective, "pairs")
        raise ValueError(
            f"the training split gives {len(train_split)} {unit}: fewer than one optimizer step "
            f"of {t.per_device_train_batch_size}×{info.world_size}×{t.gradient_accumulation_steps} {unit}. "
            "Lower --per_device_train_batch_size or --gradient_accumulation_steps, or add data."
        )
    total = _total_steps(cfg, spe)
    _seed_everything(t.seed)
    model = build_sharded_model(model_spec(cfg, info.device.type, len(tokenizer), new_ids), info)
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
    # Before a checkpoint is loaded: a precomputed reference is the run's starting point, also on resume.
    evaluated = eval_split if t.eval_strategy != "no" else None  # no reference pass for a split never evaluated
    objective = _setup_objective(cfg, model, [train_split, evaluated], info, tokenizer.pad_token_id)
    state = LoopState()
    if t.resume_from_checkpoint:
        state = _resume(cfg, model, optimizer, scheduler, info)
    settings = LoopSettings(
        batch_size=t.per_device_train_batch_size,
        eval_batch_size=t.per_device_eval_batch_size,
        grad_accum=t.gradient_accumulation_steps,
        max_grad_norm=t.max_grad_norm,
        total_steps=total,
        steps_per_epoch=spe,
        seed=t.seed,
        pad_id=tokenizer.pad_token_id,
        logging_steps=max(1, int(t.logging_steps)),
        logging_strategy=t.logging_strategy,
        eval_strategy=t.eval_strategy,
        eval_steps=int(t.eval_steps or t.logging_steps),
        save_strategy=t.save_strategy,
        save_steps=max(1, int(t.save_steps)),
        max_nonfinite_steps=t.max_nonfinite_steps,
    )
    from shardtune.distributed.fsdp import local_state_bytes
    from shardtune.distributed.mesh import all_gather_objects

    # What each rank really holds for weights: recorded for `shardtune plan` to be checked against.
    run_info = {
        **_config_record(cfg),
        "world_size": info.world_size,
        "param_bytes_per_rank": all_gather_objects(local_state_bytes(model)),
    }
    logger = RunLogger(
        t.output_dir, is_main=info.is_main, report_to=t.report_to, total_steps=total, config=run_info, trackers=trackers
    )
    print0(
        f"Training {total} steps ({spe} per epoch), global batch {t.per_device_train_batch_size * info.world_size * t.gradient_accumulation_steps} rows."
    )

    def save_fn(s: LoopState) -> None:
        _save_checkpoint(
            cfg,
            s,
            data_digest=getattr(train_split, "digest", None),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            tokenizer=tokenizer,
            info=info,
            repo_id=repo_id,
        )

    stop = StopFlag(info.device)
    start = time.perf_counter()
    try:
        state = train(
            model,
            optimizer,
            scheduler,
            train_split=train_split,
            eval_split=eval_split,
            info=info,
            s=settings,
            state=state,
            logger=logger,
            # Also with --save_strategy no: a signal still saves a checkpoint to resume from.
            save_fn=save_fn,
            stop_requested=stop,
            objective=objective,
        )
    except NonFiniteError as e:
        error(str(e))
        logger.close()
        return EXIT_FAILED
    except OSError as e:
        return _output_not_written(logger, e, info)
    if state.step < total:
        last = checkpoint.list_checkpoints(t.output_dir)[-1]
        print0(
            f"Interrupted at step {state.step}/{total}; checkpoint saved in {last}. Resume with the same command "
            f"plus --resume_from_checkpoint latest (or --resume_from_checkpoint {last})."
        )
        logger.close()
        return EXIT_INTERRUPTED
    try:
        out = _export(cfg, model, tokenizer, info, state.step)
    except OSError as e:
        return _output_not_written(logger, e, info)
    summary = _finish(
        logger, cfg, model, eval_split, info, settings, state, time.perf_counter() - start, out, objective
    )
    if info.is_main:
        _write_cards(cfg, out, summary)
        if repo_id:
            from shardtune import hub

            hub.upload(
                repo_id,
                out,
                hub_token=t.hub_token,
                message=f"shardtune: end of training (step {state.step})",
                ignore=hub.END_IGNORE,
            )
            print0(f"Uploaded {out} to https://huggingface.co/{repo_id}.")
        logger.log_model(out, is_adapter=m.use_peft_lora)
    logger.close(finished=True)
    return 0


def _output_not_written(logger, e: OSError, info) -> int:
    """A full disk during a checkpoint or the final save: one error line, a summary saying so, exit 1.
    (The writers have removed their temporary folders; earlier checkpoints and outputs are intact.)"""
    from shardtune.atomic import is_disk_full

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


def _preflight(cfg: RunConfig, info) -> str | None:
    """Checks that fail fast, before data and model loading: the output folder, hub access, FSDP1-only options,
    the optimizer on this device, the checkpoint to resume from, GPU size. Rank 0 checks (the others would see its
    first files in output_dir) and, with --overwrite_output_dir, removes the previous run's state."""
    from shardtune import hub, preflight
    from shardtune.distributed.mesh import broadcast_object
    from shardtune.launcher import fsdp1_only_notes

    t = cfg.train
    repo_id, problem = None, None
    if info.is_main:
        for note in fsdp1_only_notes(cfg.fsdp) if cfg.fsdp.enabled else []:
            print0(note)
        resuming = bool(t.resume_from_checkpoint)
        problem = preflight.output_dir_problem(t.output_dir, overwrite=t.overwrite_output_dir, resuming=resuming)
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
            from shardtune.evaluate_harness import check_tasks, split_tasks

            flags = ("--eval_harness_tasks", "--eval_harness_include_path")
            _, task_problems = check_tasks(split_tasks(t.eval_harness_tasks), t.eval_harness_include_path, flags)
            problem = "; ".join(task_problems) or None
        if not problem and t.overwrite_output_dir and not resuming:
            removed = preflight.clear_previous_run(t.output_dir)
            if removed:
                print0(f"--overwrite_output_dir: removed the previous run's {', '.join(removed)} from {t.output_dir}.")
        if info.device.type == "cuda" and not problem:
            from shardtune.plan import warn_if_too_small

            msg = warn_if_too_small(cfg, torch.cuda.get_device_properties(info.device).total_memory)
            if msg:
                warn0(msg)
    repo_id, problem = broadcast_object((repo_id, problem))
    if problem:
        raise ValueError(problem)
    return repo_id


def _config_record(cfg: RunConfig) -> dict:
    """The run's settings as saved in metrics.jsonl and checkpoints (which may be uploaded): no hub token."""
    d = cfg.to_dict()
    if d["train"].get("hub_token"):
        d["train"]["hub_token"] = "<redacted>"
    return d


def _optimizer_and_resume_problem(cfg: RunConfig, info) -> str | None:
    from shardtune.trainer import BNB_OPTIMIZERS, optimizer_problems

    t = cfg.train
    problems = optimizer_problems(t.optim, info.device)
    if problems:
        return "; ".join(problems)
    if not t.resume_from_checkpoint:
        return None
    try:
        from shardtune.preflight import identity_problem

        path = checkpoint.resolve(t.resume_from_checkpoint, t.output_dir)
        record = json.loads(json.dumps(_config_record(cfg), default=str))
        other_run = identity_problem(path, record, t.resume_from_checkpoint)
        if other_run:
            return other_run
        checkpoint.check_resumable(
            path,
            checkpoint.read_meta(path),
            per_rank_optimizer=t.optim in BNB_OPTIMIZERS,
            optimizer_name=f"--optim {t.optim}",
            world=info.world_size,
        )
    except ValueError as e:
        return str(e)
    return None


def _save_checkpoint(
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
        config={**_config_record(cfg), "data_digest": data_digest},
        state_dict_type=cfg.fsdp.state_dict_type,
        save_total_limit=t.save_total_limit,
    )
    if not repo_id or t.hub_strategy == "end":
        return
    if t.hub_strategy == "every_save":
        _write_weights(cfg, model, tokenizer, info, s.step)  # the adapter (or model) as of this step, for the upload
    if info.is_main:
        from shardtune import hub

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
    d["samples_in_epoch"] = s.batch_in_epoch * t.per_device_train_batch_size * info.world_size
    d["global_batch"] = t.per_device_train_batch_size * info.world_size * t.gradient_accumulation_steps
    return d


def _check_resumed_data(cfg: RunConfig, train_split) -> None:
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
        from shardtune.preflight import run_identity

        key = "data.dataset_name"
        before, after = (
            run_identity(record)[key],
            run_identity(json.loads(json.dumps(_config_record(cfg), default=str)))[key],
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


def _resume(cfg, model, optimizer, scheduler, info):
    from shardtune.trainer import LoopState

    t = cfg.train
    path = checkpoint.resolve(t.resume_from_checkpoint, t.output_dir, announce=True)
    saved_cfg = path / "config.json"
    if saved_cfg.exists():
        changed = checkpoint.changed_settings(
            json.loads(saved_cfg.read_text()), json.loads(json.dumps(_config_record(cfg), default=str))
        )
        if changed:
            warn0(f"Resuming {path} with settings that differ from its run: " + "; ".join(changed))
    meta = checkpoint.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    loop, notes = checkpoint.resume_position(
        meta,
        per_device=t.per_device_train_batch_size,
        world=info.world_size,
        grad_accum=t.gradient_accumulation_steps,
    )
    for note in notes:
        warn0(note)
    state = LoopState(**loop)
    if info.is_main:
        from shardtune.preflight import trim_metrics

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


def _write_weights(cfg: RunConfig, model, tokenizer, info, step: int = 0) -> Path:
    """Gather the adapter (or the whole model) and write it to output_dir in PEFT/transformers format.
    A full disk on rank 0 raises OSError(ENOSPC) on every rank (the others would wait at the next barrier)."""
    import errno

    from shardtune import export
    from shardtune.atomic import DiskFullError
    from shardtune.distributed.gather import gather_full, gather_trainable
    from shardtune.distributed.mesh import broadcast_object

    out = Path(cfg.train.output_dir)
    inner = model.model
    sd = gather_trainable(inner) if cfg.model.use_peft_lora else gather_full(inner)
    problem = None
    if info.is_main:
        try:
            if cfg.model.use_peft_lora:
                export.save_adapter(inner, sd, tokenizer, out, step=step)
            else:
                dtype = torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else None
                export.save_full_model(inner, sd, tokenizer, out, dtype=dtype, step=step)
        except DiskFullError as e:
            problem = str(e)
    problem = broadcast_object(problem)
    if problem:
        raise OSError(errno.ENOSPC, problem)
    return out


def _export(cfg: RunConfig, model, tokenizer, info, step: int) -> Path:
    from shardtune.distributed.mesh import barrier

    out = _write_weights(cfg, model, tokenizer, info, step)
    print0(f"{'Adapter' if cfg.model.use_peft_lora else 'Model'} written to {out}.")
    barrier()
    if cfg.train.merge_adapter and cfg.model.use_peft_lora and info.is_main:
        from shardtune.merge import merge_adapter

        dtype = "bf16" if cfg.train.bf16 else "fp16" if cfg.train.fp16 else None
        merged = merge_adapter(
            cfg.model.model_name_or_path,
            out,
            out / "merged",
            dtype=dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        print0(f"Merged model written to {merged}.")
    barrier()
    return out


def _finish(logger, cfg, model, eval_split, info, settings, state, runtime, out, objective) -> None:
    from shardtune.distributed.mesh import all_gather_objects
    from shardtune.trainer import evaluate_split, peak_memory_gb

    final_eval = {}
    if eval_split is not None and cfg.train.eval_strategy != "no":
        final_eval = evaluate_split(model, eval_split, objective, settings, info)
    mem = all_gather_objects(round(peak_memory_gb(info.device), 3))
    summary = {
        "runtime_s": runtime,
        "train_tokens": state.tokens,
        "tokens_per_s": state.tokens / max(runtime, 1e-9),
        "peak_memory_gb_per_rank": mem,
        "final_train_loss": state.losses[-1] if state.losses else None,
        "final_eval_loss": final_eval.get("eval_loss"),
        "final_eval_perplexity": final_eval.get("eval_perplexity"),
        "output_path": str(out),
        "interrupted": False,
        "steps": state.step,
        "nonfinite_steps": state.nonfinite_steps,
    }
    logger.finish(summary)
    if info.is_main:
        (Path(out) / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _method(cfg: RunConfig) -> str:
    m = cfg.model
    if not m.use_peft_lora:
        return "full"
    return "QLoRA" if m.use_4bit_quantization else "DoRA" if m.use_dora else "LoRA"


def _write_cards(cfg: RunConfig, out: Path, summary: dict) -> None:
    from shardtune.modelcard import write_model_card

    m, d, t = cfg.model, cfg.data, cfg.train
    hp = {
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler_type,
        "num_train_epochs": t.num_train_epochs,
        "steps": summary.get("steps"),
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "max_length": d.max_length,
        "packing": d.packing,
        "bf16": t.bf16,
        "seed": t.seed,
        "optim": t.optim,
        "fsdp_sharding_strategy": cfg.fsdp.sharding_strategy,
    }
    if t.objective != "sft":
        hp.update(objective=t.objective, beta=t.beta)
        hp.update({"loss_type": t.loss_type} if t.objective == "dpo" else {})
        if t.objective == "kto":
            hp.update(desirable_weight=t.desirable_weight, undesirable_weight=t.undesirable_weight)
    if m.use_peft_lora:
        hp.update(
            lora_r=m.lora_r,
            lora_alpha=m.lora_alpha,
            lora_dropout=m.lora_dropout,
            lora_target_modules=m.lora_target_modules,
        )
    metrics = {
        "train_loss": summary.get("final_train_loss"),
        "eval_loss": summary.get("final_eval_loss"),
        "eval_perplexity": summary.get("final_eval_perplexity"),
    }
    kwargs = {
        "base_model": m.model_name_or_path,
        "method": _method(cfg),
        "datasets": d.dataset_name,
        "hyperparameters": hp,
        "metrics": metrics,
    }
    write_model_card(out, library_name="peft" if m.use_peft_lora else "transformers", **kwargs)
    if (out / "merged" / "config.json").exists():
        write_model_card(out / "merged", library_name="transformers", **kwargs)
