"""A plain single process (a notebook, a test, `python -m shardtune train` without a launcher) gets a 1-rank group,
and leaving it takes back what was set for it: the process must not go on looking like a distributed worker."""

from __future__ import annotations

import os

import torch.distributed as dist

from shardtune.parallel.mesh import init_distributed, shutdown

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_single_process_group_leaves_no_trace(monkeypatch):
    for k in VARIABLES:
        monkeypatch.setenv(k, "x")  # recorded, so the test's own changes are undone too
        monkeypatch.delenv(k)
    info = init_distributed()
    assert (info.rank, info.world_size, dist.is_initialized()) == (0, 1, True)
    assert os.environ["WORLD_SIZE"] == "1"
    shutdown()
    assert not dist.is_initialized()
    assert [k for k in VARIABLES if k in os.environ] == []


def test_a_launchers_variables_are_kept(monkeypatch):
    """Under a launcher the variables are its own: shutdown leaves them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    init_distributed()
    shutdown()
    assert {k: os.environ.get(k) for k in env} == env
