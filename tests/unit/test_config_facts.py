"""Facts that have one home: the sharding strategies (parallel.dims), the run's precision (RunConfig.precision),
the optimizer names (training.optimizers), activation checkpointing (config.arguments.activation_checkpointing), the
dropout policy of an objective (objectives.loss.dropout_off), the vocabulary's row multiple
(data.templates.VOCAB_MULTIPLE) and the hub-id rule (runtime.hub.is_hub_id). Each test checks that
every reader of the fact agrees with its home, so that a second, diverging copy fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from shardtune.cli import main as cli_main
from shardtune.config.accelerate import accelerate_env, fsdp_settings_from_yaml, read_accelerate_yaml
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import fsdp_settings_from_env
from shardtune.data import templates
from shardtune.data.sources import ACCEPTED
from shardtune.models.builder import model_spec
from shardtune.models.loading import resize_embeddings
from shardtune.objectives.loss import OBJECTIVES, dropout_off
from shardtune.parallel.dims import STRATEGIES, ParallelDims
from shardtune.planning import ModelShape, PlanInputs, estimate_memory
from shardtune.planning.fit import launch_from_settings, plan_inputs, plan_shape
from shardtune.planning.known_configs import known_config
from shardtune.recipe.run_config import load_run_config
from shardtune.runtime.hub import is_hub_id
from shardtune.training import optimizers
from shardtune.training.modelcard import _usage as model_card_usage

HUB_ARGS = ["--model_name_or_path", "org/model", "--dataset_name", "org/data"]  # hub ids: no files needed


def _yaml(tmp_path: Path, name: str = "a.yaml", **top) -> Path:
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2, **top}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------- sharding strategies


def test_every_strategy_is_read_by_the_yaml_the_environment_the_mesh_and_the_planner(tmp_path):
    shape = ModelShape.from_config(known_config("meta-llama/Meta-Llama-3-8B"))
    for number, name in enumerate(STRATEGIES, start=1):
        for given in (name, number, name.lower()):
            path = _yaml(tmp_path, fsdp_config={"fsdp_sharding_strategy": given})
            assert fsdp_settings_from_yaml(path).sharding_strategy == name, given
            env = accelerate_env(read_accelerate_yaml(path))
            assert fsdp_settings_from_env(env).sharding_strategy == name, given
        # accelerate config writes the strategy under fsdp_reshard_after_forward (FSDP1): the same names.
        path = _yaml(tmp_path, fsdp_config={"fsdp_reshard_after_forward": name})
        assert fsdp_settings_from_yaml(path).sharding_strategy == name
        dims = ParallelDims.build(world_size=4, local_world_size=2, rank=3, sharding_strategy=name)
        assert dims.dp_size == 4 and dims.dp_rank == 3  # every strategy is data parallel over all ranks
        estimate = estimate_memory(shape, PlanInputs(world_size=4, num_nodes=2, sharding_strategy=name))
        assert estimate.total > 0


def test_an_unknown_strategy_is_refused_by_each_reader_naming_the_same_set(tmp_path):
    with pytest.raises(ConfigError) as e:
        read_accelerate_yaml(_yaml(tmp_path, fsdp_config={"fsdp_sharding_strategy": "ZERO3"}))
    (problem,) = e.value.problems
    assert "fsdp_sharding_strategy 'ZERO3'" in problem
    listed = re.search(r"is not one of (.*) or 1-5", problem).group(1).split(", ")
    assert listed == list(STRATEGIES)
    with pytest.raises(ValueError, match=", ".join(STRATEGIES)):
        ParallelDims.build(world_size=2, local_world_size=2, rank=0, sharding_strategy="ZERO3")
    shape = ModelShape.from_config(known_config("meta-llama/Meta-Llama-3-8B"))
    with pytest.raises(ValueError, match="ZERO3"):
        estimate_memory(shape, PlanInputs(world_size=2, sharding_strategy="ZERO3"))


# ---------------------------------------------------------------- precision

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (flags, mixed_precision in the YAML, LoRA?) -> (compute, storage). The rule (shardtune.config.precision): --bf16 or
# mixed_precision bf16 computes in bf16 (fp16 likewise); a frozen base (LoRA) is stored in the compute dtype, full
# fine-tuning keeps fp32 master weights. Export is the compute dtype; FSDP's param_dtype is None for fp32.
PRECISION_CASES = [
    ([], "no", True, F32, F32),
    ([], "no", False, F32, F32),
    (["--bf16", "True"], "no", True, BF16, BF16),
    (["--bf16", "True"], "no", False, BF16, F32),
    (["--fp16", "True"], "no", True, F16, F16),
    (["--fp16", "True"], "no", False, F16, F32),
    ([], "bf16", True, BF16, BF16),
    ([], "bf16", False, BF16, F32),  # full fine-tuning with the YAML's bf16 exports bf16 (was dtype=None)
    ([], "fp16", True, F16, F16),
    ([], "fp16", False, F16, F32),
    (["--bf16", "True"], "bf16", True, BF16, BF16),
    (["--fp16", "True"], "fp16", False, F16, F32),
]


@pytest.mark.parametrize(("flags", "mixed_precision", "lora", "compute", "storage"), PRECISION_CASES)
def test_the_run_precision_of_each_flag_and_yaml_combination(tmp_path, flags, mixed_precision, lora, compute, storage):
    # From the YAML through the environment `accelerate launch` sets, as a run reads it. An unquoted `no` is YAML's
    # False; accelerate_env writes it back as "no".
    path = _yaml(tmp_path, mixed_precision=False if mixed_precision == "no" else mixed_precision)
    env = accelerate_env(read_accelerate_yaml(path))
    argv = [*HUB_ARGS, *flags, *(["--use_peft_lora", "True"] if lora else [])]
    p = load_run_config(argv, env=env).precision
    assert (p.compute, p.storage, p.export) == (compute, storage, compute)
    assert p.param_dtype == (None if compute == F32 else compute)
    assert (p.bf16, p.fp16) == (compute == BF16, compute == F16)
    assert fsdp_settings_from_yaml(path).mixed_precision == mixed_precision


@pytest.mark.parametrize(("flag", "mixed_precision"), [("--bf16", "fp16"), ("--fp16", "bf16")])
def test_a_precision_flag_that_contradicts_the_yaml_is_refused(flag, mixed_precision):
    env = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": mixed_precision}
    with pytest.raises(ConfigError) as e:
        load_run_config([*HUB_ARGS, flag, "True"], env=env)
    want = f"{flag} True and the accelerate config's mixed_precision: {mixed_precision} disagree; set one of them"
    assert e.value.problems == [f"{want} (or make them the same)."]


# ---------------------------------------------------------------- optimizer names


def _train_help(capsys) -> str:
    """What `shardtune train --help` prints, on one line."""
    assert cli_main(["train", "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_optim_help_and_validation_read_the_optimizer_registry(monkeypatch, capsys):
    assert f"--optim OPTIM The optimizer: {optimizers.names()}." in _train_help(capsys)
    for name in optimizers.OPTIMIZERS:
        assert load_run_config([*HUB_ARGS, "--optim", name], env={}).train.optim == name
    # An optimizer registered in shardtune.training.optimizers is a valid --optim with no other change, and --help
    # lists it (the help is read from the registry when the parser is built, not when the flags were defined).
    toy = dataclasses.replace(optimizers.OPTIMIZERS["adamw_torch"], name="toy_sgd")
    monkeypatch.setitem(optimizers.OPTIMIZERS, "toy_sgd", toy)
    assert "or toy_sgd." in _train_help(capsys)
    assert load_run_config([*HUB_ARGS, "--optim", "toy_sgd"], env={}).train.optim == "toy_sgd"
    with pytest.raises(ConfigError) as e:
        load_run_config([*HUB_ARGS, "--optim", "adamw_9bit"], env={})
    assert e.value.problems == [f"--optim 'adamw_9bit' is not supported; use {optimizers.names()}."]
    assert "toy_sgd" in e.value.problems[0]


# ---------------------------------------------------------------- activation checkpointing, dropout, vocabulary rows


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("yaml_key", [False, True])
def test_checkpointing_from_either_flag_is_what_the_builder_the_checks_and_the_planner_read(flag, yaml_key):
    env = {"FSDP_ACTIVATION_CHECKPOINTING": "true"} if yaml_key else {}
    cfg = load_run_config([*HUB_ARGS, "--gradient_checkpointing", str(flag)], env=env)
    expected = flag or yaml_key
    assert cfg.activation_checkpointing is expected
    assert model_spec(cfg, "cpu", 64, []).gradient_checkpointing is expected
    launch = launch_from_settings(cfg.fsdp, world_size=2, num_nodes=1)
    assert plan_inputs(cfg, launch).gradient_checkpointing is expected
    # --gradient_checkpointing_kwargs is refused exactly when checkpointing is off.
    argv = [
        *HUB_ARGS,
        "--gradient_checkpointing",
        str(flag),
        "--gradient_checkpointing_kwargs",
        '{"use_reentrant": false}',
    ]
    if expected:
        load_run_config(argv, env=env)
    else:
        with pytest.raises(ConfigError, match="--gradient_checkpointing_kwargs applies to activation checkpointing"):
            load_run_config(argv, env=env)


@pytest.mark.parametrize(
    "data, drops, expected",
    [("rows", None, False), ("pairs", None, True), ("kto", None, True), ("rows", True, True), ("pairs", False, False)],
)
def test_dropout_off_is_the_objective_spec_s_rule_for_the_run_and_the_planner(monkeypatch, data, drops, expected):
    """A registered objective's dropout policy (ObjectiveSpec.drops_dropout, else: off for preference data) is what
    the run applies (recipe.objective) and what the planner counts LoRA dropout's masks by; --disable_dropout False
    keeps dropout for every objective."""
    spec = dataclasses.replace(OBJECTIVES["sft"], name="toy", data=data, drops_dropout=drops)
    monkeypatch.setitem(OBJECTIVES, "toy", spec)
    assert dropout_off("toy", True) is expected
    assert dropout_off("toy", False) is False
    cfg = load_run_config([*HUB_ARGS, "--objective", "toy", "--use_peft_lora", "True", "--lora_dropout", "0.1"], env={})
    launch = launch_from_settings(cfg.fsdp, world_size=2, num_nodes=1)
    assert plan_inputs(cfg, launch).lora_dropout == (0.0 if expected else 0.1)
    for name in ("sft", "dpo", "kto"):  # the built-in objectives: SFT keeps dropout, the preference ones drop it
        assert dropout_off(name, True) is (name != "sft")


def test_the_vocabulary_multiple_is_read_by_training_the_planner_and_the_card(monkeypatch, tmp_path):
    """The embeddings grow to a multiple of data.templates.VOCAB_MULTIPLE rows: with another multiple, every reader
    follows (a reader with its own 8 would not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(templates, "VOCAB_MULTIPLE", 24)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    assert resize_embeddings(model, 50) == 72 == model.get_input_embeddings().weight.shape[0]
    assert plan_shape({"model_type": "llama", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2}, "chatml").vocab_size == 48  # fmt: skip
    card = model_card_usage("peft", "org/base", "org/adapter")
    assert "pad_to_multiple_of=24" in card


# ---------------------------------------------------------------- hub id or local path

HUB_IDS = ["gpt2", "org/name", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.1-8B", "smangrul/ultrachat-10k-chatml"]
PATHS = ["./model", "/abs/model", "~/model", "a/b/c", "org/name/", "a\\b", "my model", "a--b", "org/a..b", ""]


def test_is_hub_id_is_the_hub_rule_and_a_path_that_exists_wins(tmp_path, monkeypatch):
    assert [r for r in HUB_IDS if not is_hub_id(r)] == []
    assert [r for r in PATHS if is_hub_id(r)] == []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)  # a local folder named like a hub id is the folder
    assert not is_hub_id("org/name") and is_hub_id("org/other")
    # A data file's name that is missing is a file, when the caller names the suffixes of its files.
    assert is_hub_id("train.jsonl") and not is_hub_id("train.jsonl", file_suffixes={".jsonl"})
    assert not is_hub_id("TRAIN.JSONL", file_suffixes={".jsonl"})


@pytest.mark.parametrize("ref", ["a/b/c", "my model", "./missing"])
def test_train_chat_preflight_card_and_data_treat_a_non_hub_name_as_a_missing_path(tmp_path, monkeypatch, ref):
    from shardtune.data.sources import load_split
    from shardtune.inference import load as inference
    from shardtune.models import preflight
    from shardtune.training.modelcard import write_model_card

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_run_config(["--model_name_or_path", ref, "--dataset_name", ref], env={})
    assert e.value.problems == [
        f"--model_name_or_path {ref}: no config.json there; give a model folder or a hub id.",
        f"--dataset_name {ref}: no such file or folder; give {ACCEPTED}.",
    ]
    config, problem = preflight.model_config_or_problem(ref)
    assert config is None and problem == f"--model_name_or_path {ref}: no such folder; give a model folder or a hub id."
    assert preflight.tokenizer_problem(ref, "--tokenizer_name_or_path").startswith(
        f"--tokenizer_name_or_path {ref}: no such folder"
    )
    with pytest.raises(ValueError, match=re.escape(f"--model_name_or_path {ref}: no such folder.")):
        inference.resolve_paths(ref, None)
    with pytest.raises(ValueError, match="no such file or folder"):
        load_split(ref, "train", is_train=True)
    (tmp_path / "out").mkdir()
    card = write_model_card(
        tmp_path / "out", base_model=ref, method="LoRA", datasets=[ref], hyperparameters={}, metrics={}
    )
    text = card.read_text()
    assert "huggingface.co" not in text and "base_model:" not in text
