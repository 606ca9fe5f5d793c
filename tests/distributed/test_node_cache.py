"""Two simulated nodes without a shared file system (each its own copy of the data and its own cache folder): each
node's local rank 0 prepares its own cache from its own files, and a node whose files differ stops the run before
training with a message naming the ranks, instead of training on other rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.distributed.test_multinode import _port, _yaml


def _node_flags(assets, data, cache, out):
    return [
        "--model_name_or_path", str(assets["model"]),
        "--dataset_name", str(data),
        "--dataset_cache_dir", str(cache),
        "--chat_template_format", "chatml",
        "--packing", "True",
        "--max_seq_len", "96",
        "--per_device_train_batch_size", "1",
        "--max_steps", "1",
        "--save_strategy", "no",
        "--output_dir", str(out),
    ]  # fmt: skip


def test_nodes_prepare_their_own_caches_and_differing_data_stops_the_run(tiny_assets, tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        shutil.copytree(tiny_assets["data"], node / "data")
    rows = (nodes[1] / "data" / "train.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    first["messages"][-1]["content"] += " (edited on node 1)"
    (nodes[1] / "data" / "train.jsonl").write_text("\n".join([json.dumps(first), *rows[1:]]) + "\n")
    config, port = _yaml(tmp_path, "FULL_SHARD", 2, 2), _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "shardtune", "launch", "--config_file", str(config)]
    procs = [
        subprocess.Popen(
            [*launch, "--machine_rank", str(r), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
             *_node_flags(tiny_assets, node / "data", node / "cache", node / "out")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for r, node in enumerate(nodes)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    err = outs[0][1] + outs[1][1]
    assert "rank(s) [1] prepared other training or evaluation rows than rank 0" in err
    assert "Give every node identical data files and tokenizer" in err
    for node in nodes:  # each node tokenized its own copy into its own cache: a train and a test split
        caches = sorted(p.name.split("-")[0] for p in (node / "cache").iterdir())
        assert caches == ["test", "train"], caches
    assert not (nodes[0] / "out" / "adapter_model.safetensors").exists()
