"""A mixture of experts trained with its router load-balancing loss (the default: the config's coefficient) on 2
FSDP2 ranks against one process that runs the same micro-batches one after the other (gradient accumulation 2):
the per-micro-batch aux loss (shardtune.objectives.loss.Objective.step) makes them the same run, so their losses, aux
losses, grad_norm and adapters agree, with gradient checkpointing on. The family matrix compares other batch
splits and so runs without the term (tests/families.py). The planted bug of this class (the term's gradient not
scaled like the cross-entropy's on several ranks) is `router_aux_unscaled` in bench/mutant_catalogue.py: its
grad_norm moves by 1e-5 to 1e-4 relative, over the 5.7e-6 bound."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.families import build_assets, matrix_tolerance, train_argv
from tests.parity import assert_same_tensors, assert_same_training, train_steps


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("moe"), ["mixtral"])


def _run(assets, out, nproc: int, accumulation: int, extra=()):
    argv = train_argv(assets["root"] / "mixtral", assets["data"], out, "lora", batch=2)
    at = argv.index("--router_aux_loss_coef")
    del argv[at : at + 2]  # the config's coefficient, as a user's run has it
    argv += ["--gradient_checkpointing", "True", "--gradient_accumulation_steps", str(accumulation), *extra]
    proc = run_cli(argv, nproc=nproc, env={"ACCELERATE_USE_FSDP": "true"})
    assert "the loss adds 0.001 (the config's) x the router load-balancing loss" in proc.stdout + proc.stderr
    return out


def test_two_ranks_with_the_router_loss_equal_one_process_on_the_same_micro_batches(mixtral, tmp_path):
    one = _run(mixtral, tmp_path / "one", 1, 2)
    two = _run(mixtral, tmp_path / "two", 2, 1)
    tol = matrix_tolerance("mixtral")
    assert_same_training(one, two, tol)
    assert_same_tensors(one, two, tol)
    want, have = train_steps(one), train_steps(two)
    for s in want:  # the term is there (Mixtral's formula gives top_k = 2 for even routing) and equal on both sides
        assert want[s]["aux_loss"] > 0
        assert abs(have[s]["aux_loss"] - want[s]["aux_loss"]) <= tol.loss * want[s]["aux_loss"], s


def test_context_parallel_with_the_router_loss_equals_one_process(mixtral, tmp_path):
    """cp=2 on 2 ranks (one data-parallel rank: the 1-process run's micro-batches): every rank's router logits
    are gathered over the cp ranks, so the aux loss is the whole micro-batch's, as in one process (the positions
    context parallelism pads a row with left out); losses, aux_loss, grad_norm and the adapter agree."""
    one = _run(mixtral, tmp_path / "one", 1, 1)
    cp = _run(mixtral, tmp_path / "cp", 2, 1, ("--context_parallel_size", "2"))
    tol = matrix_tolerance("mixtral")
    assert_same_training(one, cp, tol)
    assert_same_tensors(one, cp, tol)
    want, have = train_steps(one), train_steps(cp)
    for s in want:
        assert want[s]["aux_loss"] > 0
        assert abs(have[s]["aux_loss"] - want[s]["aux_loss"]) <= tol.loss * want[s]["aux_loss"], s


def _dpo(assets, data, out, nproc: int, accumulation: int):
    """DPO with LoRA on the attention and the experts, the router loss at the config's coefficient."""
    flags = {
        "model_name_or_path": assets["root"] / "mixtral", "dataset_name": data, "objective": "dpo", "beta": 0.1,
        "max_length": 64, "per_device_train_batch_size": 4 // (nproc * accumulation),
        "gradient_accumulation_steps": accumulation, "max_steps": 3, "learning_rate": 5e-3, "logging_steps": 1,
        "save_strategy": "no", "seed": 3, "use_peft_lora": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0,
        "lora_target_modules": "all-linear", "lora_target_experts": True, "output_dir": out,
    }  # fmt: skip
    argv = ["train", *(x for k, v in flags.items() for x in (f"--{k}", str(v)))]
    proc = run_cli(argv, nproc=nproc, env={"ACCELERATE_USE_FSDP": "true"})
    assert "the loss adds 0.001 (the config's) x the router load-balancing loss" in proc.stdout + proc.stderr
    return out


def test_dpo_with_the_router_loss_on_two_ranks_equals_one_process(mixtral, tmp_path):
    """DPO adds the router loss of the policy's forward per micro-batch as SFT does: 2 ranks equal one process
    with the same micro-batches (gradient accumulation 2), expert LoRA included, in losses, aux_loss, grad_norm
    and the adapter."""
    from shardtune.commands.demo import write_preference_dataset

    data = write_preference_dataset(tmp_path / "pairs", n_train=16, n_test=4, seed=4)
    one = _dpo(mixtral, data, tmp_path / "one", 1, 2)
    two = _dpo(mixtral, data, tmp_path / "two", 2, 1)
    tol = matrix_tolerance("mixtral")
    assert_same_training(one, two, tol)
    assert_same_tensors(one, two, tol)
    want, have = train_steps(one), train_steps(two)
    for s in want:
        assert want[s]["aux_loss"] > 0
        assert abs(have[s]["aux_loss"] - want[s]["aux_loss"]) <= tol.loss * want[s]["aux_loss"], s
