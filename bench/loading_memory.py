"""Host memory of loading a ~1.1 GB bf16 model into 2 FSDP2 ranks on CPU, with and without
fsdp_cpu_ram_efficient_loading, for LoRA (bf16 base) and QLoRA (4-bit base).

Each case runs `shardtune`'s own model setup (`build_sharded_model`: load, attach a LoRA adapter, shard, fill the
shards) in 2 processes under torchrun, and every rank reports its peak resident set (VmHWM from /proc, which counts
every page the process touched, memory-mapped checkpoint pages included). The fixed per-process overhead (python,
torch, transformers, peft, bitsandbytes, the gloo process group) is measured by the same run on a tiny model of the
same architecture (2 layers of width 64): whatever that run peaks at, it did not spend on the big model's weights.

    (sum of the 2 ranks' peaks - sum of their overheads) / model bytes

is then the number of copies of the model the ranks held together at their peaks. Prints a table and writes
bench/results/loading_memory.json.

    python bench/loading_memory.py [--workdir /tmp/loading_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "loading_memory.json"
BIG = {"vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 8, "intermediate_size": 5632}
TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
HEADS = {"num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False}
N_SHARDS = 4
CASES = [  # (name, 4-bit, cpu_ram_efficient_loading)
    ("LoRA, bf16 base, efficient loading", False, True),
    ("LoRA, bf16 base, every rank loads", False, False),
    ("QLoRA, 4-bit base, efficient loading", True, True),
    ("QLoRA, 4-bit base, every rank loads", True, False),
]


def build_checkpoint(folder: Path, shape: dict) -> int:
    """Write a random bf16 Llama checkpoint shard by shard (never the whole model in memory); return its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, **HEADS, dtype="bfloat16")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    if (folder / "config.json").exists():
        return total
    folder.mkdir(parents=True, exist_ok=True)
    names = list(shapes)
    per = -(-len(names) // N_SHARDS)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(N_SHARDS):
        fname = f"model-{i + 1:05d}-of-{N_SHARDS:05d}.safetensors"
        group = names[i * per : (i + 1) * per]
        tensors = {
            n: (torch.ones(shapes[n]) if "norm" in n else torch.randn(shapes[n], generator=gen) * 0.02).bfloat16()
            for n in group
        }
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(str(folder))
    return total


def worker(model_dir: str, four_bit: bool, efficient: bool, out: str) -> None:
    """One rank: shardtune's model setup, then this rank's peak RSS (rank 0 writes every rank's)."""
    from shardtune.models import loading
    from shardtune.models.builder import ModelSpec
    from shardtune.parallel.mesh import all_gather_objects, init_distributed, shutdown
    from shardtune.parallel.parallelize import ShardingSettings
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.runtime.log import setup_logging

    setup_logging("warning")
    torch.set_num_threads(1)
    info = init_distributed("FULL_SHARD")
    qcfg = loading.bnb_config(
        use_4bit=four_bit,
        use_8bit=False,
        quant_type="nf4",
        compute_dtype_name="bfloat16",
        nested=True,
        storage_dtype_name="bfloat16",
    )
    spec = ModelSpec(
        model_name_or_path=model_dir,
        dtype=torch.bfloat16,
        n_tokens=0,
        param_dtype=torch.bfloat16,
        quantization_config=qcfg,
    )
    t0 = time.time()
    model = build_sharded_model(spec, info, ShardingSettings(cpu_ram_efficient_loading=efficient))
    seconds = time.time() - t0
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    peak = int(status["VmHWM"].split()[0]) * 1024
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peaks = all_gather_objects({"peak_rss": peak, "held_bytes": held, "seconds": seconds})
    if info.is_main:
        Path(out).write_text(json.dumps(peaks))
    shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(model_dir: Path, four_bit: bool, efficient: bool, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
        __file__, "--worker", str(model_dir), str(int(four_bit)), str(int(efficient)), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/loading_bench")
    args = parser.parse_args()
    work = Path(args.workdir)
    t0 = time.time()
    model_bytes = build_checkpoint(work / "big", BIG)
    build_checkpoint(work / "tiny", TINY)
    build_seconds = time.time() - t0
    rows = []
    for name, four_bit, efficient in CASES:
        tiny = run_case(work / "tiny", four_bit, efficient, work / "tiny.json")
        big = run_case(work / "big", four_bit, efficient, work / "big.json")
        overhead = [r["peak_rss"] for r in tiny]
        peaks = [r["peak_rss"] for r in big]
        copies = (sum(peaks) - sum(overhead)) / model_bytes
        rows.append(
            {
                "case": name,
                "peak_rss_per_rank": peaks,
                "overhead_per_rank": overhead,
                "held_bytes_per_rank": [r["held_bytes"] for r in big],
                "seconds": max(r["seconds"] for r in big),
                "model_copies": copies,
            }
        )
        print(
            f"{name}: peaks {[p / 2**30 for p in peaks]} GiB, overhead {[o / 2**30 for o in overhead]}, {copies:.2f}×"
        )
    from shardtune.runtime.cpu import bench_line, bench_record

    result = {
        "model_bytes": model_bytes,
        "model": {**BIG, **HEADS, "dtype": "bfloat16"},
        "build_seconds": build_seconds,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "cpu": bench_record("bfloat16"),  # the CPU case these figures belong to (shardtune.runtime.cpu)
        "runs": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(bench_line(result["cpu"]))
    gib = 2**30
    print(f"\nmodel: {model_bytes / gib:.2f} GiB of bf16 weights; 2 ranks on CPU (gloo)\n")
    print(f"{'case':40s} {'peak RSS per rank (GiB)':>24s} {'overhead (GiB)':>16s} {'copies held':>12s} {'time':>7s}")
    for r in rows:
        peaks = " + ".join(f"{p / gib:.2f}" for p in r["peak_rss_per_rank"])
        over = " + ".join(f"{p / gib:.2f}" for p in r["overhead_per_rank"])
        print(f"{r['case']:40s} {peaks:>24s} {over:>16s} {r['model_copies']:>11.2f}× {r['seconds']:>6.1f}s")
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", sys.argv[5])
    else:
        main()
