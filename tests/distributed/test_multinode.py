"""Two simulated nodes of two processes each on loopback (two `shardtune launch` processes, one per
machine_rank) with HYBRID_SHARD, against one node of four processes with FULL_SHARD and the same global batch. The
two nodes share no data: each reads its own copy of the files and prepares its own cache. The runs agree in
per-step loss and grad_norm and in the trained adapter (tests/parity.py); so does HYBRID_SHARD with context
parallelism (cp 2 within each machine)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, run_cli, train_args, train_records
from tests.parity import assert_runs_match
from tests.tolerance import train_parity


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _yaml(tmp_path, strategy: str, machines: int, processes: int):
    cfg = yaml.safe_load((ROOT / "configs/fsdp_config_cpu.yaml").read_text())
    cfg["fsdp_config"]["fsdp_sharding_strategy"] = strategy
    cfg.update(num_machines=machines, num_processes=processes)
    path = tmp_path / f"{strategy}_{machines}x{processes}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train_flags(assets, out, steps=3, **extra):
    """`train`'s flags without the command (`shardtune launch` takes them)."""
    lora = {"use_peft_lora": True, "lora_r": 4, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
    run = {"max_seq_len": 96, "seed": 11, "per_device_train_batch_size": 1, "max_steps": steps, **extra}
    saving = {"learning_rate": 3e-3, "save_strategy": "steps", "save_steps": 2}
    return train_args(assets, out, **run, **saving, **lora)[1:]


def _launch_two_machines(config, flags, port, node_flags=([], [])):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardtune",
                "launch",
                "--config_file",
                str(config),
                "--machine_rank",
                str(r),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                *flags,
                *node_flags[r],
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]


# bench: HYBRID_SHARD on 2 simulated machines, 3 launches and a resume, 170 s; the launcher's two-machine rendezvous stays in tests/unit/test_launcher.py, HYBRID_SHARD over 2 machines' steps in tests/distributed/test_strategy_steps.py (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_hybrid_two_nodes_equals_one_node_full_shard_and_resumes_on_one_node(tiny_assets, tmp_path):
    hybrid, full = tmp_path / "hybrid", tmp_path / "full"
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:  # as without a shared file system: the node's own data files and cache folder
        shutil.copytree(tiny_assets["data"], node / "data")
    node_flags = [["--dataset_name", str(n / "data"), "--dataset_cache_dir", str(n / "cache")] for n in nodes]
    _launch_two_machines(_yaml(tmp_path, "HYBRID_SHARD", 2, 4), _train_flags(tiny_assets, hybrid), _port(), node_flags)
    for node in nodes:  # each node's local rank 0 prepared a train and a test cache; the losses below match
        assert sorted(p.name.split("-")[0] for p in (node / "cache").iterdir()) == ["test", "train"]
    run_cli(["launch", "--config_file", str(_yaml(tmp_path, "FULL_SHARD", 1, 4)), *_train_flags(tiny_assets, full)])
    # 3 steps of 4 ranks × 1 packed row of 96 tokens, lr 3e-3 with no warmup: the same sums split over other
    # ranks/nodes. Steps 2 and 3 ran on weights the earlier steps moved.
    assert_runs_match(full, hybrid, train_parity(steps=3, seq=96, tokens_per_step=4 * 96, lr=3e-3))
    # HYBRID_SHARD with context parallelism: each machine's 2 processes split every row of its batch of 2 (2
    # replicas × 1 shard × cp 2): the same global batch of 4 rows, the same run.
    cp = tmp_path / "hybrid-cp"
    flags = _train_flags(tiny_assets, cp, per_device_train_batch_size=2, context_parallel_size=2)
    _launch_two_machines(_yaml(tmp_path, "HYBRID_SHARD", 2, 4), flags, _port(), node_flags)
    assert_runs_match(full, cp, train_parity(steps=3, seq=96, tokens_per_step=4 * 96, lr=3e-3))
    # The 2×2 run's checkpoint at step 2 resumes on one node of two processes (global batch 4 → 2: a warning).
    ckpt = hybrid / "checkpoints" / "checkpoint-2"
    assert (ckpt / "meta.json").exists()
    resumed = tmp_path / "resumed"
    proc = run_cli(
        [
            "launch",
            "--config_file",
            str(_yaml(tmp_path, "FULL_SHARD", 1, 2)),
            *_train_flags(tiny_assets, resumed, steps=4),
            # the run's own data: the checkpoint belongs to a run that read node 0's copy
            "--dataset_name",
            str(nodes[0] / "data"),
            "--resume_from_checkpoint",
            str(ckpt),
        ]
    )
    assert "global batch" in proc.stderr + proc.stdout
    assert [r["step"] for r in train_records(resumed)] == [3, 4]
