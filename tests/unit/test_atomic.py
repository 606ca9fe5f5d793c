"""shardtune.runtime.atomic: folders replaced whole or not at all; a full disk named with the folder and the bytes."""

from __future__ import annotations

import errno

import pytest

from shardtune.runtime import atomic


def _tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _previous(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "weights.bin").write_bytes(b"old weights")
    (out / "sub" / "config.json").write_bytes(b"{}")
    return out, _tree(out)


def test_a_finished_folder_replaces_the_previous_one(tmp_path):
    out, _ = _previous(tmp_path)
    with atomic.staged_folder(tmp_path / ".out.tmp-1", what="the model", final=out) as tmp:
        (tmp / "weights.bin").write_bytes(b"new weights")
        atomic.replace_folder(tmp, out)
    assert _tree(out) == {"weights.bin": b"new weights"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .tmp or .old folder left


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # torch.save's error on a full disk carries no errno; less free space than needed identifies it.
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
    ],
)
def test_a_full_disk_mid_write_leaves_the_previous_folder_and_names_folder_and_bytes(tmp_path, failure):
    out, before = _previous(tmp_path)
    needed = 1 << 60  # more than any disk has free
    staged = atomic.staged_folder(tmp_path / ".out.tmp-1", what="the adapter", final=out, needed=needed)
    with pytest.raises(atomic.DiskFullError) as info, staged as tmp:
        (tmp / "weights.bin").write_bytes(b"half")
        raise failure
    msg = str(info.value)
    assert msg.startswith(f"no space left on device while writing the adapter to {out} (about 1073741824.00 GiB needed")
    assert info.value.errno == errno.ENOSPC and info.value.folder == out
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_other_errors_pass_through_and_still_clean_up(tmp_path):
    out, before = _previous(tmp_path)
    staged = atomic.staged_folder(tmp_path / ".out.tmp-1", what="the model", final=out, needed=10)
    with pytest.raises(ValueError, match="bad"), staged as tmp:
        (tmp / "x").write_bytes(b"x")
        raise ValueError("bad")
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_disk_full_is_found_inside_wrapped_errors():
    class CheckpointException(Exception):  # DCP's: {rank: (exception, traceback)}
        def __init__(self, failures):
            super().__init__("failed")
            self.failures = failures

    inner = OSError(errno.ENOSPC, "No space left on device")
    assert atomic.is_disk_full(CheckpointException({1: (inner, None)}))
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("write failed") from e
    except RuntimeError as e:
        assert atomic.is_disk_full(e)
    assert not atomic.is_disk_full(RuntimeError("write failed"))


# What torch 2.13 raised on a real full tmpfs (2 ranks writing DCP shards, tests/distributed/test_faults.py): the
# zip writer's short write when a shard's end is written, and a plain ENOSPC when the shard file cannot be created.
UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
FILE_WRITE_FAILED = "PytorchStreamWriter failed writing file data/0: file write failed"


def dcp_error(**per_rank: BaseException):
    """DCP's own CheckpointException as dcp.save raises it on every rank: {rank: (exception, traceback frames)}."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    failures = {}
    for rank, exc in per_rank.items():
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001 - only to give it a traceback, as DCP's _wrap_exception does
            failures[int(rank.removeprefix("rank"))] = (e, traceback.extract_tb(e.__traceback__))
    return CheckpointException("", failures)


def test_the_real_forms_of_a_full_disk_during_a_dcp_save_are_recognised(tmp_path):
    """A CheckpointException (a BaseException) with OSError(ENOSPC) inside is a full disk; with torch's short-write
    RuntimeErrors (no errno) it is one when less than the needed bytes are free where it wrote; other failures are
    not."""
    enospc = dcp_error(rank0=OSError(errno.ENOSPC, "No space left on device"), rank1=RuntimeError(UNEXPECTED_POS))
    assert not isinstance(enospc, Exception) and atomic.is_disk_full(enospc)
    for message in (UNEXPECTED_POS, FILE_WRITE_FAILED):
        short = dcp_error(rank1=RuntimeError(message))
        assert not atomic.is_disk_full(short) and atomic.is_short_write(short)
        assert atomic.disk_full_during(short, tmp_path, needed=1 << 60)  # more than any disk has free
        assert not atomic.disk_full_during(short, tmp_path, needed=10)  # room enough: another fault
        assert atomic.disk_full_during(RuntimeError(message), tmp_path, needed=1 << 60)
    other = dcp_error(rank1=ValueError("Found incompatible shape"))
    assert not atomic.is_disk_full(other) and not atomic.is_short_write(other)
    assert not atomic.disk_full_during(other, tmp_path, needed=1 << 60)  # a full disk does not explain any error
    assert not atomic.disk_full_during(ValueError("bad"), tmp_path, needed=1 << 60)


def test_stale_temporary_names_of_dead_processes_of_this_host_are_swept(tmp_path):
    """Only names of processes of this host that no longer run: a live process's (this one's, or another's) and
    another host's (a shared file system) are kept, as are names that are not temporary."""
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid, host = int(dead.stdout), socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            f".adapter.tmp-{dead_pid}@{host}": True,  # a killed export's staging folder
            f".checkpoint-4.old-{dead_pid}@{host}": True,
            f".metrics.jsonl.1a2b3c4d.tmp-{dead_pid}@{host}": True,  # a file of replaced_file
            f".runs.removing-{dead_pid}": True,  # an older name without its host: this host's
            f".adapter.tmp-{dead_pid}@another-host.example": False,
            f".adapter.tmp-{live.pid}@{host}": False,
            atomic.temp_name("adapter").lstrip("."): False,  # not hidden: not a temporary name of ours
            atomic.temp_name("adapter"): False,  # this process's own
            ".shardtune.lock": False,
            "checkpoint-4": False,
        }
        for name in names:
            (tmp_path / name).mkdir() if "metrics" not in name else (tmp_path / name).write_text("{}")
        (tmp_path / f".adapter.tmp-{dead_pid}@{host}" / "adapter_model.safetensors").write_bytes(b"half")
        swept = atomic.sweep_stale(tmp_path)
        assert sorted(p.name for p in swept) == sorted(n for n, stale in names.items() if stale)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, stale in names.items() if not stale)
        assert atomic.temp_name("x") == f".x.tmp-{os.getpid()}@{host}"
    finally:
        live.kill()
        live.wait()
    assert atomic.sweep_stale(tmp_path / "missing") == []
