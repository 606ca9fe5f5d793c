"""The saved adapter (or full model) reloads with plain transformers + peft and reproduces the trained model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import packed_eval_split, run_cli
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain, tol

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
}

# Runs in a fresh interpreter that never imports shardtune: only torch, transformers and peft.
RELOAD_SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer
base, out, rows_file, kind = sys.argv[1:5]
tok = AutoTokenizer.from_pretrained(out)
if kind == "lora":
    from peft import PeftModel
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # The chat template added tokens: give the base room for them first (as the README says).
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=8)
    model = PeftModel.from_pretrained(model, out)
else:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
model.eval()
rows = json.load(open(rows_file))
total, count = 0.0, 0
with torch.no_grad():
    for r in rows:
        ids = torch.tensor([r["input_ids"]]); pos = torch.tensor([r["position_ids"]]); y = torch.tensor(r["labels"])
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
        total += F.cross_entropy(logits, y, reduction="sum", ignore_index=-100).item()
        count += int((y != -100).sum())
assert "shardtune" not in sys.modules
print(json.dumps({"eval_loss": total / count, "vocab_rows": model.get_input_embeddings().weight.shape[0]}))
"""


def _eval_rows(assets, tmp_path, out):
    ev = packed_eval_split(assets, out, tmp_path / "cache", seed=5)
    rows = [
        {
            "input_ids": list(map(int, ev.input_ids[i])),
            "labels": list(map(int, ev.labels[i])),
            "position_ids": list(map(int, ev.position_ids[i])),
        }
        for i in range(len(ev.input_ids))
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_reload_in_fresh_process_gives_trained_eval_loss(tiny_assets, tmp_path, kind):
    out = tmp_path / "out"
    method = (
        [
            "--use_peft_lora",
            "True",
            "--lora_r",
            "4",
            "--lora_alpha",
            "16",
            "--lora_dropout",
            "0.1",
            "--lora_target_modules",
            "all-linear",
        ]
        if kind == "lora"
        else ["--use_peft_lora", "False"]
    )
    run_cli(
        [
            "train",
            "--model_name_or_path",
            str(tiny_assets["model"]),
            "--dataset_name",
            str(tiny_assets["data"]),
            "--chat_template_format",
            "chatml",
            "--max_seq_len",
            "96",
            "--packing",
            "True",
            "--seed",
            "5",
            "--max_steps",
            "3",
            "--learning_rate",
            "5e-3",
            "--per_device_train_batch_size",
            "2",
            "--per_device_eval_batch_size",
            "3",
            "--eval_strategy",
            "epoch",
            "--save_strategy",
            "no",
            "--output_dir",
            str(out),
            *method,
        ],
        nproc=2,
        env=FSDP_ENV,
    )
    summary = json.loads((out / "train_summary.json").read_text())
    rows = _eval_rows(tiny_assets, tmp_path, out)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, str(tiny_assets["model"]), str(out), str(rows), kind],
        capture_output=True,
        check=False,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # The same weights through transformers/peft instead of shardtune's model: the eval chain, 24 rows of 96.
    rel = tol(torch.float32, decoder_chain(**TINY, seq=96, vocab=TINY_VOCAB, tokens=24 * 96))
    assert got["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=rel)
    # Training moved the model: the reloaded loss is not the untrained base's.
    assert summary["final_train_loss"] is not None
