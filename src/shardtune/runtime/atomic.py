"""Writing folders so that a crash or a full disk never leaves a half-written output: the one home of the atomic
writers used by checkpoints (shardtune.parallel.checkpoint), the final export (shardtune.training.export) and merges
(shardtune.merge.fold).

The pattern: write into a hidden sibling `.<name>.tmp-<pid>@<host>`, fsync every file and the folder, then rename
it into place (a rename within one file system is atomic, and needs no free space). On any error, including a full
disk or a stop signal, the temporary folder is removed and the previous output is left as it was.

Every temporary name ends in `.<kind>-<pid>@<host>` (`temp_name`), so that what a killed process (SIGKILL, a power
cut) left behind is recognised by its owner: `sweep_stale` removes the temporary files and folders of processes of
this host that are no longer running, and never those of a live process or of another host (a shared file system).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

# What to do after a full disk during a checkpoint or the final save (the default `fix` of the message).
RESUME_FIX = "free some space (or lower --save_total_limit), then resume with --resume_from_checkpoint latest"


class DiskFullError(OSError):
    """No space left on device while writing `folder`; the message names the folder, the bytes needed and free,
    and `fix` (by default: free space, then resume)."""

    def __init__(self, folder: str | Path, needed: int | None, what: str, fix: str = RESUME_FIX):
        self.folder, self.needed = Path(folder), needed
        super().__init__(errno.ENOSPC, disk_full_message(folder, needed, what, fix))

    def __str__(self) -> str:
        return self.strerror


def disk_full_message(folder: str | Path, needed: int | None, what: str, fix: str = RESUME_FIX) -> str:
    free = _free_bytes(folder)
    need = f"about {_gb(needed)} needed" if needed else "size unknown"
    have = f", {_gb(free)} free" if free is not None else ""
    return (
        f"no space left on device while writing {what} to {folder} ({need}{have}). Nothing half-written was "
        f"left and the previous files there are intact; {fix}."
    )


def preallocate(fd: int, size: int, folder: str | Path, what: str, fix: str = RESUME_FIX) -> None:
    """Reserve `size` bytes for an open file before it is written through a memory map: a write into a map that
    the disk cannot back is a SIGBUS that kills the process, while a reservation fails here with a DiskFullError.
    (glibc writes zeros where a file system has no fallocate.)"""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(folder, size, what, fix) from e
        raise


# torch's zip writer (torch.save, and DCP's shards, which torch.save writes) on a full disk: a short write carries
# no errno. Seen with torch 2.13 on a full tmpfs: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs
# 598" when the end of the archive is written, "PytorchStreamWriter failed writing file data/0: file write failed"
# when a record is. (A file object instead of a path gives a plain OSError(ENOSPC).)
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank errors a library wrapped in it: DCP's CheckpointException
    (a BaseException, not an Exception) keeps them in `failures`, {rank: (exception, traceback frames)}."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for inner in (getattr(e, "failures", None) or {}).values():
            inner = inner[0] if isinstance(inner, tuple) and inner else inner
            todo.append(inner if isinstance(inner, BaseException) else Exception(str(inner)))
        todo += [e.__cause__, e.__context__]


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC (or a quota exceeded), also when a library wrapped it (DCP's CheckpointException, RuntimeError)."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    return False


def is_short_write(exc: BaseException) -> bool:
    """A write that stopped short without saying why: torch's zip writer (`_SHORT_WRITE`), or an OSError without an
    errno, also inside DCP's CheckpointException. On a full disk, this is what torch raises."""
    for e in _causes(exc):
        if any(s in str(e) for s in _SHORT_WRITE) or (isinstance(e, OSError) and e.errno is None):
            return True
    return False


def disk_full_during(exc: BaseException, folder: str | Path, needed: int | None) -> bool:
    """Whether a write into `folder` failed for lack of space: ENOSPC, or a short write without an errno (torch's
    zip writer: `is_short_write`) while less than `needed` bytes are free there."""
    if is_disk_full(exc):
        return True
    free = _free_bytes(folder)
    return is_short_write(exc) and bool(needed) and free is not None and free < needed


def _free_bytes(folder: str | Path) -> int | None:
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _gb(n: int | None) -> str:
    if n is not None and n >= 2**27:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**20:.3f} MiB"  # a small cache: 0.017 MiB, not 0.0


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) state dict: what writing it needs on disk, give or take headers."""
    import torch

    if torch.is_tensor(obj):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# ------------------------------------------------------------------------------------------- synced writes


def save_synced(obj, path: Path) -> None:
    """torch.save, then fsync: the data is on disk before its folder is renamed into place."""
    import torch  # here, not at the top: data preparation's worker processes use this module without torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def replaced_file(path: str | Path, mode: str = "wb") -> Iterator:
    """Write `path` whole or not at all: into a unique hidden sibling, fsynced, then renamed over `path`. A reader
    never sees half a file, and two processes writing the same file (ranks of one node) never mix their bytes."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(temp_name(f"{path.name}.{uuid.uuid4().hex[:8]}"))
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_text(path: str | Path, text: str) -> None:
    """`replaced_file` for a text."""
    with replaced_file(path, "w") as f:
        f.write(text)


def write_text_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder (or a file by its path): its entries, renames included, are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder` (files written by libraries that do not: safetensors, HF)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


# ------------------------------------------------------------------------------------------- temporary names

# kind: tmp (being written), old (being swapped out), removing (being deleted); the host may hold dots and dashes.
_TEMP = re.compile(r"^\..+\.(?:tmp|old|removing)-(?P<pid>\d+)(?:@(?P<host>[^@/]+))?$")


def temp_name(name: str, kind: str = "tmp") -> str:
    """The hidden temporary name `.<name>.<kind>-<pid>@<host>` of this process for `name`."""
    return f".{name}.{kind}-{os.getpid()}@{socket.gethostname()}"


def _owner_gone(entry: str) -> bool:
    """Whether `entry` is a temporary name of a process of this host that no longer runs (a name without a host,
    from an older shardtune, counts as this host's)."""
    m = _TEMP.match(entry)
    if m is None or (m["host"] or socket.gethostname()) != socket.gethostname():
        return False
    pid = int(m["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    return False


def sweep_stale(folder: str | Path, name: str | None = None) -> list[Path]:
    """Remove the temporary files and folders in `folder` left by dead processes of this host (only those of
    `name`'s temporary names when given: a folder shared with others' files); returns them."""
    folder, prefix = Path(folder), f".{name}." if name else "."
    try:
        entries = [p for p in folder.iterdir() if p.name.startswith(prefix) and _owner_gone(p.name)]
    except OSError:  # no such folder (yet), or not readable: nothing of ours is there
        return []
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return entries


# ------------------------------------------------------------------------------------------------ folders


def staging_path(final: Path, name: str | None = None) -> Path:
    """Where an output is written before it is moved into place: the hidden sibling `temp_name(name)` of `final`
    (`name` defaults to final's). A folder left there by a killed process of the same pid is cleared by
    `staged_folder`, one of a dead process by `sweep_stale`; publishing skips hidden names."""
    return final.parent / temp_name(name or final.name)


@contextlib.contextmanager
def staged_folder(tmp: Path, *, what: str, final: Path, needed: int | None = None) -> Iterator[Path]:
    """Create `tmp` and yield it; on any error remove it (a full disk becomes a DiskFullError naming `final`).

    The caller renames tmp into place (replace_folder, or file by file) inside the `with` block, after which
    the cleanup finds nothing to remove.
    """
    if tmp.exists():  # left by a process killed mid-write with the same pid
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)  # not tempfile.mkdtemp: its 0700 mode would stay on the published folder
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, DiskFullError) and disk_full_during(e, final, needed):
            raise DiskFullError(final, needed, what) from e
        raise


def replace_folder(new: Path, out: Path) -> None:
    """Rename the finished folder `new` to `out`; an existing `out` is swapped out first and removed after.
    The parent folder is fsynced, so the rename itself survives a power cut."""
    fsync_tree(new)
    if not out.exists():
        os.rename(new, out)
    else:
        old = out.with_name(temp_name(out.name, "old"))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent)


def move_files_into(tmp: Path, out: Path, *, last=lambda name: False, stale: list[Path] | tuple = ()) -> None:
    """Move each finished file (or folder) of `tmp` into the existing folder `out` with an atomic rename, those
    for which last(name) is true after the others; then remove `stale` files and `tmp`.

    For outputs that share their folder with other files (an adapter next to checkpoints/ and metrics.jsonl), where
    one folder rename would replace them too. Every file is fsynced before the first rename, and renames need no
    space, so a crash or a full disk leaves each file either old or new, and the files moved last (the weights)
    old until everything else is in place.
    """
    fsync_tree(tmp)
    for f in sorted(tmp.iterdir(), key=lambda p: (bool(last(p.name)), p.name)):
        target = out / f.name
        if f.is_dir():
            replace_folder(f, target)
        else:
            os.replace(f, target)
    for p in stale:
        p.unlink()
    tmp.rmdir()
    fsync_dir(out)
