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
