"""`shardtune train --objective kto` with QLoRA end to end: 2 FSDP2 ranks with the reference precomputed (KL rows
included) give the losses, KL estimates and rewards of 1 process whose reference is the 4-bit base with the adapter
disabled; the gradient norms and the trained adapter agree too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.commands.demo import write_preference_dataset
from shardtune.data.collate import epoch_order
from tests.conftest import run_cli, train_records
from tests.distributed.test_preference_cli import FSDP_ENV
from tests.families import assert_runs_match, run_tolerance
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain
from tests.unit.test_kto import write_unpaired

METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
DESIRABLE_WEIGHT = 1.33
LR = 2e-3


def _args(assets, data: Path, out: Path, *, per_device: int, **flags) -> list[str]:
    """KTO with QLoRA (fp32 compute) on 32 examples: 3 steps of 8 examples (2 micro-batches of 4 over all ranks), a final eval."""
    base = {
        "model_name_or_path": assets["model"],
        "dataset_name": data,
        "objective": "kto",
        "beta": 0.1,
        "desirable_weight": DESIRABLE_WEIGHT,
        "max_length": 64,
        "add_special_tokens": True,
        "per_device_train_batch_size": per_device,
        "per_device_eval_batch_size": per_device,  # the KL estimate is per global micro-batch, in eval too
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": LR,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "steps",
        "eval_steps": 3,
        "seed": 3,
        "output_dir": out,
        "use_peft_lora": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": "all-linear",
        # QLoRA: the reference (per step with the adapter disabled, or precomputed) runs the 4-bit base
        "use_4bit_quantization": True,
        "use_nested_quant": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_quant_storage_dtype": "float32",
        "bnb_4bit_compute_dtype": "float32",
    }
    return ["train", *(x for k, v in {**base, **flags}.items() for x in (f"--{k}", str(v)))]


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    data = write_unpaired(write_preference_dataset(root / "pairs", n_train=16, n_test=4, seed=4), root / "data")
    single, sharded = root / "single", root / "sharded"
    one = run_cli(_args(tiny_assets, data, single, per_device=4), nproc=1)
    two = run_cli(_args(tiny_assets, data, sharded, per_device=2, precompute_ref_log_probs=True), nproc=2, env=FSDP_ENV)
    return {
        "data": data,
        "single": single,
        "sharded": sharded,
        "logs": (one.stdout + one.stderr, two.stdout + two.stderr),
    }


def _by_step(out: Path, kind: str = "train") -> dict[int, dict]:
    return {r["step"]: r for r in train_records(out, kind)}


def test_two_ranks_with_a_precomputed_reference_give_the_numbers_of_one_process(runs):
    one_log, two_log = runs["logs"]
    assert (
        "adapter disabled" in one_log and "Reference log-probs of 32 examples (and their KL rows) computed" in two_log
    )
    assert "4-bit base:" in one_log and "4-bit base:" in two_log
    single, sharded = _by_step(runs["single"]), _by_step(runs["sharded"])
    assert sorted(single) == sorted(sharded) == [1, 2, 3]
    # Step 1: the fresh adapter is the identity, so every log-ratio and the KL estimate are 0 and each example's
    # loss is its weight times 1 - sigmoid(0) = 1/2.
    rows = [json.loads(line) for line in (runs["data"] / "train.jsonl").read_text().splitlines()]
    assert single[1]["kl"] == 0 and single[1]["rewards/chosen"] == 0
    assert abs(single[3]["rewards/chosen"]) > 1e-4  # the policy has left the reference
    # fp32 compute on the same 4-bit base: each step's loss a mean over its 8 examples, each a sum over up to 64
    # tokens through the tiny decoder.
    one_step = decoder_chain(**TINY, seq=64, vocab=TINY_VOCAB, tokens=64, backward=True)
    close = run_tolerance(chain=3 * one_step, n=8, steps=3, lr=LR)
    adapter = assert_runs_match(runs["single"], runs["sharded"], close, min_updates=3)  # loss, grad_norm, tensors
    assert max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > LR > 3 * close.atol  # from 0
    # fp32 runs that differ in how sums split over ranks and micro-batches and in the reference's batch shapes:
    # rounding of ~1e-7 relative grown over 3 AdamW steps; 1e-4 relative as in the other parity tests.
    for step in single:
        for key in METRICS:
            assert sharded[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), (step, key)
    ev1, ev2 = _by_step(runs["single"], "eval")[3], _by_step(runs["sharded"], "eval")[3]
    for key in ("eval_loss", "eval_kl", "eval_rewards/chosen", "eval_logps/rejected"):
        assert ev2[key] == pytest.approx(ev1[key], rel=1e-4, abs=1e-6), key
    step1 = epoch_order(len(rows), seed=3, epoch=0, shuffle=True)[:8]  # the first global batch's examples
    n_desirable = sum(rows[i]["label"] for i in step1)
    assert 0 < n_desirable < 8
    expected = 0.5 * (DESIRABLE_WEIGHT * n_desirable + (8 - n_desirable)) / 8
    assert single[1]["loss"] == pytest.approx(expected, abs=1e-7) and sharded[1]["loss"] == pytest.approx(
        expected, abs=1e-7
    )


def test_context_parallel_gives_the_numbers_of_one_process(runs, tiny_assets, tmp_path):
    """cp=2 on 2 ranks (one data-parallel rank: the micro-batches of 4 examples of the 1-process run): the
    completions' and the KL rows' log-probs each summed over the cp ranks, their forwards split on their own rows;
    the reference is the 4-bit base with the adapter disabled, as in the 1-process run. Losses, KL estimates,
    rewards, grad_norm, the adapter and the eval as in the 2-rank test above."""
    cp = tmp_path / "cp2"
    out = run_cli(_args(tiny_assets, runs["data"], cp, per_device=4, context_parallel_size=2), nproc=2, env=FSDP_ENV)
    assert "Context parallelism: each row split over 2 ranks" in out.stdout + out.stderr
    single, split = _by_step(runs["single"]), _by_step(cp)
    one_step = decoder_chain(**TINY, seq=64, vocab=TINY_VOCAB, tokens=64, backward=True)
    assert_runs_match(runs["single"], cp, run_tolerance(chain=3 * one_step, n=8, steps=3, lr=LR), min_updates=3)
    for step in single:
        for key in METRICS:
            assert split[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), (step, key)
    ev1, ev2 = _by_step(runs["single"], "eval")[3], _by_step(cp, "eval")[3]
    for key in ("eval_loss", "eval_kl", "eval_rewards/chosen", "eval_logps/rejected"):
        assert ev2[key] == pytest.approx(ev1[key], rel=1e-4, abs=1e-6), key
