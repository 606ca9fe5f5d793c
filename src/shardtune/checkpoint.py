"""Sharded checkpoints through torch.distributed.checkpoint (DCP), written atomically, resumed exactly.

A checkpoint folder `checkpoint-<step>` holds: the trainable weights and the optimizer state (DCP shards, or
one full file with FULL_STATE_DICT), the scheduler, every rank's RNG state, the loop state (step, epoch, data
position in samples) and the run's config. It is written to `checkpoint-<step>.tmp` and renamed only when every
rank has finished, so a process killed mid-save leaves the previous checkpoint complete.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardtune.log import print0, warn0

_NAME = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (no .tmp), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / "meta.json").exists()]
    return [p for _, p in sorted(found)]


def resolve(resume_from: str, output_dir: str | Path) -> Path:
    """`latest` → the newest complete checkpoint of output_dir; a path → that checkpoint (checked)."""
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise ValueError(
                f"--resume_from_checkpoint latest: no complete checkpoint in {Path(output_dir) / 'checkpoints'}."
            )
        return found[-1]
    path = Path(resume_from)
    if not (path / "meta.json").exists():
        raise ValueError(f"--resume_from_checkpoint {resume_from}: not a complete shardtune checkpoint (no meta.json).")
    return path


def _options(state_dict_type: str, for_save: bool) -> StateDictOptions:
    full = state_dict_type == "FULL_STATE_DICT"
    return StateDictOptions(
        ignore_frozen_params=True,
        full_state_dict=full,
        cpu_offload=full and for_save,
        broadcast_from_rank0=full and not for_save,
    )


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    output_dir: str | Path,
    *,
    model: nn.Module,
    optimizer,
    scheduler,
    loop_state: dict,
    config: dict,
    state_dict_type: str = "SHARDED_STATE_DICT",
    save_total_limit: int | None = None,
) -> Path:
    """Write checkpoint-<step> atomically (all ranks call this); prune the oldest beyond save_total_limit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(output_dir) / "checkpoints"
    final = root / f"checkpoint-{loop_state['step']}"
    tmp = root / f"checkpoint-{loop_state['step']}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd, osd = get_state_dict(model, optimizer, options=_options(state_dict_type, for_save=True))
    if state_dict_type == "FULL_STATE_DICT":
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, tmp / "full_state.pt")
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "sharded"))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        meta = {"loop": loop_state, "world_size": world, "state_dict_type": state_dict_type}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(output_dir, save_total_limit)
    dist.barrier()
    print0(f"Saved checkpoint {final}.")
    return final


def _prune(output_dir: str | Path, limit: int | None) -> None:
    if not limit or limit <= 0:
        return
    found = list_checkpoints(output_dir)
    for old in found[: max(len(found) - limit, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, *, model: nn.Module, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the saved meta (loop state, world size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = json.loads((path / "meta.json").read_text())
    sdt = meta["state_dict_type"]
    msd, osd = get_state_dict(model, optimizer, options=_options("SHARDED_STATE_DICT", for_save=True))
    if sdt == "FULL_STATE_DICT":
        full = torch.load(path / "full_state.pt", weights_only=False) if rank == 0 else {"model": {}, "optim": {}}
        set_state_dict(
            model,
            optimizer,
            model_state_dict=full["model"],
            optim_state_dict=full["optim"],
            options=_options(sdt, for_save=False),
        )
    else:
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path / "sharded"))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=True),
        )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / f"rng_rank{rank}.pt"
    if not rng.exists():
        warn0(
            f"{path} was saved by {meta['world_size']} rank(s); this run has {world}: ranks without a saved "
            "RNG state continue from rank 0's."
        )
        rng = path / "rng_rank0.pt"
    _set_rng_state(torch.load(rng, weights_only=False))
    return meta
