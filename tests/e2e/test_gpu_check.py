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

CHECKS = "lora_world1,attention,qlora,kill_resume,memory_vs_plan"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--tiny", "--only", CHECKS,
           "--workdir", str(tmp / "work"), "--out", str(tmp / "gpu_check.json")]  # fmt: skip
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
    # With every block recomputed, HFU/MFU is executed over model FLOPs: a weighted mean of the parts' ratios,
    # frozen base (6·N_b + 4·N_h) / (4·N_b + 4·N_h), adapter 8/6, attention 4/3 (docs/speed.md), so it lies
    # between the smallest and the largest of them.
    fm = data["flop_model"]
    parts = [(6 * fm["block_linear"] + 4 * fm["head"]) / (4 * fm["block_linear"] + 4 * fm["head"]), 8 / 6, 4 / 3]
    assert min(parts) * (1 - 1e-9) <= r["hfu"] / r["mfu"] <= max(parts) * (1 + 1e-9)
    assert 0 < r["mfu"] < r["hfu"]


def test_attention_paths_give_the_same_loss(report):
    r = report[0]["checks"]["attention"]
    assert r["status"] == "ok" and r["losses_equal"]
    losses = [v["loss"] for v in r["variants"].values()]
    assert set(r["variants"]) == {"per_document_sdpa", "sdpa_packed_mask"}
    assert max(losses) - min(losses) <= r["rtol"] * min(losses) and all(
        v["seconds"] > 0 for v in r["variants"].values()
    )
    assert r["not_run"] == {"flash_attn_varlen": "needs CUDA"}


def test_qlora_equals_the_dequantized_bf16_model(report):
    r = report[0]["checks"]["qlora"]
    if importlib.util.find_spec("bitsandbytes") is None:
        assert r["status"] == "skipped" and "shardtune[qlora]" in r["reason"]
        return
    assert r["status"] == "ok" and r["loss_equal"] and r["packed_mib_per_rank"] > 0
    assert abs(r["loss"] - r["reference_loss"]) <= r["rtol"] * r["reference_loss"]


def test_killed_run_resumes_bit_for_bit(report):
    r = report[0]["checks"]["kill_resume"]
    assert r["status"] == "ok" and r["resume_equal"]
    assert r["resumed_losses"] == r["losses"][2:4] and len(r["losses"]) == 4
