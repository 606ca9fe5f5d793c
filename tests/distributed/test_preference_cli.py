"""`shardtune train --objective dpo` end to end: 2 FSDP2 ranks give the losses, gradient norms, TRL-named metrics and
trained tensors of 1 process (the reference being the sharded base with the adapter disabled), exact resume after a
SIGKILL, the adapter reloads in plain PEFT with the run's own eval numbers, and full fine-tuning precomputes its
reference once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from shardtune.commands.demo import write_preference_dataset
from tests.conftest import run_cli, train_records
from tests.families import SPREAD, assert_runs_match, run_tolerance, saved_tensors
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
}
LR = 2e-3
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


def _args(assets, data: Path, out: Path, *, per_device: int, lora: bool = True, steps: int = 4, **flags) -> list[str]:
    """DPO on 32 pairs: 4 steps of 8 pairs (2 micro-batches), a checkpoint every 2 steps, a final eval."""
    base = {
        "model_name_or_path": assets["model"],
        "dataset_name": data,
        "objective": "dpo",
        "beta": 0.1,
        "max_length": 64,
        "add_special_tokens": True,
        "per_device_train_batch_size": per_device,
        "per_device_eval_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "max_steps": steps,
        "learning_rate": LR,
        "logging_steps": 1,
        "save_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "seed": 3,
        "output_dir": out,
    }
    if lora:
        base.update(use_peft_lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_target_modules="all-linear")
    return ["train", *(x for k, v in {**base, **flags}.items() for x in (f"--{k}", str(v)))]


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    data = write_preference_dataset(root / "data", n_train=32, n_test=8, seed=4)
    single = root / "single"
    run_cli(_args(tiny_assets, data, single, per_device=4), nproc=1)
    # 2 ranks; rank 1 SIGKILLs itself after step 3 (checkpoint-2 is the last), then the run resumes.
    sharded = root / "sharded"
    killed = run_cli(
        _args(tiny_assets, data, sharded, per_device=2),
        nproc=2,
        env={**FSDP_ENV, "SHARDTUNE_FAULT": "step:3:1"},
        check=False,
    )
    assert killed.returncode != 0
    run_cli(_args(tiny_assets, data, sharded, per_device=2, resume_from_checkpoint="latest"), nproc=2, env=FSDP_ENV)
    return {"data": data, "single": single, "sharded": sharded, "killed": killed}


# Full fine-tuning's measured 1-process vs 2-rank spread (fp32, AMD EPYC with AVX-512, torch 2.13 CPU): AdamW moves
# every weight, and a few whose gradient nearly cancels differ by up to 2.5e-3 · steps · lr (tests/families.py).
FULL_SPREAD = {"grad_norm": 1.7e-6, "weight_per_lr_step": 2.5e-3}


def _tolerance(steps: int, spread: dict = SPREAD):
    """fp32 runs that split the same sums over ranks and micro-batches: each step's loss is a mean over its 8 pairs,
    each pair's log-ratios sums over rows of up to 64 tokens through the tiny decoder (tests/families.py)."""
    one_step = decoder_chain(**TINY, seq=64, vocab=TINY_VOCAB, tokens=64, backward=True)
    return run_tolerance(chain=steps * one_step, n=8, steps=steps, lr=LR, spread=spread)


def _by_step(out: Path, kind: str = "train") -> dict[int, dict]:
    return {r["step"]: r for r in train_records(out, kind)}  # the resumed run's record wins for redone steps


def test_two_ranks_resumed_after_sigkill_give_the_losses_of_one_process(runs):
    single, sharded = _by_step(runs["single"]), _by_step(runs["sharded"])
    assert sorted(single) == sorted(sharded) == [1, 2, 3, 4]
    # Step 1: the adapter starts as the identity, so the policy is the reference.
    assert single[1]["loss"] == pytest.approx(math.log(2), abs=1e-6) and single[1]["rewards/margins"] == 0
    assert abs(single[4]["rewards/chosen"]) > 1e-3  # the policy has left the reference
    close = _tolerance(steps=4)
    adapter = assert_runs_match(runs["single"], runs["sharded"], close, min_updates=4)  # loss, grad_norm, tensors
    assert max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k) > LR > 3 * close.atol  # from 0
    # fp32 runs differing only in how sums are split over ranks and micro-batches: rounding of ~1e-7 relative,
    # grown over 4 AdamW steps; 1e-4 relative as in the SFT parity tests.
    for step in single:
        for key in METRICS:
            assert sharded[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), (step, key)
    ev1, ev2 = _by_step(runs["single"], "eval")[4], _by_step(runs["sharded"], "eval")[4]
    for key in ("eval_loss", "eval_rewards/chosen", "eval_logps/rejected"):
        assert ev2[key] == pytest.approx(ev1[key], rel=1e-4), key


def test_adapter_reloads_in_plain_peft_with_the_runs_eval_logps(runs, tiny_assets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.data.preference import tokenize_pair

    out = runs["sharded"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_assets["model"]), str(out)).eval()
    tok = AutoTokenizer.from_pretrained(out)
    logps = {"chosen": [], "rejected": []}
    rows = [json.loads(line) for line in (runs["data"] / "test.jsonl").read_text().splitlines()]
    with torch.no_grad():
        for i, row in enumerate(rows):
            prompt, chosen, rejected = tokenize_pair(tok, row, "test", i, True)
            for name, completion in (("chosen", chosen), ("rejected", rejected)):
                ids = torch.tensor([prompt + completion])
                token = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                logps[name].append(float(token[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).sum()))
    final = _by_step(out, "eval")[4]
    assert final["eval_logps/chosen"] == pytest.approx(np.mean(logps["chosen"]), rel=1e-5)
    assert final["eval_logps/rejected"] == pytest.approx(np.mean(logps["rejected"]), rel=1e-5)


def test_full_fine_tuning_precomputes_the_reference_once(runs, tiny_assets, tmp_path):
    """2 ranks compute the reference log-probs and store them with the data cache; one process reads them and
    trains to the same losses."""
    sharded, single = tmp_path / "full2", tmp_path / "full1"
    first = run_cli(_args(tiny_assets, runs["data"], sharded, per_device=2, lora=False, steps=2), nproc=2, env=FSDP_ENV)
    assert "Reference log-probs of 32 pairs computed and stored" in first.stdout + first.stderr
    stored = list((tmp_path / ".shardtune_cache").glob("pairs-*.ref-*.npy"))
    assert len(stored) == 2  # the train and eval splits' reference log-probs
    steps = _by_step(sharded)
    # Step 1 runs the starting weights: policy and stored reference agree to the last bit.
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-7) and steps[1]["rewards/chosen"] == 0
    assert steps[2]["rewards/chosen"] != 0
    again = run_cli(_args(tiny_assets, runs["data"], single, per_device=4, lora=False, steps=2), nproc=1)
    assert "Reference log-probs read from" in again.stdout + again.stderr
    for step, record in _by_step(single).items():
        for key in METRICS:
            assert record[key] == pytest.approx(steps[step][key], rel=1e-4, abs=1e-6), (step, key)
    close = _tolerance(steps=2, spread=FULL_SPREAD)
    trained = assert_runs_match(sharded, single, close, min_updates=2)  # loss, grad_norm, the model's tensors
    base = saved_tensors(tiny_assets["model"])
    assert max(float((trained[k] - v).abs().max()) for k, v in base.items()) > LR > 3 * close.atol  # it moved


CP = {"context_parallel_size": 2}


# dpo: bench (23 s; `python -m pytest tests -m bench`; docs/testing.md): orpo sums the same per-row log-probs over the
# cp ranks, and KTO's cp run (test_kto_cli.py) its own rows' split.
@pytest.mark.parametrize("objective", [pytest.param("dpo", marks=pytest.mark.bench), "orpo"])
def test_context_parallel_preference_runs_give_the_numbers_of_one_process(runs, tiny_assets, tmp_path, objective):
    """cp=2 on 2 ranks (one data-parallel rank holding the 4 pairs of each micro-batch, 2 micro-batches per step)
    against 1 process: every row's log-prob is the sum of the two ranks' position terms (an all-reduce whose
    backward is one too), the pairs are counted once per data-parallel batch, and DPO's reference (the base with
    the adapter disabled) and ORPO's NLL over the chosen targets follow. Losses, grad_norm, TRL's metrics, the
    adapter and the final eval as in the 2-rank test above."""
    steps = 4 if objective == "dpo" else 2  # the DPO baseline is the fixture's 4-step run
    single = runs["single"] if objective == "dpo" else tmp_path / "single"
    if objective != "dpo":
        run_cli(_args(tiny_assets, runs["data"], single, per_device=4, steps=steps, objective=objective), nproc=1)
    cp = tmp_path / "cp2"
    out = run_cli(_args(tiny_assets, runs["data"], cp, per_device=4, steps=steps, objective=objective, **CP),
                  nproc=2, env=FSDP_ENV)  # fmt: skip
    assert "Context parallelism: each row split over 2 ranks" in out.stdout + out.stderr
    one, two = _by_step(single), _by_step(cp)
    for step in range(1, steps + 1):
        for key in METRICS:
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert_runs_match(single, cp, _tolerance(steps=steps), min_updates=steps)
    if objective == "dpo":
        ev1, ev2 = _by_step(single, "eval")[4], _by_step(cp, "eval")[4]
        for key in ("eval_loss", "eval_rewards/chosen", "eval_logps/rejected"):
            assert ev2[key] == pytest.approx(ev1[key], rel=1e-4), key
