"""accelerate configs → FSDPSettings, the environment `accelerate launch` sets, and `shardtune launch`."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardtune.commands.launch import _parser as launch_parser
from shardtune.commands.launch import build_launch, main, torchrun_args
from shardtune.config.accelerate import accelerate_env, fsdp_settings_from_yaml, read_accelerate_yaml
from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import FSDPSettings, fsdp1_only_notes, fsdp_settings_from_env
from shardtune.config.run import parse_args

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
GUIDE_KEYS = [
    "compute_environment",
    "debug",
    "distributed_type",
    "downcast_bf16",
    "fsdp_config",
    "machine_rank",
    "main_training_function",
    "mixed_precision",
    "num_machines",
    "num_processes",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_cpu",
]
GUIDE_FSDP_KEYS = [
    "fsdp_auto_wrap_policy",
    "fsdp_backward_prefetch",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_forward_prefetch",
    "fsdp_offload_params",
    "fsdp_sharding_strategy",
    "fsdp_state_dict_type",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
]
TRAIN_FLAGS = ["--seed", "100", "--splits", "train,test", "--push_to_hub", "--lora_target_modules", "all-linear"]

# A script each process runs instead of training: `dump_env.py OUT MODE [flags]` writes its environment and flags
# to OUT/env_<rank>.json; with MODE gloo it first joins a gloo group and all-reduces rank + 1 (torch's import is
# the slow part, so only the multi-machine tests use it).
DUMP_SCRIPT = """
import json, os, sys
out, mode, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
total = None
if mode == "gloo":
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    total = t.item()
    dist.destroy_process_group()
with open(os.path.join(out, f"env_{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": flags, "sum": total}, f)
"""


@pytest.fixture
def dump_script(tmp_path: Path) -> Path:
    p = tmp_path / "dump_env.py"
    p.write_text(DUMP_SCRIPT)
    return p


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _dumps(out: Path, n: int) -> list[dict]:
    files = sorted(out.glob("env_*.json"))
    assert [f.name for f in files] == [f"env_{r}.json" for r in range(n)]
    return [json.loads(f.read_text()) for f in files]


def _launch_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_yaml(tmp_path: Path, name: str, **changes) -> Path:
    cfg = yaml.safe_load((CONFIGS / "fsdp_config_cpu.yaml").read_text())
    fsdp = changes.pop("fsdp_config", None)
    if fsdp is not None:
        cfg["fsdp_config"] = fsdp
    cfg.update(changes)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


FSDP2_CONFIG = {
    "fsdp_version": 2,
    "fsdp_reshard_after_forward": False,
    "fsdp_offload_params": True,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
    "fsdp_state_dict_type": "FULL_STATE_DICT",
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_activation_checkpointing": True,
}


# ---------------------------------------------------------------------------------------------------------------
# The files


def test_guide_yamls_keep_their_keys_and_cpu_variants_change_only_the_device_keys():
    for name in ("fsdp_config", "fsdp_config_qlora"):
        text = (CONFIGS / f"{name}.yaml").read_text()
        assert not any(line != line.rstrip() for line in text.splitlines()), f"{name}.yaml has trailing spaces"
        guide = yaml.safe_load(text)
        assert list(guide) == GUIDE_KEYS and list(guide["fsdp_config"]) == GUIDE_FSDP_KEYS
        cpu = yaml.safe_load((CONFIGS / f"{name}_cpu.yaml").read_text())
        changed = {k for k in guide if guide[k] != cpu[k]}
        assert changed <= {"num_processes", "use_cpu", "mixed_precision"}
        assert (cpu["num_processes"], cpu["use_cpu"], cpu["mixed_precision"]) == (2, True, "no")
    assert yaml.safe_load((CONFIGS / "fsdp_config.yaml").read_text())["num_processes"] == 8


def test_guide_yamls_to_settings():
    lora = fsdp_settings_from_yaml(CONFIGS / "fsdp_config.yaml")
    assert lora == FSDPSettings(
        enabled=True,
        sharding_strategy="FULL_SHARD",
        offload_params=False,
        cpu_ram_efficient_loading=True,
        sync_module_states=True,
        state_dict_type="SHARDED_STATE_DICT",
        backward_prefetch="BACKWARD_PRE",
        forward_prefetch=False,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_to_wrap=None,
        use_orig_params=False,
        activation_checkpointing=False,
        reshard_after_forward=None,
        mixed_precision="bf16",
    )
    qlora = fsdp_settings_from_yaml(CONFIGS / "fsdp_config_qlora.yaml")
    assert dataclasses.replace(lora, offload_params=True, mixed_precision="no") == qlora
    assert fsdp_settings_from_yaml(CONFIGS / "fsdp_config_cpu.yaml") == dataclasses.replace(lora, mixed_precision="no")
    assert fsdp_settings_from_yaml(CONFIGS / "fsdp_config_qlora_cpu.yaml") == qlora


def test_fsdp2_and_numeric_yamls_to_settings(tmp_path: Path):
    s = fsdp_settings_from_yaml(_write_yaml(tmp_path, "v2.yaml", fsdp_config=FSDP2_CONFIG, mixed_precision="bf16"))
    assert (s.reshard_after_forward, s.sharding_strategy, s.state_dict_type) == (False, "FULL_SHARD", "FULL_STATE_DICT")
    assert (s.transformer_cls_to_wrap, s.activation_checkpointing, s.mixed_precision) == (
        "LlamaDecoderLayer",
        True,
        "bf16",
    )
    # The launcher's defaults for keys the file leaves out: use_orig_params and sync_module_states true.
    assert (s.use_orig_params, s.sync_module_states) == (True, True)
    numeric = _write_yaml(tmp_path, "n.yaml", fsdp_config={"sharding_strategy": 4, "offload_params": True})
    s = fsdp_settings_from_yaml(numeric)  # keys without the fsdp_ prefix, as accelerate accepts
    assert (s.sharding_strategy, s.offload_params, s.reshard_after_forward) == ("HYBRID_SHARD", True, None)
    # What `accelerate config` writes for FSDP1: the strategy under fsdp_reshard_after_forward.
    s = fsdp_settings_from_yaml(
        _write_yaml(tmp_path, "r.yaml", fsdp_config={"fsdp_reshard_after_forward": "SHARD_GRAD_OP"})
    )
    assert (s.sharding_strategy, s.reshard_after_forward) == ("SHARD_GRAD_OP", None)


def test_env_reader_parses_numbers_and_fsdp1_options():
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_SHARDING_STRATEGY": "2",
        "FSDP_USE_ORIG_PARAMS": "false",
        "FSDP_SYNC_MODULE_STATES": "false",
        "FSDP_FORWARD_PREFETCH": "true",
        "FSDP_VERSION": "1",
        "FSDP_RESHARD_AFTER_FORWARD": "true",
        "ACCELERATE_MIXED_PRECISION": "fp16",
    }
    s = fsdp_settings_from_env(env)
    assert (s.enabled, s.sharding_strategy, s.use_orig_params, s.sync_module_states, s.forward_prefetch) == (
        True,
        "SHARD_GRAD_OP",
        False,
        False,
        True,
    )
    # Under FSDP1 the launcher's default "true" does not override SHARD_GRAD_OP; under FSDP2 the boolean counts.
    assert s.reshard_after_forward is None and s.mixed_precision == "fp16"
    assert (
        fsdp_settings_from_env(
            {**env, "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}
        ).reshard_after_forward
        is False
    )
    assert fsdp_settings_from_env({**env, "FSDP_RESHARD_AFTER_FORWARD": "5"}).sharding_strategy == "HYBRID_SHARD_ZERO2"
    assert fsdp_settings_from_env({}).enabled is False


@pytest.mark.parametrize(
    "name", ["fsdp_config.yaml", "fsdp_config_qlora.yaml", "fsdp_config_cpu.yaml", "v2", "num", "reshard"]
)
def test_env_round_trip(name: str, tmp_path: Path):
    if name == "v2":
        path = _write_yaml(tmp_path, "v2.yaml", fsdp_config=FSDP2_CONFIG, debug=True)
    elif name == "num":
        path = _write_yaml(
            tmp_path,
            "num.yaml",
            fsdp_config={
                "fsdp_sharding_strategy": "3",
                "fsdp_backward_prefetch": "BACKWARD_POST",
                "fsdp_forward_prefetch": True,
                "fsdp_use_orig_params": True,
            },
        )
    elif name == "reshard":
        path = _write_yaml(tmp_path, "r.yaml", fsdp_config={"reshard_after_forward": "HYBRID_SHARD_ZERO2"})
    else:
        path = CONFIGS / name
    env = accelerate_env(read_accelerate_yaml(path))
    assert fsdp_settings_from_env(env) == fsdp_settings_from_yaml(path)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == ("2" if name == "v2" else "1")


def test_accelerate_env_values_for_the_guide_yaml():
    env = accelerate_env(read_accelerate_yaml(CONFIGS / "fsdp_config_qlora.yaml"))
    assert env["FSDP_OFFLOAD_PARAMS"] == "true" and env["FSDP_USE_ORIG_PARAMS"] == "false"
    assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD" and env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["ACCELERATE_MIXED_PRECISION"] == "no" and env["FSDP_MIN_NUM_PARAMS"] == "100000000"
    assert "FSDP_TRANSFORMER_CLS_TO_WRAP" not in env and "ACCELERATE_DEBUG_MODE" not in env


# ---------------------------------------------------------------------------------------------------------------
# The real `accelerate launch`


@pytest.mark.parametrize("name", ["fsdp_config_cpu.yaml", "v2"])
def test_real_accelerate_launch_sets_what_accelerate_env_says(name: str, tmp_path: Path, dump_script: Path):
    pytest.importorskip("accelerate")
    path = (
        _write_yaml(tmp_path, "v2.yaml", fsdp_config=FSDP2_CONFIG, mixed_precision="bf16")
        if name == "v2"
        else (CONFIGS / name)
    )
    out = tmp_path / "out"
    out.mkdir()
    # `accelerate launch` exactly as a user types it (a free port, as other tests may run at the same time).
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--config_file",
        str(path),
        "--num_processes",
        "2",
        "--main_process_port",
        "0",
        str(dump_script),
        str(out),
        "env",
        *TRAIN_FLAGS,
    ]
    r = subprocess.run(cmd, check=False, env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = accelerate_env(read_accelerate_yaml(path))
    for rank, dump in enumerate(_dumps(out, 2)):
        env = dump["env"]
        assert (env["RANK"], env["WORLD_SIZE"], dump["argv"]) == (str(rank), "2", TRAIN_FLAGS)
        assert _launch_env(env) == expected
        assert fsdp_settings_from_env(env) == fsdp_settings_from_yaml(path)


# ---------------------------------------------------------------------------------------------------------------
# shardtune launch


def test_shardtune_launch_two_cpu_processes(tmp_path: Path, dump_script: Path):
    out = tmp_path / "out"
    out.mkdir()
    cfg = str(CONFIGS / "fsdp_config_cpu.yaml")
    # Launcher flags mixed in with train flags: the train flags reach the script in their order.
    argv = [
        "--seed",
        "100",
        "--config_file",
        cfg,
        "--splits",
        "train,test",
        "--num_processes",
        "2",
        "--push_to_hub",
        "--lora_target_modules",
        "all-linear",
    ]
    assert main(argv, entry=(str(dump_script), str(out), "env")) == 0
    expected = {**accelerate_env(read_accelerate_yaml(cfg)), "ACCELERATE_USE_CPU": "True"}
    for rank, dump in enumerate(_dumps(out, 2)):
        env = dump["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert dump["argv"] == TRAIN_FLAGS
        assert _launch_env(env) == expected
        assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD" and env["FSDP_USE_ORIG_PARAMS"] == "false"
        assert fsdp_settings_from_env(env) == fsdp_settings_from_yaml(cfg)


def _node(rank: int, port: int, backend: str, out: Path, script: Path) -> subprocess.Popen:
    argv = [
        "--config_file",
        str(CONFIGS / "fsdp_config_cpu.yaml"),
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--rdzv_backend",
        backend,
        "--seed",
        "7",
    ]
    entry = (str(script), str(out), "gloo")
    code = f"import sys; from shardtune.commands.launch import main; sys.exit(main({argv!r}, entry={entry!r}))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_machines_on_loopback(backend: str, tmp_path: Path, dump_script: Path):
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    nodes = [_node(r, port, backend, out, dump_script) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=180)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)[-3000:]
    dumps = _dumps(out, 2)
    assert [(d["env"]["WORLD_SIZE"], d["env"]["LOCAL_RANK"], d["env"]["LOCAL_WORLD_SIZE"]) for d in dumps] == [
        ("2", "0", "1")
    ] * 2
    assert sorted(d["env"]["GROUP_RANK"] for d in dumps) == ["0", "1"]  # one process on each machine
    assert [d["sum"] for d in dumps] == [3.0, 3.0] and all(d["argv"] == ["--seed", "7"] for d in dumps)
    if backend == "static":  # machine_rank decides the ranks
        assert [d["env"]["GROUP_RANK"] for d in dumps] == ["0", "1"]


def test_torchrun_arguments():
    t = {
        "num_machines": 2,
        "nproc_per_node": 8,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": None,
        "rdzv_backend": "static",
    }
    assert torchrun_args(t) == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29500",
    ]
    assert torchrun_args({**t, "rdzv_backend": "c10d", "main_process_port": 1234})[4:] == [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.1:1234",
    ]
    one = {**t, "num_machines": 1, "main_process_ip": None, "main_process_port": 0}
    assert torchrun_args(one) == ["--nnodes", "1", "--nproc-per-node", "8"]  # torchrun picks a free port
    assert torchrun_args({**one, "main_process_port": 2345})[4:] == [
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "2345",
    ]
    assert torchrun_args({**one, "rdzv_backend": "c10d"})[4:] == ["--standalone"]


def test_build_launch_per_machine_processes_and_overrides():
    cfg = str(CONFIGS / "fsdp_config.yaml")  # num_processes: 8, bf16
    plan = build_launch(
        ["--config_file", cfg, "--num_machines", "2", "--main_process_ip", "h0", "--machine_rank", "1", "--lr", "3"]
    )
    i = plan.cmd.index("shardtune.parallel.torchrun")
    assert plan.cmd[i + 1 : i + 5] == ["--nnodes", "2", "--nproc-per-node", "4"]  # 8 in all, 4 per machine
    assert plan.cmd[-5:] == ["-m", "shardtune", "train", "--lr", "3"]
    assert plan.env["ACCELERATE_MIXED_PRECISION"] == "bf16" and plan.env["ACCELERATE_USE_CPU"] == "False"
    plan = build_launch(
        ["--config_file", cfg, "--nproc_per_node", "3", "--num_machines", "2", "--main_process_ip", "h0"],
        entry=("x.py",),
    )
    assert plan.cmd[i + 1 : i + 5] == ["--nnodes", "2", "--nproc-per-node", "3"] and plan.cmd[-1] == "x.py"


def test_a_double_dash_between_the_launch_flags_and_the_train_flags_is_a_separator():
    """`shardtune launch --config_file f.yaml -- --seed 3`, as torchrun's users write it: train gets --seed 3, not
    a flag named `--`; the same train flags without it give the same command."""
    cfg = str(CONFIGS / "fsdp_config.yaml")
    with_sep = build_launch(["--config_file", cfg, "--", "--seed", "3", "--max_steps", "2"])
    without = build_launch(["--config_file", cfg, "--seed", "3", "--max_steps", "2"])
    assert with_sep.cmd == without.cmd and with_sep.cmd[-7:] == ["-m", "shardtune", "train", "--seed", "3",
                                                                  "--max_steps", "2"]  # fmt: skip
    assert "--" not in with_sep.cmd[with_sep.cmd.index("shardtune.parallel.torchrun") :]


def test_omp_threads_as_accelerate_sets_them(monkeypatch: pytest.MonkeyPatch):
    import psutil

    gpu, cpu = str(CONFIGS / "fsdp_config.yaml"), str(CONFIGS / "fsdp_config_cpu.yaml")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert build_launch(["--config_file", cpu]).env["OMP_NUM_THREADS"] == "3"  # the caller's value wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert build_launch(["--config_file", gpu]).env["OMP_NUM_THREADS"] == "1"
    cores = psutil.cpu_count(logical=False)
    assert build_launch(["--config_file", cpu]).env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert build_launch(["--config_file", cpu, "--num_processes", "1"]).env["OMP_NUM_THREADS"] == str(cores)


def test_launch_help_lists_the_flags(capsys: pytest.CaptureFixture):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--config_file",
        "--num_processes",
        "--num_machines",
        "--machine_rank",
        "--main_process_ip",
        "--main_process_port",
        "--rdzv_backend",
        "--nproc_per_node",
        "goes to `shardtune train`",
    ):
        assert flag in text


# ---------------------------------------------------------------------------------------------------------------
# Mistakes


def _problems(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        build_launch(argv)
    return str(e.value)


def test_config_errors_name_the_key_and_the_fix(tmp_path: Path):
    cpu = str(CONFIGS / "fsdp_config_cpu.yaml")
    msg = _problems(["--config_file", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: no such file" in msg and "configs/fsdp_config.yaml" in msg
    msg = _problems(["--config_file", str(_write_yaml(tmp_path, "ddp.yaml", distributed_type="MULTI_GPU"))])
    assert "distributed_type is 'MULTI_GPU'" in msg and "distributed_type: FSDP" in msg
    msg = _problems(["--config_file", cpu, "--num_machines", "3", "--main_process_ip", "h0"])
    assert f"num_processes 2 (num_processes in {cpu}) is not divisible by num_machines 3 (--num_machines)" in msg
    assert "use a multiple of 3" in msg
    msg = _problems(["--config_file", cpu, "--num_machines", "2"])
    assert "main_process_ip is required with num_machines 2" in msg
    msg = _problems(["--config_file", cpu, "--machine_rank", "1"])
    assert "machine_rank 1 (--machine_rank) must be in 0..0" in msg
    msg = _problems(["--config_file", cpu, "--num_processes", "4", "--nproc_per_node", "3"])
    assert "--nproc_per_node 3 × num_machines 1 != num_processes 4" in msg
    bad = _write_yaml(
        tmp_path,
        "bad.yaml",
        mixed_precision="fp8",
        num_process=2,
        fsdp_config={
            "fsdp_sharding_stratgy": "FULL_SHARD",
            "fsdp_backward_prefetch": "BEFORE",
            "fsdp_reshard_after_forward": "maybe",
            "fsdp_sync_module_states": False,
            "fsdp_cpu_ram_efficient_loading": True,
        },
    )
    msg = _problems(["--config_file", str(bad)])  # every problem at once
    assert "unknown key 'num_process'; did you mean num_processes?" in msg
    assert "fsdp_config: unknown key 'fsdp_sharding_stratgy'; did you mean fsdp_sharding_strategy?" in msg
    assert "mixed_precision 'fp8' is not supported" in msg
    assert "fsdp_backward_prefetch 'BEFORE' is not one of BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH" in msg
    assert "fsdp_reshard_after_forward 'maybe'" in msg
    assert "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true" in msg
    odd = _write_yaml(tmp_path, "odd.yaml", num_processes="eight", rdzv_backend="etcd", main_process_port=70000)
    assert "num_processes 'eight' (num_processes in" in _problems(["--config_file", str(odd)])
    msg = _problems(["--config_file", str(odd), "--num_processes", "2"])
    assert "rdzv_backend 'etcd'" in msg and "use static or c10d" in msg and "main_process_port 70000" in msg
    msg = _problems(["--config_file", str(_write_yaml(tmp_path, "s.yaml", fsdp_config={"fsdp_sharding_strategy": 9}))])
    assert "fsdp_sharding_strategy 9 is not one of FULL_SHARD" in msg and "or 1-5" in msg


def test_main_reports_config_errors_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert main(["--config_file", str(tmp_path / "missing.yaml"), "--seed", "1"]) == 2
    assert "shardtune launch: Invalid configuration" in capsys.readouterr().err
    assert main(["--seed", "1"]) == 2  # --config_file is required
    assert "--config_file" in capsys.readouterr().err


def test_fsdp1_only_notes():
    guide = fsdp_settings_from_yaml(CONFIGS / "fsdp_config.yaml")
    notes = fsdp1_only_notes(guide)
    assert [n.split(":")[0] for n in notes] == ["fsdp_use_orig_params", "fsdp_sync_module_states"]
    fsdp2_like = dataclasses.replace(guide, use_orig_params=True, sync_module_states=False)
    assert fsdp1_only_notes(fsdp2_like) == []
    odd = dataclasses.replace(
        fsdp2_like,
        backward_prefetch="BACKWARD_POST",
        auto_wrap_policy="SIZE_BASED_WRAP",
        state_dict_type="LOCAL_STATE_DICT",
    )
    assert [n.split(":")[0] for n in fsdp1_only_notes(odd)] == [
        "fsdp_backward_prefetch",
        "fsdp_auto_wrap_policy",
        "fsdp_state_dict_type",
    ]
    # Options shardtune maps to FSDP2 settings are not notes.
    honoured = dataclasses.replace(
        fsdp2_like, forward_prefetch=True, backward_prefetch="NO_PREFETCH", offload_params=True
    )
    assert fsdp1_only_notes(honoured) == []
    assert fsdp1_only_notes(dataclasses.replace(guide, enabled=False)) == []


# ---------------------------------------------------------------------------------------------------------------
# The example scripts


def _script_command(path: Path, marker: str) -> list[str]:
    """The tokens of the command in a shell script that contains `marker` (line continuations joined), without the
    "$@" that appends the script's own arguments."""
    text = path.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if marker in ln and not ln.lstrip().startswith("#"))
    return [t for t in shlex.split(line, comments=True) if t != "$@"]


@pytest.mark.parametrize("name", ["run_peft_fsdp.sh", "run_peft_qlora_fsdp.sh"])
def test_guide_examples_are_the_guide_commands_with_shardtune(name: str):
    tokens = _script_command(ROOT / "examples" / name, "accelerate launch")
    i = tokens.index("train")
    config = "configs/fsdp_config_qlora.yaml" if "qlora" in name else "configs/fsdp_config.yaml"
    assert tokens[: i + 1] == ["accelerate", "launch", "--config_file", config, "-m", "shardtune", "train"]
    model, data, train = parse_args(tokens[i + 1 :])  # every flag of the guide is a shardtune train flag
    assert (model.model_name_or_path, data.dataset_name, data.max_length) == (
        "meta-llama/Llama-2-70b-hf",
        "smangrul/ultrachat-10k-chatml",
        2048,
    )
    assert model.use_4bit_quantization == ("qlora" in name) and train.bf16 and model.lora_r == 8


def test_demo_and_multi_node_examples_use_valid_flags():
    for name, marker in (
        ("run_demo_cpu.sh", "shardtune launch"),
        ("two_nodes.sh", "shardtune launch"),
        ("slurm_multinode.sbatch", "shardtune launch"),
    ):
        tokens = _script_command(ROOT / "examples" / name, marker)
        # Each shell variable stands for one value.
        argv = [("1" if "$" in t else t) for t in tokens[tokens.index("launch") + 1 :]]
        ns, train_flags = launch_parser().parse_known_args(argv)
        assert ns.config_file == "1" or (ROOT / ns.config_file).is_file(), name
        parse_args(train_flags)


def _failure(local_rank: int, exitcode: int, timestamp: int = 100, error_file: str = "<N/A>"):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    f = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=error_file)
    f.timestamp = timestamp  # torchrun's whole seconds: a dead rank and the peers it took down often share one
    return f


def test_a_lost_worker_is_named_in_one_line_with_its_signal_or_exit_code(tmp_path):
    """shardtune.parallel.torchrun.failure_line: the rank that died, not a peer the agent then stopped (SIGTERM) or
    that lost contact (exit code 1) in the same second; the launch's exit code is the rank's (128 + a signal)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardtune.parallel.torchrun import failure_line

    killed = {0: _failure(0, -15), 1: _failure(1, -9)}
    line, code = failure_line(killed)
    assert line.startswith("torchrun: rank 1 (local rank 1, pid 1001) was killed by SIGKILL, and the other workers ")
    assert code == 137 and "\n" not in line and "its output (if it wrote any before it ended) is above" in line
    # Control: torch's own pick (the earliest by whole seconds) names the stopped peer here.
    assert ChildFailedError("shardtune", killed).get_first_failure()[0] == 0
    line, code = failure_line({0: _failure(0, 1), 1: _failure(1, -9)})  # the peer lost contact and exited 1
    assert line.startswith("torchrun: rank 1 ") and code == 137
    line, code = failure_line({2: _failure(0, 2, timestamp=99), 3: _failure(1, 1)})  # exit codes: the earliest
    assert line.startswith("torchrun: rank 2 (local rank 0, pid 1000) exited with code 2,") and code == 2
    error_file = tmp_path / "error.json"  # what a worker under torch's @record writes
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad row 7'
    error_file.write_text(json.dumps({"message": {"message": trace, "extraInfo": {"timestamp": "5"}}}))
    line, _ = failure_line({0: _failure(0, 1, error_file=str(error_file))})
    assert f"its error: ValueError: bad row 7 (in {error_file})" in line


def test_torchrun_stopped_by_a_signal_exits_with_a_stopped_runs_code(monkeypatch, capsys):
    """torch's agent signalled straight (a scheduler's SIGTERM to torchrun, not to `shardtune launch`): one line and
    exit code 3, the code a stopped `shardtune train` and a stopped launch exit with, not torch's traceback or 1."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from shardtune.parallel import torchrun
    from shardtune.runtime.stop import STOPPED_EXIT_CODE

    def stopped(argv):
        raise SignalException("Process got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    assert torchrun.run([]) == STOPPED_EXIT_CODE == 3
    assert capsys.readouterr().err == "torchrun: stopped by SIGTERM; its workers were stopped.\n"
