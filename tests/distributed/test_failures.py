"""Failures of a running job: a preemption signal, a rank that dies, a loss that stops being finite."""

from __future__ import annotations

import json
import re
import signal
import time

from tests.conftest import run_cli, train_records
from tests.distributed.test_checkpoint import FSDP_ENV, _args, _launch, _wait


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(tiny_assets, tmp_path):
    out = tmp_path / "run"
    # Long enough that the signal lands mid-run; no scheduled checkpoint before it.
    proc = _launch(_args(tiny_assets, out, "--save_steps", "1000", steps=400), tmp_path / "run.log")
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and '"step": 2,' in metrics.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to torchrun, as a scheduler preempting the job does; it forwards it
    rc = _wait(proc, timeout=120)
    log = (tmp_path / "run.log").read_text()
    assert rc != 0
    assert "Stop requested (SIGTERM)" in log
    last = train_records(out)[-1]["step"]
    assert 2 <= last < 400
    ck = out / "checkpoints" / f"checkpoint-{last}"
    assert [p.name for p in (out / "checkpoints").iterdir()] == [ck.name]
    assert json.loads((ck / "meta.json").read_text())["loop"]["step"] == last
    assert f"Interrupted at step {last}/400; checkpoint saved in {ck}. Resume with the same command plus " in log
    assert "--resume_from_checkpoint latest" in log
    assert not (out / "adapter_model.safetensors").exists()


def test_a_dead_rank_stops_the_launch_quickly_with_a_clear_message(tiny_assets, tmp_path):
    """Rank 0 (which logs and renames checkpoints) dies mid-run; test_checkpoint.py kills rank 1 mid-save."""
    out = tmp_path / "run"
    proc = _launch(
        _args(tiny_assets, out, "--save_strategy", "no", steps=50),
        tmp_path / "run.log",
        env={"SHARDTUNE_FAULT": "step:3:0"},  # rank 0 SIGKILLs itself after step 3
    )
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and '"step": 3,' in metrics.read_text()):
        time.sleep(0.05)
    t0 = time.monotonic()
    rc = _wait(proc, timeout=120)
    elapsed = time.monotonic() - t0
    log = (tmp_path / "run.log").read_text()
    assert rc != 0 and elapsed < 60, (rc, elapsed)
    assert re.search(r"Root Cause.*?rank\s*: 0 .*?exitcode\s*: -9 .*?SIGKILL", log, re.DOTALL)
    assert "[rank 1] error: lost contact with another rank" in log
    assert max(r["step"] for r in train_records(out)) == 3


def test_nonfinite_losses_stop_the_run_and_keep_the_last_good_checkpoint(tiny_assets, tmp_path):
    out = tmp_path / "run"
    # A learning rate of 1e30 blows the adapter up after the first step: every later loss is NaN.
    args = _args(tiny_assets, out, "--learning_rate", "1e30", "--warmup_steps", "0", "--save_steps", "1")
    proc = run_cli([*args, "--max_nonfinite_steps", "2"], env=FSDP_ENV, check=False)
    assert proc.returncode == 1
    assert "step 2: non-finite loss (nan) or grad norm (nan); step skipped (1/2)." in proc.stderr
    assert "2 steps had a non-finite loss or gradient norm (--max_nonfinite_steps 2); stopped at step 3" in proc.stderr
    records = train_records(out)
    assert [r["step"] for r in records] == [1, 2] and records[1]["nonfinite_steps"] == 1
    # Step 1's checkpoint is the only one: the skipped step 2 was not saved over it.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-1"]
    assert not (out / "adapter_model.safetensors").exists()
