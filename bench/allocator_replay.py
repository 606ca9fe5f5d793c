"""What the CUDA caching allocator reserves over shardtune's step, replayed from the traced history.

For each run of a calibration set (shardtune's own settings on published model configs at full depth; none of
them is a published measurement that docs/plan.md compares the estimate with), `shardtune plan --trace` traces
the step under fake tensors, records every allocation and free with its stream (shardtune.planning.recorder) and
replays them through the caching allocator's rules (shardtune.planning.allocator), by default and with
expandable segments. The script prints, per run:

- allocated: the replayed max_memory_allocated (the traced peak in blocks of 512 bytes);
- gather cache: what FSDP2's all-gather copy-in stream reserves (forward all-gather outputs; backward all-gathers
  run on the default stream and cannot use these blocks), replayed and as the estimate derives it;
- root: the root's unsharded gradients and fp32 reduce-scatter input when the root trains (segments of their own);
- residual: what the other streams reserve beyond the largest they hold allocated together and the root's
  segments, over the part of that largest which is not resident state (parameter shards, constants, optimizer
  states);
- reserved: the replayed max_memory_reserved, and with expandable_segments:True.

The estimate's allocator terms are checked against this table (planning.phases.forward_gather_cache, the derived
gather cache) or set from it (planning.estimate.ALLOCATOR_OVERHEAD and ALLOCATOR_OVERHEAD_EXPANDABLE: the largest
residuals, rounded up); docs/plan.md ("The caching allocator") quotes the run, and bench/plan_loo.py holds each
run out of that rule in turn.

    python bench/allocator_replay.py            # the calibration set, ~4 min on 2 CPU cores
    python bench/allocator_replay.py --quick    # the first two runs
    python bench/allocator_replay.py --save     # the guide's checkpoint saves on a cold allocator (seconds)

`--save` replays, instead, the FSDP1 SHARDED_STATE_DICT save that the guide's three published runs end with
(planning.checkpoint_save.sharded_save) on an allocator that holds nothing but the resident state: what the save's own
sequence fragments, without the training step's cached blocks that a real save runs through (not modelled).

Fake tensors allocate nothing, so the figures do not depend on the CPU; the traced dtype is the runs' (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

GiB = 2**30
B = "--bf16 True --gradient_checkpointing True"
L = "--use_peft_lora True --lora_r 16 --lora_dropout 0 --lora_target_modules all-linear"
Q = "--use_4bit_quantization True --use_nested_quant True --bnb_4bit_quant_storage_dtype bfloat16"


def _run(model: str, *flags: str) -> tuple[str, str]:
    return model, " ".join(flags)


RUNS = {
    "Llama-3-8B LoRA, 2 ranks, 2x1024": _run(
        "meta-llama/Meta-Llama-3-8B", B, L, "--max_length 1024 --per_device_train_batch_size 2 --num_processes 2"
    ),
    "Llama-2-7B QLoRA, 1 rank, 4x2048": _run(
        "meta-llama/Llama-2-7b-hf", B, L, Q, "--max_length 2048 --per_device_train_batch_size 4 --num_processes 1"
    ),
    "Mistral-7B LoRA, 4 ranks, 1x4096": _run(
        "mistralai/Mistral-7B-v0.1", B, L, "--max_length 4096 --per_device_train_batch_size 1 --num_processes 4"
    ),
    "Llama-2-13B DoRA, 2 ranks, 2x1024": _run(
        "meta-llama/Llama-2-13b-hf",
        B,
        L,
        "--use_dora True --max_length 1024 --per_device_train_batch_size 2",
        "--num_processes 2",
    ),
    "Llama-3-8B full, 8 ranks, 2x1024": _run(
        "meta-llama/Meta-Llama-3-8B", B, "--max_length 1024 --per_device_train_batch_size 2 --num_processes 8"
    ),
    "Llama-2-7B LoRA dropout, 2 ranks, 4x2048": _run(
        "meta-llama/Llama-2-7b-hf",
        B,
        L,
        "--lora_dropout 0.1 --max_length 2048 --per_device_train_batch_size 4",
        "--num_processes 2",
    ),
    "Llama-3-8B QLoRA, 2 ranks, 8x1024": _run(
        "meta-llama/Meta-Llama-3-8B", B, L, Q, "--max_length 1024 --per_device_train_batch_size 8 --num_processes 2"
    ),
    "Llama-2-7B LoRA, no checkpointing, 2 ranks, 1x1024": _run(
        "meta-llama/Llama-2-7b-hf",
        "--bf16 True",
        L,
        "--gradient_checkpointing False --max_length 1024",
        "--per_device_train_batch_size 1 --num_processes 2",
    ),
    "Llama-2-7B LoRA, 8 ranks, 8x512": _run(
        "meta-llama/Llama-2-7b-hf", B, L, "--max_length 512 --per_device_train_batch_size 8 --num_processes 8"
    ),
}


def one(model: str, flags: str) -> dict:
    """Trace and replay one run (in its own process: a trace owns the process group)."""
    from shardtune.commands.plan import make_plan
    from shardtune.planning.known_configs import known_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(known_config(model)))
        p = make_plan(["--model_name_or_path", str(path), *shlex.split(flags), "--trace", "True"])
    t = p.trace
    gather = t.gather_stream
    terms = p.estimate.allocator_terms
    out = {"phase": p.estimate.peak_phase, "derived_gather_cache": terms["forward all-gather cache"]}
    root, resident = terms["root gradients' segments"], terms["resident"]
    for label, r in (("default", t.replay), ("expandable", t.replay_expandable)):
        g_res = r.by_stream.get(gather, 0)
        rest = r.peak_without.get(gather, r.allocated)
        out[label] = {
            "allocated": r.allocated,
            "reserved": r.reserved,
            "gather_cache": g_res,
            "other_streams_peak": rest,
            "root_segments": root,
            "residual": (r.reserved - g_res - root - rest) / (rest - resident),
            "reserved_by_stream": {t.streams.get(k, str(k)): v for k, v in r.by_stream.items()},
        }
    return out


def save_replay(shape, inputs) -> dict:  # inputs: a MemoryEstimate's (planning.inputs.PlanInputs)
    """FSDP1's SHARDED_STATE_DICT `model.state_dict()` through the caching allocator's rules: the resident state
    allocated first, tensor by tensor (each shard, its two AdamW states when it trains, the quantization constants
    as one block); then the root unit unsharded (its pre-hook runs first), each block unsharded, its parameters'
    chunks cloned and the block resharded, and last the root's chunks cloned and the root resharded."""
    from shardtune.planning.allocator import CachingAllocator
    from shardtune.planning.model import sharded_bytes
    from shardtune.planning.state import quant_constants, run_tensors, shard_group_size

    s = inputs
    tensors = run_tensors(shape, s)
    shard = shard_group_size(s.world_size, s.num_nodes, s.sharding_strategy.upper())
    a, keys = CachingAllocator(), iter(range(1 << 62))

    def malloc(n: int) -> int:
        key = next(keys)
        a.malloc(key, n)
        return key

    def unit(group: str) -> list:
        return [t for t in tensors if t.group == group]

    if not s.offload:
        for group, copies in (("block", shape.num_layers), ("root", 1)):
            for _ in range(copies):
                for t in unit(group):
                    for _ in range(3 if t.trainable else 1):
                        malloc(sharded_bytes(t, shard))
    malloc(quant_constants(shape, s.use_4bit, s.use_8bit, s.nested_quant))
    resident = a.allocated
    root = malloc(sum(t.numel * t.itemsize for t in unit("root")))
    for _ in range(shape.num_layers):
        gathered = malloc(sum(t.numel * t.itemsize for t in unit("block")))
        for t in unit("block"):
            malloc(sharded_bytes(t, shard))
        a.free(gathered)
    for t in unit("root"):
        malloc(sharded_bytes(t, shard))
    a.free(root)
    r = a.result()
    return {"resident": resident, "allocated": r.allocated, "reserved": r.reserved}


def _saves() -> None:
    from shardtune.planning import PlanInputs, estimate_memory
    from shardtune.planning.estimate import SAVE_PHASE
    from tests.unit.test_plan import PUBLISHED, _shape_and_settings

    print("FSDP1 SHARDED_STATE_DICT save, GiB: replayed on a cold allocator (allocated, reserved, reserved beyond")
    print("allocated) | the estimate: the save's live bytes, which it reserves (no fragmentation term), and the")
    print("run's reserved peak with its phase")
    for pub in (p for p in PUBLISHED if p.settings.get("sharded_checkpoint")):
        shape, settings = _shape_and_settings(pub)
        e = estimate_memory(shape, PlanInputs(**settings))
        r = save_replay(shape, e.inputs)
        save = estimate_memory(shape, PlanInputs(**{**settings, "allocator_overhead": 0.0}))  # the save's bytes
        assert save.peak_phase == SAVE_PHASE, pub.name
        print(
            f"{pub.name:48} {r['allocated'] / GiB:6.2f} {r['reserved'] / GiB:6.2f} "
            f"{(r['reserved'] - r['allocated']) / GiB:5.2f} | {save.allocated / GiB:6.2f} "
            f"{e.reserved / GiB:6.2f} ({e.peak_phase})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--save", action="store_true", help="replay the guide's checkpoint saves instead")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/allocator_replay.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    if args.save:
        _saves()
        return
    runs = dict(list(RUNS.items())[:2]) if args.quick else RUNS
    results = {}
    for name, (model, flags) in runs.items():
        cmd = [sys.executable, __file__, "--one", model, flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.exit(f"{name}: trace failed\n{proc.stderr[-3000:]}")
        results[name] = {"model": model, "flags": flags, **json.loads(proc.stdout.strip().splitlines()[-1])}
    _print(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"cpu": platform.processor() or platform.machine(), "runs": results}, indent=1)
    )


def _print(results: dict) -> None:
    print(f"CPU: {_cpu()}; fake tensors (nothing allocated), traced in bf16; GiB")
    print(
        f"{'run':42} {'peak phase':>11} {'allocated':>9} {'gather':>6} {'derived':>7} {'root':>5} "
        f"{'reserved':>8} {'residual':>8} {'expandable':>10} {'residual':>8}"
    )
    for name, r in results.items():
        d, e = r["default"], r["expandable"]
        print(
            f"{name:42} {r['phase'][:11]:>11} {d['allocated'] / GiB:9.2f} {d['gather_cache'] / GiB:6.2f} "
            f"{r['derived_gather_cache'] / GiB:7.2f} {d['root_segments'] / GiB:5.2f} {d['reserved'] / GiB:8.2f} "
            f"{d['residual']:8.1%} {e['reserved'] / GiB:10.2f} {e['residual']:8.1%}"
        )
    for label in ("default", "expandable"):
        residuals = sorted(r[label]["residual"] for r in results.values())
        print(f"{label} allocator residual: min {residuals[0]:.1%}, max {residuals[-1]:.1%}")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
