"""Peak memory of `shardtune merge` on a ~1 GB model, next to PEFT's load-everything merge_and_unload.

Builds a random fp32 Llama checkpoint (about 1.1 GB in 5 shards) tensor by tensor, so the builder itself never
holds the model, and a rank-16 LoRA adapter on every linear layer in PEFT's on-disk format. Each merge runs in its
own subprocess, which reports its peak resident set (VmHWM, including the memory-mapped shard pages it touched).
Prints a table and writes bench/results/merge_memory.json.

    python bench/merge_memory.py [--workdir /tmp/merge_bench] [--skip_peft]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "merge_memory.json"
MODEL = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 2816}
MODEL |= {"num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False}
N_SHARDS = 5
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
import torch
from shardtune.merge.fold import merge_adapter
t0 = time.time()
if args["mode"] == "shardtune":
    merge_adapter(args["base"], args["adapter"], args["out"], dtype=args["dtype"], max_shard_size="5GB")
elif args["mode"] == "import":  # what python, torch, transformers and peft take before any weight is read
    import peft, safetensors.torch
    from transformers import AutoModelForCausalLM
elif args["mode"] == "peft":
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(model, args["adapter"]).merge_and_unload()
    model.save_pretrained(args["out"], max_shard_size="5GB")
seconds = time.time() - t0
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"seconds": seconds, "peak_rss": int(status["VmHWM"].split()[0]) * 1024}))
"""


def build_checkpoint(folder: Path) -> dict[str, int]:
    """Write a random Llama checkpoint shard by shard; return tensor sizes in bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**MODEL, dtype="float32")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    sizes = {n: 4 * torch.Size(s).numel() for n, s in shapes.items()}
    per_shard = sum(sizes.values()) / N_SHARDS
    folder.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    for name in shapes:
        if sum(sizes[n] for n in groups[-1]) >= per_shard:
            groups.append([])
        groups[-1].append(name)
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for i, names in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            n: (torch.ones(shapes[n]) if "norm" in n else torch.randn(shapes[n], generator=gen) * 0.02) for n in names
        }
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    return sizes


def build_adapter(folder: Path, shapes: dict[str, tuple[int, ...]], r: int = 16) -> None:
    """A LoRA adapter in PEFT's saved format (keys without the adapter name), random A and B."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in LORA_TARGETS:
            out_f, in_f = shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) * 0.02
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=r, lora_alpha=32, target_modules=LORA_TARGETS).save_pretrained(str(folder))


def run_child(mode: str, base: Path, adapter: Path, out: Path, dtype: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    payload = json.dumps({"mode": mode, "base": str(base), "adapter": str(adapter), "out": str(out), "dtype": dtype})
    proc = subprocess.run([sys.executable, "-c", CHILD, payload], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} merge failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/shardtune_merge_bench")
    parser.add_argument("--skip_peft", action="store_true", help="Skip the PEFT merge_and_unload reference.")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    base, adapter = work / "base", work / "adapter"
    t0 = time.time()
    if not (base / "config.json").exists():
        build_checkpoint(base)
    from safetensors import safe_open

    shapes = {}
    for f in base.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            shapes.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})  # noqa: SIM118
    build_adapter(adapter, shapes)
    shard_sizes = [f.stat().st_size for f in base.glob("*.safetensors")]
    build_s = time.time() - t0

    runs = [
        ("import only (baseline)", "import", None),
        ("shardtune merge, fp32 out", "shardtune", None),
        ("shardtune merge, bf16 out", "shardtune", "bf16"),
    ]
    if not args.skip_peft:
        runs.append(("peft merge_and_unload + save", "peft", None))
    rows = []
    for label, mode, dtype in runs:
        r = run_child(mode, base, adapter, work / "out", dtype)
        rows.append({"run": label, **r})
        print(f"  {label}: {r['peak_rss'] / 2**20:.0f} MiB in {r['seconds']:.1f} s", flush=True)

    gib = 2**30
    from shardtune.runtime.cpu import bench_line, bench_record

    result = {
        "model_bytes": sum(shard_sizes),
        "n_shards": len(shard_sizes),
        "largest_shard_bytes": max(shard_sizes),
        "adapter_bytes": (adapter / "adapter_model.safetensors").stat().st_size,
        "build_seconds": build_s,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "cpu": bench_record("float32"),  # the CPU case these figures belong to (shardtune.runtime.cpu)
        "runs": rows,
    }
    print(bench_line(result["cpu"]))
    print(
        f"\nmodel {result['model_bytes'] / gib:.2f} GiB in {len(shard_sizes)} shards, largest shard "
        f"{result['largest_shard_bytes'] / gib:.2f} GiB, adapter {result['adapter_bytes'] / 2**20:.1f} MiB\n"
    )
    baseline = rows[0]["peak_rss"]
    for r in rows:
        r["above_baseline"] = r["peak_rss"] - baseline
    shard = result["largest_shard_bytes"]
    print(f"{'run':<30}{'peak RSS GiB':>13}{'above import':>14}{'/ largest shard':>17}{'/ model':>9}{'seconds':>9}")
    for r in rows:
        print(
            f"{r['run']:<30}{r['peak_rss'] / gib:>13.2f}{r['above_baseline'] / gib:>14.2f}"
            f"{r['above_baseline'] / shard:>17.2f}{r['above_baseline'] / result['model_bytes']:>9.2f}{r['seconds']:>9.1f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
