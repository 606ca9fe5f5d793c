"""QLoRA on FSDP2: a 2-rank run (rank 1 built on meta, fed by rank 0) against a 1-process run with the same
global batch, and the saved adapter reloaded onto a 4-bit base by plain transformers + peft in a fresh process.

Tolerances. With fp32 storage and compute the two runs differ only by the order of floating-point sums (micro-
batches of 4 rows against 2 per rank), so losses, gradient norms and adapters agree as in the unquantized parity
test (tests.tolerance.train_parity, compared by tests/parity.py).
With bf16 (the guide's setting), every activation is rounded to bf16 (unit roundoff 2^-8 ≈ 3.9e-3) and matmuls
over 2 rows round differently from matmuls over 4. Each step's loss is a mean over ~700 target tokens whose
per-token errors are independent, so it moves by ~3.9e-3/sqrt(700) ≈ 1.5e-4 relative; we allow 1e-3. Adam makes
every update about lr·sign(gradient), so a lora_B entry whose gradient is within bf16 noise of zero can move the
other way: adapters are compared by the relative norm of their difference (≤ 5e-2 per tensor), and through what
they compute, the final eval loss, to the same 1e-3 as the losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import packed_eval_split, run_cli, train_records
from tests.parity import assert_runs_match, assert_same_training
from tests.tolerance import (
    TINY,
    TINY_VOCAB,
    TrainParity,
    decoder_chain,
    tol,
    tol_rounding,
    train_parity,
    unit_roundoff,
)

pytest.importorskip("bitsandbytes")

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_OFFLOAD_PARAMS": "true",
}

# A fresh interpreter that never imports shardtune: the base is quantized by transformers' own 4-bit loader.
RELOAD_SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
base, out, rows_file, quant_type, dtype = sys.argv[1:6]
dtype = getattr(torch, dtype)
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)
tok = AutoTokenizer.from_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(base, quantization_config=bnb, dtype=dtype)
model.resize_token_embeddings(len(tok), pad_to_multiple_of=8)
model = PeftModel.from_pretrained(model, out).eval()
for m in model.modules():  # bitsandbytes' AVX512-BF16 CPU inference kernel rounds to bf16; use the exact one
    if hasattr(m, "support_avx512bf16_for_cpu"):
        m.support_avx512bf16_for_cpu = False
rows = json.load(open(rows_file))
total, count = 0.0, 0
with torch.no_grad():
    for r in rows:
        ids, pos, y = torch.tensor([r["input_ids"]]), torch.tensor([r["position_ids"]]), torch.tensor(r["labels"])
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
        total += F.cross_entropy(logits, y, reduction="sum", ignore_index=-100).item()
        count += int((y != -100).sum())
assert "shardtune" not in sys.modules
print(json.dumps({"eval_loss": total / count, "layer": type(model.base_model.model.model.layers[0].mlp.up_proj.base_layer).__name__}))
"""


def _args(assets, out, batch, extra):
    return [
        "train",
        "--model_name_or_path", str(assets["model"]),
        "--dataset_name", str(assets["data"]),
        "--chat_template_format", "chatml",
        "--max_seq_len", "96",
        "--packing", "True",
        "--seed", "7",
        "--max_steps", "4",
        "--logging_steps", "1",
        "--learning_rate", "3e-3",
        "--lr_scheduler_type", "cosine",
        "--warmup_steps", "0",
        "--save_strategy", "no",
        "--eval_strategy", "epoch",
        "--per_device_eval_batch_size", "2",
        "--output_dir", str(out),
        "--gradient_accumulation_steps", "2",
        "--gradient_checkpointing", "True",
        "--use_reentrant", "True",
        "--per_device_train_batch_size", str(batch),
        "--use_peft_lora", "True",
        "--lora_r", "4",
        "--lora_alpha", "8",
        "--lora_dropout", "0.0",
        "--lora_target_modules", "all-linear",
        "--use_4bit_quantization", "True",
        "--use_nested_quant", "True",
        *extra,
    ]  # fmt: skip


def _run_pair(assets, tmp_path, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(_args(assets, one, 4, extra), nproc=1, env=FSDP_ENV)
    proc = run_cli(_args(assets, two, 2, extra), nproc=2, env=FSDP_ENV)
    return one, two, proc.stderr + proc.stdout


def _eval_rows(assets, tmp_path, out) -> Path:
    ev = packed_eval_split(assets, out, tmp_path / "cache", seed=7)
    rows = [
        {"input_ids": list(map(int, ev.input_ids[i])), "labels": list(map(int, ev.labels[i])),
         "position_ids": list(map(int, ev.position_ids[i]))}
        for i in range(len(ev.input_ids))
    ]  # fmt: skip
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    return path


def _reload_eval_loss(assets, tmp_path, out, quant_type, dtype) -> float:
    rows = _eval_rows(assets, tmp_path, out)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, str(assets["model"]), str(out), str(rows), quant_type, dtype],
        capture_output=True, text=True, check=False, timeout=300, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["layer"] == "Linear4bit"
    return got["eval_loss"]


# 4 steps of 2 micro-batches × 4 packed rows of 96 tokens, lr 3e-3 (_args); see tests/tolerance.py.
FP32 = train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)
# Eval: one forward over the 24 eval rows of up to 96 tokens.
EVAL_TARGETS = 24 * 96 // 2  # at least half of each packed eval row is targets
EVAL_FP32 = tol(torch.float32, decoder_chain(**TINY, seq=96, vocab=TINY_VOCAB, tokens=24 * 96))
# bf16 QDoRA: roundings of a value to bf16 on its way to the loss, per forward: per layer the 7 linears' outputs
# with DoRA's 3 extra stages each (the norm, the scale, the sum), the attention's 2 and the MLP's 2 products, 2
# norms and 2 residual sums: 7·4 + 8 = 36, times 2 layers, plus the head: 73. A loss after 4 steps also carries
# each step's forward and backward (3 times the forward's roundings): 4·3·73 = 876, averaged over the 768
# targets of a step. A weight after 4 steps: each step rounds its update and the stored bf16 value (2
# roundings, each side: 4·2·2·u relative in the worst case).
BF16_FORWARD_ROUNDINGS = 73
BF16_LOSS = tol_rounding(torch.bfloat16, 4 * 3 * BF16_FORWARD_ROUNDINGS, n=8 * 96)
BF16_WEIGHTS = 4 * 2 * 2 * unit_roundoff(torch.bfloat16)
# grad_norm: the gradient sums the same step's independently rounded tokens; the loss's bound holds it (measured
# on AMD EPYC AVX-512: 1.2e-3 relative, 23x inside; the loss 1.7e-5). Tensors: by relative norm, BF16_WEIGHTS.
BF16 = TrainParity(loss=BF16_LOSS, grad_norm=BF16_LOSS, rtol=BF16_WEIGHTS, atol=0.0)


def _summary(out: Path) -> dict:
    return json.loads((out / "train_summary.json").read_text())


def _packed_bytes_per_rank(log: str) -> list[float]:
    line = next(x for x in log.splitlines() if x.startswith("4-bit base:"))
    return [float(v) for v in line.split("held per rank: [")[1].split("]")[0].split(",")]


def test_qlora_fp32_two_ranks_match_one_process_and_reload(tiny_assets, tmp_path):
    extra = ["--bnb_4bit_quant_type", "nf4", "--bnb_4bit_quant_storage_dtype", "float32",
             "--bnb_4bit_compute_dtype", "float32"]  # fmt: skip
    one, two, log = _run_pair(tiny_assets, tmp_path, extra)
    # The 4-bit weights are dequantized to fp32 identically on both sides; only the order of the sums differs.
    assert_runs_match(one, two, FP32)
    a1 = load_file(one / "adapter_model.safetensors")
    assert sum(k.endswith("lora_A.weight") for k in a1) == 2 * 7
    # Each rank held half of the packed 4-bit bytes; the frozen bytes per rank say the same.
    halves = _packed_bytes_per_rank(log)
    assert len(halves) == 2 and halves[0] == pytest.approx(halves[1], rel=0.02) and halves[0] > 0
    start = train_records(two, "start")[0]["config"]["param_bytes_per_rank"]
    assert start[0]["frozen"] == pytest.approx(start[1]["frozen"], rel=0.05)
    single = train_records(one, "start")[0]["config"]["param_bytes_per_rank"][0]["frozen"]
    assert start[0]["frozen"] + start[1]["frozen"] == pytest.approx(single, rel=1e-3)
    assert "offload policy runs without pinned memory" in log  # FSDP2's CPUOffloadPolicy ran on both ranks
    # The adapter on transformers' own 4-bit base gives the trained model's eval loss.
    final = _summary(two)["final_eval_loss"]
    assert final == pytest.approx(_summary(one)["final_eval_loss"], rel=FP32.loss + EVAL_FP32)
    # transformers' 4-bit modules instead of shardtune's, same weights: the eval forward's sums in another order.
    assert _reload_eval_loss(tiny_assets, tmp_path, two, "nf4", "float32") == pytest.approx(final, rel=EVAL_FP32)


# bench: QDoRA in emulated bf16, 45 s; QLoRA fp32 (this file) and DoRA (test_adapters.py) stay (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_qdora_bf16_two_ranks_match_one_process_and_reload(tiny_assets, tmp_path):
    extra = ["--bf16", "True", "--use_dora", "True", "--bnb_4bit_quant_type", "fp4",
             "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bnb_4bit_compute_dtype", "bfloat16"]  # fmt: skip
    one, two, _ = _run_pair(tiny_assets, tmp_path, extra)
    assert_same_training(one, two, BF16)
    l1 = [r["loss"] for r in train_records(one)]
    assert abs(l1[-1] - l1[0]) > 1e-2
    a1, a2 = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert a1.keys() == a2.keys() and sum(k.endswith("lora_magnitude_vector") for k in a1) == 2 * 7
    for k in a1:
        assert float((a2[k] - a1[k]).norm() / a1[k].norm()) <= BF16_WEIGHTS, k
    # Each lora_B (zero at the start) trained: the relative comparison above measures a real update.
    assert all(float(v.abs().max()) > 1e-4 for k, v in a1.items() if "lora_B" in k)
    final = _summary(two)["final_eval_loss"]
    assert final == pytest.approx(_summary(one)["final_eval_loss"], rel=BF16_LOSS)
    # One bf16 forward per side (the same weights), its roundings averaged over the eval targets.
    rel = tol_rounding(torch.bfloat16, BF16_FORWARD_ROUNDINGS, n=EVAL_TARGETS)
    assert _reload_eval_loss(tiny_assets, tmp_path, two, "fp4", "bfloat16") == pytest.approx(final, rel=rel)
