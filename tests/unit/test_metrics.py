"""metrics.jsonl, TensorBoard scalars, the loss plot, the summary table and `shardtune report`."""

from __future__ import annotations

import sys

import pytest
import torch

from shardtune.training.metrics import RunLogger, build_summary, plot_run, read_metrics, report_main, summary_table
from tests.tolerance import unit_roundoff

TRAIN = {
    1: {
        "loss": 3.25,
        "learning_rate": 1e-4,
        "grad_norm": 2.5,
        "tokens_per_s": 1500.0,
        "tokens": 2048,
        "epoch": 0.25,
        "memory_per_rank_gb": [1.25, 1.5],
    },
    2: {
        "loss": 2.75,
        "learning_rate": 2e-4,
        "grad_norm": 1.75,
        "tokens_per_s": 1600.0,
        "tokens": 4096,
        "epoch": 0.5,
        "memory_per_rank_gb": [1.5, 1.25],
    },
    3: {
        "loss": 2.5,
        "learning_rate": 1.5e-4,
        "grad_norm": 1.5,
        "tokens_per_s": 1700.0,
        "tokens": 6144,
        "epoch": 0.75,
        "memory_gb": 2.0,
    },
    4: {
        "loss": 2.125,
        "learning_rate": 5e-5,
        "grad_norm": 1.25,
        "tokens_per_s": 1800.0,
        "tokens": 8192,
        "epoch": 1.0,
        "memory_gb": 1.0,
    },
}
EVAL = {2: {"eval_loss": 2.9, "eval_perplexity": 18.17}, 4: {"eval_loss": 2.4, "eval_perplexity": 11.02}}
SUMMARY = {
    "runtime_s": 12.5,
    "train_tokens": 8192,
    "tokens_per_s": 655.36,
    "peak_memory_gb_per_rank": [2.0, 1.5],
    "final_train_loss": 2.125,
    "final_eval_loss": 2.4,
    "final_eval_perplexity": 11.02,
    "output_path": "/runs/demo/adapter",
    "interrupted": False,
}


def _run(out, report_to="none", steps=(1, 2, 3, 4), finish=True, total_steps=4):
    logger = RunLogger(
        str(out),
        is_main=True,
        report_to=report_to,
        total_steps=total_steps,
        config={"learning_rate": 2e-4, "lora_r": 8},
        disable_progress=True,
    )
    for step in steps:
        logger.log_train(step, TRAIN[step])
        if step in EVAL:
            logger.log_eval(step, EVAL[step])
    if finish:
        logger.finish(SUMMARY)
    logger.close()


def _table_rows(table: str) -> dict[str, str]:
    rows = {}
    for line in table.splitlines()[1:]:
        key, _, value = line.strip().partition("  ")
        rows[key] = value.strip()
    return rows


def test_metrics_jsonl_holds_what_was_logged(tmp_path):
    _run(tmp_path)
    records = read_metrics(tmp_path)
    assert [r["type"] for r in records] == ["start", "train", "train", "eval", "train", "train", "eval", "summary"]
    assert records[0]["total_steps"] == 4 and records[0]["config"] == {"learning_rate": 2e-4, "lora_r": 8}
    for kind, logged in (("train", TRAIN), ("eval", EVAL)):
        got = {
            r["step"]: {k: v for k, v in r.items() if k not in ("type", "step", "time", "elapsed_s")}
            for r in records
            if r["type"] == kind
        }
        assert got == logged
    summary = records[-1]
    assert summary["step"] == 4
    assert {k: summary[k] for k in SUMMARY} == SUMMARY
    times = [r["time"] for r in records]
    assert times == sorted(times) and records[-1]["elapsed_s"] >= records[1]["elapsed_s"] >= 0


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, report_to="tensorboard")
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()

    def scalars(tag):
        return {e.step: e.value for e in acc.Scalars(tag)}

    for key, tag in (
        ("loss", "train/loss"),
        ("learning_rate", "train/learning_rate"),
        ("grad_norm", "train/grad_norm"),
        ("tokens_per_s", "train/tokens_per_s"),
    ):
        # TensorBoard stores scalars as fp32: one rounding of each float64 value.
        assert scalars(tag) == pytest.approx({s: m[key] for s, m in TRAIN.items()}, rel=unit_roundoff(torch.float32))
    # a per-rank list is shown as its maximum
    assert scalars("train/memory_gb") == {1: 1.5, 2: 1.5, 3: 2.0, 4: 1.0}  # exact in fp32
    fp32 = unit_roundoff(torch.float32)
    assert scalars("eval/loss") == pytest.approx({s: m["eval_loss"] for s, m in EVAL.items()}, rel=fp32)
    assert scalars("eval/perplexity") == pytest.approx({s: m["eval_perplexity"] for s, m in EVAL.items()}, rel=fp32)


def test_tensorboard_resume_replaces_redone_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, report_to="tensorboard", finish=False)
    logger = RunLogger(str(tmp_path), is_main=True, report_to="tensorboard", total_steps=4, disable_progress=True)
    logger.log_train(3, {"loss": 9.0})  # resumed from a checkpoint at step 2: step 3 is redone
    logger.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == {1: 3.25, 2: 2.75, 3: 9.0}


def test_loss_plot_png(tmp_path):
    import matplotlib.image

    _run(tmp_path)
    image = matplotlib.image.imread(tmp_path / "loss.png")
    assert image.shape == (400, 1000, 4)
    rgb = image[..., :3]
    blue = ((abs(rgb - [0.122, 0.467, 0.706]) < 0.06).all(-1)).sum()  # tab:blue, the train loss line
    orange = ((abs(rgb - [1.0, 0.498, 0.055]) < 0.06).all(-1)).sum()  # tab:orange, the eval loss
    assert blue > 200 and orange > 50


def test_an_rl_runs_plot_has_its_reward_curve_below_the_loss(tmp_path):
    """Online RL (TRL's metric names): the reward and each function's mean in green and their own colours, in a
    panel below the loss; a run without rewards keeps the one-panel plot (test_loss_plot_png)."""
    import matplotlib.image

    from shardtune.training.metrics import plot_run

    records = [
        {"type": "train", "step": s, "loss": 0.0, "learning_rate": 1e-3, "reward": 0.1 * s,
         "rewards/exact_answer_reward/mean": 0.9 - 0.1 * s}
        for s in range(1, 9)
    ]  # fmt: skip
    path = plot_run(tmp_path, records)
    image = matplotlib.image.imread(path)
    assert image.shape == (700, 1000, 4)
    rgb = image[..., :3]
    green = (abs(rgb - [0.173, 0.627, 0.173]) < 0.06).all(-1)  # tab:green, the reward line
    rows = green.any(-1).nonzero()[0]
    assert green.sum() > 200 and rows.min() > 350  # drawn, and in the lower panel only


def test_summary_table_matches_metrics(tmp_path, capsys):
    _run(tmp_path)
    records = read_metrics(tmp_path)
    summary = records[-1]
    rows = _table_rows(summary_table(records))
    assert rows["status"] == "finished"
    assert rows["steps"] == "4 / 4"
    assert int(rows["train tokens"].replace(",", "")) == summary["train_tokens"]
    assert rows["time"].endswith(f"({summary['runtime_s']:.1f} s)")
    # Printed rounded to the shown decimals: within half of the last digit.
    assert float(rows["tokens/s"].replace(",", "")) == pytest.approx(summary["tokens_per_s"], abs=0.05)
    assert rows["peak memory (GB)"] == "rank 0: 2.00, rank 1: 1.50"
    assert float(rows["final train loss"]) == pytest.approx(summary["final_train_loss"], abs=5e-5)
    assert float(rows["final eval loss"]) == pytest.approx(summary["final_eval_loss"], abs=5e-5)
    assert float(rows["final eval perplexity"]) == pytest.approx(summary["final_eval_perplexity"], abs=5e-5)
    assert rows["output"] == summary["output_path"]
    assert report_main([str(tmp_path)]) == 0
    assert _table_rows(capsys.readouterr().out.split("\n  loss plot")[0]) == rows


class _Clock:
    """A stand-in for the time module whose clock moves 1.5 s at each reading."""

    def __init__(self):
        self.now = 1_700_000_000.0

    def time(self) -> float:
        self.now += 1.5
        return self.now


def test_report_on_interrupted_and_resumed_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("shardtune.training.metrics.time", _Clock())
    _run(tmp_path, steps=(1, 2, 3), finish=False, total_steps=6)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"type": "train", "step": 4, "lo')  # killed while writing
    first = read_metrics(tmp_path)
    assert [r["type"] for r in first] == ["start", "train", "train", "eval", "train"]
    # resumed from a checkpoint at step 2: steps 3 and 4 are redone, then it is interrupted again
    _run(tmp_path, steps=(3, 4), finish=False, total_steps=6)
    records = read_metrics(tmp_path)
    assert [r["type"] for r in records] == [r["type"] for r in first] + ["start", "train", "train", "eval"]
    starts = [i for i, r in enumerate(records) if r["type"] == "start"]
    runtime = records[starts[1] - 1]["elapsed_s"] + records[-1]["elapsed_s"]
    # each segment runs from its logger's start to its last record: 5 then 4 records, 1.5 s apart
    assert runtime == 5 * 1.5 + 4 * 1.5

    summary = build_summary(records)
    assert summary["interrupted"] is True and summary["output_path"] is None
    assert summary["steps"] == 4 and summary["total_steps"] == 6
    assert summary["final_train_loss"] == TRAIN[4]["loss"] and summary["final_eval_loss"] == EVAL[4]["eval_loss"]
    assert summary["train_tokens"] == TRAIN[4]["tokens"]
    assert summary["runtime_s"] == pytest.approx(runtime)
    assert summary["peak_memory_gb_per_rank"] == [1.5, 1.5]  # elementwise max of the per-rank lists

    assert report_main([str(tmp_path)]) == 0
    rows = _table_rows(capsys.readouterr().out.split("\n  loss plot")[0])
    assert rows["status"].startswith("INTERRUPTED")
    assert rows["steps"] == "4 / 6"
    assert rows["final train loss"] == f"{TRAIN[4]['loss']:.4f}"
    assert rows["output"].startswith("none: the run did not finish")
    assert (tmp_path / "loss.png").is_file()


def test_report_errors(tmp_path, capsys):
    assert report_main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert report_main([str(tmp_path)]) == 2
    assert f"no metrics.jsonl in {tmp_path}" in capsys.readouterr().err


def test_non_main_process_writes_nothing(tmp_path):
    out = tmp_path / "run"
    logger = RunLogger(str(out), is_main=False, report_to="tensorboard", total_steps=4)
    logger.log_train(1, TRAIN[1])
    logger.log_eval(1, EVAL[2])
    logger.progress(1, {"loss": 1.0})
    logger.finish(SUMMARY)
    logger.close()
    assert not out.exists()


def test_progress_bar_shows_step_and_postfix(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), is_main=True, total_steps=10)
    logger.progress(1, {"loss": 3.5, "lr": 2e-4, "tokens/s": 1234.5, "memory_gb": 1.5})
    logger.progress(3, {"loss": 2.25, "lr": 1e-4, "tokens/s": 2345.5, "memory_gb": 1.5})
    logger.close()
    err = capsys.readouterr().err
    assert "3/10" in err and "loss 2.2500, lr 1.00e-04, tokens/s 2,346, memory_gb 1.50" in err


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    _run(tmp_path, finish=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match=r"shardtune\[report\]"):
        plot_run(tmp_path)
    assert report_main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "final train loss" in captured.out and "pip install 'shardtune[report]'" in captured.err
