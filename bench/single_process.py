"""One process with FSDP2 against one process without it (the default at world size 1), on the tiny CPU model.

Each round trains the same LoRA run (bf16 or fp32, packed rows, checkpointed blocks) once under
SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp and once under the default, in alternating order, each in a fresh process whose
peak RSS is read with getrusage; tokens/s is over the steps after the first (which builds the caches).
Prints the ratios without/with FSDP and the CPU and dtype they were measured on (results in docs/speed.md).

    python bench/single_process.py --rounds 3 --steps 20 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frozen_base import cpu_name, speed_after_first_step  # bench/ is not a package: found on sys.path

# A child that runs `shardtune train` and prints the peak RSS of that run (its own child) in KiB.
RSS_WRAPPER = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " + (
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _assets(root: Path) -> dict[str, Path]:
    from shardtune.commands.demo import build_model, build_tokenizer, write_chat_dataset

    tok = build_tokenizer(root / "model", vocab_size=600)
    build_model(root / "model", vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    write_chat_dataset(root / "data", n_train=400, n_test=8, seed=3)
    return {"model": root / "model", "data": root / "data"}


def _train(assets, out: Path, mode: str, steps: int, dtype: str) -> tuple[float, float]:
    """(tokens/s, peak RSS in MiB) of one run."""
    args = ["--model_name_or_path", assets["model"], "--dataset_name", assets["data"], "--chat_template_format"]
    args += ["chatml", "--packing", "True", "--max_seq_len", "256", "--per_device_train_batch_size", "4"]
    args += ["--max_steps", steps, "--logging_steps", "1", "--save_strategy", "no", "--gradient_checkpointing"]
    args += ["True", "--use_peft_lora", "True", "--lora_r", "8", "--lora_target_modules", "all-linear"]
    args += ["--bf16", str(dtype == "bf16"), "--output_dir", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["SHARDTUNE_FSDP_SINGLE_PROCESS"] = mode
    cmd = [sys.executable, "-c", RSS_WRAPPER, sys.executable, "-m", "shardtune", "train", *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    rss_mib = int(proc.stdout.strip().splitlines()[-1]) / 1024
    # A train record's tokens_per_s is the average since the first step started: the speed after the first step
    # (which builds the caches) is derived from the records as bench/frozen_base.py does it.
    return speed_after_first_step(out)["tokens_per_s"], rss_mib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        assets = _assets(Path(tmp))
        got: dict[str, list[tuple[float, float]]] = {"fsdp": [], "auto": []}
        for r in range(a.rounds):
            for mode in ("fsdp", "auto") if r % 2 == 0 else ("auto", "fsdp"):
                got[mode].append(_train(assets, Path(tmp) / f"{mode}{r}", mode, a.steps, a.dtype))
    speed = [p[0] / f[0] for p, f in zip(got["auto"], got["fsdp"], strict=True)]
    rss = [p[1] / f[1] for p, f in zip(got["auto"], got["fsdp"], strict=True)]
    cpu = cpu_name()
    print(json.dumps({"cpu": cpu, "dtype": a.dtype, "rounds": a.rounds, "steps": a.steps, "runs": got}))
    print(
        f"without/with FSDP ({a.dtype}, {cpu}): tokens/s x{statistics.median(speed):.3f} "
        f"(rounds {', '.join(f'{x:.3f}' for x in speed)}), peak RSS x{statistics.median(rss):.3f} "
        f"(rounds {', '.join(f'{x:.3f}' for x in rss)})"
    )


if __name__ == "__main__":
    main()
