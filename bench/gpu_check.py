"""The device check: one command that runs shardtune's CUDA paths on a random ~1B-parameter Llama and reports one
table (and JSON). Each check runs in its own subprocess, so one failure does not stop the others.

    python bench/gpu_check.py                       # CUDA: builds the model locally; at most ~8 minutes on one H200
    python bench/gpu_check.py --device cpu --tiny   # the same checks on the CPU with a tiny model (the tests run it)
    python bench/gpu_check.py --only lora_world1,kill_resume

Checks (docs/gpu.md says what each proves):
  lora_world1, lora_world2  LoRA, bf16, gradient checkpointing on FSDP2 (NCCL on CUDA, gloo on CPU), 1 and 2 ranks:
                            the loss falls; tokens/s; MFU (model FLOPs) and HFU (recompute included) against the
                            bf16 matmul peak measured in the same run. 2 ranks need 2 GPUs (NCCL allows one rank
                            per GPU).
  attention                 per-document SDPA (shardtune's fast path) vs transformers' SDPA with the packed mask vs
                            flash-attention 2 varlen (where installed): equal losses, forward+backward times.
  qlora                     4-bit base on FSDP2: its loss equals a bf16 model holding the dequantized weights;
                            memory per rank.
  offload_loading           the guide's QLoRA YAML (fsdp_offload_params + cpu_ram_efficient_loading): trains, saves,
                            resumes exactly.
  bnb_optimizers            adamw_8bit and paged_adamw_8bit: save and exact resume.
  kill_resume               SIGKILL after a step, resume from the last checkpoint: the same losses and adapter, bit
                            for bit (RNG states, the CUDA one included, restored).
  memory_vs_plan            torch.cuda.max_memory_allocated / reserved of a run against `shardtune plan` (CUDA only).
  reference_stack           TRL SFTTrainer + PEFT on the same model and data: tokens/s ratio (where trl is installed).
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import speed
from gpu_checks import CHECKS, NEEDS_CUDA, RUN, SIZES, Skip, build_assets

# --------------------------------------------------------------------------------------------- the parent


def run_check(name: str, ctx_path: Path, timeout_s: float) -> dict:
    """Run one check in a fresh interpreter; a crash, a non-zero exit or a timeout is that check's failure."""
    result = ctx_path.parent / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_check", name, "--_ctx", str(ctx_path)]
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, timeout_s), check=False)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        return {"status": "fail", "reason": f"timed out after {timeout_s:.0f} s", "seconds": timeout_s}
    out = json.loads(result.read_text()) if result.exists() else {"status": "fail", "reason": f"exit {proc.returncode}"}
    if out["status"] == "fail":
        out["log_tail"] = tail
    return {**out, "seconds": time.perf_counter() - t0, "cpu_s": _children_cpu_s() - cpu0}


def _children_cpu_s() -> float:
    """CPU seconds of the finished child processes (their children included): the check's cost on a busy machine."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def check_main(name: str, ctx_path: str) -> int:
    """Inside the check's process: run it and write {status, reason | results} next to the context file."""
    ctx = json.loads(Path(ctx_path).read_text())
    if ctx["device"] == "cpu":
        import torch

        torch.set_num_threads(ctx["threads"])
    try:
        out = {"status": "ok", **RUN[name](ctx)}
    except Skip as e:
        out = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - reported in the table; the other checks go on
        out = {"status": "fail", "reason": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()}
    out["status"] = "fail" if out["status"] == "ok" and _failed(name, out) else out["status"]
    Path(ctx_path).parent.joinpath(f"{name}.json").write_text(json.dumps(out, indent=1))
    return 0


def _failed(name: str, r: dict) -> bool:
    """A check whose numbers contradict what it proves fails, even though it ran."""
    if name.startswith("lora_world"):
        return not r["loss_falls"] or not r["hfu"] >= r["mfu"] > 0
    if name == "attention":
        return not r["losses_equal"]
    if name == "qlora":
        return not r["loss_equal"]
    if name in ("offload_loading", "kill_resume"):
        return not r["resume_equal"]
    if name == "bnb_optimizers":
        return not all(v["resume_equal"] for v in r["optimizers"].values())
    return False


def _summary(name: str, r: dict) -> str:
    """One line of numbers per check for the table."""
    if r["status"] != "ok":
        return r.get("reason", "")[:110]
    pct = lambda x: f"{100 * x:.1f}%"
    if name.startswith("lora_world"):
        return (f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {r['tokens_per_s']:.0f} tok/s, "
                f"MFU {pct(r['mfu'])}, HFU {pct(r['hfu'])}")  # fmt: skip
    if name == "attention":
        return ", ".join(f"{k} {v['loss']:.4f} in {1e3 * v['seconds']:.1f} ms" for k, v in r["variants"].items())
    if name == "qlora":
        mem = f", {r['memory_gb_per_rank']:.2f} GiB/rank" if r["memory_gb_per_rank"] is not None else ""
        return f"loss {r['loss']:.4f} vs dequantized bf16 {r['reference_loss']:.4f}{mem}"
    if name in ("offload_loading", "kill_resume"):
        return f"resumed steps 3-4 and adapter identical: {r['resume_equal']}" + "".join(
            f"; {n}" for n in r.get("notes", [])
        )
    if name == "bnb_optimizers":
        return ", ".join(f"{k}: exact resume {v['resume_equal']}" for k, v in r["optimizers"].items())
    if name == "memory_vs_plan":
        m = r["measured_gib"]
        return (f"measured/plan: allocated {m['allocated']:.2f} GiB {r['allocated_over_plan']:.2f}x, reserved "
                f"{m['reserved']:.2f} GiB {r['reserved_over_plan']:.2f}x, weights {r['weights_over_plan']:.2f}x")  # fmt: skip
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
    ap.add_argument("--only", default=",".join(CHECKS), help="Comma-separated checks, in this order.")
    ap.add_argument("--budget_s", type=float, default=480, help="Checks not started within this many seconds "
                    "of the start are reported as skipped (default 480: 8 minutes).")  # fmt: skip
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "shardtune-gpu-check"), help="Assets.")
    ap.add_argument("--out", help="JSON output (default bench/results/gpu_check[-cpu]-<date>.json).")
    ap.add_argument("--_check", help=argparse.SUPPRESS)
    ap.add_argument("--_ctx", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _context(a: argparse.Namespace, workdir: Path) -> dict:
    """What every check needs: assets, sizes, the FLOP model and the bf16 matmul peak of this machine."""
    import torch
    from transformers import AutoConfig

    from shardtune.modeling import load_tokenizer

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
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "flash_attn", "trl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a._check:
        return check_main(a._check, a._ctx)
    unknown = [c for c in a.only.split(",") if c and c not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}.", file=sys.stderr)
        return 2
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run `python bench/gpu_check.py --device cpu --tiny`.", file=sys.stderr)
        return 2
    t0 = time.monotonic()
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
        "size": ctx["size"],
        "flop_model": ctx["flop_model"],
        "setup_s": time.monotonic() - t0,
        "matmul_peak_flops": ctx["peak_flops"],
        "checks": {},
    }
    for name in [c for c in CHECKS if c in a.only.split(",")]:
        left = a.budget_s - (time.monotonic() - t0)
        if left < 5:
            report["checks"][name] = {"status": "skipped", "reason": f"time budget of {a.budget_s:.0f} s spent"}
        elif name in NEEDS_CUDA and a.device != "cuda":
            report["checks"][name] = {"status": "skipped", "reason": "needs CUDA"}
        else:
            print(f"gpu_check: {name} ...", flush=True)
            report["checks"][name] = run_check(name, ctx_path, left)
    ref, own = report["checks"].get("reference_stack", {}), report["checks"].get("lora_world1", {})
    if ref.get("status") == "ok" and own.get("status") == "ok":
        ref["ratio"] = own["tokens_per_s"] / ref["tokens_per_s"]
    report["total_s"] = time.monotonic() - t0
    report["table"] = format_table(report)
    print(report["table"])
    date = datetime.date.today().isoformat()
    out = (
        Path(a.out)
        if a.out
        else REPO / "bench" / "results" / f"gpu_check{'-cpu' if a.device == 'cpu' else ''}-{date}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out} ({report['total_s']:.0f} s)")
    return 1 if any(r["status"] == "fail" for r in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
