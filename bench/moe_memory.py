"""Host memory of training a mixture of experts on 2 CPU ranks: LoRA on a 16-bit base against QLoRA with 4-bit
experts (shardtune.models.quant_experts), with and without expert LoRA.

Each case is `shardtune train` as a user runs it (torchrun, 2 ranks, FSDP2, 3 steps of packed chat rows, the
frozen base sharded, the checkpoint read on rank 0 only as the guide's fsdp_config.yaml asks), on a Qwen3-MoE-shaped model of ~0.3B parameters, ~90% of them in its experts; every rank's
peak resident set is read from the run summary (ru_maxrss: every page the process touched). The fixed per-process
overhead (python, torch, transformers, peft, bitsandbytes, gloo, the data) is measured by the same command on a
tiny model of the same architecture; what the big run peaks above it is what its weights, adapters and activations
took. Beside it, the planner's per rank for the same flags: the model state and the peak of live tensors (its GPU
estimate less the CUDA context and the allocator's overhead), to see that the memory falls as planned. Prints a table, writes
bench/results/moe_memory.json.

    python bench/moe_memory.py [--workdir /tmp/moe_memory]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "moe_memory.json"
ARCH = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts_per_tok": 4,
        "tie_word_embeddings": False, "router_aux_loss_coef": 0.001}  # fmt: skip
BIG = {"hidden_size": 1024, "num_hidden_layers": 4, "num_experts": 32, "moe_intermediate_size": 640,
       "intermediate_size": 2048}  # fmt: skip
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 4, "moe_intermediate_size": 32,
        "intermediate_size": 64}  # fmt: skip
LORA = ["--use_peft_lora", "True", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
QLORA = ["--use_4bit_quantization", "True", "--bnb_4bit_quant_type", "nf4", "--use_nested_quant", "True",
         "--bnb_4bit_compute_dtype", "float32", "--bnb_4bit_quant_storage_dtype", "float32"]  # fmt: skip
EXPERTS = ["--lora_target_experts", "True"]
CASES = {
    "LoRA, fp32 base": LORA,
    "QLoRA, 4-bit experts": [*LORA, *QLORA],
    "QLoRA, 4-bit experts + expert LoRA": [*LORA, *QLORA, *EXPERTS],
}


def build(folder: Path, shape: dict, vocab: int) -> int:
    """A random Qwen3-MoE checkpoint (fp32) in `folder`; returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**ARCH, **shape, vocab_size=vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if not (folder / "config.json").exists():
        model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(model: Path, tokenizer: Path, data: Path, out: Path, flags: list[str]) -> list[float]:
    """Run shardtune train on 2 ranks; every rank's peak resident GiB from the run summary."""
    argv = ["--model_name_or_path", str(model), "--tokenizer_name_or_path", str(tokenizer),
            "--dataset_name", str(data), "--chat_template_format", "chatml", "--packing", "True",
            "--max_seq_len", "256", "--per_device_train_batch_size", "2", "--max_steps", "3",
            "--save_strategy", "no", "--logging_steps", "1", "--output_dir", str(out),
            "--frozen_base", "sharded", "--gradient_checkpointing", "True", "--overwrite_output_dir", "True",
            *flags]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "shardtune", "train", *argv]  # fmt: skip
    # The guide's fsdp_config.yaml loads on rank 0 only (fsdp_cpu_ram_efficient_loading: true), as accelerate
    # launch passes it.
    # glibc returns freed blocks to the OS (bench/long_context.py measured what its default heap retention adds
    # to the resident set), so that the peak follows the live tensors.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "MALLOC_MMAP_THRESHOLD_": "65536",
           "MALLOC_TRIM_THRESHOLD_": "65536"}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    line = re.search(r"peak memory \(GB\)\s+(.*)", proc.stdout + proc.stderr).group(1)
    return [float(x) for x in re.findall(r"rank \d+: ([\d.]+)", line)]


def planned(model: Path, flags: list[str]) -> dict[str, float]:
    """The planner's per-rank model state (frozen base, quantization constants, trainable weights, gradients,
    optimizer state) and peak of live tensors (its GPU estimate less the CUDA context and allocator), GiB."""
    from shardtune.commands.plan import make_plan

    plan = make_plan(["--model_name_or_path", str(model), "--num_processes", "2", "--max_seq_len", "256",
                      "--per_device_train_batch_size", "2", "--frozen_base", "sharded",
                      "--gradient_checkpointing", "True", *flags])  # fmt: skip
    device = plan.estimate.device
    state = ("frozen base weights", "quantization constants", "trainable weights", "gradients", "optimizer state")
    return {"state_gib": sum(device[k] for k in state) / 2**30, "allocated_gib": plan.estimate.allocated / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/moe_memory")
    args = parser.parse_args()
    from shardtune.commands.demo import build_tokenizer, write_chat_dataset

    work = Path(args.workdir)
    t0 = time.time()
    data = write_chat_dataset(work / "data", n_train=64, n_test=8, seed=3)
    tok = build_tokenizer(work / "tok", vocab_size=1024)
    tok.save_pretrained(str(work / "tok"))
    params = build(work / "big", BIG, len(tok))
    build(work / "tiny", TINY, len(tok))
    rows = []
    for name, flags in CASES.items():
        big = train(work / "big", work / "tok", data, work / "out-big", flags)
        tiny = train(work / "tiny", work / "tok", data, work / "out-tiny", flags)
        above = [b - t for b, t in zip(big, tiny, strict=True)]
        rows.append({"case": name, "peak_gib": big, "overhead_gib": tiny, "above_overhead_gib": above,
                     **{f"planned_{k}": v for k, v in planned(work / "big", flags).items()}})  # fmt: skip
    base = rows[0]
    for r in rows:
        r["ratio_to_lora"] = sum(r["above_overhead_gib"]) / sum(base["above_overhead_gib"])
        r["planned_ratio_to_lora"] = r["planned_allocated_gib"] / base["planned_allocated_gib"]
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())  # fmt: skip
    result = {"cpu": cpu, "cores": os.cpu_count(), "dtype": "float32 compute, 4-bit nf4 stored in float32",
              "torch": torch.__version__, "parameters": params, "seconds": round(time.time() - t0), "rows": rows}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"{params / 1e6:.0f}M-parameter Qwen3-MoE, 2 ranks, on {cpu} ({result['dtype']}):")
    print(
        "| case | peak per rank GiB | above the tiny run, both ranks | ratio to LoRA | planned per rank: state, "
        "live tensors GiB | planned ratio |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        peaks = ", ".join(f"{x:.2f}" for x in r["peak_gib"])
        print(f"| {r['case']} | {peaks} | {sum(r['above_overhead_gib']):.2f} | {r['ratio_to_lora']:.2f} | "
              f"{r['planned_state_gib']:.2f}, {r['planned_allocated_gib']:.2f} | {r['planned_ratio_to_lora']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
