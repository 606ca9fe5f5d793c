"""A full disk while the tokenized data cache is written (docs/errors.md, "Faults"): a DiskFullError naming the
cache folder, the bytes needed and free and the flag that moves it; no SIGBUS from the memory-mapped arrays (their
files are reserved before they are mapped), nothing half-written left. On a real full disk: a small tmpfs (skipped
where mounting is not permitted), filled up to a chosen amount of free space."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from shardtune.data import build_datasets, cache, setup_tokenizer
from shardtune.runtime import atomic
from tests.conftest import build_data, train_args

FIX = "free some space there, or give --dataset_cache_dir a folder on a disk with room, then run again."


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs; fill(free) leaves about `free` bytes of it free."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")

    def fill(free: int) -> Path:
        with open(mount / "filler", "wb") as f:
            f.write(b"\0" * (os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize - free))
        return mount / "cache"

    yield fill
    subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: a built split still maps its files


def _build(tiny_assets, cache_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(tokenizer, "chatml")
    return build_data(
        build_datasets,
        tokenizer=tokenizer,
        dataset_name=str(tiny_assets["data"]),
        splits="train",
        dataset_text_field="text",
        chat_template_format="chatml",
        max_length=64,
        packing=True,
        seed=0,
        cache_dir=str(cache_dir),
        num_proc=1,
    )


def test_a_full_disk_while_mapping_the_arrays_is_named_not_a_sigbus(tiny_assets, small_disk):
    """The train split's part files (44 KiB in tmpfs pages) fit, its ids.npy (20 KiB) does not: before the reservation the copy
    into the sparse memory-mapped file died of SIGBUS."""
    where = small_disk(56 * 1024)
    with pytest.raises(atomic.DiskFullError) as e:
        _build(tiny_assets, where)
    msg = str(e.value)
    assert re.fullmatch(
        rf"no space left on device while writing the tokenized data cache to {where} \(about [\d.]+ MiB needed, "
        rf"[\d.]+ MiB free\)\. Nothing half-written was left and the previous files there are intact; {re.escape(FIX)}",
        msg,
    ), msg
    assert e.value.errno == errno.ENOSPC and e.value.needed > 2 * 4 * 4000  # ids and labels of ~4.3k tokens
    assert list(where.iterdir()) == []  # the temporary cache folder is removed
    (where.parent / "filler").unlink()  # with room again, the same build succeeds
    train, _ = _build(tiny_assets, where)
    assert train.stats["tokens"] > 4000 and [p.name.split("-")[0] for p in where.iterdir()] == ["train"]


def test_a_full_disk_in_the_tokenizer_is_named_by_train_with_exit_1(tiny_assets, small_disk, capsys, monkeypatch):
    from tests.e2e.test_bad_inputs import DIST_ENV, _main

    for k in DIST_ENV:  # the in-process run sets them; undo it after the test
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    where = small_disk(8 * 1024)  # not even the part files fit
    args = train_args(tiny_assets, where.parent / "out", dataset_cache_dir=where, max_seq_len=64)
    rc, line = _main(args, capsys)
    assert rc == 1
    assert line.startswith(f"error: no space left on device while writing the tokenized data cache to {where} (size")
    assert line.endswith(FIX) and list(where.iterdir()) == []


def test_the_reservation_turns_enospc_into_the_named_error(tmp_path, monkeypatch):
    """Where no tmpfs can be mounted: the reservation's ENOSPC (monkeypatched) becomes the DiskFullError."""

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    folder = tmp_path / "cache" / ".train-x.tmp"
    folder.mkdir(parents=True)
    (folder / "part-000000.ids").write_bytes(b"\1\0\0\0" * 10)
    with pytest.raises(atomic.DiskFullError, match=rf"to {tmp_path / 'cache'} \(about [\d.]+ MiB needed"):
        cache._concatenate([folder / "part-000000.ids"], folder / "ids.npy", 10, hashlib.sha256())
