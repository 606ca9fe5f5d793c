"""What all-linear wraps (models.targets): every linear layer by module path, not the output head, the routers,
the experts' fused tensors, nor what PEFT refuses; an SSM's 3-D convolution is not an expert."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING

from shardtune.models import adapter, families, targets


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: a thread pool costs more than their products."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(model_type: str):
    with families._quiet():
        return families.build_tiny(families.tiny_config(CONFIG_MAPPING[model_type]()), "eager")


def _leaves(paths: list[str]) -> set[str]:
    return {targets.summarise([p]) for p in paths}


def test_llama4_router_subclass_is_left_out_and_shared_expert_adapted():
    """Llama 4's router is an nn.Linear subclass (PEFT's all-linear wraps it, and the forward then fails); its
    shared expert and dense MLP carry the experts' leaf names and are adapted by path."""
    from peft import LoraConfig, get_peft_model

    model = _model("llama4_text")
    plan = targets.plan_all_linear(model)
    routers = [p for r, ps in plan.left_out.items() if r.startswith("routers") for p in ps]
    assert routers and all(p.endswith("feed_forward.router") for p in routers)
    assert isinstance(model.get_submodule(routers[0]), torch.nn.Linear)
    assert "model.layers.*.feed_forward.shared_expert.gate_proj" in _leaves(plan.paths)
    assert plan.experts and not any(".experts" in p for p in plan.paths) and "lm_head" not in plan.paths
    ids = torch.randint(5, 128, (1, 12))
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=plan.paths))
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(plan.paths) and torch.isfinite(logits).all()
    # Control: PEFT's own all-linear takes the router (an nn.Linear subclass) too.
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    peft_all = _maybe_include_all_linear_layers(LoraConfig(target_modules="all-linear"), _model("llama4_text"))
    assert set(routers) <= set(peft_all.target_modules)


@pytest.mark.parametrize("model_type", ["falcon_h1", "mamba2"])
def test_ssm_convolution_is_not_an_expert_and_peft_refusals_are_left_out(model_type):
    model = _model(model_type)
    assert any(p.ndim == 3 for n, p in model.named_parameters() if "conv1d" in n)  # the 3-D convolution
    plan = targets.plan_all_linear(model)
    assert plan.experts == []
    assert any(p.endswith("out_proj") for r, ps in plan.left_out.items() if "PEFT refuses" in r for p in ps)
    assert not any(p.endswith(("out_proj", "conv1d")) for p in plan.paths)
    if model_type == "falcon_h1":  # its dense MLP keeps its projections (a 3-D conv once hid them as "experts")
        assert {"model.layers.*.feed_forward.gate_proj", "model.layers.*.feed_forward.down_proj"} <= _leaves(plan.paths)


def test_remapped_leaf_names_are_left_out_only_where_peft_remaps_them(caplog):
    """Qwen3-MoE with a dense first layer: PEFT reads gate_proj/up_proj/down_proj as the fused experts, so the dense
    layer's would reload as the experts' (left out, said); Jamba (no such remap): its dense MLP layers get adapters
    beside the experts."""
    with families._quiet():
        config = families.tiny_config(CONFIG_MAPPING["qwen3_moe"](mlp_only_layers=[0]))
        qwen = targets.plan_all_linear(families.build_tiny(config, "eager"))
    remapped = {p for r, ps in qwen.left_out.items() if "PEFT reads" in r for p in ps}
    assert remapped == {f"model.layers.0.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
    assert "model.layers.0.self_attn.q_proj" in qwen.paths
    jamba = targets.plan_all_linear(_model("jamba"))
    assert {"model.layers.*.feed_forward.gate_proj"} <= _leaves(jamba.paths)
    assert jamba.experts and not any("experts" in p for p in jamba.paths)
    # The run's log lists what got adapters, summarised by module-path pattern.
    with caplog.at_level("INFO"):
        paths = adapter._target_modules("all-linear", _model("jamba"))
    assert paths == jamba.paths
    assert "LoRA targets (all-linear, " in caplog.text and "model.layers.*.mamba.in_proj (2)" in caplog.text


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "falcon_h1"])
def test_planner_counts_lora_on_the_layers_training_wraps(model_type):
    """shardtune plan's LoRA count is PEFT's on the layers all-linear wraps (shared experts, Mamba projections);
    on Llama it equals the count of the Llama names, elsewhere those undercount."""
    from peft import LoraConfig, get_peft_model

    from shardtune.planning.model import lora_param_count, resolve_lora_targets
    from shardtune.planning.shape import ModelShape

    config = families.tiny_config(CONFIG_MAPPING[model_type]())
    shape = ModelShape.from_config(config)
    names = resolve_lora_targets(shape, "all-linear")
    model = _model(model_type)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets.plan_all_linear(model).paths))
    trained = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    assert lora_param_count(shape, 4, names) == trained
    llama_names = lora_param_count(shape, 4, tuple(names))
    assert (llama_names == trained) == (model_type == "llama")
