"""Faults around a run: a full disk at a checkpoint or the final save, damaged checkpoint files, SIGTERM's exit
code. Full disks are injected with SHARDTUNE_FAULT=<save|export>:<step>:<rank>:ENOSPC (shardtune.checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.parallel import checkpoint
from tests.conftest import run_cli, train_records
from tests.distributed.test_checkpoint import FSDP_ENV, _args, _wait


@pytest.fixture(scope="module")
def disk_full(tiny_assets, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 2-rank run whose rank 1 finds the disk full while writing checkpoint-4 (checkpoint-2 is saved)."""
    out = tmp_path_factory.mktemp("disk_full") / "run"
    env = {**FSDP_ENV, "SHARDTUNE_FAULT": "save:4:1:ENOSPC"}
    return out, run_cli(_args(tiny_assets, out, dropout=0.0), nproc=2, env=env, check=False)


def _summary(out: Path) -> dict:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "summary"][-1]


def test_disk_full_at_a_checkpoint_names_the_folder_and_keeps_the_previous_one(disk_full):
    out, proc = disk_full
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"Root Cause.*?exitcode\s*: 1\b", log, re.DOTALL)  # the documented exit code of each rank
    folder = out / "checkpoints" / "checkpoint-4"
    m = re.search(
        rf"error: no space left on device while writing a checkpoint to {folder} \(about ([\d.]+) MiB needed", log
    )
    assert m and float(m.group(1)) > 0, log[-3000:]
    assert not re.search(r'File ".*/shardtune/', log)  # torchrun prints its own traceback; no shardtune frame
    # No temporary folder left; the previous checkpoint whole and still listed as the newest.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert checkpoint.damage(out / "checkpoints" / "checkpoint-2") is None
    assert max(r["step"] for r in train_records(out)) == 4
    # The run summary says nothing was written, and why.
    summary = _summary(out)
    assert summary["output_path"] is None and "no space left on device" in summary["output_error"]
    assert re.search(r"output\s+NOT WRITTEN: no space left on device", log)
    assert not (out / "adapter_model.safetensors").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 96 KiB file system (tmpfs; skipped where mounting is not permitted): room for the run's logs, not for
    a checkpoint of the tiny LoRA run (weights and Adam moments, about 130 KiB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_real_full_disk_during_a_context_parallel_dcp_save_is_one_line_and_leaves_nothing(tiny_assets, small_disk):
    """The disk really fills while DCP writes checkpoint-2 of a 2-rank context-parallel run: torch raises no
    OSError but a CheckpointException (a BaseException) carrying each rank's RuntimeError from its zip writer
    ("unexpected pos ...") or OSError(ENOSPC). Every rank leaves the save together; one line names the folder and the
    space needed; no `checkpoint-2.tmp` or other temporary file is left; exit code 1."""
    out = small_disk / "run"
    cache = ["--dataset_cache_dir", str(small_disk.parent / "cache")]  # the data cache on the roomy disk
    args = _args(tiny_assets, out, "--context_parallel_size", "2", *cache, dropout=0.0, steps=4)
    proc = run_cli(args, nproc=2, env=FSDP_ENV, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(r"Root Cause.*?exitcode\s*: 1\b", log, re.DOTALL), log[-3000:]
    folder = out / "checkpoints" / "checkpoint-2"
    lines = [line for line in log.splitlines() if "no space left on device" in line and "error:" in line]
    assert len(lines) == 1, log[-3000:]
    assert re.search(
        rf"error: no space left on device while writing a checkpoint to {folder} \(about [\d.]+ MiB needed, "
        r"[\d.]+ MiB free\)",
        lines[0],
    ), lines[0]
    assert "CheckpointException" not in log and "unexpected pos" not in log
    assert not re.search(r'File ".*/shardtune/', log)
    assert [p.name for p in (out / "checkpoints").iterdir()] == []  # neither checkpoint-2 nor checkpoint-2.tmp
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert max(r["step"] for r in train_records(out)) == 2


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_damaged_checkpoint_files_are_named(disk_full, tmp_path):
    good = disk_full[0] / "checkpoints" / "checkpoint-2"
    cases = {
        "sharded/__1_0.distcp": r"sharded/__1_0\.distcp is truncated \(\d+ of \d+ bytes\)",
        "sharded/.metadata": r"sharded/\.metadata is missing or unreadable",
        "scheduler.pt": r"scheduler\.pt is missing or truncated",
        "rng_rank1.pt": r"rng_rank1\.pt is missing or truncated",
        "meta.json": r"meta\.json is unreadable",
    }
    for name, pattern in cases.items():
        ck = tmp_path / name.replace("/", "_") / "checkpoint-2"
        shutil.copytree(good, ck)
        _truncate(ck / name)
        assert re.search(pattern, checkpoint.damage(ck) or ""), name
        # An explicit path is refused with the file's name (exit code 2 in `shardtune train`).
        with pytest.raises(ValueError, match=pattern):
            checkpoint.resolve(str(ck), ck.parent.parent)


def test_latest_skips_a_damaged_checkpoint_and_a_full_disk_at_the_end_keeps_the_old_output(
    disk_full, tiny_assets, tmp_path
):
    """One process resumes `latest`: the newest checkpoint (3) has a truncated shard, so checkpoint-2 is used; the
    final adapter then finds the disk full: the adapter already in output_dir stays, and the run says so."""
    out = tmp_path / "run"
    shutil.copytree(disk_full[0] / "checkpoints", out / "checkpoints")
    damaged = out / "checkpoints" / "checkpoint-3"
    shutil.copytree(out / "checkpoints" / "checkpoint-2", damaged)
    _truncate(damaged / "sharded" / "__0_0.distcp")
    old = {"adapter_model.safetensors": b"the previous adapter", "adapter_config.json": b"{}"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    args = _args(tiny_assets, out, "--resume_from_checkpoint", "latest", "--save_strategy", "no", dropout=0.0, steps=4)
    env = {**FSDP_ENV, "SHARDTUNE_FAULT": "export:4:0:ENOSPC"}
    proc = run_cli([*args, "--per_device_train_batch_size", "4"], env=env, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    skip = [line for line in log.splitlines() if "--resume_from_checkpoint latest: skipping" in line]
    assert len(skip) == 1 and f"{damaged}/sharded/__0_0.distcp is truncated" in skip[0]
    assert skip[0].endswith(f"resuming from {out / 'checkpoints' / 'checkpoint-2'}.")
    assert "Resumed from" in log and "at step 2" in log
    assert re.search(rf"error: no space left on device while writing the adapter to {out} \(about [\d.]+ MiB", log)
    assert "Traceback" not in log
    # The previous output untouched, no temporary folder, and the summary says the output was not written.
    assert {n: (out / n).read_bytes() for n in old} == old
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert _summary(out)["output_error"].startswith("no space left on device")


def _resumed_from_checkpoint_2(
    disk_full, tiny_assets, tmp_path, *flags: str
) -> tuple[Path, subprocess.CompletedProcess]:
    """One process resumes the 2-rank run's checkpoint-2 (the same global batch: 4 rows × 2 accumulation steps)."""
    out = tmp_path / "run"
    shutil.copytree(disk_full[0] / "checkpoints", out / "checkpoints")
    args = _args(tiny_assets, out, "--resume_from_checkpoint", "latest", "--save_strategy", "no", dropout=0.0)
    proc = run_cli([*args, "--per_device_train_batch_size", "4", *flags], env=FSDP_ENV, check=False)
    return out, proc


def _schedule(lr: float, kind: str, warmup: int, total: int) -> list[float]:
    """The rate a fresh run logs after each step 1..total (metrics.jsonl's learning_rate)."""
    import torch
    from transformers import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)
    out = []
    for _ in range(total):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def test_a_resume_with_a_new_schedule_trains_with_it_from_the_resumed_step(disk_full, tiny_assets, tmp_path):
    """Resumed at step 2 of a cosine run at 3e-3 for 6 steps with a new learning rate, scheduler, warmup, length,
    weight decay, clipping and per-device batch: steps 3..8 log the rates of a fresh run with the new flags
    (docs/checkpoints.md, "Changed settings"). Control: the old behaviour (the checkpoint's base rate with the new
    schedule's shape) logs other rates."""
    new = ("--learning_rate", "1e-3", "--lr_scheduler_type", "linear", "--warmup_steps", "3", "--max_steps", "8")
    out, proc = _resumed_from_checkpoint_2(
        disk_full, tiny_assets, tmp_path, *new, "--weight_decay", "0.0", "--max_grad_norm", "0.5"
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "this run's values apply from the resumed step on" in log and "learning_rate: 0.003 → 0.001" in log
    logged = {r["step"]: r["learning_rate"] for r in train_records(out)}
    expected = _schedule(1e-3, "linear", 3, 8)
    assert [logged[k] for k in range(3, 9)] == pytest.approx(expected[2:], rel=1e-6)
    old = [3e-3 / 1e-3 * v for v in expected[2:]]  # the checkpoint's base rate 3e-3 over the new shape
    assert [logged[k] for k in range(3, 9)] != pytest.approx(old, rel=1e-3)


def test_a_resume_with_another_seed_is_refused_naming_it(disk_full, tiny_assets, tmp_path):
    """The packing and the order of the rows depend on --seed: a resume with another is refused before anything
    loads, in one line naming the flag, both values and the fix (exit code 2)."""
    out, proc = _resumed_from_checkpoint_2(disk_full, tiny_assets, tmp_path, "--seed", "8")
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(
        f"error: --seed 8 differs from the checkpoint's 7 ({out / 'checkpoints' / 'checkpoint-2'}): the packing of "
        "the rows and their order in every epoch depend on it; resume with --seed 7, or start afresh"
    )
    assert "Traceback" not in proc.stderr and not (out / "metrics.jsonl").exists()


def test_sigterm_exits_with_the_documented_code_3(tiny_assets, tmp_path):
    """docs/checkpoints.md: a stopped run saves a checkpoint and exits with code 3 (here without torchrun, whose
    own exit code on a signal is its own)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **FSDP_ENV}
    cmd = [sys.executable, "-m", "shardtune", *_args(tiny_assets, out, "--save_steps", "1000", steps=400)]
    with (tmp_path / "run.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and not (metrics.exists() and '"step": 2,' in metrics.read_text()):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert _wait(proc, timeout=120) == 3
    last = train_records(out)[-1]["step"]
    assert (out / "checkpoints" / f"checkpoint-{last}" / "meta.json").exists()


def _gone(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive (zombies count as gone: they no longer run) after waiting up to within_s."""
    import psutil

    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _launched_at_step_2(assets, tmp_path: Path, log) -> tuple[subprocess.Popen, Path]:
    """`shardtune launch` of a 2-rank, 400-step run on CPU, output to `log`, returned once step 2 is logged; and
    its output folder."""
    out = tmp_path / "run"
    flags = _args(assets, out, "--save_steps", "1000", steps=400)[1:]  # `launch` takes the train flags
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "shardtune", "launch", "--config_file", "configs/fsdp_config_cpu.yaml", *flags]
    root = Path(__file__).resolve().parents[2]
    launch = subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    metrics = out / "metrics.jsonl"
    while launch.poll() is None and not (metrics.exists() and '"step": 2,' in metrics.read_text()):
        time.sleep(0.05)
    return launch, out


def _checkpoint_of_the_last_step(out: Path) -> None:
    last = train_records(out)[-1]["step"]
    assert last < 400 and (out / "checkpoints" / f"checkpoint-{last}" / "meta.json").exists()


def test_killing_torchrun_stops_its_workers(tiny_assets, tmp_path):
    """kill -9 of the torchrun agent under `shardtune launch`: its two workers notice, stop as on SIGTERM (a
    checkpoint of the step they reached) and exit, instead of training on."""
    import psutil

    with (tmp_path / "run.log").open("w") as log:
        launch, out = _launched_at_step_2(tiny_assets, tmp_path, log)
        (agent,) = psutil.Process(launch.pid).children()
        workers = [p.pid for p in agent.children()]
        assert len(workers) == 2
        agent.kill()
        assert _gone(workers, within_s=20) == []
        assert _wait(launch, timeout=30) != 0
    text = (tmp_path / "run.log").read_text()
    assert text.count(f"the launcher (pid {agent.pid}) is gone; stopping this worker") == 2
    _checkpoint_of_the_last_step(out)


def test_sigterm_to_the_launcher_alone_stops_the_workers_and_it_waits_for_them(tiny_assets, tmp_path):
    """SIGTERM to `shardtune launch` only (a `kill`, a scheduler that signals the job's first process): it passes
    the stop to torchrun, which passes it to both workers; they finish the step, save and exit, and the launch waits
    for them and exits 3, leaving no process (it used to die at once, leaving the workers to save unwaited), and no
    traceback."""
    import psutil

    with (tmp_path / "run.log").open("w") as log:
        launch, out = _launched_at_step_2(tiny_assets, tmp_path, log)
        (agent,) = psutil.Process(launch.pid).children()
        tree = [agent.pid, *(p.pid for p in agent.children())]
        launch.send_signal(signal.SIGTERM)
        assert _wait(launch, timeout=60) == 3
        assert _gone(tree, within_s=0.5) == []  # the launch returned after its whole tree was gone
    text = (tmp_path / "run.log").read_text()
    assert text.count("Stop requested (SIGTERM): saving a checkpoint, then stopping.") == 1  # rank 0's line
    # torchrun (shardtune.parallel.torchrun) ends with its line, not the traceback of torch's SignalException.
    assert text.strip().endswith("torchrun: stopped by SIGTERM; its workers were stopped.") and "Traceback" not in text
    _checkpoint_of_the_last_step(out)


@pytest.mark.parametrize(
    ("fault", "rank", "how", "code"),
    [
        ("step:2:1:KILL", 1, "was killed by SIGKILL", 128 + signal.SIGKILL),
        # an error's exit: rank 1 finds the disk full at checkpoint-2, and both ranks end with code 1 (either is named)
        ("save:2:1:ENOSPC", "[01]", "exited with code 1", 1),
        # an error of one rank alone (rank 0's disk fills while it logs step 2): it leaves at once rather than
        # waiting for its peer at a barrier, so the launch ends in seconds, not after --ddp_timeout
        ("step:2:0:ENOSPC", 0, "exited with code 1", 1),
    ],
)
def test_a_lost_rank_under_launch_is_one_line_naming_it_and_leaves_no_process(
    tiny_assets, tmp_path, fault, rank, how, code
):
    """A worker of `shardtune launch` dies (SIGKILL, or exit code 1 after an error): torchrun's agent stops the other
    one; the launch prints one line naming the rank, its signal or exit code and where its output is, instead of
    torch's ChildFailedError traceback and report, exits non-zero (128 + the signal, or the rank's code), and no
    process of the launch's tree is left."""
    import psutil

    out = tmp_path / "run"
    flags = _args(tiny_assets, out, "--save_steps", "2", steps=400)[1:]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "SHARDTUNE_FAULT": fault}
    cmd = [sys.executable, "-m", "shardtune", "launch", "--config_file", "configs/fsdp_config_cpu.yaml", *flags]
    seen: set[int] = set()
    with (tmp_path / "run.log").open("w") as log:
        launch = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=log)
        deadline = time.monotonic() + 300
        while launch.poll() is None and time.monotonic() < deadline:  # every process the launch starts
            with contextlib.suppress(psutil.Error):
                seen |= {p.pid for p in psutil.Process(launch.pid).children(recursive=True)}
            time.sleep(0.05)
        assert _wait(launch, timeout=30) == code
    text = (tmp_path / "run.log").read_text()
    assert len(seen) >= 3 and _gone(sorted(seen), within_s=1) == []  # the agent and both workers, all gone
    assert "Traceback" not in text and "ChildFailedError" not in text and "Root Cause (first observed" not in text
    assert re.search(
        rf"^torchrun: rank ({rank}) \(local rank \1, pid \d+\) {how}, and the other workers were stopped; its output ",
        text,
        re.MULTILINE,
    ), text[-2000:]
    assert re.match(f"torchrun: rank {rank} ", text.rstrip().splitlines()[-1])


def test_a_stop_before_torchrun_starts_is_one_line_and_starts_nothing(tiny_assets, tmp_path, monkeypatch, capsys):
    """A stop while `shardtune launch` checks the flags and the model: one line naming what it was doing, exit 3,
    torchrun never started."""
    from shardtune.commands import launch

    def stopped(*_):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in this frame
        raise AssertionError("SIGTERM did not stop the launch")

    started = []
    monkeypatch.setattr(launch, "_train_problems", stopped)
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: started.append(a))
    flags = _args(tiny_assets, tmp_path / "run", steps=2)[1:]
    config = Path(__file__).resolve().parents[2] / "configs" / "fsdp_config_cpu.yaml"
    before = signal.getsignal(signal.SIGTERM)
    assert launch.main(["--config_file", str(config), *flags]) == 3
    assert capsys.readouterr().err.strip().splitlines() == [
        "shardtune launch: stopped by SIGTERM while checking the flags and the model's files; no process was started."
    ]
    assert started == [] and signal.getsignal(signal.SIGTERM) is before


def test_a_launched_child_gets_sigterm_when_the_launcher_dies(tmp_path):
    """`shardtune launch` starts torchrun with child_preexec: killing the launcher with -9 ends its child."""
    import psutil

    script = (
        "import subprocess, sys, time\n"
        "from shardtune.runtime.parent import child_preexec\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=child_preexec)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    assert psutil.Process(child).ppid() == launcher.pid
    launcher.kill()
    launcher.wait()
    assert _gone([child], within_s=5) == []
