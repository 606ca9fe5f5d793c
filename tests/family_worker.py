"""Run several `shardtune train` command lines one after another in one process (under torchrun: in every rank),
so that a matrix over model families pays for starting Python, torch and transformers once, not once per family.

    python -m torch.distributed.run --nproc_per_node 2 tests/family_worker.py JOBS.json RESULTS.json

JOBS.json is a list of {"name", "argv"}; each argv is what follows `shardtune` on the command line. Each run starts
and ends its own process group (shardtune.commands.train.main does both). Rank 0 writes {name: exit code or the error}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(jobs_file: str, results_file: str) -> int:
    from shardtune.commands.train import main as train_main

    results = {}
    # Under torchrun, its agent store; in one process shardtune starts a 1-rank group (and sets RANK) itself.
    agent_port = os.environ.get("MASTER_PORT") if "RANK" in os.environ else None
    for i, job in enumerate(json.loads(Path(jobs_file).read_text())):
        if agent_port is not None and i > 0:
            _fresh_store(i, int(agent_port))
        try:
            results[job["name"]] = train_main(job["argv"][1:] if job["argv"][0] == "train" else job["argv"])
        except Exception:  # noqa: BLE001 - recorded for the test to report, then the next family runs
            results[job["name"]] = traceback.format_exc()[-3000:]
            from shardtune.parallel.mesh import shutdown

            shutdown()
    if os.environ.get("RANK", "0") == "0":
        with open(results_file, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _fresh_store(i: int, agent_port: int) -> None:
    """Each run starts its own process group. torchrun's agent store keeps the first group's keys, and a second
    group on it waits forever; so each later group gets a fresh store on a free port that rank 0 picks and shares
    through the agent store."""
    import socket

    from torch.distributed import TCPStore

    agent = TCPStore(os.environ["MASTER_ADDR"], agent_port, is_master=False)
    key = f"family_worker/port/{i}"
    if os.environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            agent.set(key, str(s.getsockname()[1]))
    port = agent.get(key).decode()
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
