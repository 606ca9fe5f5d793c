"""accelerate's `parallelism_config` (the YAML section, and the PARALLELISM_CONFIG_* variables `accelerate launch`
sets from it) honoured or refused the same way under every launcher: `accelerate launch` (the environment
accelerate 1.15 itself builds), `shardtune launch`, and torchrun with `shardtune launch --dry_run`'s variables.
dp_replicate_size × dp_shard_size map onto the sharding strategy; context, tensor and sequence parallel sizes above 1
are refused with the reason and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardtune.commands.launch import build_launch
from shardtune.config.accelerate import accelerate_env, read_accelerate_yaml
from shardtune.config.errors import ConfigError
from shardtune.recipe.run_config import load_run_config

TRAIN = ["--model_name_or_path", "org/model", "--dataset_name", "org/data"]


def _yaml(tmp_path: Path, sizes: dict, *, machines: int = 2, processes: int = 4, version: int = 2, **fsdp) -> Path:
    cfg = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "no",
        "num_machines": machines, "num_processes": processes, "machine_rank": 0, "main_process_ip": "127.0.0.1",
        "main_process_port": 29500, "use_cpu": True,
        "fsdp_config": {"fsdp_version": version, "fsdp_reshard_after_forward": True, **fsdp},
        "parallelism_config": {f"parallelism_config_{k}": v for k, v in sizes.items()},
    }  # fmt: skip
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _accelerate_launch_env(path: Path) -> dict[str, str]:
    """The variables accelerate 1.15's own `accelerate launch --config_file path` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "shardtune", "train"])
    args, _, _ = _validate_launch_command(args)
    return {k: str(v) for k, v in prepare_multi_gpu_env(args).items()}


def _train_env(launcher_env: dict, world: int = 4, local: int = 2) -> dict[str, str]:
    return {**launcher_env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local)}


def _dry_run_env(path: Path, capsys) -> dict[str, str]:
    from shardtune.commands.launch import main

    assert main(["--config_file", str(path), "--dry_run", *TRAIN]) == 0
    lines = capsys.readouterr().out.splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and line.split("=", 1)[0].isupper())


def test_the_variables_equal_accelerate_launchs(tmp_path):
    path = _yaml(tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2})
    theirs = _accelerate_launch_env(path)
    ours = accelerate_env(read_accelerate_yaml(path))
    mine = ("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM_CONFIG")  # not TOKENIZERS_PARALLELISM, inherited
    keys = sorted(k for k in theirs if k.startswith(mine))
    assert keys and {k: ours.get(k) for k in keys} == {k: theirs[k] for k in keys}
    assert sorted(k for k in ours if k.startswith(mine)) == keys


@pytest.mark.parametrize(
    ("sizes", "strategy", "world", "local", "want"),
    [({"dp_replicate_size": 2, "dp_shard_size": 2}, "FULL_SHARD", 4, 2, "HYBRID_SHARD"),
     ({"dp_replicate_size": 2, "dp_shard_size": 2}, "SHARD_GRAD_OP", 4, 2, "HYBRID_SHARD_ZERO2"),
     ({"dp_shard_size": 4}, "FULL_SHARD", 4, 2, "FULL_SHARD"),
     ({"dp_shard_size": 4}, "HYBRID_SHARD", 4, 2, "FULL_SHARD"),  # replicate 1: sharded over all
     ({"dp_replicate_size": 4}, "FULL_SHARD", 4, 2, "NO_SHARD")],
)  # fmt: skip
def test_data_parallel_sizes_map_onto_the_sharding_strategy(tmp_path, sizes, strategy, world, local, want):
    path = _yaml(tmp_path, sizes, fsdp_sharding_strategy=strategy)
    cfg = load_run_config(TRAIN, env=_train_env(_accelerate_launch_env(path), world, local))
    assert cfg.fsdp.sharding_strategy == want


CP = (
    "parallelism_config_dp_replicate_size 1 × parallelism_config_dp_shard_size 3 × parallelism_config_cp_size 2 = 6, "
    "but the run has 4 processes; make the product 4 (e.g. parallelism_config_dp_shard_size: 2)."
)


@pytest.mark.parametrize(
    ("sizes", "want"),
    [({"dp_shard_size": 3, "cp_size": 2}, CP),
     ({"dp_shard_size": 3, "tp_size": 2},
      ("parallelism_config_dp_replicate_size 1 × parallelism_config_dp_shard_size 3 × parallelism_config_cp_size 1 × "
       "parallelism_config_tp_size 2 = 6, but the run has 4 processes")),
     ({"dp_replicate_size": 1, "dp_shard_size": 3},
      ("parallelism_config_dp_replicate_size 1 × parallelism_config_dp_shard_size 3 × parallelism_config_cp_size 1 = 3, "
       "but the run has 4 processes")),
     ({"dp_replicate_size": 2, "dp_shard_size": 2},  # on one machine of 4: HYBRID_SHARD would shard over all 4
      ("parallelism_config_dp_replicate_size 2 and parallelism_config_dp_shard_size 2 do not fit "
      "fsdp_sharding_strategy FULL_SHARD on 1 machine(s) of 4 processes"))],
)  # fmt: skip
def test_every_launcher_refuses_the_same_way(tmp_path, capsys, sizes, want):
    one_machine = sizes.get("dp_replicate_size") == 2
    path = _yaml(tmp_path, sizes, machines=1 if one_machine else 2)
    local = 4 if one_machine else 2
    # accelerate launch: the variables accelerate builds, read by `shardtune train` in each process.
    with pytest.raises(ConfigError) as e:
        load_run_config(TRAIN, env=_train_env(_accelerate_launch_env(path), 4, local))
    assert f"the accelerate config's {want}" in str(e.value) and len(e.value.problems) == 1
    # shardtune launch: refused before any process starts, --dry_run included.
    with pytest.raises(ConfigError) as e:
        build_launch(["--config_file", str(path), *TRAIN])
    assert f"{path}: {want}" in str(e.value)
    # torchrun with the variables `shardtune launch --dry_run` prints: the same as accelerate launch.
    env = accelerate_env(read_accelerate_yaml(path))
    with pytest.raises(ConfigError) as e:
        load_run_config(TRAIN, env=_train_env(env, 4, local))
    assert f"the accelerate config's {want}" in str(e.value)


def test_a_consistent_layout_launches_under_shardtune_launch(tmp_path, capsys):
    path = _yaml(tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2})
    env = _dry_run_env(path, capsys)
    assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "2" and env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert load_run_config(TRAIN, env=_train_env(env)).fsdp.sharding_strategy == "HYBRID_SHARD"


def test_plan_reads_the_mapped_strategy(tmp_path):
    """`shardtune plan --config_file` estimates the layout the run will have."""
    from shardtune.config.accelerate import fsdp_settings_from_yaml

    assert fsdp_settings_from_yaml(_yaml(tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2})).sharding_strategy == (
        "HYBRID_SHARD"
    )
    assert fsdp_settings_from_yaml(_yaml(tmp_path, {"dp_shard_size": 2, "cp_size": 2})).sharding_strategy == (
        "FULL_SHARD"
    )


def test_cp_size_is_the_context_parallel_size_and_agrees_with_the_flag(tmp_path):
    """parallelism_config_cp_size 2 (as accelerate launch passes it) is --context_parallel_size 2: the batch is
    shared by 2 ranks, FSDP shards over all 4; the flag may repeat it, not contradict it."""
    env = _train_env(_accelerate_launch_env(_yaml(tmp_path, {"dp_shard_size": 2, "cp_size": 2})), 4, 2)
    cfg = load_run_config(TRAIN, env=env)
    assert (cfg.train.context_parallel_size, cfg.fsdp.sharding_strategy) == (2, "FULL_SHARD")
    assert load_run_config([*TRAIN, "--context_parallel_size", "2"], env=env).train.context_parallel_size == 2
    with pytest.raises(ConfigError) as e:
        load_run_config([*TRAIN, "--context_parallel_size", "4"], env=env)
    assert e.value.problems == [
        "--context_parallel_size 4 and the accelerate config's parallelism_config_cp_size 2 differ: give one of them."
    ]


@pytest.mark.parametrize(
    ("flags", "env", "want"),
    [(["--context_parallel_size", "3"], {"WORLD_SIZE": "4"},
      "--context_parallel_size 3: it must be a whole number ≥ 1 that divides the 4 processes."),
     (["--context_parallel_size", "2", "--torch_compile", "True"], {"WORLD_SIZE": "2"},
      "--context_parallel_size 2 with --torch_compile True: compiled blocks take transformers' own attention"),
     (["--context_parallel_size", "2"], {"WORLD_SIZE": "2", "FSDP_SHARDING_STRATEGY": "NO_SHARD"},
      "--context_parallel_size 2 with fsdp_sharding_strategy NO_SHARD: context parallelism shards over its ranks"),
     (["--context_parallel_size", "4"],
      {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"},
      ("--context_parallel_size 4 with fsdp_sharding_strategy HYBRID_SHARD: it must divide the 2 processes of a "
       "machine"))],
)  # fmt: skip
def test_what_context_parallelism_cannot_run_is_refused_before_loading(flags, env, want):
    with pytest.raises(ConfigError) as e:
        load_run_config([*TRAIN, *flags], env=env)
    assert any(p.startswith(want) for p in e.value.problems), e.value.problems


def test_yaml_mistakes_name_the_key(tmp_path):
    path = _yaml(tmp_path, {"dp_shard_size": 4}, version=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["parallelism_config"]["dp_replicate_size"] = 1  # without the prefix accelerate would ignore it
    cfg["parallelism_config"]["parallelism_config_cp_size"] = "two"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        read_accelerate_yaml(path)
    msg = str(e.value)
    assert (
        "parallelism_config: unknown key 'dp_replicate_size'; did you mean parallelism_config_dp_replicate_size?" in msg
    )
    assert "parallelism_config.parallelism_config_cp_size 'two' is not a whole number" in msg
    assert "parallelism_config needs fsdp_config.fsdp_version: 2 (accelerate refuses it with FSDP1)" in msg


def test_negative_control_variables_read_by_nobody_pass_silently(tmp_path, monkeypatch):
    """The bug the refusal tests guard: with the variables not read, a cp_size 2 run starts as if it had none."""
    from shardtune.config import fsdp as fsdp_settings

    monkeypatch.setattr(fsdp_settings, "parallelism_from_env", lambda env: None)
    path = _yaml(tmp_path, {"dp_shard_size": 2, "cp_size": 2})
    cfg = load_run_config(TRAIN, env=_train_env(_accelerate_launch_env(path)))
    assert cfg.fsdp.parallelism is None and cfg.fsdp.sharding_strategy == "FULL_SHARD"
    assert cfg.train.context_parallel_size == 1


@pytest.mark.parametrize(("option", "value"), [("cp_comm_strategy", "alltoall"), ("cp_backend", "deepspeed")])
def test_a_context_parallel_algorithm_shardtune_does_not_run_is_refused(tmp_path, capsys, option, value):
    """accelerate's cp_comm_strategy (allgather or alltoall) and cp_backend: with cp_size 2, anything but
    all-gather in shardtune's own attention is refused by name under each launcher, not run as all-gather; the
    defaults accelerate writes pass."""
    path = _yaml(tmp_path, {"dp_shard_size": 2, "cp_size": 2, option: value})
    want = f"parallelism_config_{option} {value!r}: shardtune's context parallelism all-gathers"
    with pytest.raises(ConfigError, match=want):
        load_run_config(TRAIN, env=_train_env(_accelerate_launch_env(path)))
    with pytest.raises(ConfigError, match=want):
        build_launch(["--config_file", str(path), *TRAIN])
    with pytest.raises(ConfigError, match=want):
        load_run_config(TRAIN, env=_train_env(accelerate_env(read_accelerate_yaml(path))))
    ok = _yaml(tmp_path, {"dp_shard_size": 2, "cp_size": 2, "cp_comm_strategy": "allgather", "cp_backend": "torch"})
    assert load_run_config(TRAIN, env=_train_env(_accelerate_launch_env(ok))).train.context_parallel_size == 2


def test_hybrid_shard_with_context_parallelism_keeps_a_batchs_cp_ranks_on_one_machine():
    """2 machines of 4 processes, cp 2, HYBRID_SHARD: replicas across the machines, FSDP's shard group the 4
    ranks of a machine (2 data-parallel shards × cp 2), ranks 2k and 2k+1 sharing batch k; the mesh's rows are the
    machines, so the replicate coordinate is the machine and every batch index is taken once."""
    from shardtune.parallel.dims import ParallelDims

    dims = [ParallelDims.build(world_size=8, local_world_size=4, rank=r, sharding_strategy="HYBRID_SHARD", cp=2)
            for r in range(8)]  # fmt: skip
    assert {d.mesh_shape for d in dims} == {(2, 4)} and {d.gradient_divisor for d in dims} == {8}
    assert [d.dp_rank for d in dims] == [0, 0, 1, 1, 2, 2, 3, 3] and [d.cp_rank for d in dims] == [0, 1] * 4
    assert [d.dp_replicate_rank for d in dims] == [r // 4 for r in range(8)]  # the mesh row of rank r
    assert {d.dp_size for d in dims} == {4}
    with pytest.raises(ValueError, match="HYBRID_SHARD a machine's processes it divides"):
        ParallelDims.build(world_size=8, local_world_size=2, rank=0, sharding_strategy="HYBRID_SHARD", cp=4)
