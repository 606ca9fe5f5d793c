"""The device check's budget (bench/gpu_check.py): the checks' budgets follow the process start the run measured, a
check whose budget does not fit what is left is not started, and the measurement stays within its own cap."""

from __future__ import annotations

import argparse
import os
import time

import psutil
import pytest
import torch

from tests.conftest import ROOT


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check

    return gpu_check


def test_budgets_grow_with_the_start_of_each_process_a_check_starts(gpu_check):
    """One term per fresh process a check starts: lora_world1 starts one, memory_vs_plan two (the run and the
    trace), the modelled start gives the budgets docs/gpu.md tabulates."""
    assert gpu_check.budgets(gpu_check.PROCESS_S) == gpu_check.BUDGET_S
    assert gpu_check.BUDGET_S["lora_world1"] == 35 and gpu_check.BUDGET_S["memory_vs_plan"] == 80
    fast, slow = gpu_check.estimates(2.0), gpu_check.estimates(12.0)
    assert slow["lora_world1"] - fast["lora_world1"] == pytest.approx(10.0)
    assert slow["memory_vs_plan"] - fast["memory_vs_plan"] == pytest.approx(20.0)
    assert all(gpu_check.budgets(2.0)[k] <= gpu_check.budgets(12.0)[k] for k in fast)


def _decide(gpu_check, monkeypatch, process_s: float, budget_s: float) -> tuple[dict, dict]:
    """_run_all on CUDA (one GPU faked) with the budgets of a measured start; each started check records the
    timeout it was given instead of running."""
    started: dict[str, float] = {}

    def run_check(name, ctx_path, timeout_s):
        started[name] = timeout_s
        return {"status": "ok", "seconds": 0.0}

    monkeypatch.setattr(gpu_check, "run_check", run_check)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    a = argparse.Namespace(device="cuda", budget_s=budget_s)
    out = gpu_check._run_all(a, ["lora_world1", "memory_vs_plan"], set(), ROOT, time.monotonic(),
                             gpu_check.budgets(process_s))  # fmt: skip
    return out, started


def test_the_measured_start_decides_what_fits(gpu_check, monkeypatch):
    # a fast start: both fit in 100 s, each started with its budget as its timeout
    out, started = _decide(gpu_check, monkeypatch, process_s=2.0, budget_s=100)
    assert started == {k: gpu_check.budgets(2.0)[k] for k in ("lora_world1", "memory_vs_plan")}
    # a slow one: memory_vs_plan starts two processes and no longer fits; lora_world1 still does
    out, started = _decide(gpu_check, monkeypatch, process_s=30.0, budget_s=100)
    need = gpu_check.budgets(30.0)["memory_vs_plan"]
    assert list(started) == ["lora_world1"] and need > 100
    assert out["memory_vs_plan"]["status"] == "skipped"
    assert out["memory_vs_plan"]["reason"].startswith(f"its budget of {need} s does not fit in the")


def test_a_failed_measurement_falls_back_to_the_modelled_start(gpu_check, monkeypatch):
    def broken(*_a, **_kw):
        raise RuntimeError("the process-start measurement exited 1")

    monkeypatch.setattr(gpu_check.process_start, "measure", broken)
    a = argparse.Namespace(device="cuda", budget_s=290, process_start_runs=5)
    got = gpu_check.measure_process_start(a, time.monotonic())
    assert got["used"] == "modelled" and got["used_s"] == gpu_check.PROCESS_S and "exited 1" in got["error"]


def test_the_measurement_stops_at_its_cap_and_leaves_no_process(gpu_check):
    """A run still starting at the cap is killed (its session), counted as the time it took, and no other starts.
    No process it started is left: the test's own children from before (earlier tests' helpers, a resource
    tracker) are not the measurement's."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    m = gpu_check.process_start.measure("cpu", runs=5, cap_s=0.5)
    assert m["runs"] == 1 and m["timed_out"] and 0.5 <= m["max_s"] < 30 and m["spent_s"] < 30
    assert m["imports_s"] == [None]
    assert {p.pid for p in me.children(recursive=True)} <= before


def test_no_time_left_starts_no_measurement(gpu_check):
    """With nothing left of --budget_s no process is started (and no check will be): the modelled start stands in."""
    a = argparse.Namespace(device="cuda", budget_s=1, process_start_runs=5)
    got = gpu_check.measure_process_start(a, time.monotonic() - 10)
    assert got["runs"] == 0 and got["used"] == "modelled" and got["used_s"] == gpu_check.PROCESS_S
    assert gpu_check.process_start.summary(got).startswith("process start: not measured")
