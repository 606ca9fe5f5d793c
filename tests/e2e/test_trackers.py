"""`--report_to wandb,mlflow` for real, without a network: W&B in offline mode and MLflow on a local SQLite store.
One 2-rank run; its W&B run file and MLflow store are read back and compared with metrics.jsonl."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.conftest import run_cli, train_args, train_records

FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (`run-<id>.wandb`): LevelDB's log format (32 KiB blocks of chunks with a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte W&B header, each record one
    `wandb_internal_pb2.Record`. wandb no longer ships a Python reader for it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.fixture(scope="module")
def tracked_run(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    env = {
        **FSDP_ENV,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root),
        "WANDB_PROJECT": "shardtune-test",
        "WANDB_LOG_MODEL": "end",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
        "MLFLOW_EXPERIMENT_NAME": "tiny-experiment",
    }
    out = root / "out"
    args = train_args(
        tiny_assets,
        out,
        max_seq_len=96,
        per_device_train_batch_size=2,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        use_peft_lora=True,
        lora_r=4,
        report_to="wandb,mlflow",
        run_name="tiny-run",
    )
    proc = run_cli(args, nproc=2, env=env, cwd=root)
    return root, out, proc


def _jsonl(out: Path, kind: str, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in train_records(out, kind) if r.get(key) is not None}


def test_wandb_offline_run_holds_the_metrics_config_and_model(tracked_run):
    root, out, _ = tracked_run
    runs = list((root / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # rank 0 only
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "shardtune-test" and run.display_name == "tiny-run"
    # W&B stores a key with a slash as its nested parts.
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    for tag, kind, key in [
        ("train/loss", "train", "loss"),
        ("train/learning_rate", "train", "learning_rate"),
        ("eval/loss", "eval", "eval_loss"),
    ]:
        logged = {h["train/global_step"]: h[tag] for h in history if tag in h}
        assert logged == _jsonl(out, kind, key)  # json round-trips floats exactly
    assert sorted(_jsonl(out, "eval", "eval_loss")) == [2, 4]
    config = {}
    for r in records:
        if r.HasField("config"):
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    assert config["model"]["lora_r"] == 4 and config["train"]["max_steps"] == 4 and config["world_size"] == 2
    summary = {}
    for r in records:
        if r.HasField("summary"):
            summary.update({i.key: json.loads(i.value_json) for i in r.summary.update if i.key})
    assert summary["final_train_loss"] == json.loads((out / "train_summary.json").read_text())["final_train_loss"]
    assert "artifact" in kinds  # WANDB_LOG_MODEL=end
    artifact = next(r.artifact for r in records if r.HasField("artifact"))
    assert artifact.type == "model"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {e.path for e in artifact.manifest.contents}
    assert kinds[-1] == "exit" and next(r.exit for r in records if r.HasField("exit")).exit_code == 0


def test_mlflow_store_holds_the_metrics_params_and_adapter(tracked_run, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    root, out, _ = tracked_run
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("tiny-experiment")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # rank 0 only
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-run"
    for key, kind in [("loss", "train"), ("learning_rate", "train"), ("eval_loss", "eval")]:
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == pytest.approx(_jsonl(out, kind, key), rel=1e-12, abs=0)  # float64 in SQLite
    params = run.data.params
    assert (
        params["model.lora_r"] == "4"
        and params["train.max_steps"] == "4"
        and params["train.report_to"] == ("wandb,mlflow")
    )
    got = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id,
            artifact_path="model",
            dst_path=str(tmp_path),
            tracking_uri=f"sqlite:///{root}/mlflow.db",
        )
    )
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md"):
        assert (got / name).read_bytes() == (out / name).read_bytes()


def test_tracker_that_cannot_start_stops_the_run_before_loading(tiny_assets, tmp_path):
    # MLflow refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true: a real start-up failure, no network.
    env = {"MLFLOW_TRACKING_URI": f"file://{tmp_path}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "false"}
    proc = run_cli(
        train_args(tiny_assets, tmp_path / "out", max_steps=1, report_to="mlflow"), env=env, cwd=tmp_path, check=False
    )
    assert proc.returncode == 2
    assert "--report_to mlflow: the tracker could not start" in proc.stderr
    assert "MLFLOW_ALLOW_FILE_STORE" in proc.stderr
    assert "Training" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()
