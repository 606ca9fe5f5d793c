"""Long rows on 2 CPU ranks: peak memory per rank and tokens/s with cp=1 (each rank its own row) against cp=2 (each
row split over both ranks, shardtune.parallel.split), at 8K, 16K and 32K positions per row, side by side.

Each case is `shardtune train` as a user runs it (torchrun, 2 ranks, FSDP2, LoRA, packed chat rows, gradient
checkpointing, 3 steps of one row per data-parallel rank), on a Llama-shaped model of 4 blocks (hidden 256, 8
heads, 4 KV heads) in fp32, with glibc returning freed blocks to the OS (see `train`). Peak resident set per rank
and tokens/s come from the run summary; the same command at
512 positions gives the fixed part (python, torch, gloo, the weights), and what a run peaks above it is what its
rows cost. Beside it, the planner's activations + logits per rank for the same flags (a GPU estimate, in the
compute dtype: fp32 here, as the runs), how far each cp's plan is from the measured, and the ratio cp=2 / cp=1 of
both, to see that memory per rank falls as planned. Prints a table, writes bench/results/long_context.json;
`--table` prints the table of that file without running anything.

    python bench/long_context.py [--workdir /tmp/long_context] [--lengths 8192,16384,32768] [--table]
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

RESULTS = Path(__file__).resolve().parent / "results" / "long_context.json"
SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "intermediate_size": 688, "tie_word_embeddings": False}  # fmt: skip


def build(folder: Path, vocab: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, vocab_size=vocab, max_position_embeddings=65536)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(work: Path, length: int, cp: int) -> dict:
    """One run; its summary's peak GiB per rank and tokens/s."""
    argv = ["--model_name_or_path", str(work / "model"), "--tokenizer_name_or_path", str(work / "tok"),
            "--dataset_name", str(work / "data"), "--chat_template_format", "chatml", "--packing", "True",
            "--max_seq_len", str(length), "--per_device_train_batch_size", "1", "--max_steps", "3",
            "--save_strategy", "no", "--logging_steps", "1", "--output_dir", str(work / f"out-{length}-{cp}"),
            "--overwrite_output_dir", "True", "--gradient_checkpointing", "True", "--use_peft_lora", "True",
            "--lora_r", "8", "--lora_target_modules", "all-linear", "--context_parallel_size", str(cp)]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "shardtune", "train", *argv]  # fmt: skip
    # glibc keeps freed blocks below its (dynamic, up to 32 MiB) mmap threshold in the heap, which the resident
    # set then counts: measured at 32K positions, cp=2 peaked 3.50 / 3.00 GiB per rank with glibc's defaults and
    # 1.96 / 1.54 with this threshold (cp=1: 4.29 / 4.23 and 3.65 / 3.68). With it, a freed tensor leaves the
    # resident set, which then follows the live tensors the planner counts.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-4000:]}")
    peaks = [float(x) for x in re.findall(r"rank \d+: ([\d.]+)", re.search(r"peak memory \(GB\)\s+(.*)", out)[1])]
    speed = float(re.search(r"tokens/s\s+([\d,.]+)", out)[1].replace(",", ""))
    return {"peak_gib": peaks, "tokens_per_s": speed}


def planned(work: Path, length: int, cp: int) -> float:
    from shardtune.commands.plan import make_plan

    plan = make_plan(["--model_name_or_path", str(work / "model"), "--num_processes", "2", "--max_seq_len",
                      str(length), "--per_device_train_batch_size", "1", "--gradient_checkpointing", "True",
                      "--use_peft_lora", "True", "--lora_target_modules", "all-linear", "--lora_r", "8",
                      "--packing", "True", "--context_parallel_size", str(cp)])  # fmt: skip
    device = plan.estimate.device
    return (device["activations"] + device["logits and loss"]) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/long_context")
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--table", action="store_true", help="print the table of the last results, run nothing")
    args = parser.parse_args()
    if args.table:
        print_table(json.loads(RESULTS.read_text()))
        return
    from shardtune.commands.demo import build_tokenizer, write_chat_dataset

    work = Path(args.workdir)
    t0 = time.time()
    lengths = [int(x) for x in args.lengths.split(",")]
    # enough conversations for 2 rows of the longest length per step, 3 steps
    write_chat_dataset(work / "data", n_train=max(lengths) * 6 // 60, n_test=8, seed=3)
    tok = build_tokenizer(work / "tok", vocab_size=1024)
    tok.save_pretrained(str(work / "tok"))
    build(work / "model", len(tok))
    base = {cp: train(work, 512, cp) for cp in (1, 2)}
    rows = []
    for length in lengths:
        runs = {cp: train(work, length, cp) for cp in (1, 2)}
        above = {cp: max(b - a for a, b in zip(base[cp]["peak_gib"], runs[cp]["peak_gib"], strict=True))
                 for cp in (1, 2)}  # fmt: skip
        plan = {cp: planned(work, length, cp) for cp in (1, 2)}
        rows.append({"length": length, "runs": runs, "above_512_gib": above, "planned_gib": plan,
                     "memory_ratio": above[2] / above[1], "planned_ratio": plan[2] / plan[1],
                     "speed_ratio": runs[2]["tokens_per_s"] / runs[1]["tokens_per_s"]})  # fmt: skip
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())  # fmt: skip
    result = {"cpu": cpu, "cores": os.cpu_count(), "dtype": "float32", "torch": torch.__version__, "base": base,
              "seconds": round(time.time() - t0), "rows": rows}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print_table(json.loads(RESULTS.read_text()))  # the table reads the file's (string) keys, as --table does


def print_table(result: dict) -> None:
    """The markdown table of docs/long_context.md: per cp, the measured peaks, what a run peaks above the
    512-position one, the planned activations + logits and how far they are from it; then tokens/s."""
    print(f"2 CPU ranks on {result['cpu']}, {result['dtype']}, LoRA on a 4-block Llama (hidden 256), 1 row per "
          "data-parallel rank:")  # fmt: skip
    print("| positions per row | peak per rank GiB, cp=1 / cp=2 | above the 512 run, GiB, cp=1 / cp=2 | "
          "planned GiB, cp=1 / cp=2 | planned vs measured, cp=1 / cp=2 | cp=2 / cp=1, measured / planned | "
          "tokens/s, cp=1 / cp=2 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        runs, above, plan = r["runs"], r["above_512_gib"], r["planned_gib"]
        peaks = " / ".join(", ".join(f"{x:.2f}" for x in runs[cp]["peak_gib"]) for cp in ("1", "2"))
        off = " / ".join(f"{plan[cp] / above[cp] - 1:+.0%}" for cp in ("1", "2"))
        speeds = " / ".join(f"{runs[cp]['tokens_per_s']:,.0f}" for cp in ("1", "2"))
        print(f"| {r['length']:,} | {peaks} | {above['1']:.2f} / {above['2']:.2f} | {plan['1']:.2f} / {plan['2']:.2f} "
              f"| {off} | {r['memory_ratio']:.2f} / {r['planned_ratio']:.2f} | {speeds} |")  # fmt: skip


if __name__ == "__main__":
    main()
