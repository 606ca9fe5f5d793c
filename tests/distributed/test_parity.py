"""2-rank runs (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD) against 1-process runs with the same global batch: the same
per-step losses and gradient norms, the same trained weights (tests/parity.py). Planted bugs in the training
step (a halved gradient, a per-rank token normaliser, a dropped gradient shard) make the same comparison fail.

HYBRID_SHARD on one machine is FULL_SHARD (shardtune.parallel.dims.ParallelDims.build); across two simulated nodes it
is tests/distributed/test_multinode.py's. DoRA's 2-rank parity is tests/distributed/test_adapters.py's."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import run_cli, train_args
from tests.mutation import plant
from tests.parity import BUGS, assert_runs_match, assert_same_training, train_steps
from tests.tolerance import train_parity

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
}
LORA = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0"]
LORA += ["--lora_target_modules", "all-linear"]
# 4 steps of 2 micro-batches × 4 packed rows of 96 tokens, lr 3e-3 with no warmup: every step updates.
CLOSE = train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)


def _args(assets, out, batch: int, extra=()):
    run = {"max_seq_len": 96, "seed": 7, "max_steps": 4, "gradient_accumulation_steps": 2}
    optim = {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.01}
    flags = train_args(assets, out, **run, **optim, gradient_checkpointing=True, per_device_train_batch_size=batch)
    return [*flags, *extra]


def _two_ranks(assets, out, extra=(), env=None):
    """The 2-rank run: 2 rows per rank and micro-batch, the 1-process run's 4 in total."""
    run_cli(_args(assets, out, 2, extra), nproc=2, env={**FSDP_ENV, **(env or {})})
    return out


@pytest.fixture(scope="module")
def lora_one(tiny_assets, tmp_path_factory):
    """The 1-process LoRA reference every 2-rank LoRA run and negative control below is compared with."""
    out = tmp_path_factory.mktemp("lora_one") / "run"
    run_cli(_args(tiny_assets, out, 4, LORA), nproc=1, env=FSDP_ENV)
    return out


def _held_bytes(out):
    start = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "start")
    return start["config"]["param_bytes_per_rank"]


def _assert_planner_matches(out, model_dir, **kwargs):
    """`shardtune plan`'s per-rank weight bytes equal what each rank's sharded tensors held in the run."""
    from transformers import AutoConfig

    from shardtune.commands.plan import plan_shape
    from shardtune.planning import PlanInputs, model_state_bytes_per_rank

    held = _held_bytes(out)
    shape = plan_shape(AutoConfig.from_pretrained(model_dir), "chatml")
    for rank, got in enumerate(held):
        est = model_state_bytes_per_rank(shape, PlanInputs(world_size=len(held), bf16=False, **kwargs), rank=rank)
        assert (est["frozen"], est["trainable"]) == (got["frozen"], got["trainable"]), (rank, est, got)


# SHARD_GRAD_OP and NO_SHARD: bench (20 s each; `python -m pytest tests -m bench`; docs/testing.md); FULL_SHARD, the
# guide's, stays in the suite, and both strategies' steps in tests/distributed/test_strategy_steps.py.
@pytest.mark.parametrize(
    "strategy",
    [
        "FULL_SHARD",
        pytest.param("SHARD_GRAD_OP", marks=pytest.mark.bench),
        pytest.param("NO_SHARD", marks=pytest.mark.bench),
    ],
)
def test_lora_two_ranks_match_one_process(tiny_assets, lora_one, tmp_path, strategy):
    two = _two_ranks(tiny_assets, tmp_path / "two", LORA, env={"FSDP_SHARDING_STRATEGY": strategy})
    assert_runs_match(lora_one, two, CLOSE)
    a = load_file(two / "adapter_model.safetensors")
    # Every decoder linear is adapted, and the rows of the chat template's new tokens are saved.
    assert sum(k.endswith("lora_A.weight") for k in a) == 2 * 7
    assert any("trainable_tokens_delta" in k for k in a)
    held = _held_bytes(two)
    if strategy == "NO_SHARD":  # full replicas: each rank holds every byte
        assert held[0] == held[1] == _held_bytes(lora_one)[0]
    else:
        assert held[0]["frozen"] < 0.6 * _held_bytes(lora_one)[0]["frozen"]
    if strategy == "FULL_SHARD":
        for out in (lora_one, two):
            _assert_planner_matches(out, tiny_assets["model"], lora_r=4, use_dora=False)


def test_full_finetune_two_ranks_match_one_process(tiny_assets, tmp_path):
    one = tmp_path / "one"
    run_cli(_args(tiny_assets, one, 4, ["--use_peft_lora", "False"]), nproc=1, env=FSDP_ENV)
    two = _two_ranks(tiny_assets, tmp_path / "two", ["--use_peft_lora", "False"])
    # Every weight has a known start, the base model's (the embedding and head grew rows for the new tokens).
    assert_runs_match(one, two, CLOSE, start=tiny_assets["model"] / "model.safetensors")
    for out in (one, two):
        _assert_planner_matches(out, tiny_assets["model"], use_peft_lora=False)


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [
        ("halved_gradients", r"grad_norm: .*relative 0\.5"),  # the losses alone agree to 1e-6
        ("per_rank_normaliser", r"loss: .*relative [0-9.]+e-0[56]"),  # a 1e-5 shift, above the 2.3e-6 bound
        ("dropped_shard", r"training differs"),
    ],
)
def test_planted_gradient_bugs_fail_the_comparison(tiny_assets, lora_one, tmp_path, bug, caught_by):
    two = _two_ranks(tiny_assets, tmp_path / "two", LORA, env=plant(BUGS[bug], tmp_path / "planted"))
    with pytest.raises(AssertionError, match=caught_by):
        assert_same_training(lora_one, two, CLOSE)
    # The run itself completed every step: the comparison, not a crash, is what failed.
    assert sorted(train_steps(two)) == [1, 2, 3, 4]
