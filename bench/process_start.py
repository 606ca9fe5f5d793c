"""What a fresh process of the device check costs before it does any work: a new interpreter that starts as each
check's process starts (bench/gpu_check.py's own imports, `shardtune.cli.prepare_process`, torch, transformers,
peft and shardtune's training stack) and, on CUDA, starts CUDA. Timed from outside, N times in a row; the median
and the largest are reported. bench/gpu_check.py measures it at the start of its run and sizes the checks' budgets
with the largest (docs/gpu.md, "The budget").

    python bench/process_start.py                  # 5 runs on the CPU
    python bench/process_start.py --device cuda    # CUDA's start included
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import speed  # bench/speed.py: the CPU's name, as the other benches report it

RUNS = 5
# The start of a check's process (bench/gpu_check.py check_main), then the imports its runs make, then CUDA's start
# (what a check's first CUDA work pays once): each part timed inside, the whole from outside.
START = f"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {str(BENCH)!r})
import gpu_check  # bench's speed, gpu_checks and gpu_numerics: torch and shardtune's objectives
from shardtune import cli
from shardtune.config import cuda_allocator
cli.prepare_process()
import peft, torch, transformers
import shardtune.commands.train  # the training stack every training check runs
t1 = time.perf_counter()
cuda_start_s = None
if sys.argv[1] == "cuda":
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    cuda_start_s = time.perf_counter() - t1
print(json.dumps({{"imports_s": t1 - t0, "cuda_start_s": cuda_start_s}}))
"""


def start_once(device: str, timeout_s: float) -> dict:
    """One fresh process: its wall time from start to exit, and the parts it timed itself (None if it was killed at
    `timeout_s`; its process group is killed then, as a timed-out check's)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", START, device], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=None if timeout_s == float("inf") else max(0.1, timeout_s))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"seconds": time.perf_counter() - t0, "timed_out": True}
    if proc.returncode != 0:
        raise RuntimeError(f"the process-start measurement exited {proc.returncode}:\n{err[-2000:]}")
    return {"seconds": time.perf_counter() - t0, **json.loads(out.strip().splitlines()[-1])}


def measure(device: str, runs: int = RUNS, cap_s: float = float("inf")) -> dict:
    """`runs` fresh processes one after the other, within `cap_s` seconds in all: a run still going at the cap is
    killed and counts as the time it had taken (a lower bound, marked `timed_out`); none is started after it."""
    t0, got = time.perf_counter(), []
    while len(got) < runs and not any(r.get("timed_out") for r in got):
        left = cap_s - (time.perf_counter() - t0)
        if left <= 0:
            break
        got.append(start_once(device, left))
    seconds = [r["seconds"] for r in got]
    return {
        "device": device,
        "runs": len(seconds),
        "seconds": seconds,
        "median_s": statistics.median(seconds) if seconds else None,
        "max_s": max(seconds) if seconds else None,
        "imports_s": [r.get("imports_s") for r in got],
        "cuda_start_s": [r.get("cuda_start_s") for r in got],
        "timed_out": any(r.get("timed_out") for r in got),
        "spent_s": time.perf_counter() - t0,
    }


def summary(m: dict) -> str:
    """One line: median and largest of the runs, and CUDA's part where it started."""
    if not m["runs"]:
        return "process start: not measured (no time was left to start a process)"
    runs = f"{m['runs']} fresh process" + ("es" if m["runs"] != 1 else "")
    line = f"process start: median {m['median_s']:.1f} s, max {m['max_s']:.1f} s over {runs}"
    cuda = [s for s in m["cuda_start_s"] if s is not None]
    if m["device"] == "cuda" and cuda:
        line += f" (CUDA's start {statistics.median(cuda):.1f} s of it, median)"
    return line + (" (the last killed at the cap: a lower bound)" if m["timed_out"] else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--out", help="Also write the measurement as JSON here.")
    a = ap.parse_args(argv)
    m = {**measure(a.device, a.runs), "cpu": speed._cpu_name(), "cores": os.cpu_count(),
         "load_average_1m": os.getloadavg()[0]}  # fmt: skip
    print(summary(m) + f"; {m['cpu']}, {m['cores']} cores, load {m['load_average_1m']:.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(m, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
