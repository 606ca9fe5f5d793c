"""Flags, files and environment → RunConfig, as the guide's command lines use them."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from shardtune.config.errors import ConfigError
from shardtune.config.run import parse_args
from shardtune.recipe.run_config import load_run_config

GUIDE_LORA = """--seed 100 --model_name_or_path "meta-llama/Llama-2-70b-hf" --dataset_name "smangrul/ultrachat-10k-chatml"
--chat_template_format "chatml" --add_special_tokens False --append_concat_token False --splits "train,test"
--max_seq_len 2048 --num_train_epochs 1 --logging_steps 5 --log_level "info" --logging_strategy "steps"
--eval_strategy "epoch" --save_strategy "epoch" --push_to_hub --hub_private_repo True --hub_strategy "every_save"
--bf16 True --packing True --learning_rate 1e-4 --lr_scheduler_type "cosine" --weight_decay 1e-4 --warmup_steps 0
--max_grad_norm 1.0 --output_dir "llama-sft-lora-fsdp" --per_device_train_batch_size 8 --per_device_eval_batch_size 8
--gradient_accumulation_steps 4 --gradient_checkpointing True --use_reentrant False --dataset_text_field "content"
--use_flash_attn True --use_peft_lora True --lora_r 8 --lora_alpha 16 --lora_dropout 0.1
--lora_target_modules "all-linear" --use_4bit_quantization False"""

GUIDE_QLORA = """--seed 100 --model_name_or_path "meta-llama/Llama-2-70b-hf" --dataset_name "smangrul/ultrachat-10k-chatml"
--chat_template_format "chatml" --add_special_tokens False --append_concat_token False --splits "train,test"
--max_seq_len 2048 --num_train_epochs 1 --logging_steps 5 --log_level "info" --logging_strategy "steps"
--eval_strategy "epoch" --save_strategy "epoch" --push_to_hub --hub_private_repo True --hub_strategy "every_save"
--bf16 True --packing True --learning_rate 1e-4 --lr_scheduler_type "cosine" --weight_decay 1e-4 --warmup_steps 0
--max_grad_norm 1.0 --output_dir "llama-sft-qlora-fsdp" --per_device_train_batch_size 2 --per_device_eval_batch_size 2
--gradient_accumulation_steps 2 --gradient_checkpointing True --use_reentrant True --dataset_text_field "content"
--use_flash_attn True --use_peft_lora True --lora_r 8 --lora_alpha 16 --lora_dropout 0.1
--lora_target_modules "all-linear" --use_4bit_quantization True --use_nested_quant True
--bnb_4bit_compute_dtype "bfloat16" --bnb_4bit_quant_storage_dtype "bfloat16\""""

QLORA_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_OFFLOAD_PARAMS": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
}


def test_guide_lora_command_parses_to_expected_config():
    cfg = load_run_config(
        shlex.split(GUIDE_LORA), env={"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}
    )
    m, d, t = cfg.model, cfg.data, cfg.train
    assert (m.model_name_or_path, m.chat_template_format, m.use_peft_lora) == (
        "meta-llama/Llama-2-70b-hf",
        "chatml",
        True,
    )
    assert (m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules) == (8, 16, 0.1, "all-linear")
    assert (m.use_4bit_quantization, m.use_reentrant, m.use_flash_attn, m.trust_remote_code) == (
        False,
        False,
        True,
        False,
    )
    assert (d.max_length, d.packing, d.splits, d.dataset_text_field) == (2048, True, "train,test", "content")
    assert (d.add_special_tokens, d.append_concat_token) == (False, False)
    assert (t.seed, t.bf16, t.learning_rate, t.weight_decay, t.lr_scheduler_type) == (100, True, 1e-4, 1e-4, "cosine")
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.gradient_checkpointing) == (8, 4, True)
    assert (t.push_to_hub, t.hub_private_repo, t.hub_strategy) == (True, True, "every_save")
    assert (t.eval_strategy, t.save_strategy, t.logging_steps, t.output_dir) == (
        "epoch",
        "epoch",
        5,
        "llama-sft-lora-fsdp",
    )
    assert cfg.fsdp.enabled and cfg.fsdp.mixed_precision == "bf16"


def test_guide_qlora_command_parses_to_expected_config():
    cfg = load_run_config(shlex.split(GUIDE_QLORA), env=QLORA_ENV)
    m, t = cfg.model, cfg.train
    assert (m.use_4bit_quantization, m.use_nested_quant, m.use_reentrant) == (True, True, True)
    assert (m.bnb_4bit_compute_dtype, m.bnb_4bit_quant_storage_dtype, m.bnb_4bit_quant_type) == (
        "bfloat16",
        "bfloat16",
        "nf4",
    )
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps) == (2, 2)
    assert cfg.fsdp.offload_params and cfg.fsdp.cpu_ram_efficient_loading


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_single_config_file_equals_flags(tmp_path, suffix):
    import yaml

    flags = parse_args(shlex.split(GUIDE_LORA))
    data = {
        "model_name_or_path": "meta-llama/Llama-2-70b-hf",
        "dataset_name": "smangrul/ultrachat-10k-chatml",
        "max_seq_len": 2048,
        "bf16": True,
        "packing": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "use_peft_lora": True,
        "lora_target_modules": "all-linear",
        "seed": 100,
    }
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    model, data_args, train = parse_args([str(path)])
    assert data_args.max_length == 2048 == flags[1].max_length
    assert (model.lora_r, train.bf16, train.seed) == (8, True, 100)


@pytest.mark.parametrize(
    "value,expected", [("true", True), ("True", True), ("false", False), ("False", False), ("1", True), ("0", False)]
)
def test_boolean_values_as_hf_argument_parser(value, expected):
    _, d, _ = parse_args(["--packing", value])
    assert d.packing is expected


def test_bare_boolean_flag_means_true():
    _, _, t = parse_args(["--push_to_hub"])
    assert t.push_to_hub is True


def test_unknown_flag_names_closest_known_flag():
    with pytest.raises(ConfigError) as e:
        parse_args(["--lora_rank", "8", "--learnin_rate", "1e-4"])
    msg = str(e.value)
    assert "--lora_rank" in msg and "--lora_r" in msg
    assert "--learnin_rate" in msg and "did you mean --learning_rate" in msg
    assert "'8'" not in msg  # a flag's value is not reported as a separate problem


def test_unknown_key_in_config_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"lora_alpah": 16}))
    with pytest.raises(ConfigError, match=r"lora_alpah.*did you mean --lora_alpha"):
        parse_args([str(path)])


def test_every_problem_reported_at_once(tmp_path):
    argv = [
        "--model_name_or_path",
        str(tmp_path / "missing"),
        "--dataset_name",
        str(tmp_path / "nodata.jsonl"),
        "--use_peft_lora",
        "True",
        "--lora_r",
        "0",
        "--lora_alpha",
        "-1",
        "--bf16",
        "True",
        "--fp16",
        "True",
        "--use_4bit_quantization",
        "True",
        "--use_8bit_quantization",
        "True",
    ]
    with pytest.raises(ConfigError) as e:
        load_run_config(argv, env={})
    problems = e.value.problems
    joined = "\n".join(problems)
    for needle in (
        "--lora_r must be > 0",
        "--lora_alpha must be > 0",
        "--bf16 and --fp16",
        "--use_4bit_quantization and",
        "no config.json",
        "no such file",
    ):
        assert needle in joined, joined
    assert len(problems) >= 6


def test_required_flags(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_run_config([], env={})
    assert any("--model_name_or_path is required" in p for p in e.value.problems)
    assert any("--dataset_name is required" in p for p in e.value.problems)


def test_trust_remote_code_defaults_to_false():
    m, _, _ = parse_args([])
    assert m.trust_remote_code is False


# ---------------------------------------------------------------- bad input: strict run files, ranges, ignored flags


def _write(path, text: str):
    path.write_text(text)
    return str(path)


def test_run_file_values_are_typed_strictly(tmp_path):
    """A quoted "false" is false (as on the command line), a YAML 1e-4 (a string to YAML) is a float, a list of
    module names is joined; a value of the wrong type is refused naming the key, never a TypeError."""
    good = _write(
        tmp_path / "run.yaml",
        "model_name_or_path: org/m\ndataset_name: org/d\nuse_peft_lora: 'false'\nlearning_rate: 1e-4\n"
        "packing: 'True'\nmax_steps: '7'\n",
    )
    cfg = load_run_config([good], env={})
    assert cfg.model.use_peft_lora is False and cfg.data.packing is True
    assert cfg.train.learning_rate == 1e-4 and cfg.train.max_steps == 7
    lst = _write(tmp_path / "l.yaml", "model_name_or_path: org/m\ndataset_name: org/d\nuse_peft_lora: true\n"
                 "lora_target_modules: [q_proj, v_proj]\n")  # fmt: skip
    assert load_run_config([lst], env={}).model.lora_target_modules == "q_proj,v_proj"

    bad = _write(
        tmp_path / "bad.yaml",
        "model_name_or_path: org/m\ndataset_name: [a, b]\nuse_peft_lora: 'maybe'\nlora_r: eight\n"
        "max_steps: 2.5\nbf16: 1.0\nseed: null\n",
    )
    with pytest.raises(ConfigError) as e:
        load_run_config([bad], env={})
    assert e.value.problems == [
        f"{bad}: dataset_name: ['a', 'b'] is not a string; quote it.",
        f"{bad}: use_peft_lora: 'maybe' is not a boolean; write true or false.",
        f"{bad}: lora_r: 'eight' is not an integer.",
        f"{bad}: max_steps: 2.5 is not an integer; write e.g. max_steps: 2.",
        f"{bad}: bf16: 1.0 is not a boolean; write true or false.",
        f"{bad}: seed: null is not allowed; give a value or remove the key.",
    ]


@pytest.mark.parametrize("text", ["a: [1,\n", '{"a": 1,}'])
def test_unparsable_run_file_names_the_file(tmp_path, text):
    path = _write(tmp_path / ("run.yaml" if text.startswith("a") else "run.json"), text)
    with pytest.raises(ConfigError) as e:
        load_run_config([path], env={})
    (problem,) = e.value.problems
    assert problem.startswith(f"config file {path} cannot be parsed (") and problem.endswith("fix its syntax.")


REQUIRED = ["--model_name_or_path", "org/m", "--dataset_name", "org/d"]


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--learning_rate", "-1e-4"], "--learning_rate must be > 0 (got -0.0001)."),
        (["--learning_rate", "0"], "--learning_rate must be > 0 (got 0.0)."),
        (["--weight_decay", "-0.1"], "--weight_decay must be >= 0 (got -0.1)."),
        (["--adam_beta2", "1"], "--adam_beta2 must be in [0, 1) (got 1.0)."),
        (["--adam_epsilon", "-1e-8"], "--adam_epsilon must be > 0 (got -1e-08)."),
        (["--max_grad_norm", "nan"], "--max_grad_norm must be >= 0 (got nan)."),
        (["--warmup_steps", "-5"], "--warmup_steps must be >= 0 (got -5)."),
        (["--save_steps", "0"], "--save_steps must be > 0 (got 0.0)."),
        (["--save_total_limit", "0"], "--save_total_limit must be >= 1 (got 0)."),
        (["--seed", "-1"], f"--seed must be in [0, {2**32 - 1}] (got -1)."),
        (["--ddp_timeout", "-30"], "--ddp_timeout must be > 0 (got -30)."),
        (["--max_train_samples", "-3"], "--max_train_samples must be >= 1 (got -3)."),
        (["--router_aux_loss_coef", "-0.01"], "--router_aux_loss_coef must be >= 0 (got -0.01)."),
    ],
)
def test_negative_and_out_of_range_numbers_parse_and_are_refused(flags, problem):
    """`--flag -1e-4` reaches validation (argparse alone stops at values starting with '-' unless they look like
    -1 or -.5), which names the flag, the allowed range and the value."""
    with pytest.raises(ConfigError) as e:
        load_run_config([*REQUIRED, *flags], env={})
    assert e.value.problems == [problem]


def test_negative_values_in_range_are_accepted():
    cfg = load_run_config([*REQUIRED, "--max_steps", "-1", "--num_train_epochs", "2", "--seed", "0"], env={})
    assert (cfg.train.max_steps, cfg.train.num_train_epochs, cfg.train.seed) == (-1, 2.0, 0)
    assert cfg.train.router_aux_loss_coef is None  # the config's coefficient
    cfg = load_run_config([*REQUIRED, "--router_aux_loss_coef", "0"], env={})
    assert cfg.train.router_aux_loss_coef == 0.0


def test_router_aux_loss_coef_applies_to_preference_objectives():
    """DPO and KTO add the router load-balancing loss as SFT does (shardtune.objectives.loss): the flag is taken."""
    for objective in ("dpo", "kto"):
        cfg = load_run_config([*REQUIRED, "--objective", objective, "--router_aux_loss_coef", "0.01"], env={})
        assert cfg.train.router_aux_loss_coef == 0.01
    assert load_run_config([*REQUIRED, "--objective", "dpo"], env={}).train.router_aux_loss_coef is None


def test_full_fine_tuning_refuses_explicit_adapter_flags(tmp_path):
    """LoRA/DoRA flags given with --use_peft_lora False would be ignored: refused, naming each; their defaults
    (not given) and the same flags with LoRA on are fine."""
    with pytest.raises(ConfigError) as e:
        load_run_config([*REQUIRED, "--use_peft_lora", "False", "--lora_r", "8", "--use_dora", "True"], env={})
    want = "--lora_r, --use_dora set an adapter, but --use_peft_lora is False (full fine-tuning, where they would be "
    assert e.value.problems == [want + "ignored): add --use_peft_lora True, or remove them."]
    assert load_run_config([*REQUIRED, "--use_peft_lora", "False"], env={}).explicit >= {"use_peft_lora"}
    assert load_run_config([*REQUIRED, "--use_peft_lora", "True", "--lora_r", "8"], env={}).model.lora_r == 8
    run = _write(tmp_path / "run.json", json.dumps({"model_name_or_path": "org/m", "dataset_name": "org/d",
                                                    "use_peft_lora": "false", "lora_alpha": 32}))  # fmt: skip
    with pytest.raises(ConfigError, match="--lora_alpha set an adapter, but --use_peft_lora is False"):
        load_run_config([run], env={})


# A flag that means something only while another setting is on: (the flag with a value, the setting that turns it
# on, the fix the message names).
DEPENDENT = [
    (["--dora_dropout", "peft"], ["--use_dora", "True"], "--use_dora True"),
    (["--use_nested_quant", "True"], ["--use_4bit_quantization", "True"], "--use_4bit_quantization True"),
    (["--bnb_4bit_compute_dtype", "bfloat16"], ["--use_4bit_quantization", "True"], "--use_4bit_quantization True"),
    (["--bnb_4bit_quant_type", "fp4"], ["--use_4bit_quantization", "True"], "--use_4bit_quantization True"),
    (["--use_reentrant", "True"], ["--gradient_checkpointing", "True"], "--gradient_checkpointing True"),
    (["--checkpoint_every_n_layers", "2"], ["--gradient_checkpointing", "True"], "--gradient_checkpointing True"),
    (["--packing_window", "50"], ["--streaming", "True", "--max_steps", "5"], "--streaming True"),
    (["--eval_steps", "10"], ["--eval_strategy", "steps"], "--eval_strategy steps"),
    (["--save_steps", "10", "--save_strategy", "epoch"], ["--save_strategy", "steps"], "--save_strategy steps"),
    (["--logging_steps", "3", "--logging_strategy", "no"], ["--logging_strategy", "steps"], "--logging_strategy steps"),
    (
        ["--save_total_limit", "2", "--save_strategy", "no"],
        ["--save_strategy", "epoch"],
        "--save_strategy steps (or epoch)",
    ),
]


@pytest.mark.parametrize(("flag", "switch", "fix"), DEPENDENT, ids=[d[0][0] for d in DEPENDENT])
def test_a_flag_whose_setting_is_off_is_refused_naming_the_setting(flag, switch, fix):
    """It would change nothing (transformers and the reference script ignore it): refused naming what turns it on,
    accepted with that; its default value alone is never refused."""
    base = [*REQUIRED, "--use_peft_lora", "True", "--splits", "train,test"]
    with pytest.raises(ConfigError) as e:
        load_run_config([*base, *flag], env={})
    assert e.value.problems == [f"{flag[0]} {flag[1]} only applies with {fix}: add it, or remove {flag[0]}."]
    assert flag[0][2:] in load_run_config([*base, *flag, *switch], env={}).explicit


def test_help_does_not_offer_8bit_loading():
    from shardtune.config.arguments import ModelArguments

    help_ = {f.name: f.metadata["help"] for f in dataclasses.fields(ModelArguments)}["use_8bit_quantization"]
    assert help_.startswith("Refused:") and "--use_4bit_quantization" in help_
