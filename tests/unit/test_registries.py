"""Adding an optimizer touches one place (shardtune.training.optimizers.register): the flag's validation, the trainer's
builder and the planner all read the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.config.arguments import DataArguments, ModelArguments, RunConfig, TrainArguments
from shardtune.config.fsdp import FSDPSettings
from shardtune.planning import PlanInputs, estimate_memory
from shardtune.recipe.run_config import validate
from shardtune.training import optimizers

LLAMA_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
}


@pytest.fixture
def sgd():
    """Plain SGD (no momentum: no state at all), registered for the test and removed after it."""
    spec = optimizers.OptimizerSpec(
        "sgd_plain",
        lambda named, *, weight_decay, lr, betas, eps: torch.optim.SGD(
            optimizers.param_groups(named, weight_decay), lr=lr
        ),
        state_bytes=lambda numel, itemsize: 0,
        help="SGD without momentum",
    )
    optimizers.register(spec)
    yield spec
    optimizers.OPTIMIZERS.pop(spec.name)


def _config(optim: str) -> RunConfig:
    model = ModelArguments(model_name_or_path="m")
    train = TrainArguments(output_dir="out", optim=optim)
    return RunConfig(model, DataArguments(dataset_name="d"), train, FSDPSettings())


def test_a_registered_optimizer_is_a_valid_flag(sgd):
    validate(_config("sgd_plain"), check_paths=False)
    optimizers.OPTIMIZERS.pop("sgd_plain")
    with pytest.raises(Exception, match=r"--optim 'sgd_plain'.*adamw_torch, adamw_torch_fused, adamw_8bit or paged"):
        validate(_config("sgd_plain"), check_paths=False)
    optimizers.register(sgd)


def test_the_trainer_builds_it_and_it_steps(sgd):
    layer = nn.Linear(4, 3)
    opt = optimizers.build_optimizer(
        list(layer.named_parameters()), optim="sgd_plain", lr=0.5, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8
    )
    assert isinstance(opt, torch.optim.SGD)
    before = layer.weight.detach().clone()
    layer(torch.ones(2, 4)).sum().backward()
    opt.step()
    torch.testing.assert_close(layer.weight, before - 0.5 * layer.weight.grad)
    assert optimizers.optimizer_problems("sgd_plain", torch.device("cpu")) == []


def test_the_planner_counts_its_state(sgd):
    common = {"world_size": 8, "use_peft_lora": False, "bf16": True, "batch_size": 1, "seq_len": 512}
    adamw = estimate_memory(LLAMA_7B, PlanInputs(optim="adamw_torch", **common))
    plain = estimate_memory(LLAMA_7B, PlanInputs(optim="sgd_plain", **common))
    assert plain.device["optimizer state"] == 0
    # AdamW's two fp32 states of every (fp32 master) parameter, sharded over 8 ranks. Llama's parameters: the
    # embeddings and the head (V x h each), per block q/k/v/o (h x h), gate/up/down (h x I) and two norms (h), and
    # the final norm. Each tensor's rows are split in ceil(rows / 8) per rank: the padding is under 8 rows of the
    # largest tensor's width per tensor, far below 0.1%.
    h, inter, vocab, layers = 4096, 11008, 32000, 32
    params = 2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h
    assert adamw.device["optimizer state"] == pytest.approx(2 * 4 * params / 8, rel=1e-3)
