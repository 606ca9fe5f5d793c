"""Stop signals outside the training loop and the run's lock on its output folder (docs/errors.md, "Faults").

SIGTERM/SIGINT while tokenizing or loading (injected with SHARDTUNE_FAULT=<tokenize|load>:0:<rank>:<signal>):
one line, exit code 3, no traceback of shardtune's, no process left (the tokenizer's workers, torchrun's), no
temporary folder left, and the output folder that the run's lock made removed again. A second run into a folder
in use is refused naming the holder; a lock of a killed run blocks nothing."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardtune.runtime import hooks
from shardtune.runtime.stop import StopHandler, Stopped
from shardtune.training import run_dir
from tests.conftest import build_data, run_cli, train_args
from tests.distributed.test_faults import _gone

STOPPED = re.compile(r"^Stopped by (SIGTERM|SIGINT) while (preparing the data|loading the model), before the first")


def _tagged(tag: str) -> list[int]:
    """Processes (other than zombies) whose environment carries SHARDTUNE_TEST_TAG=tag: a run's whole tree."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("SHARDTUNE_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _args(assets, out: Path, cache: Path) -> list[str]:
    flags = {"max_steps": 4, "max_seq_len": 64, "per_device_train_batch_size": 2, "dataset_cache_dir": cache}
    return train_args(assets, out, use_peft_lora=True, **flags)


def _left_behind(*folders: Path) -> list[str]:
    """Temporary names (and the lock file) under folders: what a stopped run must not leave."""
    return [
        str(p) for f in folders if f.exists() for p in f.rglob(".*") if ".tmp" in p.name or p.name == run_dir.LOCK_FILE
    ]


def _stopped_line(log: str, stage: str) -> str:
    lines = [line for line in log.splitlines() if line.startswith("Stopped by")]
    assert len(lines) == 1 and STOPPED.match(lines[0]) and f"while {stage}," in lines[0], log[-3000:]
    assert lines[0].endswith("run the same command again to start. No temporary files were left.")
    return lines[0]


def test_a_stop_while_loading_exits_3_with_one_line_and_leaves_nothing(tiny_assets, tmp_path, capsys, monkeypatch):
    """One process, in this one: SIGINT (Ctrl-C) as the model starts loading."""
    from shardtune import cli
    from tests.e2e.test_bad_inputs import DIST_ENV

    for k in DIST_ENV:  # the in-process run sets them; undo it after the test
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    monkeypatch.setenv("SHARDTUNE_FAULT", "load:0:0:INT")
    out, cache = tmp_path / "out", tmp_path / "cache"
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = cli.main([str(a) for a in _args(tiny_assets, out, cache)])
        restored = {s: signal.getsignal(s) for s in before} == before  # the caller's Ctrl-C is its own again
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert restored
    err = capsys.readouterr().err
    assert rc == 3 and "Traceback" not in err
    _stopped_line(err, "loading the model")
    assert not out.exists()  # the lock made the folder; nothing else was written, so it is removed again
    assert _left_behind(cache) == [] and sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["test", "train"]


def test_preempting_torchrun_while_tokenizing_stops_every_rank_and_leaves_no_process(tiny_assets, tmp_path):
    """torchrun's agent gets SIGTERM while rank 0 tokenizes (rank 1 waits for its cache) and forwards it to both."""
    out, cache, tag = tmp_path / "out", tmp_path / "cache", uuid.uuid4().hex
    env = {"SHARDTUNE_FAULT": "tokenize:0:0:PARENT_TERM", "SHARDTUNE_TEST_TAG": tag}
    proc = run_cli(_args(tiny_assets, out, cache), nproc=2, env=env, check=False, timeout=240)
    log = proc.stdout + proc.stderr
    _stopped_line(log, "preparing the data")  # rank 0's; the other rank says nothing
    assert not re.search(r'File ".*/shardtune/', log), log[-3000:]  # torchrun's own SignalException is its own
    # torchrun exits with its own code on a signal; no rank reported another error.
    assert proc.returncode != 0 and "lost contact" not in log and "error:" not in log
    assert _gone(_tagged(tag), within_s=10) == []  # no rank or tokenizer worker left running
    assert not out.exists() and _left_behind(cache) == []


def test_a_stop_while_tokenizing_ends_the_workers_and_removes_the_temporary_cache(tiny_assets, tmp_path, monkeypatch):
    """Two tokenizer processes, stopped by a real SIGTERM as the StopHandler of `shardtune train` sees it."""
    import psutil
    from transformers import AutoTokenizer

    from shardtune import data
    from shardtune.data import build_datasets, prepare, setup_tokenizer

    monkeypatch.setattr(prepare, "_TASK_ROWS", 20)  # 160 rows: 8 tasks for 2 workers
    seen: list[int] = []

    def workers() -> list[int]:
        return [c.pid for c in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]

    def term(**_) -> None:
        # The pool has started both processes, but a child shows spawn_main only once it has exec'd: under load
        # that can be a moment after the first task is submitted, so the signal waits for both to be seen.
        deadline = time.monotonic() + 30
        while len(workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.extend(workers())
        os.kill(os.getpid(), signal.SIGTERM)

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    setup_tokenizer(tokenizer, "chatml")
    hooks.register("tokenize", term)
    # What the temporary cache folder held when it was removed: the workers' part files of the tasks that ran.
    removed: list[str] = []
    real_rmtree = data.shutil.rmtree
    monkeypatch.setattr(
        data.shutil, "rmtree", lambda path, **kw: (removed.extend(os.listdir(path)), real_rmtree(path, **kw))
    )
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    StopHandler().install()
    try:
        with pytest.raises(Stopped, match="SIGTERM while starting"):
            build_data(
                build_datasets,
                tokenizer=tokenizer,
                dataset_name=str(tiny_assets["data"]),
                splits="train",
                dataset_text_field="text",
                chat_template_format="chatml",
                max_length=64,
                packing=True,
                seed=0,
                cache_dir=str(tmp_path / "cache"),
                num_proc=2,
            )
    finally:
        hooks.clear()
        for s, h in before.items():
            signal.signal(s, h)
    assert len(seen) >= 2  # the workers were running when the signal came
    assert _gone(seen, within_s=10) == []
    # Ended at once, not after their tasks: the executor's own shutdown would have run all 8 (3 part files each).
    assert len([n for n in removed if n.startswith("part-")]) < 3 * 8, removed
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary cache folder is gone


# ---------------------------------------------------------------- the output folder's lock


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_holder(tiny_assets, tmp_path, capsys, monkeypatch):
    from tests.e2e.test_bad_inputs import DIST_ENV, _main

    for k in DIST_ENV:  # the in-process run below sets them; undo it after the test
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from shardtune.training.run_dir import lock_output_dir as lock\n"
                "print(lock(sys.argv[1]), flush=True); time.sleep(120)"
            ),
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "None"  # it holds the lock
        rc, line = _main(train_args(tiny_assets, out), capsys)
        assert rc == 2
        assert re.fullmatch(
            rf"error: --output_dir {out} is in use by another run \(pid {holder.pid} on {re.escape(socket.gethostname())}, "
            rf"started [\d-]+ [\d:]+\), which holds its lock {out}/\.shardtune\.lock; wait for it to end or stop it, "
            r"or give another --output_dir\.",
            line,
        ), line
    finally:
        holder.kill()  # SIGKILL: no code of the holder runs, the kernel drops its lock
        holder.wait()
    assert (out / run_dir.LOCK_FILE).read_text().startswith(f'{{"pid": {holder.pid},')  # left by the killed run
    assert run_dir.lock_output_dir(str(out)) is None  # ... and blocks nothing
    run_dir.release_output_dir(str(out))
    assert not (out / run_dir.LOCK_FILE).exists()


def test_the_lock_is_held_for_the_run_and_released_at_its_end(tmp_path):
    out = tmp_path / "out"
    assert run_dir.lock_output_dir(str(out)) is None
    code = "import sys; from shardtune.training.run_dir import lock_output_dir as lock; print(lock(sys.argv[1]))"
    probe = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, check=True)
    assert f"is in use by another run (pid {os.getpid()} on " in probe.stdout
    run_dir.release_output_dir(str(out))
    assert not out.exists()  # made by the lock, left empty: removed
    probe = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "None"  # the lock ended with the process that took it


def test_a_stopped_merge_leaves_nothing_and_a_killed_ones_leftovers_are_swept(
    tiny_assets, tmp_path, capsys, monkeypatch
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune import cli
    from shardtune.merge import fold
    from shardtune.runtime import atomic

    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_assets["model"]), LoraConfig(r=4, target_modules=["q_proj"])
    ).save_pretrained(tmp_path / "adapter")
    out = tmp_path / "merged"
    killed = tmp_path / f".merged.tmp-{2**22 + 12345}@{socket.gethostname()}"  # a pid above Linux's pid_max
    killed.mkdir()
    (killed / "model-00001-of-00002.safetensors").write_bytes(b"half")
    real = fold.apply_edit
    calls = []

    def term_once(*args):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(fold, "apply_edit", term_once)
    argv = [
        "merge",
        "--base",
        str(tiny_assets["model"]),
        "--adapter",
        str(tmp_path / "adapter"),
        "--output_dir",
        str(out),
    ]
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert cli.main(argv) == 3
    assert {s: signal.getsignal(s) for s in before} == before
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "shardtune merge: stopped by SIGTERM; nothing was written (--output_dir is as it was). Run it again."
    )
    assert f"removed {killed.name}, left by a merge that was killed" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no output, no temporary folder
    assert atomic.sweep_stale(tmp_path) == []


@pytest.mark.parametrize("delay", [0.3, 0.9, 1.6])
def test_ctrl_c_while_starting_leaves_one_line(tmp_path, delay):
    """Ctrl-C while the command still imports its libraries (before the run's own handlers): exit 3, one line, no
    traceback, at any point of the imports — also where a library's import catches the KeyboardInterrupt and
    raises its own error, or swallows it and goes on (the delays land in torch's, transformers' and
    bitsandbytes' imports on this machine; a command that finished before the signal is skipped)."""
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "shardtune", "plan", "--model_name_or_path", "meta-llama/Llama-2-70b-hf"]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    finished = "total (as nvidia-smi shows)" in out and "interrupted" not in err
    if proc.returncode == 0 or (finished and proc.returncode == -signal.SIGINT):
        # the plan was printed before the signal (which then met the interpreter's exit)
        pytest.skip(f"the command finished within {delay} s, before the signal")
    assert proc.returncode == 3, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "interrupted while starting" in err.strip().splitlines()[-1], err[-2000:]
    assert not list(tmp_path.iterdir())
