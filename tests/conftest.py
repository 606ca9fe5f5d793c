"""Shared fixtures: a tiny local Llama model, its tokenizer and a small chat dataset (no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    from shardtune.commands.demo import build_model, build_tokenizer, write_chat_dataset

    root = tmp_path_factory.mktemp("assets")
    tok = build_tokenizer(root / "model", vocab_size=600)
    build_model(root / "model", vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    write_chat_dataset(root / "data", n_train=160, n_test=24, seed=3)
    return {"model": root / "model", "data": root / "data", "root": root}


def run_cli(
    args: list[str],
    *,
    nproc: int = 1,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout: int = 600,
    check: bool = True,
    plugin: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `shardtune <args>` in a subprocess (under torchrun when nproc > 1), one thread per process. `plugin`:
    a script run instead of `-m shardtune` (one process), which registers its parts and then calls shardtune's CLI."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(_free_port()),
            "-m",
            "shardtune",
            *args,
        ]
    else:
        cmd = [sys.executable, *([str(plugin)] if plugin else ["-m", "shardtune"]), *args]
    proc = subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_records(output_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == kind]


def train_args(assets: dict[str, Path], out: Path, **flags) -> list[str]:
    """`train` argv on the tiny model and chat data with chatml, packing and no saving; `flags` add or override
    (`max_seq_len=128` becomes `--max_seq_len 128`)."""
    base = {
        "model_name_or_path": assets["model"],
        "dataset_name": assets["data"],
        "chat_template_format": "chatml",
        "packing": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "output_dir": out,
    }
    return ["train", *(x for k, v in {**base, **flags}.items() for x in (f"--{k}", str(v)))]


def packed_eval_split(assets: dict[str, Path], tokenizer_dir: Path, cache_dir: Path, seed: int):
    """The packed evaluation rows (96 positions) a training run on the tiny data evaluates on, tokenized with the
    tokenizer the run saved."""
    from transformers import AutoTokenizer

    from shardtune.data import build_datasets

    _, ev = build_data(
        build_datasets,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        dataset_name=str(assets["data"]),
        splits="train,test",
        dataset_text_field="text",
        max_length=96,
        packing=True,
        append_concat_token=False,
        add_special_tokens=False,
        assistant_only_loss=False,
        drop_long_samples=False,
        cache_dir=str(cache_dir),
        seed=seed,
    )
    return ev


# The keywords data builders take beside the DataArguments (the rest are DataArguments fields, and num_proc is
# --dataset_num_proc): lets tests write one flat dict of what a run would set.
_BUILD_KEYWORDS = ("tokenizer", "seed", "cache_dir", "chat_template_format", "kto_group")


def build_data(builder, **flat):
    """Call shardtune.data.build_datasets or build_preference_datasets with DataArguments made from `flat`."""
    from shardtune.config.arguments import DataArguments

    call = {k: flat.pop(k) for k in _BUILD_KEYWORDS if k in flat}
    if "num_proc" in flat:
        flat["dataset_num_proc"] = flat.pop("num_proc")
    return builder(DataArguments(**flat), **call)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind():
    """A test module that leaves torch.distributed initialised (or a single-process run's launcher variables set)
    breaks the modules after it that start their own group (plan --trace's fake group, accelerate in the TRL
    parity tests): fail the module that leaks, and clean up so that the rest still runs."""
    import torch.distributed as dist

    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    yield
    leaked = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        leaked.append("a process group")
    after = {k: os.environ.get(k) for k in before}
    if after != before:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        leaked.append(f"launcher variables {sorted(k for k in before if before[k] != after[k])}")
    if leaked:
        pytest.fail(f"this test module left {' and '.join(leaked)} behind", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def _collector_given_back():
    """A command run in a test's process gives the garbage collector back as it found it (runtime.collector): a
    module that leaves objects frozen or the oldest generation off would grow every later test's memory."""
    import gc

    before = gc.get_threshold(), gc.get_freeze_count()
    yield
    after = gc.get_threshold(), gc.get_freeze_count()
    if after != before:
        gc.unfreeze()
        gc.set_threshold(*before[0])
        pytest.fail(f"the garbage collector was left as {after}, not {before}")
