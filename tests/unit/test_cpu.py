"""The bf16 speed check: the decision on injected measurements, and one real measurement's figures."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from shardtune.runtime import cpu


def _speed(bf16: float, fp32: float, *, flags: bool) -> cpu.MatmulSpeed:
    return cpu.MatmulSpeed(
        cpu_model="AMD EPYC 7763 64-Core Processor",
        avx512_bf16=flags,
        amx_bf16=flags,
        fp32_gflops=fp32,
        bf16_gflops=bf16,
    )


def test_emulated_bf16_is_reported_with_the_figures_and_the_fix():
    # The figures of an AVX2-only AMD EPYC: bf16 1.5 GFLOP/s, fp32 30.
    msg = cpu.bf16_warning(_speed(1.5, 30.0, flags=False))
    assert msg == (
        "bf16 is emulated on this CPU (AMD EPYC 7763 64-Core Processor; no avx512_bf16 or amx_bf16): a bf16 "
        "matrix product ran at 1.5 GFLOP/s against 30.0 GFLOP/s in fp32, so its matrix products run up to 20x "
        "slower than in fp32. On this CPU pass --bf16 False (or set mixed_precision: 'no' in the accelerate YAML)."
    )
    # Flags present but the kernels not used (a build without them, ONEDNN_MAX_CPU_ISA): the measurement decides.
    assert "bf16 kernels not used" in cpu.bf16_warning(_speed(1.0, 80.0, flags=True))


def test_native_bf16_or_the_threshold_says_nothing():
    assert cpu.bf16_warning(_speed(450.0, 200.0, flags=True)) is None  # AMX: bf16 faster than fp32
    assert cpu.bf16_warning(_speed(30.0, 30.0, flags=False)) is None
    # The threshold: bf16 below half the fp32 rate (it moves half the bytes) is slow.
    assert cpu.bf16_is_slow(14.9, 30.0) and not cpu.bf16_is_slow(15.0, 30.0)


def test_a_real_measurement_is_positive_recorded_and_cached():
    speed = cpu.measure()
    assert speed.fp32_gflops > 0 and speed.bf16_gflops > 0 and speed.cpu_model
    assert cpu.measure() is speed  # once per process
    rec = cpu.bench_record("bfloat16")
    assert rec["dtype"] == "bfloat16" and rec["bf16_fp32_ratio"] > 0
    assert set(rec) >= {"cpu_model", "avx512_bf16", "amx_bf16", "fp32_gflops", "bf16_gflops", "bf16_slow"}
    assert json.loads(json.dumps(rec)) == rec
    assert cpu.bench_line(rec).startswith(f"CPU {speed.cpu_model} (avx512_bf16 ")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is x86 only")
def test_emulated_bf16_on_this_machine_is_measured_as_emulated():
    """oneDNN limited to AVX2 (what an AVX2-only CPU has) emulates bf16 here too: 1-2 GFLOP/s against tens of
    GFLOP/s in fp32, a ratio ~0.01 far below the 0.5 threshold (the only timing-based assertion, with a margin of
    about 50x)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = "import json; from shardtune.runtime.cpu import measure; print(json.dumps(measure().record()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    rec = json.loads(out.stdout)
    assert rec["bf16_slow"] and rec["bf16_fp32_ratio"] < cpu.SLOW_RATIO


def test_only_a_cpu_run_in_bf16_is_checked(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "measure", lambda: calls.append(1) or _speed(1.5, 30.0, flags=False))
    assert cpu.bf16_check("cuda", True) is None and cpu.bf16_check("cpu", False) is None and not calls
    assert cpu.bf16_check("cpu", True).startswith("bf16 is emulated on this CPU") and calls == [1]
