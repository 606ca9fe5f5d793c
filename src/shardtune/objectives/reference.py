"""The reference model's log-probs of every preference sequence (for KTO also of its KL rows), computed once before
the first optimizer step and stored beside the tokenized data (shardtune.data cache), so that full fine-tuning
needs no second model copy.

The pass runs on the sharded model as it is built, before a checkpoint is loaded: its weights are then exactly
the starting point of the run, also when the run resumes. Each rank computes the pairs of its share of each global
batch; the per-row results are gathered so that every rank holds the whole array.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shardtune.objectives.heads import sequence_logps
from shardtune.parallel.adapters import disabled_adapter, reshard
from shardtune.parallel.context_parallel import local_part
from shardtune.parallel.mesh import all_gather_objects
from shardtune.runtime.atomic import replaced_file
from shardtune.runtime.log import print0

FORMAT = 1


def precompute_reference(
    model: nn.Module, split, *, batch_size: int, info, pad_id: int, identity: dict, disable_adapter: bool
) -> np.ndarray:
    """Set split.ref_logps (one float64 per row) from the cache or a forward pass over every pair; return it.

    identity names the reference weights (model, adapter, dtype): it is part of the cache file's name.
    disable_adapter: the reference is the base without the (freshly initialised) adapter.
    """
    path = _cache_path(split, {**identity, "disable_adapter": disable_adapter})
    cached = _load(path, 2 * len(split))
    if cached is not None:
        print0(f"Reference log-probs read from {path}.")
        split.ref_logps = cached
        return cached
    values = _forward_pass(model, split, batch_size=batch_size, info=info, pad_id=pad_id, disable=disable_adapter)
    if info.is_main and path is not None:
        _save(path, values)
    what = f"{len(split)} {'pairs' if getattr(split, 'desirable', None) is None else 'examples (and their KL rows)'}"
    print0(f"Reference log-probs of {what} computed" + (f" and stored in {path}." if path else "."))
    split.ref_logps = values
    return values


@torch.no_grad()
def _forward_pass(model: nn.Module, split, *, batch_size: int, info, pad_id: int, disable: bool) -> np.ndarray:
    was_training = model.training
    model.eval()
    local: list[tuple[int, float, float]] = []
    dims = info.dims  # data-parallel rank and size: which rows this rank takes
    kw = {"batch_size": batch_size, "rank": dims.dp_rank, "world_size": dims.dp_size, "epoch": 0, "seed": 0}
    with disabled_adapter(model) if disable else contextlib.nullcontext():
        for batch in split.iterate(**kw, shuffle=False, pad_id=pad_id, drop_last=False):
            rows = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
            part, model.cp_shard = local_part(rows, info, model)  # the rows' sums on every cp rank
            logps, _ = model(**{k: v.to(info.device) for k, v in part.items()}, head=sequence_logps)
            chosen, rejected = logps.double().cpu().chunk(2)
            for j, pair in enumerate(batch["pair_index"].tolist()):
                if pair >= 0:
                    local.append((pair, float(chosen[j]), float(rejected[j])))
    # FSDP2 leaves the root and the last block on their unsharded parameters after a forward: model.parameters()
    # would then list those (which never get a gradient) to the training loop's gradient clipping, in place of
    # the sharded ones the optimizer steps.
    reshard(model)
    model.train(was_training)
    values = np.full(2 * len(split), np.nan)
    for part in all_gather_objects(local):
        for pair, c, r in part:
            values[2 * pair], values[2 * pair + 1] = c, r
    assert not np.isnan(values).any(), "a pair got no reference log-prob"
    return values


def _cache_path(split, identity: dict) -> Path | None:
    if not split.cache_path:
        return None
    key = hashlib.sha256(json.dumps([FORMAT, identity], sort_keys=True, default=str).encode()).hexdigest()[:24]
    data = Path(split.cache_path)
    return data.with_name(f"{data.stem}.ref-{key}.npy")


def weights_identity(*paths: str | None) -> list:
    """Names, sizes and times of the files of local model/adapter folders (hub ids as given): a changed file
    changes the reference."""
    out = []
    for p in paths:
        if not p:
            out.append(None)
            continue
        folder = Path(p).expanduser()
        if folder.is_dir():
            files = sorted(f for f in folder.iterdir() if f.is_file())
            out.append([str(folder.resolve())] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files])
        else:
            out.append(p)
    return out


def _load(path: Path | None, n_rows: int) -> np.ndarray | None:
    if path is None or not path.exists():
        return None
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None  # unreadable: compute again
    return values if values.shape == (n_rows,) and np.isfinite(values).all() else None


def _save(path: Path, values: np.ndarray) -> None:
    """Atomically (shardtune.runtime.atomic.replaced_file): ranks of one node may write the same file."""

    with replaced_file(path) as f:
        np.save(f, values)
