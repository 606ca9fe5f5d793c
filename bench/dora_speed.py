"""Training step time of DoRA next to LoRA on the same ~24M-parameter Llama, through shardtune's FSDP2 model.

Each variant is built with `build_sharded_model` (1 process, or N ranks under torchrun over gloo/NCCL), trained
with AdamW on random tokens, with activation checkpointing as in the guide's runs. Variants are timed in
interleaved rounds so that a busy machine slows them alike; the median step time is reported. Prints a table and
writes bench/results/dora_speed.json.

    python bench/dora_speed.py [--nproc 1,2] [--dropout 0.1,0.0] [--seq 256] [--batch 2] [--steps 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from shardtune.objectives.heads import token_loss

RESULTS = Path(__file__).resolve().parent / "results" / "dora_speed.json"
MODEL = {"vocab_size": 1024, "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}
# forward: "peft" (peft's DoRA forward), "fast-peft" (shardtune's, --dora_dropout peft), "fast" (shardtune's
# default, --dora_dropout lora_path). Without dropout the last two are the same computation.
VARIANTS = {
    "lora": {"use_dora": False},
    "dora (peft)": {"use_dora": True, "forward": "peft"},
    "dora (shardtune, peft dropout)": {"use_dora": True, "forward": "fast-peft"},
    "dora (shardtune)": {"use_dora": True, "forward": "fast"},
}


def _spec(model_dir: str, *, use_dora: bool, dropout: float, rank: int, dora_dropout: str = "lora_path"):
    from shardtune.models.builder import ModelSpec

    return ModelSpec(
        model_name_or_path=model_dir,
        dtype=torch.float32,
        n_tokens=MODEL["vocab_size"],
        lora_r=rank,
        lora_alpha=2 * rank,
        lora_dropout=dropout,
        use_dora=use_dora,
        dora_dropout=dora_dropout,
        gradient_checkpointing=True,
    )


def _use_peft_dora_forward(model) -> None:
    """Put peft's own DoRA forward back (build_sharded_model installs shardtune's)."""
    from peft.tuners.lora.variants import DoraLinearVariant

    for m in model.modules():
        variants = getattr(m, "lora_variant", None)
        if isinstance(variants, dict):
            for name in variants:
                variants[name] = DoraLinearVariant()


def _build(model_dir: str, variant: dict, dropout: float, rank: int, info):
    from shardtune.models import dora
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.runtime.log import setup_logging

    setup_logging("warning")
    torch.manual_seed(0)
    forward = variant.get("forward")
    mode = "peft" if forward == "fast-peft" else "lora_path"
    spec = _spec(model_dir, use_dora=variant["use_dora"], dropout=dropout, rank=rank, dora_dropout=mode)
    model = build_sharded_model(spec, info)
    if forward == "peft":
        _use_peft_dora_forward(model)
    elif forward is not None:
        assert dora.use_fast_dora(model) == 0  # already installed by build_sharded_model
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _step(model, optimizer, batch) -> None:
    loss, n = model(**batch, head=token_loss)
    (loss / n).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args) -> dict:
    """Median seconds per optimizer step for every (variant, dropout); runs on every rank, returns on all."""
    from shardtune.parallel.mesh import init_distributed

    info = init_distributed()
    g = torch.Generator().manual_seed(info.rank)
    ids = torch.randint(3, MODEL["vocab_size"], (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "position_ids": torch.arange(args.seq).repeat(args.batch, 1), "labels": ids.roll(-1, 1)}
    batch = {k: v.to(info.device) for k, v in batch.items()}
    runs = {}
    for dropout in args.dropout:
        for name, variant in VARIANTS.items():
            model, opt = _build(args.model_dir, variant, dropout, args.rank, info)
            _step(model, opt, batch)  # warm-up: lazy init, allocator
            runs[(name, dropout)] = (model, opt, [])
    for _ in range(args.rounds):
        for model, opt, times in runs.values():
            _sync(info.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                _step(model, opt, batch)
            _sync(info.device)
            times.append((time.perf_counter() - start) / args.steps)
    return {f"{name}|{dropout}": statistics.median(t) for (name, dropout), (_, _, t) in runs.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").exists():
        return
    from shardtune.commands.demo import build_model

    build_model(model_dir, **MODEL)


def _run_ranks(nproc: int, args) -> dict:
    """Measure under torchrun with nproc ranks; rank 0 writes its numbers to a file read back here."""
    out = Path(args.workdir) / f"ranks{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), __file__, "--child"]
    cmd += ["--out", str(out), "--model_dir", args.model_dir, "--seq", str(args.seq), "--batch", str(args.batch)]
    cmd += ["--steps", str(args.steps), "--rounds", str(args.rounds), "--rank", str(args.rank)]
    cmd += ["--dropout", ",".join(map(str, args.dropout))]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def _table(results: dict, args) -> list[dict]:
    rows = []
    for nproc, times in results.items():
        for dropout in args.dropout:
            lora = times[f"lora|{dropout}"]
            for name in VARIANTS:
                t = times[f"{name}|{dropout}"]
                rows.append(
                    {"ranks": nproc, "lora_dropout": dropout, "variant": name, "step_s": t, "vs_lora": t / lora}
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", default="1,2", help="comma-separated rank counts to measure")
    p.add_argument("--dropout", default="0.1,0.0", help="comma-separated lora_dropout values")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--workdir", default="/tmp/shardtune_dora_bench")
    p.add_argument("--model_dir", default=None)
    p.add_argument("--json", default=str(RESULTS), help="where the results are written")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dropout = [float(x) for x in str(args.dropout).split(",")]
    if args.child:
        times = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(times))
        return
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    args.model_dir = args.model_dir or str(Path(args.workdir) / "model")
    _ensure_model(Path(args.model_dir))
    results = {int(n): _run_ranks(int(n), args) for n in args.nproc.split(",")}
    rows = _table(results, args)
    print(f"{'ranks':>5}  {'dropout':>7}  {'variant':<31} {'step (s)':>9}  {'vs LoRA':>7}")
    for r in rows:
        print(f"{r['ranks']:>5}  {r['lora_dropout']:>7}  {r['variant']:<31} {r['step_s']:>9.3f}  {r['vs_lora']:>6.2f}x")
    setup = {k: getattr(args, k) for k in ("seq", "batch", "steps", "rounds", "rank")}
    device = "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    setup["load_average_1m"] = os.getloadavg()[0]  # other jobs on the machine slow every variant alike
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    from shardtune.runtime.cpu import bench_line, bench_record

    cpu = bench_record("float32")  # the CPU case these figures belong to (shardtune.runtime.cpu)
    print(bench_line(cpu))
    result = {"model": MODEL, "setup": setup, "device": device, "cpu": cpu, "rows": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
