"""Is bf16 fast on this CPU? A measured check, done once per process.

CPUs with AVX512-BF16 or AMX multiply bf16 matrices natively (faster than fp32); AVX2-only CPUs (many AMD EPYC
and older Intel parts) emulate them, some 20-60× slower than fp32, so a CPU run with --bf16 True (or
`mixed_precision: bf16` in the accelerate YAML, as in the guide's GPU file) would crawl without a word. The
ISA flags alone do not settle it (oneDNN may be limited by ONEDNN_MAX_CPU_ISA, a build may lack the kernels),
so the check times a small bf16 and fp32 matrix product a few times (a few ms with native bf16, about 100 ms
emulated) and compares the best rates.
"""

from __future__ import annotations

import functools
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# The product timed: small enough for ~50 ms when bf16 is emulated (~0.5 GFLOP/s), big enough to be
# compute-bound on one core (2·128·256·256 = 16.8 MFLOP, 2·(128·256 + 256·256 + 128·256) values moved).
SHAPE = (128, 256, 256)
# bf16 moves half the bytes of fp32; a bf16 product slower than half the fp32 rate costs more than that can
# save, so below this ratio bf16 is reported as slow. (Native bf16 runs at 1-30× fp32, emulated at 1/20-1/60:
# the threshold sits far from both.)
SLOW_RATIO = 0.5
_ROUNDS = 5  # timings per dtype; the best counts


@dataclass(frozen=True)
class MatmulSpeed:
    """Measured GFLOP/s of a SHAPE product in bf16 and fp32 on this CPU, with what the CPU says it has."""

    cpu_model: str
    avx512_bf16: bool
    amx_bf16: bool
    fp32_gflops: float
    bf16_gflops: float

    @property
    def bf16_ratio(self) -> float:
        return self.bf16_gflops / self.fp32_gflops

    @property
    def bf16_slow(self) -> bool:
        return bf16_is_slow(self.bf16_gflops, self.fp32_gflops)

    def record(self) -> dict:
        """For benchmark results: the CPU, its bf16 flags and the measured rates."""
        return {**asdict(self), "bf16_fp32_ratio": round(self.bf16_ratio, 4), "bf16_slow": self.bf16_slow}


def bf16_is_slow(bf16_gflops: float, fp32_gflops: float) -> bool:
    return bf16_gflops < SLOW_RATIO * fp32_gflops


def _cpu_flags() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (Linux); elsewhere platform's name, no flags."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (x.strip() for x in line.partition(":"))
            if key == "model name" and not model:
                model = value
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the measurement still decides
        pass
    return model or platform.processor() or platform.machine(), flags


def _rates(rounds: int = _ROUNDS) -> tuple[float, float]:
    """GFLOP/s of the SHAPE product in fp32 and bf16: the best of `rounds` timings of one product each,
    alternating the dtypes. Other processes can only slow a timing down, so the best one is the kernel's rate."""
    m, k, n = SHAPE
    a32, b32 = torch.randn(m, k), torch.randn(k, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    a32 @ b32, a16 @ b16  # first calls: oneDNN builds its kernels
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, (x, y) in enumerate(((a32, b32), (a16, b16))):
            start = time.perf_counter()
            x @ y
            best[i] = min(best[i], time.perf_counter() - start)
    flop = 2 * m * k * n
    return flop / best[0] / 1e9, flop / best[1] / 1e9


@functools.lru_cache(maxsize=1)
def measure() -> MatmulSpeed:
    """Time the bf16 and fp32 products (once per process; later calls return the first result)."""
    model, flags = _cpu_flags()
    # One thread: the kernels' rates per core, which decide the ratio, free of thread start-up and of other
    # processes sharing the cores (ranks on one machine measure at the same time).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = _rates()
    finally:
        torch.set_num_threads(threads)
    return MatmulSpeed(
        cpu_model=model,
        avx512_bf16="avx512_bf16" in flags,
        amx_bf16="amx_bf16" in flags,
        fp32_gflops=fp32,
        bf16_gflops=bf16,
    )


def bf16_warning(speed: MatmulSpeed) -> str | None:
    """The warning for a CPU run in bf16 on a CPU where bf16 is slow (None where it is not)."""
    if not speed.bf16_slow:
        return None
    isa = "no avx512_bf16 or amx_bf16" if not (speed.avx512_bf16 or speed.amx_bf16) else "bf16 kernels not used"
    return (
        f"bf16 is emulated on this CPU ({speed.cpu_model}; {isa}): a bf16 matrix product ran at "
        f"{speed.bf16_gflops:.1f} GFLOP/s against {speed.fp32_gflops:.1f} GFLOP/s in fp32, so its matrix products run up to "
        f"{1 / speed.bf16_ratio:.0f}x slower than in fp32. On this CPU pass --bf16 False (or set "
        "mixed_precision: 'no' in the accelerate YAML)."
    )


def bf16_check(device_type: str, bf16: bool) -> str | None:
    """The warning for a run on `device_type` in bf16 or not: measured (once) only for a CPU run in bf16."""
    if device_type != "cpu" or not bf16:
        return None
    return bf16_warning(measure())


def bench_record(dtype: str) -> dict:
    """What a benchmark records about the case it ran in: the CPU, its bf16 flags, the measured bf16 and fp32
    rates and their ratio, and the dtype it ran in."""
    return {"dtype": dtype, **measure().record()}


def bench_line(record: dict) -> str:
    """bench_record as one line for a benchmark's printed table."""
    emulated = ", bf16 emulated" if record["bf16_slow"] else ""
    return (
        f"CPU {record['cpu_model']} (avx512_bf16 {record['avx512_bf16']}, amx_bf16 {record['amx_bf16']}): bf16 "
        f"{record['bf16_gflops']:.1f} vs fp32 {record['fp32_gflops']:.1f} GFLOP/s "
        f"({record['bf16_fp32_ratio']:.2f}x{emulated}); ran in {record['dtype']}"
    )
