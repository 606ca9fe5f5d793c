"""Sharded checkpoints through torch.distributed.checkpoint (DCP), written atomically, resumed exactly.

A checkpoint folder `<output_dir>/checkpoints/checkpoint-<step>` holds:

- the trainable weights and the optimizer state: DCP shards in `sharded/` (SHARDED_STATE_DICT, reshardable to
  any number of ranks), or one consolidated `full_state.pt` written by rank 0 (FULL_STATE_DICT);
- with a bitsandbytes 8-bit optimizer, its state per rank shard in `optim_rank<r>.pt` (see `LocalShards` in
  shardtune.training.trainer: its quantized blocks follow each rank's shard, so it resumes on the same number of ranks);
- `scheduler.pt`, every rank's RNG state `rng_rank<r>.pt`, the run's `config.json`, and `meta.json` (the loop
  state: step, epoch and data position in samples; the world size; the state dict type; the optimizer).

It is written to `checkpoint-<step>.tmp` and renamed only once every rank has finished writing, then older
checkpoints beyond --save_total_limit are pruned: a process killed mid-save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardtune.parallel.mesh import broadcast_object
from shardtune.runtime import atomic, hooks
from shardtune.runtime.log import print0, warn0

FORMAT_VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")
# What a failed write raises: DCP's CheckpointException (its per-rank failures: on a full disk torch's zip writer's
# RuntimeError "unexpected pos ..." or an OSError(ENOSPC)) derives from BaseException, not Exception.
_WRITE_ERRORS = (Exception, dcp.api.CheckpointException)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (renamed into place, with meta.json), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / "meta.json").exists()]
    return [p for _, p in sorted(found)]


def resolve(resume_from: str, output_dir: str | Path, *, announce: bool = False) -> Path:
    """`latest` → the newest complete and readable checkpoint of output_dir (with announce, one warning names
    the damaged newer ones it skipped); a path → that checkpoint, checked (ValueError naming the bad file).
    `True` (any case) means `latest`, as transformers' Trainer reads --resume_from_checkpoint True."""
    if resume_from == "latest" or resume_from.lower() == "true":
        found = list_checkpoints(output_dir)
        skipped = []
        for path in reversed(found):
            problem = damage(path)
            if problem is None:
                if skipped and announce:
                    warn0(f"--resume_from_checkpoint latest: skipping {'; '.join(skipped)}; resuming from {path}.")
                return path
            skipped.append(problem)
        where = Path(output_dir) / "checkpoints"
        asked = "latest" if resume_from == "latest" else f"{resume_from} (the latest checkpoint)"
        raise ValueError(
            f"--resume_from_checkpoint {asked}: no complete checkpoint in {where}"
            + (f" ({'; '.join(skipped)})" if skipped else "")
            + "; check --output_dir, or drop --resume_from_checkpoint to start afresh."
        )
    path = Path(resume_from)
    if not (path / "meta.json").exists():
        hint = " (an unfinished save: resume from an earlier checkpoint)" if path.name.endswith(".tmp") else ""
        raise ValueError(
            f"--resume_from_checkpoint {resume_from}: not a complete shardtune checkpoint (no meta.json){hint}."
        )
    problem = damage(path)
    if problem:
        raise ValueError(f"--resume_from_checkpoint {resume_from}: {problem}; resume from an earlier checkpoint.")
    return path


def damage(path: Path) -> str | None:
    """Why checkpoint `path` cannot be resumed from (None when it looks whole), checked cheaply before any
    loading: meta.json parses; every file it implies exists; each torch file is a whole zip archive (its
    directory is at the end, so a truncated file fails); DCP's .metadata loads and every shard file is as long
    as the metadata says. Names the damaged file."""
    try:
        meta = read_meta(path)
        world, full = int(meta["world_size"]), meta["state_dict_type"] == "FULL_STATE_DICT"
        int(meta["loop"]["step"])
        per_rank = bool(meta.get("optimizer", {}).get("per_rank"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path / 'meta.json'} is unreadable ({type(e).__name__}: {_first_line(e)})"
    files = ["scheduler.pt", *(f"rng_rank{r}.pt" for r in range(world))]
    files += [f"optim_rank{r}.pt" for r in range(world)] if per_rank else []
    files += ["full_state.pt"] if full else []
    for name in files:
        try:
            zipfile.ZipFile(path / name).close()
        except (OSError, zipfile.BadZipFile) as e:
            return f"{path / name} is missing or truncated ({_first_line(e)})"
    return None if full else _dcp_damage(path / "sharded")


def _dcp_damage(folder: Path) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        return f"{folder / '.metadata'} is missing or unreadable ({type(e).__name__}: {_first_line(e)})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        have = (folder / name).stat().st_size if (folder / name).exists() else None
        if have is None or have < size:
            return f"{folder / name} is {'missing' if have is None else f'truncated ({have} of {size} bytes)'}"
    return None


# --------------------------------------------------------------------------------------------------- saving


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
    """Write checkpoint-<step> atomically (all ranks call this); prune the oldest beyond save_total_limit.

    A write error on any rank (a full disk: DiskFullError, naming the folder and the bytes needed) is raised on
    every rank after the temporary folder is removed, so the previous checkpoints stay as they were.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    root = Path(output_dir) / "checkpoints"
    step = int(loop_state["step"])
    final, tmp = root / f"checkpoint-{step}", root / f"checkpoint-{step}.tmp"
    shards = getattr(optimizer, "local_shards", None)
    full = state_dict_type == "FULL_STATE_DICT"
    state = _weights_state(model, None if shards else optimizer, full)
    needed = _global_bytes(state, shards and optimizer.state_dict())
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in [*root.glob("*.tmp"), *root.glob("*.old"), *root.glob(".*.old-*")]:  # killed mid-save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            problem = _describe(e, root, needed)
    if broadcast_object(problem) is None:  # the folder exists: every rank writes its part
        try:
            _write_rank_files(tmp, state, full, optimizer, shards, rank)
            hooks.at("save", step=step, rank=rank)
        except _WRITE_ERRORS as e:  # every rank must learn of it before anyone raises
            problem = _describe(e, root, needed)
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    if rank == 0 and not any(problems):
        try:
            _write_rank0_files(tmp, scheduler, config, loop_state, world, state_dict_type, optimizer, shards)
            atomic.replace_folder(tmp, final)
            _prune(output_dir, save_total_limit)
        except _WRITE_ERRORS as e:
            problems[0] = _describe(e, root, needed)
    problems = broadcast_object(problems)
    if any(problems):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        _raise_save_problem(problems, final, needed)
    print0(f"Saved checkpoint {final} ({time.perf_counter() - start:.1f} s).")
    return final


def _describe(e: BaseException, root: Path, needed: int) -> tuple[bool, str]:
    """(whether the disk is full, one line saying what failed): DCP's CheckpointException by its ranks' errors."""
    failures = getattr(e, "failures", None) or {}
    inner = {r: f[0] if isinstance(f, tuple) and f else f for r, f in sorted(failures.items())}
    what = "; ".join(f"rank {r}: {type(f).__name__}: {_first_line(f)}" for r, f in inner.items())
    return atomic.disk_full_during(e, root, needed), what or f"{type(e).__name__}: {_first_line(e)}"


def _raise_save_problem(problems: list, final: Path, needed: int) -> None:
    if any(p[0] for p in problems if p):
        raise atomic.DiskFullError(final, needed, "a checkpoint")
    ranks = "; ".join(f"rank {r}: {p[1]}" for r, p in enumerate(problems) if p)
    raise OSError(f"saving {final} failed ({ranks}); the previous checkpoints are intact.")


def _global_bytes(state: dict, extra) -> int:
    """Bytes the checkpoint needs on disk, summed over ranks (each writes its own shards)."""
    local = atomic.tensor_bytes(state) + (atomic.tensor_bytes(extra) if extra else 0)
    box = torch.tensor([float(local)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        box = box.cuda()
    dist.all_reduce(box)
    return int(box.item())


def _weights_state(model: nn.Module, optimizer, full: bool) -> dict:
    """Trainable weights (and a torch optimizer's state), as DTensor shards or (full) CPU tensors on rank 0."""
    opts = StateDictOptions(ignore_frozen_params=True, full_state_dict=full, cpu_offload=full)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts), "optim": {}}
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": msd, "optim": osd}


def _write_rank_files(tmp: Path, state: dict, full: bool, optimizer, shards, rank: int) -> None:
    """Each rank's part: DCP shards (or rank 0's full file), a per-rank 8-bit optimizer state, the RNG."""
    if not full:
        dcp.save(state, checkpoint_id=str(tmp / "sharded"))
    elif rank == 0:
        atomic.save_synced(state, tmp / "full_state.pt")
    if shards is not None:
        atomic.save_synced(
            {"names": shards.names, "shapes": shards.shapes(), "state": optimizer.state_dict()},
            tmp / f"optim_rank{rank}.pt",
        )
    atomic.save_synced(_rng_state(), tmp / f"rng_rank{rank}.pt")


def _write_rank0_files(tmp, scheduler, config, loop_state, world, state_dict_type, optimizer, shards) -> None:
    atomic.save_synced(scheduler.state_dict(), tmp / "scheduler.pt")
    atomic.write_text_synced(tmp / "config.json", json.dumps(config, indent=2, default=str))
    meta = {
        "format": FORMAT_VERSION,
        "loop": loop_state,
        "world_size": world,
        "state_dict_type": state_dict_type,
        "optimizer": {"class": type(optimizer).__name__, "per_rank": shards is not None},
    }
    # meta.json last: a folder with meta.json is complete (list_checkpoints).
    atomic.write_text_synced(tmp / "meta.json", json.dumps(meta, indent=2))


def _prune(output_dir: str | Path, limit: int | None) -> None:
    if not limit or limit <= 0:
        return
    found = list_checkpoints(output_dir)
    for old in found[: max(len(found) - limit, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # Plain lists instead of a numpy array, so that the file loads with torch.load(weights_only=True).
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -------------------------------------------------------------------------------------------------- loading

# Settings that may change between a run and its resumption without a warning.
_RESUME_FREE = {
    "output_dir",
    "resume_from_checkpoint",
    "logging_steps",
    "logging_strategy",
    "log_level",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "push_to_hub",
    "hub_model_id",
    "hub_private_repo",
    "hub_strategy",
    "hub_token",
    "report_to",
    "run_name",
    "dataset_cache_dir",
    "per_device_eval_batch_size",
    "eval_steps",
    "eval_strategy",
    "max_nonfinite_steps",
    "merge_adapter",
    "overwrite_output_dir",
    "dataloader_num_workers",
    "dataset_num_proc",
    "frozen_base",  # the checkpoint holds the trainable state only, the same for either placement
    "tensor_parallel_size",  # a checkpoint holds whole tensors (DCP shards or the full file), for any tp size
}


def changed_settings(saved: dict, now: dict) -> list[str]:
    """`flag: old → new` for each setting (other than those free to change) that differs from the saved config."""
    out = []
    for part in ("model", "data", "train", "fsdp"):
        a, b = saved.get(part, {}), now.get(part, {})
        out += [
            f"{k}: {a.get(k)!r} → {b.get(k)!r}" for k in sorted(b) if k not in _RESUME_FREE and a.get(k) != b.get(k)
        ]
    return out


def resume_position(meta: dict, *, per_device: int, world: int, grad_accum: int) -> tuple[dict, list[str]]:
    """The loop state to continue from (LoopState fields) on this run's ranks, and warnings to show.

    The data position is kept in samples, so it survives a change of ranks or batch size: the run continues at
    the micro-batch that starts at that sample of the epoch.
    """
    loop = dict(meta["loop"])
    samples = int(loop.pop("samples_in_epoch", 0))
    saved_gb = loop.pop("global_batch", None)
    notes = []
    gb = per_device * world * grad_accum
    if saved_gb != gb:
        notes.append(
            f"The checkpoint was trained with a global batch of {saved_gb} rows ({meta['world_size']} rank(s)); "
            f"this run uses {gb} ({per_device} per device × {world} rank(s) × {grad_accum} accumulation steps): "
            "the loss curve and the learning-rate schedule per sample change from here on."
        )
    per_micro = per_device * world
    loop["batch_in_epoch"] = samples // per_micro
    if samples % per_micro:
        notes.append(
            f"The checkpoint stopped {samples} samples into epoch {loop['epoch']}, not a multiple of this run's "
            f"{per_micro} rows per micro-batch: continuing at sample {loop['batch_in_epoch'] * per_micro}."
        )
    return loop, notes


def read_meta(path: str | Path) -> dict:
    """A checkpoint's meta.json: loop state, world size, state dict type, optimizer."""
    return json.loads((Path(path) / "meta.json").read_text())


def load(path: str | Path, *, model: nn.Module, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG (all ranks call this); return the meta.

    SHARDED and FULL checkpoints load on any number of ranks; a bitsandbytes optimizer's per-shard state
    only on the number of ranks that saved it.
    """
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = read_meta(path)
    shards = getattr(optimizer, "local_shards", None)
    check_resumable(
        path, meta, per_rank_optimizer=shards is not None, optimizer_name=type(optimizer).__name__, world=world
    )
    torch_optim = None if shards is not None else optimizer
    if meta["state_dict_type"] == "FULL_STATE_DICT":
        _load_full(path, model, torch_optim, rank)
    else:
        _load_sharded(path, model, torch_optim)
    if shards is not None:
        _load_local_optimizer(path, optimizer, shards, rank)
    scheduler.load_state_dict(_read(path / "scheduler.pt"))
    saved_world = int(meta["world_size"])
    if saved_world != world:
        warn0(
            f"{path} was saved by {saved_world} rank(s); this run has {world}: rank r continues from the RNG "
            f"state of saved rank r mod {saved_world} (dropout masks differ from an uninterrupted run)."
        )
    _set_rng_state(_read(path / f"rng_rank{rank % saved_world}.pt"))
    return meta


def _read(file: Path):
    """torch.load of a checkpoint file; a damaged one gives an error naming it."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:
        raise ValueError(
            f"{file} is damaged ({type(e).__name__}: {_first_line(e)}); resume from an earlier checkpoint, or "
            f"with --resume_from_checkpoint latest, which skips damaged ones."
        ) from e


def check_resumable(path: str | Path, meta: dict, *, per_rank_optimizer: bool, optimizer_name: str, world: int) -> None:
    """Raise ValueError when this run's optimizer or world size cannot take the checkpoint's optimizer state."""
    saved = meta.get("optimizer", {})
    if bool(saved.get("per_rank")) != per_rank_optimizer:
        raise ValueError(
            f"{path} holds the state of a {saved.get('class')} optimizer; this run uses {optimizer_name}. "
            f"Resume with the --optim the checkpoint was trained with (see {Path(path) / 'config.json'})."
        )
    if per_rank_optimizer and int(meta["world_size"]) != world:
        n = meta["world_size"]
        raise ValueError(
            f"{path}: the 8-bit optimizer state of {saved.get('class')} is quantized block by block within each "
            f"rank's shard, so it cannot be resharded from {n} to {world} rank(s). Resume on {n} rank(s) "
            f"(torchrun --nproc_per_node {n}, or accelerate launch --num_processes {n}); for runs that must "
            "change size, train with --optim adamw_torch, whose state reshards."
        )


def _template(model: nn.Module, optimizer) -> dict:
    """This rank's current trainable weights (and optimizer state) as DTensors: the layout to load into."""
    opts = StateDictOptions(ignore_frozen_params=True)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=opts)}
    msd, osd = get_state_dict(model, optimizer, options=opts)  # initializes an empty optimizer state
    return {"model": msd, "optim": osd}


def _apply(model: nn.Module, optimizer, state: dict) -> None:
    # strict=False: frozen base weights are not in the checkpoint (ignore_frozen_params). The keys that are
    # were taken from the live model's trainable weights, so nothing trainable can be missing.
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        result = set_model_state_dict(model, state["model"], options=opts)
    else:
        result = set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
        )
    assert not result.unexpected_keys, f"unexpected keys: {result.unexpected_keys}"


def _load_sharded(path: Path, model: nn.Module, optimizer) -> None:
    state = _template(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path / "sharded"))
    except dcp.api.CheckpointException as e:
        broken = _dcp_damage(path / "sharded")
        if broken:
            raise ValueError(f"{broken}; resume from an earlier checkpoint.") from e
        raise ValueError(
            f"{path}: its weights or optimizer state do not fit this model ({_first_line(e)}). Resume with the "
            f"model, adapter and --optim settings the checkpoint was trained with (see {path / 'config.json'})."
        ) from e
    _apply(model, optimizer, state)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def _load_full(path: Path, model: nn.Module, optimizer, rank: int) -> None:
    """Rank 0 reads the consolidated file; every rank receives its shards (any number of ranks)."""
    template = _template(model, optimizer)
    full, problem = None, None
    if rank == 0:
        full = _read(path / "full_state.pt")
        problem = _key_problem(template, full)
    problem = broadcast_object(problem)
    if problem:
        raise ValueError(
            f"{path / 'full_state.pt'} does not fit this model: {problem}. Resume with the model, adapter and "
            f"--optim settings the checkpoint was trained with (see {path / 'config.json'})."
        )
    _apply(model, optimizer, _from_full(template, full))


def _leaf_paths(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _leaf_paths(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def _key_problem(template: dict, full: dict) -> str | None:
    want, have = _leaf_paths(template), _leaf_paths({k: full.get(k, {}) for k in template})
    if want == have:
        return None
    missing, extra = sorted(want - have), sorted(have - want)
    return f"{len(missing)} entries missing (e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]})"


def _from_full(template: dict, full: dict | None) -> dict:
    """Rank 0's full tensors → this rank's part, in the layout of `template` (None on other ranks)."""
    out = {}
    for key, t in template.items():
        src = full[key] if full is not None else None
        if isinstance(t, dict):
            out[key] = _from_full(t, src)
        elif isinstance(t, DTensor):
            data = (
                src.to(t.device, t.dtype) if src is not None else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            )
            out[key] = _distribute_from_rank0(data, t)
        elif torch.is_tensor(t):  # small replicated tensors (an optimizer's step count), possibly on CPU under NCCL
            out[key] = broadcast_object(src).to(t.device, t.dtype)
        else:
            out[key] = broadcast_object(src)
    return out


def _distribute_from_rank0(data: torch.Tensor, t: DTensor) -> DTensor:
    """Rank 0's full tensor `data` as a DTensor laid out as `t`. On a mesh of every rank, torch's scatter from rank 0.
    Under tensor parallelism the mesh may lack rank 0 (a whole tensor's data-parallel mesh, one per tp rank) or
    hold tp slices (whose blocks DTensor's offsets give, _StridedShard included): rank 0 broadcasts the whole
    tensor and each rank keeps its block, the offsets DCP reads by (one full tensor per rank at a time)."""
    mesh = t.device_mesh
    if mesh.size() == dist.get_world_size() and "tp" not in (mesh.mesh_dim_names or ()):
        return distribute_tensor(data, mesh, t.placements, src_data_rank=0)
    dist.broadcast(data, src=0)
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    block = data[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return DTensor.from_local(
        block.clone(memory_format=torch.contiguous_format), mesh, t.placements, shape=t.shape, stride=t.stride()
    )


def _load_local_optimizer(path: Path, optimizer, shards, rank: int) -> None:
    blob = _read(path / f"optim_rank{rank}.pt")
    problem = None
    if blob["names"] != shards.names or blob["shapes"] != shards.shapes():
        problem = (
            f"rank {rank}: the saved 8-bit optimizer state is for other parameters or shard shapes; resume with the "
            f"model, adapter and FSDP settings of {path / 'config.json'}"
        )
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise ValueError(f"{path}: " + "; ".join(p for p in problems if p))
    optimizer.load_state_dict(blob["state"])
