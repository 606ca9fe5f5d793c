"""Where one shardtune training step spends its time: torch.profiler's key_averages table of one optimizer step.

    python bench/profile_step.py                      # the speed benchmark's 25M model, bf16, 2 threads
    python bench/profile_step.py --shardtune_flags "--torch_compile True" --sort self_cpu_time_total
    python bench/profile_step.py --reference          # the same for TRL's SFTTrainer + PEFT

It runs `shardtune train` (or the reference stack) in this process exactly as bench/speed.py does, profiles the
optimizer step after the warm-up (from one step's start to the next), prints the table and writes it with a
short summary (time by operator family) to bench/results/speed_profile[-reference].txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # bench/ is not a package

# Operator families for the summary: the first pattern that a (lower-cased) operator name contains wins.
FAMILIES = [
    ("matmul", ("mm", "matmul", "linear", "addmm", "bmm", "baddbmm")),
    ("attention", ("attention", "sdpa", "flash")),
    ("dtype casts and copies", ("copy_", "to_copy", "_to_copy", "clone", "contiguous", "cat")),
    ("elementwise", ("mul", "add", "div", "pow", "rsqrt", "silu", "neg", "exp", "sigmoid", "mean", "sum", "where")),
    ("optimizer", ("adam", "foreach", "lerp", "sqrt")),
    ("collectives", ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "c10d", "gloo")),
]


class StepProfiler:
    """Starts torch.profiler at the start of step `at` and stops it at the start of the next step."""

    def __init__(self, at: int, record_shapes: bool = False):
        self.at, self.seen, self.prof, self.record_shapes = at, 0, None, record_shapes

    def on_step_start(self) -> None:
        import torch

        if self.seen == self.at:
            self.prof = torch.profiler.profile(activities=_activities(), record_shapes=self.record_shapes)
            self.prof.__enter__()
        elif self.seen == self.at + 1 and self.prof is not None:
            self.prof.__exit__(None, None, None)
        self.seen += 1


def _activities():
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def families(events, key: str) -> dict[str, float]:
    """Self time (ms) summed by operator family over the profiled step."""
    out: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        fam = next((f for f, pats in FAMILIES if any(p in name for p in pats)), "other")
        out[fam] = out.get(fam, 0.0) + getattr(e, key) / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _patch_recorder(profiler: StepProfiler) -> None:
    """Hook the profiler onto the benchmark's per-step recorder (the same step boundaries as bench/speed.py)."""
    original = speed.StepRecorder.step_start

    def step_start(self, batches):
        original(self, batches)
        profiler.on_step_start()

    speed.StepRecorder.step_start = step_start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="25m", choices=sorted(speed.MODELS))
    ap.add_argument("--reference", action="store_true", help="Profile TRL's SFTTrainer + PEFT instead.")
    ap.add_argument("--warmup", type=int, default=2, help="Steps before the profiled one.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--no_gradient_checkpointing", action="store_true")
    ap.add_argument("--shardtune_flags", default="")
    ap.add_argument("--by_shape", action="store_true", help="One row per operator and input shapes.")
    ap.add_argument("--rows", type=int, default=30, help="Rows of the table.")
    ap.add_argument("--sort", default=None, help="key_averages sort key (default: self time on the device).")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "shardtune-bench"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    from shardtune.models.loading import load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = speed.Settings(model=a.model, warmup=a.warmup, steps=1, threads=a.threads)
    s.bf16, s.gradient_checkpointing = not a.fp32, not a.no_gradient_checkpointing
    workdir = Path(a.workdir)
    assets = speed.build_assets(workdir, s.model, s.n_train)
    tok, _ = load_tokenizer(
        str(assets["model"]), tokenizer_name_or_path=None, chat_template_format="chatml", trust_remote_code=False
    )
    kind = "reference" if a.reference else "shardtune"
    spec = speed.worker_spec(
        speed.Contender(kind, kind, a.shardtune_flags.split()), s, assets, workdir, device, tok.pad_token_id
    )
    profiler = StepProfiler(at=s.warmup, record_shapes=a.by_shape)
    _patch_recorder(profiler)
    rec = (speed.run_reference_worker if a.reference else speed.run_shardtune_worker)(spec)
    step_s = rec["starts"][s.warmup + 1] - rec["starts"][s.warmup]
    # The profiled step is slower than an unprofiled one; the table's shares are what matter.
    events = profiler.prof.key_averages(group_by_input_shape=a.by_shape)
    time_key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=a.sort or time_key, row_limit=a.rows)
    fam = families(events, time_key)
    total = sum(fam.values())
    summary = "\n".join(f"  {k:<24}{v:>10.1f} ms {100 * v / total:>6.1f}%" for k, v in fam.items())
    head = (
        f"{'reference' if a.reference else 'shardtune'} {spec['flags']} model {a.model}, bf16={s.bf16}, "
        f"checkpointing={s.gradient_checkpointing}, {a.threads} thread(s), {rec['tokens'][s.warmup]} tokens; "
        f"profiled step {step_s:.2f} s\nself time by operator family:\n{summary}\n"
    )
    print(head + table)
    suffix = "-reference" if a.reference else ""
    out = Path(a.out) if a.out else speed.RESULTS / f"speed_profile{suffix}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + table + "\n")
    from shardtune.runtime.cpu import bench_line, bench_record

    cpu = bench_record("bfloat16" if s.bf16 else "float32")  # the CPU case of these figures (shardtune.runtime.cpu)
    print(bench_line(cpu))
    (out.with_suffix(".json")).write_text(json.dumps({"families_ms": fam, "step_s": step_s, "cpu": cpu}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
