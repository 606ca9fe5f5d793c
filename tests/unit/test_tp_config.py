"""The tensor-parallel degree: from --tensor_parallel_size, accelerate's parallelism_config_tp_size (the YAML, through
accelerate's own launcher's variables) or PARALLELISM_CONFIG_TP_SIZE; the ranks' layout on the mesh (tp innermost,
as torchtitan's); and every combination not supported yet refused with one line naming the flag."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig, MixtralConfig

from shardtune.config.errors import ConfigError
from shardtune.config.run import parse_run_config
from shardtune.config.validation import flag_problems
from shardtune.parallel.dims import ParallelDims
from shardtune.parallel.tensor import family_plan, model_problems
from shardtune.recipe.run_config import load_run_config
from tests.unit.test_parallelism_config import _accelerate_launch_env, _train_env, _yaml

TRAIN = ["--model_name_or_path", "org/model", "--dataset_name", "org/data"]


def test_tp_is_the_innermost_axis():
    """Ranks 2k and 2k+1 share batch k (dp) and hold the two slices (tp); FSDP's mesh leaves tp out."""
    layout = [
        ParallelDims.build(world_size=8, local_world_size=4, rank=r, sharding_strategy="HYBRID_SHARD", tp=2)
        for r in range(8)
    ]
    assert [(d.dp_rank, d.tp_rank) for d in layout] == [(r // 2, r % 2) for r in range(8)]
    d = layout[5]
    assert (d.dp_replicate, d.dp_shard, d.dp_size, d.world_size, d.gradient_divisor) == (2, 2, 4, 8, 4)
    assert d.mesh_shape == (2, 2, 2) and d.mesh_dim_names == ("replicate", "shard", "tp")
    assert d.dp_mesh_dim_names == ("replicate", "shard")
    one = ParallelDims.build(world_size=2, local_world_size=2, rank=1, sharding_strategy="FULL_SHARD", tp=2)
    assert (one.mesh_shape, one.dp_size, one.tp_rank) == ((1, 2), 1, 1)
    with pytest.raises(ValueError, match="tensor parallel size 4 must divide"):
        ParallelDims.build(world_size=8, local_world_size=2, rank=0, sharding_strategy="FULL_SHARD", tp=4)


def test_tp_from_the_flag_the_environment_and_accelerates_yaml(tmp_path):
    assert (
        load_run_config([*TRAIN, "--tensor_parallel_size", "2"], env=_train_env({}, 2, 2)).train.tensor_parallel_size
        == 2
    )
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}  # fmt: skip
    assert load_run_config(TRAIN, env=_train_env(env, 4, 4)).train.tensor_parallel_size == 2
    # The variables accelerate's own `accelerate launch` sets for the YAML's parallelism_config (no longer refused).
    path = _yaml(tmp_path, {"dp_shard_size": 2, "tp_size": 2}, machines=1)
    cfg = load_run_config(TRAIN, env=_train_env(_accelerate_launch_env(path), 4, 4))
    assert (cfg.train.tensor_parallel_size, cfg.fsdp.sharding_strategy) == (2, "FULL_SHARD")


DIFFER = "--tensor_parallel_size 4 and the accelerate config's parallelism_config_tp_size 2 differ"
NOT_A_DIVISOR = "--tensor_parallel_size 4: it must be a whole number ≥ 1 that divides the 2 processes of a machine"
ENV_TP2 = {"PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"}


@pytest.mark.parametrize(
    ("argv", "env", "want"),
    [(["--tensor_parallel_size", "4"], _train_env({}, 4, 2), NOT_A_DIVISOR),
     (["--tensor_parallel_size", "4"], _train_env(ENV_TP2, 4, 4), DIFFER)],
)  # fmt: skip
def test_a_tp_size_that_does_not_fit_is_refused(argv, env, want):
    with pytest.raises(ConfigError) as e:
        load_run_config([*TRAIN, *argv], env=env)
    assert want in str(e.value)


@pytest.mark.parametrize(
    ("flags", "want"),
    [(["--use_peft_lora", "True", "--use_4bit_quantization", "True"], "with a quantized base (QLoRA)"),
     (["--objective", "dpo"], "with --objective dpo"),
     (["--torch_compile", "True"], "with --torch_compile True")],
)  # fmt: skip
def test_combinations_not_supported_yet_are_refused_naming_the_flag(flags, want):
    cfg = parse_run_config([*TRAIN, "--tensor_parallel_size", "2", *flags], env=_train_env({}, 4, 4))
    lines = [p for p in flag_problems(cfg, check_paths=False) if p.startswith("--tensor_parallel_size 2")]
    assert len(lines) == 1 and want in lines[0], lines


@pytest.mark.parametrize("flags", [["--use_peft_lora", "True", "--use_dora", "True"], ["--context_parallel_size", "2"]])
def test_dora_and_context_parallelism_compose_with_tp(flags):
    """DoRA's magnitudes follow their layer's slices, and cp groups hold the ranks of one tp slice
    (tests/distributed/test_tensor_parallel.py proves both equal to one process): no tp line refuses them."""
    cfg = parse_run_config([*TRAIN, "--tensor_parallel_size", "2", *flags], env=_train_env({}, 4, 4))
    assert [p for p in flag_problems(cfg, check_paths=False) if p.startswith("--tensor_parallel_size")] == []


def test_the_model_is_checked_from_its_config():
    """Heads, key/value heads and the MLP's width divisible; a verified plan; no experts."""
    llama = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
    assert family_plan(llama) is not None and model_problems(llama, 2) == []
    problems = model_problems(llama, 4)
    assert len(problems) == 1 and "num_key_value_heads 2 is not divisible by 4" in problems[0]
    assert any("intermediate_size 160 is not divisible by 3" in p for p in model_problems(llama, 3))
    assert "has no tensor-parallel plan" in model_problems(GPT2Config(), 2)[0]
    moe = model_problems(MixtralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2), 2)  # fmt: skip
    assert any("has experts (num_local_experts)" in p for p in moe)


def test_plan_plans_the_tensor_parallel_size(tmp_path):
    """`shardtune plan --tensor_parallel_size 2` plans the tp slices (tests/unit/test_plan_tensor_parallel.py
    checks the terms) rather than every process as a data-parallel rank; tp 1 plans the same command too."""
    import json

    from shardtune.commands.plan import make_plan

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    argv = ["--model_name_or_path", str(tmp_path), "--use_peft_lora", "True", "--max_seq_len", "64",
            "--num_processes", "2"]  # fmt: skip
    assert make_plan([*argv, "--tensor_parallel_size", "2"]).inputs.tensor_parallel == 2
    assert make_plan([*argv, "--tensor_parallel_size", "1"]).inputs.world_size == 2
