"""--report_to parsing and the missing-package error (exit 2 before anything loads)."""

from __future__ import annotations

import importlib.util

import pytest

from shardtune.training.trackers import parse_report_to


def test_report_to_values_as_transformers():
    assert parse_report_to("none") == []
    assert parse_report_to("wandb,mlflow") == ["wandb", "mlflow"]
    assert parse_report_to("tensorboard, wandb,wandb") == ["tensorboard", "wandb"]
    installed = [
        n
        for n, m in [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")]
        if importlib.util.find_spec(m) is not None
    ]
    assert parse_report_to("all") == installed
    with pytest.raises(ValueError, match=r"--report_to comet is not supported; use none, all, or a comma list"):
        parse_report_to("wandb,comet")


def test_missing_tracker_package_is_a_config_error_naming_the_extra(monkeypatch, tmp_path, capsys):
    from shardtune.commands.train import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    rc = main(
        [
            "--model_name_or_path",
            str(tmp_path),
            "--dataset_name",
            str(tmp_path),
            "--report_to",
            "mlflow",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        "--report_to mlflow needs the `mlflow` package, which is not installed: pip install 'shardtune[mlflow]'" in err
    )
    assert not (tmp_path / "out").exists()
