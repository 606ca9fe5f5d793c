"""fsdp_cpu_ram_efficient_loading reads the checkpoint once per node: two simulated nodes of two processes each on
loopback (two torchrun processes, --nnodes 2) train exactly like one node of four processes, and only global ranks
0 and 2 (each node's LOCAL_RANK 0) read the checkpoint; the other ranks get their shards from their node's rank 0.
FULL_SHARD spans the nodes here, so rank 2 cuts ranks 2 and 3's slices of the global tensors; HYBRID_SHARD over
two nodes (same loader, shards within a node) is covered by test_multinode.py, whose config sets
fsdp_cpu_ram_efficient_loading.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import _free_port, run_cli, train_args, train_records
from tests.parity import assert_runs_match
from tests.tolerance import train_parity


def _env(strategy: str, load_log) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
        "FSDP_SYNC_MODULE_STATES": "true",
        "FSDP_SHARDING_STRATEGY": strategy,
        "SHARDTUNE_LOAD_LOG": str(load_log),
    }


def _flags(assets, out) -> list[str]:
    lora = {"use_peft_lora": True, "lora_r": 4, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
    return train_args(
        assets, out, max_seq_len=96, seed=5, per_device_train_batch_size=1, max_steps=3, learning_rate=3e-3, **lora
    )


def _two_nodes(flags: list[str], env: dict[str, str]) -> None:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(r),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "-m",
                "shardtune",
                *flags,
            ],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out + err)[-5000:]
    assert "rank 0 of each node reads the checkpoint" in "".join(o + e for o, e in outs)


def _read_by(load_log) -> list[str]:
    return sorted(p.name for p in load_log.iterdir())


# bench: 2 simulated machines reading once per node, 75 s; rank-0 reading and scattering stays in test_loading.py, one read per machine in test_strategy_steps.py (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_full_shard_two_nodes_read_once_per_node_and_train_like_one_node(tiny_assets, tmp_path):
    two, one = tmp_path / "two_nodes", tmp_path / "one_node"
    _two_nodes(_flags(tiny_assets, two), _env("FULL_SHARD", tmp_path / "log2"))
    run_cli(_flags(tiny_assets, one), nproc=4, env=_env("FULL_SHARD", tmp_path / "log1"))
    assert _read_by(tmp_path / "log2") == ["loaded-rank0", "loaded-rank2"]
    assert _read_by(tmp_path / "log1") == ["loaded-rank0"]
    assert len(train_records(two)) == 3
    # 3 steps of 4 ranks × 1 packed row of 96 tokens, lr 3e-3: the same sums split over other ranks/nodes; losses,
    # grad_norm and the adapter within the measured-spread bounds (tests/parity.py's planted bugs fail them).
    assert_runs_match(one, two, train_parity(steps=3, seq=96, tokens_per_step=4 * 96, lr=3e-3))
