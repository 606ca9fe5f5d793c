"""A run's data: its tokenizer, the training and eval splits built in rank order, checked equal on every rank, and
the number of optimizer steps they give."""

from __future__ import annotations

import json
import math
from pathlib import Path

from shardtune.config.arguments import RunConfig
from shardtune.data import build_datasets
from shardtune.data.cache import CACHE_FIX
from shardtune.data.preference import build_preference_datasets
from shardtune.data.prompts import build_prompt_datasets
from shardtune.models import loading
from shardtune.models.preflight import tokenizer_load_error
from shardtune.objectives.loss import objective_spec
from shardtune.parallel import mesh
from shardtune.parallel.mesh import barrier
from shardtune.runtime.atomic import DiskFullError, is_disk_full, sweep_stale
from shardtune.runtime.log import print0
from shardtune.training.trainer import STREAMING_STEPS_PER_EPOCH, steps_per_epoch


def load_tokenizer(cfg: RunConfig):
    """The run's tokenizer with its chat format applied, and the ids of the tokens it added (models.loading); a
    file it cannot parse is a ValueError naming the flag that named it."""
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


def prepare_data(cfg: RunConfig, tokenizer, info):
    """Rank 0 prepares the cache first; then each other node's local rank 0 reads it (a shared file system) or
    prepares its own (node-local disks); then the remaining ranks read their node's cache. Every rank then checks
    that it holds the same rows as rank 0."""

    d = cfg.data
    cache = d.dataset_cache_dir or str(Path(cfg.train.output_dir).resolve().parent / ".shardtune_cache")
    kind = objective_spec(cfg.train.objective).data
    if kind == "prompts":  # online RL: the prompts alone; their completions are generated (recipe.rl)

        def build():
            return build_prompt_datasets(d, tokenizer=tokenizer, max_prompt_length=cfg.train.max_prompt_length)
    elif kind == "rows":

        def build():
            return build_datasets(
                d,
                tokenizer=tokenizer,
                seed=cfg.train.seed,
                cache_dir=cache,
                chat_template_format=cfg.model.chat_template_format,
            )
    else:
        # KTO's KL rows: completions rotated within each global micro-batch.
        group = cfg.train.per_device_train_batch_size * info.dims.dp_size if kind == "kto" else None

        def build():
            return build_preference_datasets(d, tokenizer=tokenizer, cache_dir=cache, kto_group=group)

    if info.is_local_main:  # what a killed run of this host left half-written (the names say whose)
        for stale in sweep_stale(cache):
            print0(f"Removed {stale}, a cache that a killed run left half-written.")
    result = None
    for turn in (info.is_main, info.is_local_main and not info.is_main, not info.is_local_main):
        if turn:
            result = _disk_full_named(build, cache)
        barrier()
    train, evals = result
    _check_same_rows(train, evals, d.dataset_name)
    if d.streaming:
        return train, evals
    print0(train.summary(evals, d.max_length))
    return train, evals


def _disk_full_named(build, cache: str):
    """A full disk while the tokenizer's workers write their part files: the cache folder's DiskFullError (the
    arrays' own writes say it with the size they need, shardtune.data.cache)."""
    try:
        return build()
    except OSError as e:
        if isinstance(e, DiskFullError) or not is_disk_full(e):
            raise
        raise DiskFullError(cache, None, "the tokenized data cache", CACHE_FIX) from e


def _check_same_rows(train, evals, dataset_name: str) -> None:
    """Nodes without a shared file system prepare their caches from their own copies of the data: compare the
    caches' content digests, so that a node with other files stops the run instead of training on other rows."""

    mine = [getattr(train, "digest", None), getattr(evals, "digest", None)]  # None for a streamed split: not compared
    digests = mesh.all_gather_objects(mine)
    differ = [r for r, x in enumerate(digests) if x != digests[0]]
    if differ:
        raise ValueError(
            f"rank(s) {differ} prepared other training or evaluation rows than rank 0 from --dataset_name "
            f"{dataset_name}: each node tokenizes its own copy of the data into its own --dataset_cache_dir. Give "
            "every node identical data files and tokenizer."
        )


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.num_train_epochs * steps_per_epoch))


def steps_per_epoch_for(cfg: RunConfig, train_split, info) -> int:
    """Optimizer steps in one epoch of the split at this run's global batch; a stream's length is unknown."""

    t, dp = cfg.train, info.dims.dp_size
    if cfg.data.streaming:
        return STREAMING_STEPS_PER_EPOCH
    spe = steps_per_epoch(
        train_split, batch_size=t.per_device_train_batch_size, world_size=dp, grad_accum=t.gradient_accumulation_steps
    )
    if spe < 1:
        unit = {"rows": "rows", "kto": "examples"}.get(objective_spec(t.objective).data, "pairs")
        raise ValueError(
            f"the training split gives {len(train_split)} {unit}: fewer than one optimizer step "
            f"of {t.per_device_train_batch_size}×{dp}×{t.gradient_accumulation_steps} {unit}. "
            "Lower --per_device_train_batch_size or --gradient_accumulation_steps, or add data."
        )
    return spe
