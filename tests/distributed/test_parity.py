"""2-rank FULL_SHARD runs against 1-process runs with the same global batch: same losses, same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli, train_args, train_records
from tests.tolerance import parity

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
}


def _args(assets, out, extra=()):
    run = {"max_seq_len": 96, "seed": 7, "max_steps": 4, "gradient_accumulation_steps": 2}
    optim = {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 1, "weight_decay": 0.01}
    return [*train_args(assets, out, **run, **optim, gradient_checkpointing=True), *extra]


def _run_pair(assets, tmp_path, extra):
    one = tmp_path / "one"
    two = tmp_path / "two"
    run_cli(_args(assets, one, ["--per_device_train_batch_size", "4", *extra]), nproc=1, env=FSDP_ENV)
    run_cli(_args(assets, two, ["--per_device_train_batch_size", "2", *extra]), nproc=2, env=FSDP_ENV)
    return one, two


def _assert_planner_matches(out, model_dir, **kwargs):
    """`shardtune plan`'s per-rank weight bytes equal what each rank's sharded tensors held in the run."""
    import json

    from transformers import AutoConfig

    from shardtune.plan import plan_shape
    from shardtune.planning import model_state_bytes_per_rank

    start = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "start")
    held = start["config"]["param_bytes_per_rank"]
    shape = plan_shape(AutoConfig.from_pretrained(model_dir), "chatml")
    for rank, got in enumerate(held):
        est = model_state_bytes_per_rank(shape, world_size=len(held), bf16=False, rank=rank, **kwargs)
        assert (est["frozen"], est["trainable"]) == (got["frozen"], got["trainable"]), (rank, est, got)


# 2 micro-batches × 4 packed rows of 96 tokens per step, lr 3e-3 (_args).
CLOSE = parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)


def _assert_same_losses(one, two):
    l1 = [r["loss"] for r in train_records(one)]
    l2 = [r["loss"] for r in train_records(two)]
    assert len(l1) == len(l2) == 4
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=CLOSE["rtol"], atol=0)
    # The model really trained: the loss moved.
    assert abs(l1[-1] - l1[0]) > 1e-3


@pytest.mark.parametrize("use_dora", [False])
def test_lora_two_ranks_match_one_process(tiny_assets, tmp_path, use_dora):
    extra = [
        "--use_peft_lora",
        "True",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--lora_dropout",
        "0.0",
        "--lora_target_modules",
        "all-linear",
        "--use_dora",
        str(use_dora),
    ]
    one, two = _run_pair(tiny_assets, tmp_path, extra)
    _assert_same_losses(one, two)
    a1 = load_file(one / "adapter_model.safetensors")
    a2 = load_file(two / "adapter_model.safetensors")
    assert a1.keys() == a2.keys()
    # Every decoder linear is adapted, and the rows of the chat template's new tokens are saved.
    assert sum(k.endswith("lora_A.weight") for k in a1) == 2 * 7
    assert any("trainable_tokens_delta" in k for k in a1)
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], **CLOSE)
    for out in (one, two):
        _assert_planner_matches(out, tiny_assets["model"], lora_r=4, use_dora=use_dora)
    # lora_B starts at zero; after training it is not.
    assert any(v.abs().max() > 0 for k, v in a1.items() if "lora_B" in k)


def test_full_finetune_two_ranks_match_one_process(tiny_assets, tmp_path):
    one, two = _run_pair(tiny_assets, tmp_path, ["--use_peft_lora", "False"])
    _assert_same_losses(one, two)
    for out in (one, two):
        _assert_planner_matches(out, tiny_assets["model"], use_peft_lora=False)
    w1 = load_file(one / "model.safetensors")
    w2 = load_file(two / "model.safetensors")
    assert w1.keys() == w2.keys() and len(w1) > 10
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], **CLOSE)


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
def test_other_sharding_strategies_match_one_process(tiny_assets, tmp_path, strategy):
    extra = [
        "--use_peft_lora",
        "True",
        "--lora_r",
        "4",
        "--lora_dropout",
        "0.0",
        "--lora_target_modules",
        "all-linear",
        "--max_steps",
        "2",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(_args(tiny_assets, one, ["--per_device_train_batch_size", "4", *extra]), nproc=1, env=FSDP_ENV)
    run_cli(
        _args(tiny_assets, two, ["--per_device_train_batch_size", "2", *extra]),
        nproc=2,
        env={**FSDP_ENV, "FSDP_SHARDING_STRATEGY": strategy},
    )
    l1 = [r["loss"] for r in train_records(one)]
    l2 = [r["loss"] for r in train_records(two)]
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=CLOSE["rtol"], atol=0)
    held = _held_bytes(two)
    if strategy == "NO_SHARD":  # full replicas: each rank holds every byte
        assert held[0] == held[1] == _held_bytes(one)[0]
    else:
        assert held[0]["frozen"] < 0.6 * _held_bytes(one)[0]["frozen"]


def _held_bytes(out):
    import json

    start = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "start")
    return start["config"]["param_bytes_per_rank"]
