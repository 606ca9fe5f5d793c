"""The planner holds in memory every parameter it counts. Its layout (the Llama-style layers, a mixture of experts'
routed and shared experts) covers most of a block; what a family's class holds beyond it (multi-latent attention's
factors, a dense first block among expert blocks, biases, a shared expert's gate) is read off the class built on
meta and held as well, so that the memory plan cannot leave out weights the parameter count includes."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from shardtune.models import families
from shardtune.planning import PlanInputs, model_state_bytes_per_rank
from shardtune.planning import model as planning_model
from shardtune.planning.shape import ModelShape, base_param_count

# Dense and mixture-of-experts families with and without a shared expert, biases, multi-latent attention, a dense
# first block, and a hybrid (Mamba) one.
MODEL_TYPES = [
    "llama",
    "qwen2",
    "gemma2",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "qwen2_moe",
    "deepseek_v2",
    "deepseek_v3",
    "falcon_h1",
]


def _shape_and_real(model_type: str) -> tuple[ModelShape, int]:
    config = families.tiny_config(CONFIG_MAPPING[model_type]())
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return ModelShape.from_config(config), real


def _held(shape: ModelShape) -> int:
    """Parameters the plan holds: full fine-tuning in fp32 on one rank (no padding), every tensor trained."""
    state = model_state_bytes_per_rank(shape, PlanInputs(world_size=1, use_peft_lora=False, bf16=False))
    assert state["frozen"] == 0
    return state["trainable"] // 4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_memory_holds_every_parameter_the_plan_counts(model_type):
    """The count is the class's own; the memory holds all of it, and more only where the layout counts more than
    the class holds in a block (DeepSeek's dense first block is laid out as an expert block): never less."""
    shape, real = _shape_and_real(model_type)
    assert base_param_count(shape) == real
    held = _held(shape)
    surplus = -shape.num_layers * (min(0, shape.block_extra_linear) + min(0, shape.block_extra_other))
    assert held == real + surplus - min(0, shape.root_extra)
    assert held >= real


def test_a_shared_expert_is_laid_out_not_left_to_the_extras():
    """Qwen2-MoE's shared expert is part of its layout (its width read from the config): what is left beyond the
    layout is its gate (one output) and the attention's biases, a few rows per block."""
    shape, _ = _shape_and_real("qwen2_moe")
    h = shape.hidden_size
    assert shape.shared_expert_intermediate_size > 0
    assert shape.block_extra_linear == h  # shared_expert_gate: (1, h)
    assert shape.block_extra_other == shape.q_dim + 2 * shape.kv_dim  # q, k and v biases


def test_without_the_extras_the_memory_misses_parameters(monkeypatch):
    """Negative control: the extras not held (as before they were), the memory plan is short of the count."""
    monkeypatch.setattr(planning_model, "_unmodelled_tensors", lambda *a, **k: [])
    for model_type in ("qwen2_moe", "deepseek_v2", "gpt_oss", "falcon_h1"):
        shape, real = _shape_and_real(model_type)
        assert _held(shape) < real, model_type
