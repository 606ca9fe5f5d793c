"""The device check: one command that runs shardtune's CUDA paths on a random ~1B-parameter Llama and reports one
table (and JSON). Each check runs in its own subprocess, so one failure does not stop the others.

    python bench/gpu_check.py                       # CUDA: builds the model locally; 290 s at most on one H200
    python bench/gpu_check.py --device cpu --tiny   # the same checks on the CPU with a tiny model (the tests run it)
    python bench/gpu_check.py --only lora_world1,kill_resume

The installed versions are checked against pyproject.toml's ranges first; one out of range stops the run.
Checks, in this order (docs/gpu.md says what each proves; each has a budget, `budgets` below, sized by the start of a
fresh process, which the run measures after its setup: bench/process_start.py):
  lora_world1               the guide's LoRA run (bf16, gradient checkpointing, FSDP2) on one rank: the loss falls;
                            tokens/s, MFU and HFU against the bf16 matmul peak measured in the same run.
  memory_vs_plan            max_memory_allocated / reserved of a run against `shardtune plan` and the allocator
                            replay, under the allocator setting shardtune's commands use (CUDA only).
  attention                 per-document SDPA (and flash-attention 2 varlen, where installed) against SDPA with the
                            packed mask: logits element by element; a planted cross-document leak must fail.
  qlora                     the 4-bit base on FSDP2 against bf16 holding its dequantized weights: logits element by
                            element; a planted wrong dequantization scale must fail.
  kill_resume               SIGKILL after a step, resume: the same losses and adapter bit for bit, on deterministic
                            kernels.
  bnb_optimizers            paged_adamw_8bit: save and exact resume.
  lora_world2               lora_world1 on 2 ranks (NCCL needs 2 GPUs; gloo on the CPU).
  offload_loading, reference_stack (only when named in --only): the guide's QLoRA offload YAML resumes exactly;
                            TRL SFTTrainer + PEFT's tokens/s against lora_world1's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

START = time.monotonic()  # the budget counts from here: the imports are part of the run
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import process_start
import speed
from gpu_checks import CHECKS, GPUS, NEEDS_CUDA, OPT_IN, RUN, SIZES, Skip, build_assets
from gpu_numerics import read_partial

# ------------------------------------------------------------------------------------------------ the budget

# Seconds each check may take on one H200 with the 1B model: its timeout there, and a check is started only when its
# budget fits in what is left of the run's. Each budget is its estimate plus 25%, rounded up to 5 s. One term is
# measured by the run itself: the start of a fresh process (`p`: its imports, `shardtune.cli.prepare_process` and
# CUDA's start), the largest of --process_start_runs fresh processes timed after the setup (bench/process_start.py).
# The other terms are a stated model, not a GPU measurement (none exists yet): reading the 2.2 GB checkpoint LOAD_S,
# a training step of 8 rows of 2048 tokens ~6·1.1e9·16384 ≈ 1.1e14 FLOPs, STEP_S at 35% of the ~790 TFLOP/s bf16
# peak; `shardtune plan --trace` of this model measured at 34 CPU-seconds on a 2-core EPYC (TRACE_S). PROCESS_S is
# the start as modelled before a run has measured it: it sizes the measurement's own budget and the budgets
# docs/gpu.md tabulates (the CPU start measured on a busy 2-core Xeon is in docs/gpu.md, "The budget").
PROCESS_S, LOAD_S, STEP_S, TRACE_S = 10.0, 3.0, 0.4, 34.0


def estimates(p: float) -> dict[str, float]:
    """Each part's estimated seconds on one H200 when a fresh process takes `p` seconds to start."""
    return {
        # its own start; the 1B model drawn and written 11, data 2, numerics model 1, matmul peak 5, tokenizer 2
        "setup": p + 21,
        "lora_world1": p + LOAD_S + 5 + 11 * STEP_S + 3,  # tokenizing once (5), 11 steps, NCCL's start (3)
        "memory_vs_plan": p + LOAD_S + 3 * STEP_S + 2 + p + TRACE_S,  # 3 steps, plan, the trace
        "attention": p + 2 + 8 * 0.25,  # 2 loads of the 2-layer model, logits, 4 timed steps each
        "context_parallel": p + 2,  # attention only, on an 8192-position row
        "qlora": p + LOAD_S + 2,  # 2 layers quantized and sharded, the reference, 14 layers dequantized
        # 3 runs of 4 steps of 4 rows of 512 tokens with 2 checkpoints: 2 in this process, 1 (SIGKILLed) in its own
        "kill_resume": p + 3 * (LOAD_S + 3) + p,
        "bnb_optimizers": p + 2 * (LOAD_S + 3),  # one 8-bit optimizer, 2 runs in this process
        "lora_world2": p + 2 * p + LOAD_S + 11 * STEP_S,  # not started on one GPU
        "offload_loading": 3 * (2 * p + 2 * LOAD_S + 4 * STEP_S),  # opt-in: host-memory loading, 3 runs
        "reference_stack": p + 4 * LOAD_S + 11 * 1.0 + 30,  # opt-in: fp32 base, TRL's start
    }


def _budget(seconds: float) -> int:
    """An estimate plus 25%, rounded up to 5 s."""
    return int(5 * -(-1.25 * seconds // 5))


def budgets(p: float) -> dict[str, int]:
    """Each check's budget (and the setup's, reported only) when a fresh process takes `p` seconds to start."""
    return {k: _budget(v) for k, v in estimates(p).items()}


BUDGET_S = budgets(PROCESS_S)  # before a run has measured the start (docs/gpu.md's table)
# The whole check on one H200, from its start: with <= 30 s to install the carried wheels, a device command of at
# most 320 s (timeout_s), so that two of them (a rerun) and two machine starts of up to 2 minutes each fit a 15-minute
# device budget: 2 x 320 + 2 x 120 = 880 <= 900 s.
DEVICE_BUDGET_S = 290

# --------------------------------------------------------------------------------------------- the parent


def run_check(name: str, ctx_path: Path, timeout_s: float) -> dict:
    """Run one check in a fresh interpreter, in its own session (process group); a crash, a non-zero exit or a
    timeout is that check's failure. At the timeout the whole group is killed (and any descendant that left it), and
    what the check recorded so far (gpu_numerics.record: JSON lines flushed per measurement) is kept."""
    result, partial = ctx_path.parent / f"{name}.json", ctx_path.parent / f"{name}.partial.jsonl"
    result.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_check", name, "--_ctx", str(ctx_path)]
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        tail = proc.communicate(timeout=max(1, timeout_s))[0][-3000:]
    except subprocess.TimeoutExpired:
        killed = kill_tree(proc)
        out = {"status": "fail", "reason": f"timed out after {timeout_s:.0f} s", "seconds": timeout_s,
               "killed_pids": killed}  # fmt: skip
        return {**out, **({"partial": read_partial(partial)} if partial.exists() else {})}
    out = json.loads(result.read_text()) if result.exists() else {"status": "fail", "reason": f"exit {proc.returncode}"}
    if out["status"] == "fail":
        out["log_tail"] = tail
        if partial.exists() and "partial" not in out:
            out["partial"] = read_partial(partial)
    return {**out, "seconds": time.perf_counter() - t0, "cpu_s": _children_cpu_s() - cpu0}


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the check's process group and every descendant found (one that started a session of its own too),
    then reap the check; returns the pids killed."""
    import signal

    import psutil

    try:
        tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = [proc.pid]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group's id is the check's pid
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()
    psutil.wait_procs([p for p in map(_proc, tree[1:]) if p], timeout=5)  # reparented: gone or zombies
    return tree


def _proc(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _children_cpu_s() -> float:
    """CPU seconds of the finished child processes (their children included): the check's cost on a busy machine."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def check_main(name: str, ctx_path: str) -> int:
    """Inside the check's process: run it and write {status, reason | results} next to the context file."""
    from shardtune import cli
    from shardtune.config import cuda_allocator

    cli.prepare_process()  # before any CUDA work: the allocator setting of shardtune's commands (shardtune.cli)
    ctx = json.loads(Path(ctx_path).read_text())
    ctx["partial_path"] = str(Path(ctx_path).parent / f"{name}.partial.jsonl")
    if ctx["device"] == "cpu":
        import torch

        torch.set_num_threads(ctx["threads"])
    try:
        out = {"status": "ok", **RUN[name](ctx)}
    except Skip as e:
        out = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - reported in the table; the other checks go on
        out = {"status": "fail", "reason": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc(),
               "partial": read_partial(ctx["partial_path"])}  # fmt: skip
    out["allocator"] = cuda_allocator.describe()
    out["status"] = "fail" if out["status"] == "ok" and _failed(name, out) else out["status"]
    Path(ctx_path).parent.joinpath(f"{name}.json").write_text(json.dumps(out, indent=1))
    return 0


def _failed(name: str, r: dict) -> bool:
    """A check whose numbers contradict what it proves fails, even though it ran."""
    if name.startswith("lora_world"):  # lora_world1 must have run FSDP2 (SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp)
        return not r["loss_falls"] or not r["hfu"] >= r["mfu"] > 0 or not r.get("fsdp")
    if name == "attention":  # a control that passes means the comparison cannot see a leak
        return not r["logits_equal"] or not r["control"]["failed"]
    if name in ("qlora", "context_parallel"):
        return not r["equal"] or not r["control"]["failed"]
    if name in ("offload_loading", "kill_resume"):  # the control: a one-ulp change must be seen
        return not r["resume_equal"] or not r["control"]["failed"]
    if name == "memory_vs_plan":  # the plan estimated another allocator setting, or FSDP, than the run had
        if "trace_error" in r or "plan_error" in r:  # the measurements stay in the result
            return True
        return r["plan_expandable_segments"] != r["expandable_segments"] or (
            r["plan_fsdp"] and r["single_process_setting"] == "auto"
        )
    if name == "bnb_optimizers":
        return not all(v["resume_equal"] and v["control"]["failed"] for v in r["optimizers"].values())
    return False


def _summary(name: str, r: dict) -> str:
    """One line of numbers per check for the table."""
    # a failure without a reason ran: its numbers say what failed (a timed-out one keeps its record in "partial")
    if r["status"] == "skipped" or "reason" in r:
        return r.get("reason", "")[:110]
    pct = lambda x: f"{100 * x:.1f}%"
    if name.startswith("lora_world"):
        return (f"{'FSDP2' if r.get('fsdp') else 'NOT FSDP'}, loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {r['tokens_per_s']:.0f} tok/s, "
                f"MFU {pct(r['mfu'])}, HFU {pct(r['hfu'])}")  # fmt: skip
    ctl = lambda c: f"control {'failed' if c['failed'] else 'PASSED'} ({c['over_tol']:.1f}x tol)"
    if name == "attention":
        times = ", ".join(f"{k} {1e3 * v['seconds']:.1f} ms" for k, v in r["variants"].items())
        worst = max(v.get("over_tol", 0) for v in r["variants"].values())
        return f"logits max {worst:.2f}x tol; {ctl(r['control'])}; fwd+bwd {times}"
    if name == "qlora":
        return f"logits {r['over_tol']:.2f}x tol; {ctl(r['control'])}; {r['packed_mib_per_rank']:.2f} MiB packed"
    if name == "context_parallel":
        worst = max(v["over_tol"] for v in r["sizes"].values())
        kernels = "SDPA and flash varlen" if "skipped" not in r["flash_varlen"] else "SDPA (no flash_attn)"
        return f"attention max {worst:.2f}x tol at cp 2 and 4, {kernels}; {ctl(r['control'])}"
    if name == "kill_resume" and r.get("nondeterministic_ops"):
        return f"identical: {r['resume_equal']}; ops without a deterministic kernel: {len(r['nondeterministic_ops'])}"
    if name in ("offload_loading", "kill_resume"):
        return f"resumed steps 3-4 and adapter identical: {r['resume_equal']}" + "".join(
            f"; {n}" for n in r.get("notes", [])
        )
    if name == "bnb_optimizers":
        return ", ".join(f"{k}: exact resume {v['resume_equal']}" for k, v in r["optimizers"].items())
    if name == "memory_vs_plan" and ("trace_error" in r or "plan_error" in r):
        m = r["measured_gib"]
        return f"measured allocated {m['allocated']:.2f} GiB, reserved {m['reserved']:.2f} GiB; " + (
            r.get("plan_error") or "trace failed: " + r["trace_error"][:60]
        )
    if name == "memory_vs_plan":
        m = r["measured_gib"]
        return (f"measured/plan: allocated {m['allocated']:.2f} GiB {r['allocated_over_plan']:.2f}x, reserved "
                f"{m['reserved']:.2f} GiB {r['reserved_over_plan']:.2f}x, weights {r['weights_over_plan']:.2f}x"
                f"{'' if r['plan_fsdp'] else ', one process without FSDP'}")  # fmt: skip
    if name == "reference_stack":
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "- (lora_world1 did not run)"
        return f"{r['tokens_per_s']:.0f} tok/s, shardtune/reference {ratio}"
    return ""


def format_table(report: dict) -> str:
    lines = [f"{'check':<17}{'status':<9}{'s':>6}  result", "-" * 110]
    for name, r in report["checks"].items():
        lines.append(f"{name:<17}{r['status']:<9}{r.get('seconds', 0):>6.0f}  {_summary(name, r)}")
    p = report["matmul_peak_flops"]
    lines.append(f"bf16 matmul peak: {p / 1e12:.1f} TFLOP/s ({report['device_name']}); MFU: model FLOPs, "
                 "HFU: recompute included, both against this peak")  # fmt: skip
    return "\n".join(lines)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="Where to run (default cuda).")
    ap.add_argument("--tiny", action="store_true", help="A tiny model and short runs (for the CPU).")
    ap.add_argument("--only", help=f"Comma-separated checks, run in the order {','.join(CHECKS)} (default: all but "
                    f"{', '.join(sorted(OPT_IN))}).")  # fmt: skip
    ap.add_argument("--budget_s", type=float, help=f"A check whose budget does not fit in what is left of this many "
                    f"seconds is skipped (default {DEVICE_BUDGET_S} on CUDA; none on the CPU).")  # fmt: skip
    ap.add_argument("--process_start_runs", type=_positive, default=process_start.RUNS, help="Fresh processes "
                    "timed after the setup; the checks' budgets use the slowest (default %(default)s).")  # fmt: skip
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "shardtune-gpu-check"), help="Assets.")
    ap.add_argument("--out", help="JSON output (default bench/results/gpu_check[-cpu]-<date>.json).")
    ap.add_argument("--_check", help=argparse.SUPPRESS)
    ap.add_argument("--_ctx", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError("at least 1: the budgets use the measured start")
    return int(text)


def _context(a: argparse.Namespace, workdir: Path) -> dict:
    """What every check needs: assets, sizes, the FLOP model and the bf16 matmul peak of this machine."""
    import torch
    from transformers import AutoConfig

    from shardtune.models.loading import load_tokenizer

    size = SIZES["tiny" if a.tiny else "1b"]
    assets = build_assets(workdir, size)
    tok, _ = load_tokenizer(assets["model"], tokenizer_name_or_path=None, chat_template_format="chatml",
                            trust_remote_code=False)  # fmt: skip
    vocab_rows = -(-len(tok) // 8) * 8
    # CPU threads per run: 1 for the tiny model (too small to gain from more, and OpenMP threads that wait for a
    # descheduled peer make a busy machine far slower), all cores for the 1B one on the CPU, 8 beside a GPU.
    threads = 1 if a.tiny else (os.cpu_count() or 1) if a.device == "cpu" else min(8, os.cpu_count() or 1)
    shapes = speed.peak_shapes(Path(assets["model"]), size.batch * size.seq_len, a.device)
    if a.tiny:  # squares of 1024 and 2048 already reach a CPU's peak, in a fraction of the time
        shapes = [(n, n, n) for n in (1024, 2048)] + shapes[-1:]
    return {
        **assets,
        "device": a.device,
        "size": asdict(size),
        "workdir": str(workdir),
        "cache": str(workdir / "cache"),
        "threads": threads,
        "pad_id": tok.pad_token_id,
        "vocab_rows": vocab_rows,
        "base_vocab": AutoConfig.from_pretrained(assets["model"]).vocab_size,
        "flop_model": asdict(speed.flop_model(Path(assets["model"]), 8, vocab_rows)),
        "peak_flops": speed.matmul_peak("bfloat16", threads, a.device, shapes),
        "device_name": torch.cuda.get_device_name() if a.device == "cuda" else speed._cpu_name(),
        "parent_device_bytes": _own_device_bytes(a.device),
    }


def _own_device_bytes(device: str) -> int:
    """What this process (its CUDA context, after the matmul peak's blocks are released) holds on the device while
    the checks run: memory_vs_plan leaves it out of the memory it finds outside its own allocator."""
    if device != "cuda":
        return 0
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "flash_attn", "trl"):
        out[name] = _installed(name)
    return out


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def version_problems(installed=None) -> list[str]:
    """Each package out of pyproject.toml's range: the project's dependencies must be installed and in range; the
    optional ones the checks use (the extras qlora and bench: bitsandbytes, trl, accelerate) in range where
    installed (their checks say they skip where not)."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [(Requirement(r), True) for r in project["dependencies"]]
    wanted += [(Requirement(r), False) for r in extras["qlora"] + extras["bench"]]
    problems = []
    for req, required in wanted:
        got = (installed or _installed)(req.name)
        if got is None:
            problems += [f"{req.name} is not installed (needs {req.specifier})"] if required else []
        elif not req.specifier.contains(Version(got), prereleases=True):
            problems.append(f"{req.name} {got} is out of range (needs {req.specifier})")
    return problems


def _selected(a: argparse.Namespace) -> tuple[list[str], set[str]]:
    """The checks to report, in CHECKS' order, and those of them that are not run by default."""
    if a.only is None:
        return list(CHECKS), set(OPT_IN)
    return [c for c in CHECKS if c in a.only.split(",")], set()


def _run_all(a: argparse.Namespace, names: list[str], not_default: set[str], ctx_path: Path, t0: float,
             budget_s: dict[str, int]) -> dict:  # fmt: skip
    """Each check in its own process, started only when its budget (on CUDA; from the measured process start) fits
    in what is left of the run's."""
    import torch

    gpus, out = torch.cuda.device_count() if a.device == "cuda" else 0, {}
    for name in names:
        left = _left(a, t0)
        budget = budget_s[name] if a.device == "cuda" else 600  # the CPU is not held to the device's budgets
        if name in not_default:
            out[name] = {"status": "skipped", "reason": "not in the default run (name it in --only)"}
        elif name in NEEDS_CUDA and a.device != "cuda":
            out[name] = {"status": "skipped", "reason": "needs CUDA"}
        elif a.device == "cuda" and GPUS.get(name, 1) > gpus:
            out[name] = {"status": "skipped", "reason": f"needs {GPUS[name]} GPUs: NCCL runs one rank per GPU "
                         f"({gpus} here)"}  # fmt: skip
        elif budget > left:
            out[name] = {"status": "skipped", "reason": f"its budget of {budget} s does not fit in the {max(0, left):.0f} "
                         f"s left of {a.budget_s:.0f} s"}  # fmt: skip
        else:
            print(f"gpu_check: {name} ...", flush=True)
            out[name] = {**run_check(name, ctx_path, budget), "budget_s": budget}
    return out


def _left(a: argparse.Namespace, t0: float) -> float:
    """Seconds left of --budget_s (none set: no limit)."""
    return a.budget_s - (time.monotonic() - t0) if a.budget_s else float("inf")


def measure_process_start(a: argparse.Namespace, t0: float) -> dict:
    """The start of a fresh check process on this machine (bench/process_start.py), measured once the setup is done
    (this process holds its CUDA context then, as while the checks run): --process_start_runs fresh processes, on CUDA
    within their own budget (modelled: PROCESS_S each) and what is left of --budget_s. The checks' budgets use the
    slowest (`used_s`: a check's timeout must not be met by a slow start); the median is reported beside it."""
    cap = _budget(a.process_start_runs * PROCESS_S)
    print(f"gpu_check: process start x{a.process_start_runs} ...", flush=True)
    try:
        m = process_start.measure(a.device, a.process_start_runs, min(cap, _left(a, t0)) if a.device == "cuda" else
                                  float("inf"))  # fmt: skip
    except RuntimeError as e:  # a fresh process that cannot start fails every check: they say why, each
        return {"error": str(e)[-2000:], "spent_s": 0.0, "budget_s": cap, "used_s": PROCESS_S, "used": "modelled"}
    # no run at all: nothing was left of --budget_s, and no check starts; the modelled start stands in
    used = m["max_s"] if m["max_s"] is not None else PROCESS_S
    return {**m, "budget_s": cap, "used_s": used, "used": "max_s" if m["max_s"] is not None else "modelled"}


def _budget_line(report: dict, device: str) -> str:
    b, ps = report["budget_s"], report["process_start"]
    used = {k: v["seconds"] for k, v in report["checks"].items() if "seconds" in v}
    parts = ", ".join(f"{k} {s:.0f}/{b[k]}" for k, s in used.items())
    held = "" if device == "cuda" else " (the device's budgets; a CPU run is not held to them)"
    start = process_start.summary(ps) if "error" not in ps else f"process start not measured: {ps['error'][-200:]}"
    return (f"budget: {report['total_s']:.0f} s used of {DEVICE_BUDGET_S}{held}: setup {report['setup_s']:.0f}/"
            f"{b['setup']}, process start {ps['spent_s']:.0f}/{ps['budget_s']}, {parts}\n{start}; the budgets use "
            f"{ps['used_s']:.1f} s per process (modelled before measuring: {PROCESS_S:.0f} s)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a._check:
        return check_main(a._check, a._ctx)
    if a.budget_s is None:
        a.budget_s = DEVICE_BUDGET_S if a.device == "cuda" else 0
    unknown = [c for c in (a.only or "").split(",") if c and c not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}.", file=sys.stderr)
        return 2
    problems = version_problems()
    if problems:  # before anything runs: a result under untested versions would say nothing about shardtune
        print(
            f"gpu_check: {'; '.join(problems)} (pyproject.toml); carry the wheels docs/gpu.md lists.", file=sys.stderr
        )
        return 2
    from shardtune import cli
    from shardtune.config import cuda_allocator

    cli.prepare_process()  # the setting the checks' processes inherit, before this one measures the matmul peak
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run `python bench/gpu_check.py --device cpu --tiny`.", file=sys.stderr)
        return 2
    t0 = START
    workdir = Path(a.workdir) / ("tiny" if a.tiny else "1b")
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = _context(a, workdir)
    ctx_path = workdir / "checks" / "context.json"
    ctx_path.parent.mkdir(exist_ok=True)
    ctx_path.write_text(json.dumps(ctx, indent=1))
    report = {
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": a.device,
        "device_name": ctx["device_name"],
        "versions": _versions(),
        "allocator": cuda_allocator.describe(),
        "size": ctx["size"],
        "flop_model": ctx["flop_model"],
        "setup_s": time.monotonic() - t0,
        "matmul_peak_flops": ctx["peak_flops"],
    }
    report["process_start"] = measure_process_start(a, t0)
    budget_s = budgets(report["process_start"]["used_s"])
    report["budget_s"] = {"device": DEVICE_BUDGET_S, **budget_s}
    report["budget_s_modelled"] = {"process_s": PROCESS_S, **BUDGET_S}
    report["checks"] = _run_all(a, *_selected(a), ctx_path, t0, budget_s)
    ref, own = report["checks"].get("reference_stack", {}), report["checks"].get("lora_world1", {})
    if ref.get("status") == "ok" and own.get("status") == "ok":
        ref["ratio"] = own["tokens_per_s"] / ref["tokens_per_s"]
    report["total_s"] = time.monotonic() - t0
    report["table"] = format_table(report) + "\n" + _budget_line(report, a.device)
    print(report["table"])
    date = datetime.date.today().isoformat()
    suffix = "-cpu" if a.device == "cpu" else ""
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"gpu_check{suffix}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out} ({report['total_s']:.0f} s)")
    return 1 if any(r["status"] == "fail" for r in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
