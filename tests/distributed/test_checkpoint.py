"""Sharded checkpoints of 2-rank FSDP2 runs over gloo: what a checkpoint holds, exact resume after a rank is
SIGKILLed mid-save, FULL_STATE_DICT, resuming on fewer and more ranks, and bitsandbytes' 8-bit AdamW. A resumed
run continues the uninterrupted one: the same per-step loss, grad_norm and learning rate, the same tensors
(tests/parity.py); a resume that loses the optimizer state fails that comparison."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import _free_port, run_cli, train_records
from tests.mutation import Edit, plant
from tests.parity import assert_same_tensors, assert_same_training, train_steps
from tests.tolerance import train_parity

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
}


def _args(assets, out: Path, *extra: str, dropout: float = 0.1, steps: int = 6) -> list[str]:
    """A LoRA run (with dropout, so that the RNG state matters) of `steps` steps, a checkpoint every 2 steps (unless
    `extra` gives --save_strategy)."""
    return [
        "train",
        "--model_name_or_path", str(assets["model"]),
        "--dataset_name", str(assets["data"]),
        "--chat_template_format", "chatml",
        "--max_seq_len", "96",
        "--packing", "True",
        "--seed", "7",
        "--max_steps", str(steps),
        "--logging_steps", "1",
        "--learning_rate", "3e-3",
        "--lr_scheduler_type", "cosine",
        "--warmup_steps", "0",
        "--weight_decay", "0.01",
        "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2",
        *(["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", str(dropout),
           "--lora_target_modules", "all-linear"] if "--use_peft_lora" not in extra else []),
        *(["--save_steps", "2"] if "--save_strategy" not in extra else []),
        "--output_dir", str(out),
        *extra,
    ]  # fmt: skip


def _launch(args: list[str], log: Path, *, nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    """Start `shardtune <args>` under torchrun in the background, output to `log`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **FSDP_ENV, **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(_free_port()), "-m", "shardtune", *args]
    return subprocess.Popen(cmd, env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _history(out: Path, after: int = 0) -> dict[int, tuple[float, float, float]]:
    """Step → (loss, grad_norm, learning rate) of the last record of each step (a resumed run redoes the steps
    after its checkpoint)."""
    return {s: (r["loss"], r["grad_norm"], r["learning_rate"]) for s, r in train_steps(out).items() if s > after}


# 4 steps of 2 micro-batches × 4 packed rows of 96 tokens, lr 3e-3; legs on other world sizes sum in other orders.
CLOSE = train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)


def _copy_checkpoint(src: Path, out: Path) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(src, out / "checkpoints" / src.name)


@pytest.fixture(scope="module")
def baseline(tiny_assets, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run: 6 steps, checkpoints at 2, 4, 6, the newest two kept."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    run_cli(_args(tiny_assets, out, "--save_total_limit", "2"), nproc=2, env=FSDP_ENV)
    return out


def test_checkpoint_holds_trainable_weights_optimizer_scheduler_rng_data_position(baseline):
    from torch.distributed.checkpoint import FileSystemReader

    root = baseline / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"]  # checkpoint-2 pruned
    ck = root / "checkpoint-4"
    meta = json.loads((ck / "meta.json").read_text())
    # 4 steps × 2 accumulated micro-batches of 2 rows on each of 2 ranks.
    assert meta["loop"]["step"] == 4 and meta["loop"]["epoch"] == 0
    assert meta["loop"]["batch_in_epoch"] == 8 and meta["loop"]["samples_in_epoch"] == 32
    assert meta["loop"]["global_batch"] == 8 and meta["world_size"] == 2
    # The same Python floats written to two JSON files: repr round-trips exactly.
    assert meta["loop"]["losses"] == [r["loss"] for r in train_records(baseline)][:4]
    assert meta["optimizer"] == {"class": "AdamW", "per_rank": False}
    assert json.loads((ck / "config.json").read_text())["model"]["lora_r"] == 4
    assert torch.load(ck / "scheduler.pt", weights_only=True)["last_epoch"] == 4
    r0, r1 = (torch.load(ck / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["torch"].shape == r1["torch"].shape and r0["torch"].dtype == torch.uint8
    keys = FileSystemReader(str(ck / "sharded")).read_metadata().state_dict_metadata
    lora = [k for k in keys if k.startswith("model.") and "lora_A" in k]
    assert len(lora) == 2 * 7  # every decoder linear of both blocks
    assert not any("base_layer" in k for k in keys)  # the frozen base is not in the checkpoint
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in keys)
    assert sorted(p.name for p in (ck / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_sigkill_mid_save_keeps_previous_checkpoint_and_resume_is_exact(baseline, tiny_assets, tmp_path):
    out = tmp_path / "run"
    # Rank 1 SIGKILLs itself while saving checkpoint-4, its shards written, the folder not yet renamed.
    proc = _launch(_args(tiny_assets, out), tmp_path / "killed.log", env={"SHARDTUNE_FAULT": "save:4:1"})
    while proc.poll() is None and not (out / "checkpoints" / "checkpoint-4.tmp").exists():
        time.sleep(0.05)
    t0 = time.monotonic()
    rc = _wait(proc)
    assert rc != 0 and time.monotonic() - t0 < 60
    log = (tmp_path / "killed.log").read_text()
    assert re.search(r"Root Cause.*?rank\s*: 1 .*?exitcode\s*: -9", log, re.DOTALL)  # torchrun names the dead rank
    assert "error: lost contact with another rank" in log  # rank 0 says why it stops
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["checkpoint-2", "checkpoint-4.tmp"]

    run_cli([*_args(tiny_assets, out), "--resume_from_checkpoint", "latest"], nproc=2, env=FSDP_ENV)
    assert not (out / "checkpoints" / "checkpoint-4.tmp").exists()
    # The resumed run redid steps 3..6: the same losses, gradient norms and adapter, bit for bit.
    assert _history(out, after=2) == _history(baseline, after=2)
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert [r["type"] for r in records].count("start") == 2
    # The killed attempt's records after step 2 (the resumed checkpoint) were dropped: one history, redone from 3.
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5, 6]
    a, b = load_file(baseline / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_across_world_sizes_and_state_dict_types(tiny_assets, tmp_path):
    """2 ranks (FULL_STATE_DICT) → 1 rank → 2 ranks (SHARDED_STATE_DICT), with the same global batch throughout:
    every leg continues the 2-rank run, up to float summation order."""
    full_env = {**FSDP_ENV, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}
    two, one, again = tmp_path / "two", tmp_path / "one", tmp_path / "again"
    run_cli(_args(tiny_assets, two, dropout=0.0, steps=4), nproc=2, env=full_env)
    ck = two / "checkpoints" / "checkpoint-2"
    assert (ck / "full_state.pt").exists() and not (ck / "sharded").exists()
    full = torch.load(ck / "full_state.pt", weights_only=True)
    q_a = [k for k in full["model"] if "q_proj.lora_A" in k]
    assert len(q_a) == 2 and all(full["model"][k].shape == (4, 64) for k in q_a)  # whole tensors, not shards
    assert len(full["optim"]["state"]) == len(full["model"])

    # 2 → 1: one rank with 4 rows per micro-batch; it loads the FULL checkpoint and saves SHARDED ones.
    _copy_checkpoint(ck, one)
    args = _args(tiny_assets, one, "--resume_from_checkpoint", "latest", "--save_steps", "1", dropout=0.0, steps=4)
    proc = run_cli([*args, "--per_device_train_batch_size", "4"], nproc=1, env=FSDP_ENV)
    assert "was saved by 2 rank(s); this run has 1" in proc.stderr
    assert "trained with a global batch" not in proc.stderr
    assert "at step 2 (epoch 0, sample 16 of the epoch)" in proc.stderr
    ck3 = one / "checkpoints" / "checkpoint-3"
    assert (ck3 / "sharded" / "__0_0.distcp").exists() and json.loads((ck3 / "meta.json").read_text())[
        "world_size"
    ] == 1

    # 1 → 2: DCP reshards the 1-rank SHARDED checkpoint of step 3 onto 2 ranks.
    _copy_checkpoint(ck3, again)
    run_cli(
        _args(tiny_assets, again, "--resume_from_checkpoint", "latest", dropout=0.0, steps=4), nproc=2, env=FSDP_ENV
    )
    assert sorted(train_steps(one)) == [3, 4] and sorted(train_steps(again)) == [4]
    assert_same_training(two, one, CLOSE)
    assert_same_training(two, again, CLOSE, min_trained_steps=1)
    for other in (one, again):
        assert_same_tensors(two, other, CLOSE)


# bench: the per-rank optimizer state of adamw_8bit, 57 s; exact resume of DCP state stays in this file (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_adamw_8bit_state_resumes_exactly_and_refuses_another_world_size(tiny_assets, tmp_path):
    """Full fine-tuning with bitsandbytes' AdamW8bit under FSDP2: its per-shard state saves and resumes."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    extra = ("--use_peft_lora", "False", "--optim", "adamw_8bit")
    run_cli(_args(tiny_assets, first, *extra, steps=4), nproc=2, env=FSDP_ENV)
    ck = first / "checkpoints" / "checkpoint-2"
    for rank in (0, 1):
        blob = torch.load(ck / f"optim_rank{rank}.pt", weights_only=True)
        states = [v["__bnb_optimizer_quant_state__"] for v in blob["state"]["state"].values()]
        # The embedding's 304×64 shard is above bitsandbytes' 4096-value threshold: its moments are 8-bit.
        assert any(s["state1"].dtype == torch.uint8 and s["absmax1"].numel() == 304 * 64 // 256 for s in states)
        assert all(v["step"] == 2 for v in blob["state"]["state"].values())
    _copy_checkpoint(ck, resumed)
    run_cli(_args(tiny_assets, resumed, *extra, "--resume_from_checkpoint", "latest", steps=4), nproc=2, env=FSDP_ENV)
    assert _history(resumed) == _history(first, after=2)
    a, b = load_file(first / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The same checkpoint on 1 rank: refused before any data or model is loaded.
    t0 = time.monotonic()
    proc = run_cli(
        _args(tiny_assets, resumed, *extra, "--resume_from_checkpoint", str(ck), steps=4), env=FSDP_ENV, check=False
    )
    assert proc.returncode == 2 and time.monotonic() - t0 < 60
    assert "cannot be resharded from 2 to 1 rank(s). Resume on 2 rank(s)" in proc.stderr
    assert "Data:" not in proc.stderr


def test_resume_without_the_optimizer_state_fails_the_comparison(baseline, tiny_assets, tmp_path):
    """Negative control: a planted resume that restores the weights but not AdamW's moments continues from
    checkpoint-4 with fresh moments; its steps 5 and 6 differ from the uninterrupted run's."""
    out = tmp_path / "run"
    _copy_checkpoint(baseline / "checkpoints" / "checkpoint-4", out)
    lost = Edit(
        "parallel/checkpoint.py",
        "    torch_optim = None if shards is not None else optimizer\n",
        "    torch_optim = None\n",
    )
    args = [*_args(tiny_assets, out), "--resume_from_checkpoint", "latest"]
    run_cli(args, nproc=2, env={**FSDP_ENV, **plant(lost, tmp_path / "planted")})
    assert sorted(train_steps(out)) == [5, 6]
    with pytest.raises(AssertionError, match="training differs"):
        assert_same_training(baseline, out, CLOSE)
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_tensors(baseline, out, CLOSE)
