"""Command lines written for transformers' Trainer and TRL: step intervals as ratios, flags given twice, TRL's and
transformers' spellings (--torch_dtype, --gradient_checkpointing_kwargs, list flags as several words), a precision
flag against the accelerate config's, the precision line every run logs, and a regex target's dead alternative."""

from __future__ import annotations

import json

import pytest
from torch import nn

from shardtune.config import run as config
from shardtune.config.arguments import interval_steps
from shardtune.config.errors import ConfigError
from shardtune.config.run import parse_args, precision_line
from shardtune.models import targets
from shardtune.recipe.run_config import load_run_config

BASE = ["--model_name_or_path", "org/model", "--dataset_name", "org/data"]
FSDP_BF16 = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}
FSDP_NO = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "no"}


def _load(*flags, env=None):
    return load_run_config([*BASE, *flags], env=env or {})


def _refused(*flags, env=None) -> str:
    with pytest.raises(ConfigError) as e:
        _load(*flags, env=env)
    return str(e.value)


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(config, "warn0", seen.append)
    monkeypatch.setattr(targets, "warn0", seen.append)
    return seen


# ------------------------------------------------------------------------------------- step intervals


@pytest.mark.parametrize(("value", "total", "steps"), [(0.1, 95, 10), (0.25, 10, 3), (0.001, 10, 1), (5.0, 95, 5)])
def test_a_value_below_one_is_a_ratio_of_the_total_steps(value, total, steps):
    """transformers' rule: ceil(ratio × max_steps) below 1, the number itself from 1 up."""
    assert interval_steps(value, total) == steps


def test_the_loop_reads_ratios_against_the_run_total():
    from shardtune.recipe.settings import loop_settings

    cfg = _load("--save_steps", "0.5", "--logging_steps", "0.1", "--eval_strategy", "steps", "--splits", "a,b")
    s = loop_settings(cfg, total=95, steps_per_epoch=95, pad_id=0)
    assert (s.save_steps, s.logging_steps, s.eval_steps) == (48, 10, 10)  # eval: --logging_steps' ratio


@pytest.mark.parametrize("flag", ["--save_steps", "--eval_steps", "--logging_steps"])
def test_a_fractional_number_of_steps_is_refused_naming_the_flag(flag):
    msg = _refused(flag, "2.5")
    assert f"{flag} 2.5: from 1 up it is a number of steps and must be a whole number (e.g. 3)" in msg
    assert f"{flag} must be > 0 (got 0.0)" in _refused(flag, "0")


# ------------------------------------------------------------------------------------- a flag given twice


def test_two_aliases_with_different_values_are_refused():
    msg = _refused("--max_length", "512", "--max_seq_len", "1024")
    assert "--max_length 512 and --max_seq_len 1024 both set --max_length, to different values; give it once" in msg


def test_two_aliases_with_the_same_value_are_one_warning(warnings):
    assert _load("--max_seq_length", "512", "--max_length", "512").data.max_length == 512
    assert warnings == [
        (
            "the command line: --max_seq_length 512 and --max_length 512 both set --max_length (the same value); give "
            "it once."
        )
    ]


def test_one_flag_repeated_keeps_the_last_and_says_so(warnings):
    """argparse's rule, which command lines that append an override rely on."""
    assert _load("--seed", "1", "--seed", "2").train.seed == 2
    assert warnings == ["the command line: --seed is given 2 times; the last, 2, is used."]


def test_a_run_file_with_two_aliases_is_refused(tmp_path):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"model_name_or_path": "org/m", "dataset_name": "org/d", "max_seq_len": 8,
                             "max_length": 16}))  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_run_config([str(f)], env={})
    assert f"{f}: --max_seq_len 8 and --max_length 16 both set --max_length, to different values" in str(e.value)


# ------------------------------------------------------------------------------------- TRL's spellings


@pytest.mark.parametrize(
    ("flags", "bf16", "fp16"),
    [(["--torch_dtype", "bfloat16"], True, False), (["--dtype", "float16"], False, True),
     (["--torch_dtype", "float32"], False, False), (["--torch_dtype", "bf16", "--bf16", "True"], True, False)],
)  # fmt: skip
def test_torch_dtype_is_the_precision_flag(flags, bf16, fp16):
    t = _load(*flags).train
    assert (t.bf16, t.fp16) == (bf16, fp16)


@pytest.mark.parametrize(
    ("flags", "want"),
    [(["--torch_dtype", "float16", "--bf16", "True"], "--torch_dtype float16 and --bf16 True disagree"),
     (["--torch_dtype", "auto"], ("--torch_dtype auto: the dtype of the model's config; shardtune trains in the "
                                 "precision you name: give bfloat16 (= --bf16 True), float16")),
     (["--torch_dtype", "int8"], "--torch_dtype int8: not a training dtype")],
)  # fmt: skip
def test_torch_dtype_that_does_not_map_is_refused_with_the_fix(flags, want):
    assert want in _refused(*flags)


def test_gradient_checkpointing_kwargs_sets_use_reentrant(tmp_path):
    cfg = _load("--gradient_checkpointing", "True", "--gradient_checkpointing_kwargs", '{"use_reentrant": true}')
    assert cfg.model.use_reentrant is True
    f = tmp_path / "run.yaml"  # a run file gives it as a mapping, as TRL's YAML configs do
    f.write_text("model_name_or_path: org/m\ndataset_name: org/d\ngradient_checkpointing: true\n"
                 "gradient_checkpointing_kwargs:\n  use_reentrant: true\n")  # fmt: skip
    assert load_run_config([str(f)], env={}).model.use_reentrant is True


@pytest.mark.parametrize(
    ("value", "extra", "want"),
    [("use_reentrant=false", [], ("--gradient_checkpointing_kwargs 'use_reentrant=false' is not a JSON object; "
                                 """write e.g. '{"use_reentrant": false}'""")),
     ('{"preserve_rng_state": false}', [], "--gradient_checkpointing_kwargs: preserve_rng_state is not supported"),
     ('{"use_reentrant": true}', ["--use_reentrant", "False"], "use_reentrant true and --use_reentrant False disagree")],
)  # fmt: skip
def test_gradient_checkpointing_kwargs_refused_with_the_fix(value, extra, want):
    assert want in _refused("--gradient_checkpointing", "True", "--gradient_checkpointing_kwargs", value, *extra)


def test_gradient_checkpointing_kwargs_without_checkpointing_is_not_ignored():
    msg = _refused("--gradient_checkpointing_kwargs", '{"use_reentrant": false}')
    assert "--gradient_checkpointing_kwargs applies to activation checkpointing, which is off" in msg


@pytest.mark.parametrize(
    ("argv", "field", "want"),
    [(["--lora_target_modules", "q_proj", "v_proj"], "lora_target_modules", "q_proj,v_proj"),
     (["--report_to", "wandb", "tensorboard", "--seed", "3"], "report_to", "wandb,tensorboard"),
     (["--report_to=none", "tensorboard"], "report_to", "none,tensorboard"),
     (["--modules_to_save", "embed_tokens", "lm_head"], "modules_to_save", "embed_tokens,lm_head")],
)  # fmt: skip
def test_list_flags_take_several_words(argv, field, want):
    model, _, train = parse_args([*BASE, *argv])
    assert getattr(model if hasattr(model, field) else train, field) == want


def test_an_optional_boolean_alone_is_true():
    _, data, train = parse_args([*BASE, "--completion_only_loss", "--hub_private_repo"])
    assert (data.completion_only_loss, train.hub_private_repo) == (True, True)
    assert parse_args([*BASE, "--completion_only_loss", "False"])[1].completion_only_loss is False
    assert parse_args(BASE)[1].completion_only_loss is None


# ------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    ("flags", "want"),
    [(["--bf16", "False"], ("--bf16 False asks for float32, but the accelerate config's mixed_precision: bf16 "
                           "trains in bf16; set mixed_precision: 'no' in the config, or remove --bf16 False.")),
     (["--torch_dtype", "float32"], "--torch_dtype float32 asks for float32, but the accelerate config's")],
)  # fmt: skip
def test_a_precision_flag_the_yaml_overrides_is_refused(flags, want):
    assert want in _refused(*flags, env=FSDP_BF16)


@pytest.mark.parametrize(
    ("flags", "env", "want"),
    [([], {}, "precision: compute float32, storage float32 (neither --bf16 nor --fp16)"),
     (["--bf16", "True", "--use_peft_lora", "True"], FSDP_NO,
      ("precision: compute bfloat16, storage bfloat16 (--bf16 True; overrides the accelerate config's mixed_precision: "
      "no)")),
     ([], FSDP_BF16, "precision: compute bfloat16, storage float32 (mixed_precision: bf16)")],
)  # fmt: skip
def test_every_run_logs_its_precision_in_one_line(flags, env, want):
    assert precision_line(_load(*flags, env=env)) == want  # logged by `shardtune train` (the CLI test checks it)


# ------------------------------------------------------------------------------------- a regex target


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.v_proj, self.up_proj = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)


def test_a_regex_alternative_that_matches_no_module_is_warned(warnings):
    from shardtune.models.preflight import target_module_problems

    model = nn.Sequential(_Block())
    pattern = r".*\.(q_proj|v_proj|qkv_proj)"
    assert target_module_problems(model, pattern, explicit=True, model_name="m") == []
    assert warnings == [
        (
            f"--lora_target_modules '{pattern}': its alternative 'qkv_proj' matches no module (PEFT skips it); the "
            "model's layers are named q_proj, up_proj, v_proj."
        )
    ]
    warnings.clear()
    for fine in (r".*\.(q|v)_proj", r".*(?:q_proj|up_proj)", r".*[|]?q_proj"):  # every alternative matches
        assert target_module_problems(model, fine, explicit=True, model_name="m") == [] and warnings == [], fine
    target_module_problems(model, r".*q_proj|.*w_proj", explicit=True, model_name="m")
    assert [w.split(": its ")[1].split(" matches")[0] for w in warnings] == ["alternative '.*w_proj'"]
