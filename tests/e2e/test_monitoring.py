"""A real run's monitoring outputs: TensorBoard events equal metrics.jsonl, the plot, `shardtune report`, logs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli, train_records
from tests.tolerance import unit_roundoff

FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


@pytest.fixture(scope="module")
def finished_run(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor") / "out"
    proc = run_cli(
        [
            "train",
            "--model_name_or_path",
            str(tiny_assets["model"]),
            "--dataset_name",
            str(tiny_assets["data"]),
            "--chat_template_format",
            "chatml",
            "--max_seq_len",
            "96",
            "--packing",
            "True",
            "--per_device_train_batch_size",
            "2",
            "--max_steps",
            "4",
            "--logging_steps",
            "1",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--save_strategy",
            "no",
            "--use_peft_lora",
            "True",
            "--lora_r",
            "4",
            "--report_to",
            "tensorboard",
            "--log_level",
            "info",
            "--output_dir",
            str(out),
        ],
        nproc=2,
        env=FSDP_ENV,
    )
    return out, proc


def test_tensorboard_events_equal_metrics_jsonl(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = finished_run
    acc = EventAccumulator(str(out / "runs"))
    acc.Reload()
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    jsonl_loss = {r["step"]: r["loss"] for r in train_records(out)}
    assert sorted(tb_loss) == [1, 2, 3, 4]
    for step, value in jsonl_loss.items():
        # TensorBoard stores scalars as fp32: one rounding of the float64 loss.
        assert tb_loss[step] == pytest.approx(value, rel=unit_roundoff(torch.float32))
    evals = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert sorted(evals) == [2, 4]
    assert {"train/learning_rate", "train/grad_norm", "train/tokens_per_s"} <= set(acc.Tags()["scalars"])


def test_plot_and_report_match_the_summary(finished_run):
    import matplotlib.image as mpimg

    out, _ = finished_run
    img = mpimg.imread(out / "loss.png")
    assert img.shape[0] == 400 and img.shape[1] == 1000
    summary = json.loads((out / "train_summary.json").read_text())
    report = run_cli(["report", str(out)])
    assert f"{summary['final_train_loss']:.4f}" in report.stdout
    assert f"{summary['final_eval_loss']:.4f}" in report.stdout
    assert summary["steps"] == 4 and len(summary["peak_memory_gb_per_rank"]) == 2


def test_only_rank_zero_prints(finished_run):
    _, proc = finished_run
    text = proc.stdout + proc.stderr
    assert text.count("Training 4 steps") == 1
    assert "[rank 1]" not in text
