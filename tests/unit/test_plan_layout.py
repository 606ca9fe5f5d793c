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

# Dense and mixture-of-experts families with and without a shared expert, biases, multi-latent attention (dense:
# MiniCPM3; with experts: DeepSeek), a dense first block, and a hybrid (Mamba) one.
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
    "minicpm3",
    "falcon_h1",
]


def _shape_and_real(model_type: str, **overrides) -> tuple[ModelShape, int]:
    config = families.tiny_config(CONFIG_MAPPING[model_type](**overrides))
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


@pytest.mark.parametrize("model_type,q_lora_rank", [("deepseek_v2", 16), ("deepseek_v2", None), ("minicpm3", 16)])
def test_multi_latent_attention_is_laid_out_not_left_to_the_extras(model_type, q_lora_rank):
    """Multi-latent attention's factors and norms are the layout's own linears (with and without the query's
    factor), so nothing is left beyond the layout, and LoRA on them by name counts r·(in + out) for each."""
    shape, real = _shape_and_real(model_type, q_lora_rank=q_lora_rank)
    assert bool(shape.q_lora_rank) == bool(q_lora_rank)
    assert shape.latent_attention
    assert (shape.block_extra_linear, shape.block_extra_other, shape.root_extra) == (0, 0, 0)
    assert base_param_count(shape) == real
    names = ("q_a_proj", "q_b_proj") if shape.q_lora_rank else ("q_proj",)
    targets = planning_model.resolve_lora_targets(shape, ",".join((*names, "kv_a_proj_with_mqa", "kv_b_proj")))
    assert targets == (*names, "kv_a_proj_with_mqa", "kv_b_proj")
    dims = shape.linear_dims()
    want = shape.num_layers * sum(4 * (dims[n][0] + dims[n][1]) for n in targets)
    assert planning_model.lora_param_count(shape, 4, targets) == want


def test_without_the_extras_the_memory_misses_parameters(monkeypatch):
    """Negative control: the extras not held (as before they were), the memory plan is short of the count."""
    monkeypatch.setattr(planning_model, "_unmodelled_tensors", lambda *a, **k: [])
    for model_type in ("qwen2_moe", "gpt_oss", "falcon_h1"):
        shape, real = _shape_and_real(model_type)
        assert _held(shape) < real, model_type


@pytest.mark.parametrize(
    "model_type,fp32", [("mixtral", True), ("deepseek_v3", True), ("qwen3_moe", False), ("gpt_oss", False)]
)
def test_routing_weights_dtype_is_read_off_the_router(model_type, fp32):
    """The combine of routed copies runs in the routing weights' dtype, which the family's router decides (Mixtral
    and DeepSeek keep them in fp32, Qwen3-MoE and gpt-oss cast them to the compute dtype): read by running the
    router on meta, and the combine's bytes follow it (twice as many for fp32 weights at bf16)."""
    from shardtune.planning.activations import routed_combine_bytes

    shape, _ = _shape_and_real(model_type)
    assert shape.routing_weight_bytes == (4 if fp32 else 0)
    forward, backward = routed_combine_bytes(shape, 2)
    k, h = shape.experts_per_token, shape.hidden_size
    assert forward == k * h * (4 + (8 if fp32 else 4))
    assert backward == 3 * (4 if fp32 else 2) * k * h + 2 * h
