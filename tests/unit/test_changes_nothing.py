"""A flag that would change nothing in the run's configuration is refused (or, for --lora_r, warned) with one line
naming it (docs/errors.md, "Bad input"): the configuration's own cases (shardtune.config.validation: _DEPENDENT,
NEW_ADAPTER_FLAGS, ADAPTER_FLAGS) and those that need the model's config (shardtune.models.preflight: the router
loss on a model without one, a LoRA rank that is not low). Each case has its negative control: with the setting
that makes the flag matter, it is accepted."""

from __future__ import annotations

import pytest

from shardtune.config.errors import ConfigError
from shardtune.models import preflight
from shardtune.recipe.run_config import load_run_config

REQUIRED = ["--model_name_or_path", "org/m", "--dataset_name", "org/d"]


@pytest.mark.parametrize(
    ("flag", "switch", "fix"),
    [
        (["--warmup_ratio", "0.1"], ["--warmup_steps", "0"], "--warmup_steps 0 (a step count wins over it)"),
        (["--max_eval_samples", "5"], ["--splits", "train,test"], "an evaluation split in --splits"),
        (["--hub_model_id", "me/run"], ["--push_to_hub", "True"], "--push_to_hub True"),
        (["--hub_strategy", "end"], ["--push_to_hub", "True"], "--push_to_hub True"),
        (["--hub_private_repo", "True"], ["--push_to_hub", "True"], "--push_to_hub True"),
    ],
)
def test_a_flag_whose_setting_is_off_is_refused(flag, switch, fix):
    # The setting off: --warmup_steps 10 (a count), --splits train (no evaluation split), no --push_to_hub.
    off = {"--warmup_ratio": ["--warmup_steps", "10"], "--max_eval_samples": ["--splits", "train"]}.get(flag[0], [])
    with pytest.raises(ConfigError) as e:
        load_run_config([*REQUIRED, *off, *flag], env={})
    assert e.value.problems == [f"{flag[0]} {flag[1]} only applies with {fix}: add it, or remove {flag[0]}."]
    cfg = load_run_config([*REQUIRED, *flag, *switch], env={})  # negative control: the setting on
    assert flag[0][2:] in cfg.explicit


def test_the_hub_token_is_refused_without_being_printed():
    with pytest.raises(ConfigError) as e:
        load_run_config([*REQUIRED, "--hub_token", "hf_secret123"], env={})
    assert e.value.problems == [("--hub_token <redacted> only applies with --push_to_hub True: add it, or remove "
                                "--hub_token.")]  # fmt: skip


def test_merge_adapter_without_an_adapter_is_refused():
    with pytest.raises(ConfigError) as e:
        load_run_config([*REQUIRED, "--merge_adapter", "True"], env={})
    assert e.value.problems == [
        (
            "--merge_adapter set an adapter, but --use_peft_lora is False (full fine-tuning, where they would be "
            "ignored): add --use_peft_lora True, or remove them."
        )
    ]
    assert load_run_config(
        [*REQUIRED, "--merge_adapter", "True", "--use_peft_lora", "True"], env={}
    ).train.merge_adapter


def test_a_new_adapters_shape_with_adapter_path_is_refused(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    base = [*REQUIRED, "--use_peft_lora", "True", "--adapter_path", str(adapter)]
    with pytest.raises(ConfigError) as e:
        load_run_config([*base, "--lora_r", "8", "--lora_target_modules", "q_proj"], env={})
    assert e.value.problems == [
        (
            f"--lora_r, --lora_target_modules shape a new adapter, but --adapter_path {adapter} continues an adapter "
            "whose adapter_config.json decides them (they would be ignored): remove them."
        )
    ]
    load_run_config([*base, "--lora_dropout", "0.05"], env={})  # read with target parameters: not refused
    load_run_config([*REQUIRED, "--use_peft_lora", "True", "--lora_r", "8"], env={})  # a new adapter: its shape


# ---------------------------------------------------------------- checks that read the model's config


def _tiny(model_type: str):
    from transformers import CONFIG_MAPPING

    from shardtune.models import families

    config = families.tiny_config(CONFIG_MAPPING[model_type]())
    return config, preflight.meta_skeleton(config)


def test_the_router_loss_coefficient_on_a_dense_model_is_refused():
    _, dense = _tiny("llama")
    problem = preflight.router_aux_problem(dense, 0.02, "tiny-llama")
    assert problem == (
        "--router_aux_loss_coef 0.02: tiny-llama (LlamaForCausalLM) has no router load-balancing loss (it is not a "
        "mixture of experts, or its family defines none), so the flag would change nothing; remove it."
    )
    assert preflight.router_aux_problem(dense, None, "tiny-llama") is None  # not given: nothing to say
    # 0, "no such loss", is true of a dense model: a command line shared by several families may say it
    assert preflight.router_aux_problem(dense, 0.0, "tiny-llama") is None
    _, moe = _tiny("mixtral")
    assert preflight.router_aux_problem(moe, 0.02, "tiny-mixtral") is None  # negative control: it matters there


def test_the_router_loss_coefficient_is_checked_before_loading(tmp_path):
    """Through the training run's model checks (models.preflight.model_input_problems), for full fine-tuning too."""
    from shardtune.commands.demo import build_model, build_tokenizer

    build_tokenizer(tmp_path / "m", vocab_size=128)
    build_model(tmp_path / "m", vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    args = ["--model_name_or_path", str(tmp_path / "m"), "--dataset_name", "org/d", "--max_seq_len", "64"]
    cfg = load_run_config([*args, "--router_aux_loss_coef", "0.01"], env={})
    problems = preflight.model_input_problems(cfg)
    assert len(problems) == 1 and problems[0].startswith("--router_aux_loss_coef 0.01: ")
    assert preflight.model_input_problems(load_run_config(args, env={})) == []


def test_a_lora_rank_that_is_not_low_is_warned(monkeypatch):
    """r at or above min(in, out) of every targeted linear is warned; below the widest one's, nothing is said."""
    config, skeleton = _tiny("llama")
    said: list[str] = []
    monkeypatch.setattr(preflight, "warn0", said.append)
    hidden, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    preflight.warn_full_rank(skeleton, kv, "k_proj,v_proj")  # (kv, hidden): min is kv
    assert len(said) == 1 and said[0].startswith(f"--lora_r {kv} is at least the smaller width of every layer")
    assert f"use --lora_r below {kv}" in said[0]
    preflight.warn_full_rank(skeleton, kv - 1, "k_proj,v_proj")  # negative control: low-rank
    gate = min(skeleton.model.layers[0].mlp.gate_proj.weight.shape)
    preflight.warn_full_rank(skeleton, kv, "gate_proj,k_proj")  # gate_proj is wider than r: low-rank there
    assert len(said) == 1 and gate > kv
    preflight.warn_full_rank(skeleton, max(hidden, gate), "all-linear")
    assert len(said) == 2
    preflight.warn_full_rank(skeleton, hidden, r".*\.self_attn\.(k|v)_proj")  # one expression, full-matched
    assert len(said) == 3
