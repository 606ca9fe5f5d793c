"""Start-up of `shardtune train`: the seconds from starting the process to the end of the first optimizer step, by
phase. Each run is a fresh process (or two under torchrun) training a small local model (bench/speed.py's presets,
random weights, its chat data; nothing from the hub) for two steps (the second for comparison with the first); the phases are timed inside rank 0 by wrapping
the functions that do them, and the start of the interpreter (and of torchrun) from outside.

    python bench/startup.py                      # 1 process, 2 FSDP2 processes, 1 process planned: 3 rounds, bf16
    python bench/startup.py --rounds 1 --layouts 1

A layout is a process count, with `p` (e.g. `1p`) for a run whose start-up plans as on a GPU of --gpu_memory GiB
(80): a CPU run plans nothing (no GPU memory to plan against), a GPU run plans once (recipe.settings.start_plan).

Phases (each exclusive of the others; the conformance check is taken out of the phase it ran in):
interpreter start (and torchrun), imports (`shardtune.commands.train`: torch, shardtune's training stack; and
transformers, peft and datasets, which a run imports when it first needs them),
configuration and its checks (flags, run file, environment, every check, config.json/tokenizer/weights headers),
process group, run checks (output folder, hub, trackers), planner (recipe.settings.start_plan), conformance check
(models.families.check: the tiny copy's forwards), tokenizer, data (tokenize, pack, cache), model build/load
(models.builder.build_training_module: weights, adapter, fast paths), FSDP setup (parallel.setup: shard, fill,
assert), optimizer/objective/loop (up to the first step's start), first step (forward, backward, optimizer step,
log line), and what is left between them. Results: printed, and bench/results/startup.json (or --out).
"""

from __future__ import annotations

import time

T_ENTRY = time.time()  # the interpreter has started and reached this script (its own imports come next)

import argparse  # (after the entry time, as the imports below)
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
PHASES = (
    "interpreter start",
    "imports",
    "configuration and its checks",
    "process group",
    "run checks",
    "planner",
    "conformance check",
    "tokenizer",
    "data",
    "model build/load",
    "FSDP setup",
    "optimizer, objective, loop",
    "first step",
    "other",
)
AFTER = ("total to the first step", "second step (for comparison)", "process, start to exit")
# The functions each phase runs, as (module, attribute) where `shardtune train` calls them (name: timed intervals).
WRAPPED = {
    "config": ("shardtune.commands.train", "load_run_config"),
    "preflight": ("shardtune.commands.train", "model_input_problems"),
    "process group": ("shardtune.recipe.train", "init_distributed"),
    "run checks": ("shardtune.recipe.checks", "preflight_run"),
    "trackers": ("shardtune.recipe.checks", "open_trackers_for_run"),
    "planner": ("shardtune.recipe.settings", "start_plan"),
    "conformance check": ("shardtune.models.families", "check"),
    "tokenizer": ("shardtune.recipe.data", "load_tokenizer"),
    "data": ("shardtune.recipe.data", "prepare_data"),
    "model build/load": ("shardtune.parallel.setup", "build_training_module"),
    "model and FSDP": ("shardtune.parallel.setup", "build_sharded_model"),
    "step": ("shardtune.training.trainer", "train_step"),
}


# ---------------------------------------------------------------------------------------------------------------
# Worker: one `shardtune train` in this process, its phases timed


def _wrap(record: dict[str, list[tuple[float, float]]], name: str, module: str, attr: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    real = getattr(mod, attr)

    def timed(*args, **kwargs):
        t0 = time.time()
        try:
            return real(*args, **kwargs)
        finally:
            record.setdefault(name, []).append((t0, time.time()))

    setattr(mod, attr, timed)


def worker(spec: dict) -> dict:
    """Run `shardtune train` here with its phases' functions wrapped; the intervals and marks, in epoch seconds."""
    # The imports phase: the command's module (torch, shardtune's training stack) and the libraries every run
    # imports when it first needs them (transformers, peft, datasets), so that the later phases time work. All of
    # it inside the command's garbage-collector window, as `shardtune train` imports them (runtime.collector).
    from shardtune.cli import prepare_process
    from shardtune.runtime import collector

    prepare_process()  # before torch loads OpenMP, as the `shardtune` script does (config.openmp)
    with collector.during_command(program=True):
        return _timed_command(spec)


def _timed_command(spec: dict) -> dict:
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    import shardtune.commands.train  # noqa: F401
    from shardtune.models.quant import bitsandbytes_for_peft

    with bitsandbytes_for_peft(needed=False):  # as the run imports peft: its base is not 4-bit
        import peft  # noqa: F401

    t_imported = time.time()
    from shardtune.cli import main as cli_main
    from shardtune.recipe import settings
    from shardtune.runtime import hooks

    record: dict[str, list[tuple[float, float]]] = {}
    for name, (module, attr) in WRAPPED.items():
        _wrap(record, name, module, attr)
    if spec["gpu_memory"]:
        settings.gpu_memory = lambda info: int(spec["gpu_memory"] * 2**30)
    marks = {"spawn": spec["spawn"], "entry": T_ENTRY, "imported": t_imported}
    hooks.register("step", lambda step, rank: marks.setdefault(f"step {step} done", time.time()))
    rc = cli_main(["train", *spec["argv"]])
    marks["exit"] = time.time()
    return {"rc": rc, "marks": marks, "intervals": record}


def _inside(intervals: list[tuple[float, float]], outer: list[tuple[float, float]]) -> float:
    """Seconds of `intervals` that lie within `outer`."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in outer)


def phases(run: dict) -> dict[str, float]:
    """The exclusive seconds of each phase of one run (PHASES), and the total to the end of the first step."""
    m, iv = run["marks"], run["intervals"]

    def total(name: str) -> float:
        return sum(b - a for a, b in iv.get(name, []))

    conf = iv.get("conformance check", [])
    first = iv["step"][0]
    built = iv["model and FSDP"][-1]
    out = {
        "interpreter start": m["entry"] - m["spawn"],
        "imports": m["imported"] - m["entry"],
        "configuration and its checks": total("config") + total("preflight"),
        "process group": total("process group"),
        "run checks": total("run checks") + total("trackers"),
        "planner": total("planner") - _inside(conf, iv.get("planner", [])),
        "conformance check": total("conformance check"),
        "tokenizer": total("tokenizer"),
        "data": total("data"),
        "model build/load": total("model build/load") - _inside(conf, iv.get("model build/load", [])),
        "FSDP setup": total("model and FSDP") - total("model build/load"),
        "optimizer, objective, loop": first[0] - built[1],
        "first step": m["step 1 done"] - first[0],
    }
    to_first_step = m["step 1 done"] - m["spawn"]
    out["other"] = to_first_step - sum(out.values())
    out["total to the first step"] = to_first_step
    out["second step (for comparison)"] = m["step 2 done"] - m["step 1 done"]
    out["process, start to exit"] = m["exit"] - m["spawn"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Parent: assets, runs, table


def _argv(assets: dict, out: Path, cache: Path, bf16: bool) -> list[str]:
    flags = {
        "--model_name_or_path": assets["model"], "--dataset_name": assets["data"], "--output_dir": out,
        "--dataset_cache_dir": cache, "--chat_template_format": "chatml", "--packing": True, "--max_seq_len": 512,
        "--per_device_train_batch_size": 2, "--max_steps": 2, "--bf16": bf16, "--use_peft_lora": True,
        "--lora_r": 8, "--lora_alpha": 16, "--lora_target_modules": "all-linear", "--save_strategy": "no",
        "--eval_strategy": "no", "--logging_steps": 1, "--splits": "train,test", "--report_to": "none",
    }  # fmt: skip
    return [str(x) for kv in flags.items() for x in kv]


def run_once(layout: str, assets: dict, workdir: Path, a: argparse.Namespace, fresh_cache: bool) -> dict:
    """One start-up in a fresh process (`layout` "2": two ranks under torchrun; "1p": planned as on a GPU); rank 0's
    timings."""
    planned, layout = layout.endswith("p"), int(layout.rstrip("p"))
    tmp = Path(tempfile.mkdtemp(prefix=f"startup-{layout}-", dir=workdir))
    cache = tmp / "cache" if fresh_cache else workdir / "cache"
    spec = {"argv": _argv(assets, tmp / "out", cache, a.bf16), "gpu_memory": a.gpu_memory if planned else None}
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, a.threads // layout)), "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if layout > 1:
        from shardtune.commands.demo import DEMO_FSDP_YAML
        from shardtune.config.accelerate import accelerate_env

        env.update(accelerate_env({**DEMO_FSDP_YAML, "num_processes": layout}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(layout), "--master_port",
               str(_free_port())]  # fmt: skip
    else:
        cmd = [sys.executable]
    spec["spawn"] = time.time()
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([*cmd, str(Path(__file__)), "--_worker", str(spec_path), "--_result", str(result)],
                          check=False, env=env, cwd=REPO, capture_output=True, text=True)  # fmt: skip
    ended = time.time()  # after the interpreter's exit (and torchrun's), which the worker cannot time itself
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"start-up run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    run = json.loads(result.read_text())
    run["marks"]["exit"] = ended
    return phases(run)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(runs: list[dict]) -> dict:
    """The fastest round (other load on the machine only ever slows a round down: its phases are one run's), the
    median of each phase over the rounds, and every round."""
    keys = [*PHASES, *AFTER]
    return {
        "fastest": min(runs, key=lambda r: r["total to the first step"]),
        "median": {k: statistics.median(r[k] for r in runs) for k in keys},
        "rounds": runs,
    }


def table(report: dict) -> str:
    layouts = list(report["layouts"])
    head = "| phase (s, the fastest round) | " + " | ".join(layouts) + " |"
    lines = [head, "|" + " --- |" * (len(layouts) + 1)]
    for k in [*PHASES, *AFTER]:
        cells = [f"{report['layouts'][name]['fastest'][k]:.2f}" for name in layouts]
        bold = "**" if k.startswith("total") else ""
        lines.append(f"| {bold}{k}{bold} | " + " | ".join(cells) + " |")
    cells = [" / ".join(f"{r['total to the first step']:.1f}" for r in report["layouts"][name]["rounds"])
             for name in layouts]  # fmt: skip
    lines.append("| total to the first step, every round | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _layout_name(layout: str, gpu_memory: float) -> str:
    n = int(layout.rstrip("p"))
    name = "1 process (plain module)" if n == 1 else f"{n} processes (FSDP2, torchrun)"
    return name + (f", planned as on a {gpu_memory:g} GiB GPU" if layout.endswith("p") else "")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="1,2,1p", help="process counts to start, `p`: planned as on a GPU")
    ap.add_argument("--model", default="25m", help="bench/speed.py's preset")
    ap.add_argument("--bf16", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--gpu_memory", type=float, default=80.0, help="GiB: the `p` layouts plan against it")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "shardtune-startup"))
    ap.add_argument("--out", default=str(RESULTS / "startup.json"))
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a._worker:
        out = worker(json.loads(Path(a._worker).read_text()))
        if int(os.environ.get("RANK", "0")) == 0:
            Path(a._result).write_text(json.dumps(out))
        return out["rc"]
    sys.path.insert(0, str(BENCH))
    import speed  # bench/speed.py: the model presets and their assets

    from shardtune.runtime.cpu import bench_line, bench_record

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    assets = speed.build_assets(workdir, a.model, n_train=400)
    speed.compile_as_installed(speed.Contender("shardtune", "shardtune"))  # shardtune as `pip install` leaves it
    layouts = [x.strip() for x in a.layouts.split(",")]
    load_before = os.getloadavg()[0]
    raw: dict[str, list[dict]] = {n: [] for n in layouts}
    for rnd in range(a.rounds):
        for n in layouts if rnd % 2 == 0 else layouts[::-1]:
            print(f"round {rnd + 1}/{a.rounds}: {n} process(es) ...", flush=True)
            raw[n].append(run_once(n, assets, workdir, a, fresh_cache=True))
    names = {n: _layout_name(n, a.gpu_memory) for n in layouts}
    report = {
        "command": "python bench/startup.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu_name": _cpu_name(),
        "cpus": os.cpu_count(),
        "cpu": bench_record("bfloat16" if a.bf16 else "float32"),
        "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
        "model": a.model,
        "threads": a.threads,
        "gpu_memory_gib": a.gpu_memory,
        "layouts": {names[n]: summarize(raw[n]) for n in layouts},
    }
    report["table"] = bench_line(report["cpu"]) + "\n" + table(report)
    print(report["table"])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
