"""`bench/gpu_check.py --device cpu --tiny`: the device check runs on the CPU, so that it keeps working between the
runs on a GPU, and its JSON says what each check found."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CHECKS = "lora_world1,memory_vs_plan,attention,qlora,kill_resume"  # in the check's own order


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        env.pop(name, None)  # the checks start with shardtune's default, as a command would
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--tiny", "--only", CHECKS,
           "--workdir", str(tmp / "work"), "--out", str(tmp / "gpu_check.json"),
           "--process_start_runs", "2"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((tmp / "gpu_check.json").read_text())
    return data, proc.stdout


def test_table_and_json_name_every_check(report):
    data, stdout = report
    assert list(data["checks"]) == CHECKS.split(",")
    for name in data["checks"]:
        assert any(line.startswith(name) for line in stdout.splitlines()), name
    assert data["device"] == "cpu" and data["versions"]["torch"] and data["matmul_peak_flops"] > 0
    assert data["checks"]["memory_vs_plan"] == {**data["checks"]["memory_vs_plan"], "status": "skipped"}
    assert data["checks"]["memory_vs_plan"]["reason"] == "needs CUDA"


def test_lora_loss_falls_and_mfu_hfu_follow_the_flop_model(report):
    data, _ = report
    r = data["checks"]["lora_world1"]
    assert r["status"] == "ok" and r["loss_falls"] and r["losses"][-1] < r["losses"][0]
    assert r["tokens_per_s"] > 0 and r["recompute"] == 1.0
    # one process keeps FSDP2 for this check (SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp), as the table says
    assert r["fsdp"] and r["fsdp_decisions"] and all(d[0] and "kept by" in d[1] for d in r["fsdp_decisions"])
    assert next(line for line in report[1].splitlines() if line.startswith("lora_world1")).split()[3] == "FSDP2,"
    # With every block recomputed, HFU/MFU is executed over model FLOPs: a weighted mean of the parts' ratios,
    # frozen base (6·N_b + 4·N_h) / (4·N_b + 4·N_h), adapter 8/6, attention 4/3 (docs/speed.md), so it lies
    # between the smallest and the largest of them.
    fm = data["flop_model"]
    parts = [(6 * fm["block_linear"] + 4 * fm["head"]) / (4 * fm["block_linear"] + 4 * fm["head"]), 8 / 6, 4 / 3]
    assert min(parts) * (1 - 1e-9) <= r["hfu"] / r["mfu"] <= max(parts) * (1 + 1e-9)
    assert 0 < r["mfu"] < r["hfu"]


def _numerics_hold_and_controls_fail(report, name: str, compared: list[dict]) -> None:
    """Each comparison is inside its bf16 tolerance and the planted error far outside it (the JSON and the table
    say so)."""
    r = report[0]["checks"][name]
    row = next(line for line in report[1].splitlines() if line.startswith(name))
    assert r["status"] == "ok" and r["elements"] > 1000 and "control failed" in row
    for c in compared:
        assert c["max_abs_diff"] <= c["tol"] and c["equal"]
    ctl = r["control"]
    assert ctl["failed"] and not ctl["equal"] and ctl["max_abs_diff"] > 5 * ctl["tol"], ctl


def test_attention_paths_give_the_same_logits_and_a_leak_fails(report):
    r = report[0]["checks"]["attention"]
    assert list(r["variants"]) == ["sdpa_packed_mask", "per_document_sdpa"]
    assert all(v["seconds"] > 0 for v in r["variants"].values())
    _numerics_hold_and_controls_fail(report, "attention", [r["variants"]["per_document_sdpa"]])
    assert r["logits_equal"] and "cross-document leak" in r["control"]["planted"]
    assert r["not_run"] == {"flash_attn_varlen": "needs CUDA"}


def test_qlora_equals_the_dequantized_bf16_model_and_a_wrong_scale_fails(report):
    r = report[0]["checks"]["qlora"]
    if importlib.util.find_spec("bitsandbytes") is None:
        assert r["status"] == "skipped" and "shardtune[qlora]" in r["reason"]
        return
    _numerics_hold_and_controls_fail(report, "qlora", [r])
    assert "doubled scales" in r["control"]["planted"] and r["packed_mib_per_rank"] > 0
    # the reference weights are the check's own dequantization, equal to bitsandbytes' and to each layer's forward
    assert r["dequantization"].startswith("independent") and r["logits_equal"] and r["layers"]
    assert all(v["bnb_dequantize"]["equal"] and v["forward"]["equal"] for v in r["layers"].values())


def test_killed_run_resumes_bit_for_bit(report):
    r = report[0]["checks"]["kill_resume"]
    assert r["status"] == "ok" and r["resume_equal"] and r["max_rel_diff"] == 0
    assert r["resumed_losses"] == r["losses"][2:4] and len(r["losses"]) == 4
    assert r["deterministic"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert r["control"]["failed"]  # the adapter moved by one ulp is seen


def test_every_check_ran_under_the_commands_allocator_setting(report):
    data, stdout = report
    assert data["allocator"] == "PYTORCH_ALLOC_CONF=expandable_segments:True"
    assert {r.get("allocator") for r in data["checks"].values() if r["status"] != "skipped"} == {data["allocator"]}
    assert "budget: " in stdout and data["budget_s"]["device"] == 290


def test_the_process_start_is_measured_and_sizes_the_budgets(report, monkeypatch):
    """The run times fresh processes that start as a check's does, records them, and the device budgets in its JSON
    are those of the slowest start, not of the modelled one."""
    gpu_check = _gpu_check(monkeypatch)
    data, stdout = report
    ps = data["process_start"]
    assert ps["device"] == "cpu" and ps["runs"] == 2 and len(ps["seconds"]) == 2 and not ps["timed_out"]
    assert all(s > 0 for s in ps["seconds"]) and all(0 < i < s for i, s in zip(ps["imports_s"], ps["seconds"]))
    assert ps["used"] == "max_s" and ps["used_s"] == ps["max_s"] == max(ps["seconds"]) >= ps["median_s"]
    assert ps["cuda_start_s"] == [None, None]  # no CUDA on the CPU run
    assert data["budget_s"] == {"device": 290, **gpu_check.budgets(ps["used_s"])}
    assert data["budget_s_modelled"] == {"process_s": gpu_check.PROCESS_S, **gpu_check.BUDGET_S}
    assert f"median {ps['median_s']:.1f} s, max {ps['max_s']:.1f} s over 2 fresh processes" in stdout


def test_versions_out_of_pyproject_ranges_stop_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check

    real = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "peft": "0.21.2", "datasets": "5.2.0"}
    fake = lambda v: lambda name: v.get(name, real.get(name, "99"))
    low = gpu_check.version_problems(fake({"torch": "2.10.0+cu128", "datasets": None, "trl": None}))
    assert "torch 2.10.0+cu128 is out of range (needs <2.14,>=2.11)" in low
    assert "datasets is not installed (needs <5.3,>=5.2)" in low
    assert not any("trl" in p for p in low)  # optional: its check skips
    assert "transformers 5.25.0 is out of range" in " ".join(
        gpu_check.version_problems(fake({"transformers": "5.25.0"}))
    )
    ok = {**real, "safetensors": "0.8.0", "huggingface_hub": "1.33.0", "tokenizers": "0.23.2", "pyyaml": "6.0",
          "tqdm": "4.67", "psutil": "7.0", "bitsandbytes": None, "trl": None, "accelerate": "1.15.0"}  # fmt: skip
    assert gpu_check.version_problems(lambda name: ok.get(name, "0")) == []
    monkeypatch.setattr(gpu_check, "_installed", fake({"torch": "2.10.0"}))
    assert gpu_check.main(["--device", "cpu", "--tiny", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: torch 2.10.0 is out of range (needs <2.14,>=2.11)") and err.count("\n") == 1
    assert not (tmp_path / "w").exists()  # stopped before anything ran


def test_a_numerics_check_whose_control_passes_fails(monkeypatch):
    """A comparison that cannot see its planted error proves nothing: the check fails, whatever its own result."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check

    seen, blind = {"failed": True, "over_tol": 29.0}, {"failed": False, "over_tol": 0.0}
    assert not gpu_check._failed("attention", {"logits_equal": True, "control": seen})
    assert gpu_check._failed("attention", {"logits_equal": True, "control": blind})
    assert gpu_check._failed("attention", {"logits_equal": False, "control": seen})
    assert not gpu_check._failed("qlora", {"equal": True, "control": seen})
    assert gpu_check._failed("qlora", {"equal": True, "control": blind})
    row = gpu_check._summary("qlora", {"status": "fail", "over_tol": 0.0, "control": blind, "packed_mib_per_rank": 1})
    assert "control PASSED (0.0x tol)" in row


def _gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check

    return gpu_check


def test_a_timed_out_check_leaves_no_process_and_keeps_its_measurements(monkeypatch, tmp_path):
    """The planted check records a measurement, starts a child that sleeps and sleeps itself: at its timeout the
    check's whole tree is gone (its own session killed), and what it recorded is in the result."""
    import psutil

    gpu_check = _gpu_check(monkeypatch)
    ctx = tmp_path / "checks" / "context.json"
    ctx.parent.mkdir()
    ctx.write_text(json.dumps({"device": "cpu", "threads": 1, "workdir": str(tmp_path)}))
    r = gpu_check.run_check("_planted_hang", ctx, timeout_s=60)
    assert r["status"] == "fail" and r["reason"] == "timed out after 60 s", r
    part = r["partial"]
    assert part["measured"] == 1.5 and part["check_pid"] in r["killed_pids"] and part["child_pid"] in r["killed_pids"]
    for pid in (part["check_pid"], part["child_pid"]):
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by init
        except psutil.NoSuchProcess:
            pass


def test_a_failed_trace_keeps_the_memory_measurements(report, monkeypatch, tmp_path):
    """memory_vs_plan after its training run, on the CPU with made-up peaks: a planted failing
    `shardtune plan --trace` leaves the measurements and the plan in the result (and the partial record), and fails
    the check; the real trace then gives the replay."""
    gpu_check = _gpu_check(monkeypatch)
    ctx_path = next(tmp_path.parent.glob("gpu_check*/work/tiny/checks/context.json"), None)
    if ctx_path is None:
        pytest.skip("the report's assets are not where expected")
    script = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import gpu_checks as g
from shardtune import cli
from shardtune.config.accelerate import accelerate_env
cli.prepare_process()
ctx = json.load(open({str(ctx_path)!r})); ctx["partial_path"] = {str(tmp_path / "partial.jsonl")!r}
os.environ.update(accelerate_env(g._yaml(ctx, 1)))
argv = g.train_argv(ctx, {str(tmp_path / "out")!r}, max_steps=3)
measured = {{"allocated": 2**30, "reserved": 2**31, "weights": 2**29}}
os.environ[g.TRACE_CMD_PLANT] = json.dumps([sys.executable, "-c", "import sys; sys.exit('planted: trace failed')"])
planted = g.against_plan(ctx, argv, measured, 0, 0)
del os.environ[g.TRACE_CMD_PLANT]
print(json.dumps({{"planted": planted, "real": g.against_plan(ctx, argv, measured, 0, 0)}}))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    planted, real = out["planted"], out["real"]
    assert "planted: trace failed" in planted["trace_error"] and "replayed_gib" not in planted
    assert planted["measured_gib"] == {"allocated": 1.0, "reserved": 2.0, "weights": 0.5}
    assert planted["plan_gib"]["allocated"] > 0 and planted["allocated_over_plan"] > 0
    assert gpu_check._failed("memory_vs_plan", planted) and not gpu_check._failed("memory_vs_plan", real)
    assert "trace failed" in gpu_check._summary("memory_vs_plan", {"status": "fail", **planted})
    assert real["reserved_over_replay"] > 0 and "trace_error" not in real
    partial = [json.loads(x) for x in (tmp_path / "partial.jsonl").read_text().splitlines()]
    assert {"measured_gib": planted["measured_gib"]} in partial


def test_lora_world1_on_the_plain_module_fails(monkeypatch, tmp_path):
    """The planted control of lora_world1: one process left on its default (no FSDP) must fail the check."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "GPU_CHECK_PLANT_SINGLE_PROCESS": "auto"}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--tiny", "--only", "lora_world1",
           "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "gpu_check.json"),
           "--process_start_runs", "1"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]["lora_world1"]
    assert r["status"] == "fail" and not r["fsdp"] and "No FSDP at world size 1" in r["fsdp_decisions"][0][1]
    assert r["loss_falls"]  # the run itself is fine: only the path is wrong
