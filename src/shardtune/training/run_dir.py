"""A run's output folder: whether it may be written (a file, permissions, another run there), the lock that
keeps a second run out while one writes it, removing a previous run for --overwrite_output_dir, and whether a
checkpoint to resume belongs to this run (its identity) with the metrics trimmed to it (docs/errors.md,
"Output folders"). Rank 0 runs these checks; nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from shardtune.runtime.atomic import replace_text, sweep_stale, temp_name
from shardtune.runtime.log import warn0

# What a finished or running shardtune run leaves in its output_dir.
RUN_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "model.safetensors",
    "model.safetensors.index.json",
    "metrics.jsonl",
    "train_summary.json",
    "checkpoints",
)
# Run state that --overwrite_output_dir removes before training: what a later `latest` or `shardtune report`
# would otherwise mix with the new run. Weights are replaced atomically by the new run's export.
RUN_STATE = ("checkpoints", "metrics.jsonl", "train_summary.json", "runs")
# Settings that define what a checkpoint holds: resuming with another value would load another run's weights or
# continue on other data, so `--resume_from_checkpoint` refuses it (other settings may change; they are warned of).
IDENTITY = {
    "model": (
        "model_name_or_path",
        "use_peft_lora",
        "lora_r",
        "lora_target_modules",
        "lora_target_parameters",
        "lora_target_experts",
        "use_dora",
        "modules_to_save",
        "adapter_name",
        "use_4bit_quantization",
        "chat_template_format",
    ),
    "data": ("dataset_name", "max_length", "packing"),
}


# ---------------------------------------------------------------- the output folder


def _writable(folder: Path) -> bool:
    """Create and remove a file: os.access says yes to root on a read-only mount and to ACL'd folders."""
    try:
        probe = folder / f".shardtune-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def output_dir_problem(output_dir: str, *, overwrite: bool, resuming: bool, claim: bool = False) -> str | None:
    """An output_dir that is a file, cannot be written, is in use by a live run, or holds another run that would be
    mixed with this one. With claim, this process takes the run's lock on it (`lock_output_dir`) once it may be
    written, and sweeps what dead runs left there (`atomic.sweep_stale`)."""
    try:
        return _output_dir_problem(output_dir, overwrite=overwrite, resuming=resuming, claim=claim)
    except PermissionError as e:  # a folder on the way that this user may not enter
        return (
            f"--output_dir {output_dir}: permission denied on {e.filename}; fix its permissions or give another folder."
        )


def _output_dir_problem(output_dir: str, *, overwrite: bool, resuming: bool, claim: bool) -> str | None:
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        return f"--output_dir {output_dir} is a file; give a folder (it is created if missing)."
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"--output_dir {output_dir}: {existing} is a file, so the folder cannot be created; give another path."
    if not _writable(existing):
        where = "" if existing == out else f" ({existing}, where it would be created)"
        return f"--output_dir {output_dir} is not writable{where}; fix its permissions or give another folder."
    if claim:
        if problem := lock_output_dir(output_dir):
            return problem
        for folder in (out, out / "checkpoints"):  # the lock is ours: a temporary name of a dead process is stale
            for p in sweep_stale(folder):
                warn0(f"--output_dir {output_dir}: removed {p.name}, left by a run that was killed.")
    if not out.is_dir() or overwrite or resuming:
        return None
    held = [f for f in RUN_FILES if (out / f).exists() and not ((out / f).is_dir() and not any((out / f).iterdir()))]
    if not held:
        return None
    return (
        f"--output_dir {output_dir} already holds a run ({', '.join(held)}); add --overwrite_output_dir to "
        "replace it, --resume_from_checkpoint latest to continue it, or give another --output_dir."
    )


# ---------------------------------------------------------------- the run's lock


# Held (flock) by the run's rank 0 for the run's life; holds the holder's pid and host for the message of a second
# run. The kernel releases a flock when its process dies, SIGKILL included, so a file left by a killed run blocks
# nothing.
LOCK_FILE = ".shardtune.lock"
_held: dict[Path, tuple[int, bool]] = {}  # output folder -> (the lock file's descriptor, whether we made the folder)


def lock_output_dir(output_dir: str) -> str | None:
    """Take the lock on output_dir (created if missing), or say which live run holds it."""
    out = Path(output_dir).expanduser().absolute()
    if out in _held:
        return None
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_FILE
    for _ in range(5):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return (
                f"--output_dir {output_dir} is in use by another run ({_holder(lock)}), which holds its lock "
                f"{lock}; wait for it to end or stop it, or give another --output_dir."
            )
        try:  # the file we locked must still be the one at that path (a releasing run unlinks it)
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    else:
        return f"--output_dir {output_dir}: its lock {lock} kept changing; is another run starting there?"
    os.ftruncate(fd, 0)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.write(fd, (json.dumps(record) + "\n").encode())
    _held[out] = (fd, created)
    return None


def _holder(lock: Path) -> str:
    try:
        record = json.loads(lock.read_text())
        return f"pid {record['pid']} on {record['host']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def release_output_dir(output_dir: str) -> None:
    """Give the lock back (at the end of a run, whatever the outcome); a folder the lock made and nothing else
    filled is removed again, so a refused run leaves nothing behind."""
    out = Path(output_dir).expanduser().absolute()
    if out not in _held:
        return
    fd, created = _held.pop(out)
    (out / LOCK_FILE).unlink(missing_ok=True)  # while still locked: a run waiting for it sees a changed inode
    os.close(fd)
    if created:
        with contextlib.suppress(OSError):  # not empty: the run wrote there
            out.rmdir()


def clear_previous_run(output_dir: str) -> list[str]:
    """--overwrite_output_dir: remove the previous run's checkpoints, metrics and summary (RUN_STATE) so that
    `latest` and the metrics never mix two runs. Each is renamed away first, so an interrupted removal leaves
    no half checkpoint folder behind. Returns the names removed."""
    out = Path(output_dir).expanduser()
    removed = []
    for name in RUN_STATE:
        path = out / name
        if not path.exists():
            continue
        doomed = out / temp_name(name, "removing")
        path.rename(doomed)
        shutil.rmtree(doomed) if doomed.is_dir() else doomed.unlink()
        removed.append(name)
    return removed


# ---------------------------------------------------------------- resuming the same run


def _norm(key: str, value: Any) -> Any:
    if key == "lora_target_experts":  # a checkpoint from before the flag trained no experts
        return bool(value)
    if key in ("lora_target_modules", "lora_target_parameters", "modules_to_save") and isinstance(value, str):
        return sorted(s.strip() for s in value.split(",") if s.strip())
    if key in ("model_name_or_path", "dataset_name") and isinstance(value, str):
        path = Path(value).expanduser()
        return str(path.resolve()) if path.exists() else value
    return value


def run_identity(record: dict) -> dict[str, Any]:
    """The settings of a config record (as saved in each checkpoint's config.json) that make it this run."""
    return {f"{part}.{k}": _norm(k, (record.get(part) or {}).get(k)) for part, keys in IDENTITY.items() for k in keys}


def identity_problem(checkpoint_dir: Path, record: dict, resume_from: str) -> str | None:
    """A checkpoint written by another run (other model, adapter, data or sequence length) is refused: resuming
    it would load another run's weights into this one's. Checkpoints without a saved config are not checked."""
    saved_file = Path(checkpoint_dir) / "config.json"
    if not saved_file.is_file():
        return None
    try:
        saved = run_identity(json.loads(saved_file.read_text()))
    except ValueError:
        return None  # unreadable: the checkpoint's own checks name the file
    now = run_identity(record)
    # With a saved content digest the data is compared by content after it is prepared (recipe.state.check_resumed_data):
    # the same rows under another path (another node's copy, a moved folder) resume.
    content_checked = {"data.dataset_name"} if json.loads(saved_file.read_text()).get("data_digest") else set()
    diffs = [
        f"{k.split('.', 1)[1]} {saved[k]!r} there, {now[k]!r} now"
        for k in now
        if saved[k] != now[k] and k not in content_checked
    ]
    if not diffs:
        return None
    return (
        f"--resume_from_checkpoint {resume_from}: {checkpoint_dir} belongs to another run ({'; '.join(diffs)}); "
        "resume with that run's settings, or start afresh with another --output_dir or --overwrite_output_dir."
    )


def trim_metrics(output_dir: str, step: int) -> int:
    """On resume, drop the metrics.jsonl records logged after `step` (that part of the run is redone), so the
    file holds one history; written to a new file, fsynced and renamed over the old. Returns records dropped."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1  # half a line left by a killed run
            continue
        stale = record.get("type") == "summary" or (record.get("type") in ("train", "eval") and record["step"] > step)
        if stale:  # a summary belongs to the run's end, which is redone
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        replace_text(path, "".join(line + "\n" for line in kept))
    return dropped


# ---------------------------------------------------------------- a checkpoint where an adapter is expected


def checkpoint_given_as_adapter(path: str | Path, flag: str) -> str | None:
    """A training checkpoint (OUTPUT_DIR/checkpoints/checkpoint-N, or the checkpoints folder itself) given where an
    adapter is expected (chat, merge, eval): what it is, and which folder to pass instead. None for anything else.
    A checkpoint holds the sharded training state (for --resume_from_checkpoint), not an adapter's files."""
    p = Path(path).expanduser()
    if p.name == "checkpoints" and any(p.glob("checkpoint-*/meta.json")):
        p = max(p.glob("checkpoint-*/meta.json"), key=lambda m: int(m.parent.name.split("-")[-1])).parent
    if not (p / "meta.json").is_file() or not p.name.startswith("checkpoint-"):
        return None
    run = p.parent.parent if p.parent.name == "checkpoints" else p.parent
    if (run / "adapter_config.json").is_file():
        instead = f"pass the run's final adapter, {flag} {run}"
    else:
        instead = (
            f"the run has not finished (no adapter in {run} yet): finish it with `shardtune train ... "
            f"--output_dir {run} --resume_from_checkpoint {p}`, which writes the adapter to {run}, then pass {run}"
        )
    return (
        f"{flag} {path} is a training checkpoint (the sharded state that --resume_from_checkpoint reads), not an "
        f"adapter; {instead}."
    )
