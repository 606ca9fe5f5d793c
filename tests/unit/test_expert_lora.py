"""LoRA on the experts and routers of a mixture of experts (PEFT's target_parameters): what the flags resolve to on
every fused-expert family transformers ships, that each expert's LoRA trains, that `shardtune merge`'s delta is
PEFT's own, and the refusals. The 2-rank parity, reload, merge and chat runs are in tests/e2e/test_families.py."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING

from shardtune.config.errors import ConfigError
from shardtune.merge.experts import ExpertLora, expert_factors
from shardtune.models import families, targets
from shardtune.recipe.run_config import load_run_config
from tests.unit.test_targets import _model, _one_thread  # noqa: F401 - the tiny models, one thread (autouse)

# Fused-expert families of transformers (3-D expert tensors), with where their routers are parameters.
FUSED = {
    "mixtral": "mlp.gate.weight",
    "qwen2_moe": "mlp.gate.weight",
    "qwen3_moe": "mlp.gate.weight",
    "olmoe": "mlp.gate.weight",
    "deepseek_v3": "mlp.gate.weight",  # shared experts (linear layers) beside the routed ones, MLA attention
    "gpt_oss": "mlp.router.weight",  # experts stored (E, in, out): PEFT's unswapped layout
    "glm4_moe": "mlp.gate.weight",
    "granitemoe": "block_sparse_moe.router.weight",
    "qwen3_next": "mlp.gate.weight",
    "llama4_text": None,  # its router is a linear layer: --lora_target_modules names it
}


@pytest.mark.parametrize("model_type", list(FUSED))
def test_expert_lora_on_every_fused_expert_family(model_type):
    """`experts` names every fused tensor (as PEFT's target_parameters), `routers` every router weight held as a
    parameter; PEFT wraps each, every expert's LoRA B gets a gradient, and the delta `shardtune merge` adds to a
    fused tensor equals PEFT's get_delta_weight (either layout: GPT-OSS stores its experts transposed)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper

    model = _model(model_type)
    words = "routers" if FUSED[model_type] else None
    plan = targets.plan_parameters(model, words, experts=True)
    expert_names = plan.words[targets.EXPERTS]
    assert expert_names and all(n.endswith(("gate_up_proj", "down_proj")) for n in expert_names), expert_names
    assert plan.words.get(targets.ROUTERS, [None]) == [FUSED[model_type]]
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=[], target_parameters=plan.names))
    wrappers = {n: m for n, m in peft.named_modules() if isinstance(m, ParamWrapper)}
    n_experts = targets.num_experts(model.config)
    moe_blocks = len(targets.expert_modules(model, n_experts))
    assert len(wrappers) == len(plan.names) * moe_blocks
    for m in wrappers.values():  # B starts at zero: give it values, so the delta is not trivially zero
        torch.nn.init.normal_(m.lora_B["default"].weight, std=0.02)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    peft(input_ids=ids, labels=ids).loss.backward()
    for name, m in wrappers.items():
        grads = [m.lora_A["default"].weight.grad, m.lora_B["default"].weight.grad]
        assert all(g is not None and g.abs().max() > 0 for g in grads), name
        if m.num_experts == 1:
            continue
        param = m.get_param()
        a, b = expert_factors(m.lora_A["default"].weight, m.lora_B["default"].weight, m.num_experts)
        update = ExpertLora(a, b, m.scaling["default"], transposed=not m._did_swap_in_out_features)
        assert update.shape == tuple(param.shape)
        want = m.get_delta_weight("default").detach()
        got = update.merged(param.detach()) - param.detach()
        # fp32: w + delta rounded once, minus w once more; the deltas (bmm vs einsum over r = 2 terms) a few ulps.
        atol = 8 * torch.finfo(torch.float32).eps * float(param.abs().max() + want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_dense_model_has_no_experts_to_adapt():
    model = _model("llama")
    with pytest.raises(ValueError, match=r"--lora_target_experts True: this llama model has no fused expert "
                                         r"tensors; it is not a mixture of experts\."):  # fmt: skip
        targets.plan_parameters(model, None, experts=True)
    assert targets.parameter_target_problems(model, "routers", experts=False) == [
        (
            "--lora_target_parameters routers: this llama model has no router weights held as parameters; it is "
            "not a mixture of experts."
        )
    ]


def test_a_parameter_name_that_matches_nothing_names_what_the_model_has():
    problems = targets.parameter_target_problems(_model("qwen3_moe"), "mlp.experts.w1", experts=False)
    assert problems == [
        (
            "--lora_target_parameters mlp.experts.w1: no parameter of this qwen3_moe model is named mlp.experts.w1 "
            "or ends in .mlp.experts.w1 (its expert and router parameters: mlp.experts.down_proj, "
            "mlp.experts.gate_up_proj, mlp.gate.weight)."
        )
    ]
    plan = targets.plan_parameters(_model("qwen3_moe"), "mlp.experts.down_proj", experts=False)
    assert plan.names == ["mlp.experts.down_proj"]


REQUIRED = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--use_peft_lora", "True"]


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--use_dora", "True"], "--lora_target_experts True with --use_dora: PEFT has no DoRA form"),
        (["--use_peft_lora", "False"], "--lora_target_experts set an adapter, but --use_peft_lora is False"),
    ],
)
def test_combinations_expert_lora_cannot_train_are_refused_before_loading(flags, problem):
    with pytest.raises(ConfigError) as e:
        load_run_config([*REQUIRED, "--lora_target_experts", "True", *flags], env={})
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_planner_counts_the_expert_and_router_lora_training_adds(model_type):
    """shardtune plan's LoRA count with --lora_target_experts and routers is the numel PEFT trains; and the
    merged expert copy each block keeps for backward is one block's expert tensors in the compute dtype."""
    from peft import LoraConfig, get_peft_model

    from shardtune.planning.activations import expert_lora_saved_bytes
    from shardtune.planning.model import lora_param_count, resolve_lora_targets
    from shardtune.planning.shape import ModelShape

    config = families.tiny_config(CONFIG_MAPPING[model_type]())
    shape = ModelShape.from_config(config)
    model = _model(model_type)
    experts = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.0.mlp."))
    params = targets.plan_parameters(model, "routers", experts=True).names
    lora = LoraConfig(r=4, target_modules=targets.plan_all_linear(model).paths, target_parameters=params)
    trained = sum(p.numel() for n, p in get_peft_model(model, lora).named_parameters() if "lora_" in n)
    planned = resolve_lora_targets(shape, "all-linear", ("experts", "routers"))
    assert lora_param_count(shape, 4, planned) == trained
    assert lora_param_count(shape, 4, resolve_lora_targets(shape, "all-linear")) < trained
    assert expert_lora_saved_bytes(shape, 2, planned) == 2 * experts


def test_the_planner_counts_the_router_loss_at_the_loss_not_in_the_blocks_backward():
    """With the router load-balancing loss on (the config's coefficient), every MoE block's router logits and
    the loss's softmax of them (E wide per token, compute dtype) exist at the loss; --router_aux_loss_coef 0
    removes exactly those bytes from the loss phases and nothing from a block's backward."""
    from shardtune.commands.plan import make_plan

    flags = ["--model_name_or_path", "bench/configs/qwen3-30b-a3b", "--use_peft_lora", "True", "--bf16", "True",
             "--max_seq_len", "4096", "--per_device_train_batch_size", "2", "--num_processes", "8"]  # fmt: skip
    on, off = make_plan(flags), make_plan([*flags, "--router_aux_loss_coef", "0"])
    s = on.shape
    assert s.router_aux_loss_coef > 0 and off.shape.router_aux_loss_coef == 0
    per_copy = 2 * 4096 * s.num_layers * s.num_experts * 2  # tokens x layers x E x bf16
    phases = on.estimate.phase_bytes, off.estimate.phase_bytes
    assert phases[0]["loss backward"] - phases[1]["loss backward"] == per_copy
    assert phases[0]["loss forward"] - phases[1]["loss forward"] == 2 * per_copy
    assert phases[0]["decoder-layer backward"] == phases[1]["decoder-layer backward"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_default_target_modules_that_peft_maps_onto_fused_experts_keep_their_dropout(model_type, monkeypatch):
    """The default --lora_target_modules (q/k/v/o, gate/up/down_proj) on a family whose experts transformers 5
    fused: PEFT's conversion adapts the experts' fused tensors for those names, and its parameter wrappers refuse
    any lora_dropout. attach_adapter asks PEFT's conversion first, so the adapter is made, the experts adapted, and
    --lora_dropout 0.1 kept on the linear layers' LoRA input. Planted bug: without asking, PEFT's raw ValueError."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    from shardtune.models import adapter

    default = "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj"
    names = {"qwen3_moe": default, "mixtral": "q_proj,k_proj,v_proj,o_proj,w1,w2,w3"}[model_type]
    kw = {"lora_r": 2, "lora_alpha": 4, "lora_dropout": 0.1, "target_modules": names, "use_dora": False,
          "modules_to_save": None, "new_token_ids": []}  # fmt: skip
    from shardtune.models.preflight import target_module_problems

    assert target_module_problems(_model(model_type), names, explicit=True, model_name=model_type) == []
    peft = adapter.attach_adapter(_model(model_type), **kw)
    wrappers = [m for m in peft.modules() if isinstance(m, ParamWrapper)]
    linear = [m for m in peft.modules() if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper)]
    assert wrappers and linear
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Dropout) for m in linear)
    assert all(m.lora_dropout["default"].p == 0.1 for m in linear)
    assert peft.peft_config["default"].lora_dropout == 0.0  # what PEFT needs to load the saved adapter
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    peft(input_ids=ids, labels=ids).loss.backward()
    assert all(m.lora_A["default"].weight.grad is not None for m in wrappers)
    monkeypatch.setattr(adapter, "names_peft_adapts_as_experts", lambda model, modules: (set(), set()))
    with pytest.raises(ValueError, match="lora_dropout"):
        adapter.attach_adapter(_model(model_type), **kw)
