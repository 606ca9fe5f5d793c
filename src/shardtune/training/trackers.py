"""Experiment trackers for `--report_to`: the names transformers' Trainer takes, and the W&B and MLflow runs.

`--report_to` takes `none`, `all`, or a comma list of `tensorboard`, `wandb`, `mlflow` (`all`: every one of
them whose package is installed, as in transformers). TensorBoard is written by `metrics.RunLogger` itself; this
module holds the two trackers with a run of their own. Each respects its library's environment variables as
transformers' integrations do, and is opened by the main process only, before the model loads, so that a
tracker that cannot start (bad tracking URI, no login) fails the run early.

Weights & Biases (`pip install 'shardtune[wandb]'`): `WANDB_PROJECT` (default `shardtune`), `WANDB_MODE`
(`offline` writes the run under `WANDB_DIR`, default ./wandb, for `wandb sync` later), `WANDB_DIR`,
`WANDB_RUN_ID`/`WANDB_NAME`/`WANDB_TAGS` (read by wandb), `WANDB_LOG_MODEL=end` (also log the output folder as
a model artifact). Metrics go to `train/<key>` and `eval/<key>` against `train/global_step`, as transformers.

MLflow (`pip install 'shardtune[mlflow]'`): `MLFLOW_TRACKING_URI` (default: MLflow's, `sqlite:///mlflow.db`),
`MLFLOW_EXPERIMENT_NAME`, `MLFLOW_RUN_ID` (continue that run), `MLFLOW_TAGS` (a JSON object), and
`HF_MLFLOW_LOG_ARTIFACTS` (log the output folder's files as artifacts under `model/`: on by default for an
adapter, off for a full model unless set to 1). Metrics keep metrics.jsonl's names (loss, learning_rate,
eval_loss, ...); the run's flags are params named `<group>.<flag>` (model.lora_r, train.learning_rate, ...).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from shardtune.runtime.log import warn0

# tracker -> (module to import, pip extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "report"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
_TRUE = ("1", "true", "yes", "on")


def parse_report_to(value: str | list[str] | None) -> list[str]:
    """`--report_to` as a list of tracker names; raises ValueError naming the flag, the bad value and the choices."""
    items = value if isinstance(value, list) else str(value or "none").replace(" ", ",").split(",")
    names = [x.strip().lower() for x in items if x.strip()]
    bad = [n for n in names if n not in (*PACKAGES, "all", "none")]
    if bad:
        raise ValueError(
            f"--report_to {','.join(bad)} is not supported; use none, all, or a comma list of {', '.join(PACKAGES)}."
        )
    if "all" in names:  # transformers: every integration that is installed
        return [n for n, (module, _) in PACKAGES.items() if importlib.util.find_spec(module) is not None]
    return [n for n in dict.fromkeys(names) if n != "none"]


def report_to_problems(report_to: str | list[str] | None) -> list[str]:
    """--report_to: known tracker names, and their packages installed (checked with the run's flags, before any
    loading)."""
    try:
        return missing_packages(parse_report_to(report_to))
    except ValueError as e:
        return [str(e)]


def missing_packages(names: list[str]) -> list[str]:
    """One line per tracker whose package is not installed, naming the package and the pip command."""
    out = []
    for n in names:
        module, extra = PACKAGES[n]
        if importlib.util.find_spec(module) is None:
            out.append(
                f"--report_to {n} needs the `{module}` package, which is not installed: "
                f"pip install 'shardtune[{extra}]'"
            )
    return out


def open_trackers(names: list[str], *, output_dir: str, run_name: str | None) -> list:
    """Start the W&B and MLflow runs among `names` (TensorBoard is RunLogger's); call on the main process only."""
    classes = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    opened = []
    try:
        for n in names:
            if n in classes:
                opened.append(classes[n](output_dir=output_dir, run_name=run_name))
    except Exception:
        for t in opened:
            t.close(finished=False)
        raise
    return opened


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _model_files(out: str | Path) -> list[Path]:
    """The files at the top of an output folder (adapter or model, tokenizer, card, metrics, plot): not the
    checkpoints/, runs/ or merged/ folders below it."""
    return sorted(p for p in Path(out).iterdir() if p.is_file())


class WandbTracker:
    """A Weights & Biases run: config = the run's flags, history = metrics against train/global_step."""

    raw_keys = False  # metrics arrive as train/loss, eval/loss, ... (RunLogger's TensorBoard tags)

    def __init__(self, *, output_dir: str, run_name: str | None):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "shardtune"),
            name=run_name or os.environ.get("WANDB_NAME") or Path(output_dir).resolve().name,
            dir=os.environ.get("WANDB_DIR") or None,
        )
        # As transformers: every metric is plotted against the optimizer step, so that train and eval records of
        # one step share the x axis, and a resumed run that logs a step again does not break W&B's own counter.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, kind: str, step: int, tagged: dict[str, float]) -> None:
        self.run.log({**tagged, "train/global_step": step})

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def log_model(self, out: str | Path, *, is_adapter: bool) -> None:
        if os.environ.get("WANDB_LOG_MODEL", "false").lower() not in ("end", "checkpoint", *_TRUE):
            return
        artifact = self._wandb.Artifact(name=f"model-{self.run.id}", type="model")
        for p in _model_files(out):
            artifact.add_file(str(p))
        self.run.log_artifact(artifact, aliases=["final"])

    def close(self, finished: bool = True) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if finished else 1)
            self.run = None


class MlflowTracker:
    """An MLflow run: params = the run's flags, metrics with metrics.jsonl's names, the adapter as artifacts."""

    raw_keys = True

    def __init__(self, *, output_dir: str, run_name: str | None):
        import mlflow

        self._mlflow = mlflow
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if experiment:
            mlflow.set_experiment(experiment)
        tags = json.loads(os.environ.get("MLFLOW_TAGS", "{}"))
        self.run = mlflow.start_run(
            run_id=os.environ.get("MLFLOW_RUN_ID") or None,
            run_name=run_name or Path(output_dir).resolve().name,
            tags=tags or None,
        )
        self._log_artifacts = os.environ.get("HF_MLFLOW_LOG_ARTIFACTS")

    def log_config(self, config: dict) -> None:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {}
        for k, v in _flatten(config).items():
            text = json.dumps(v, default=str) if isinstance(v, (list, tuple)) else str(v)
            if len(text) > MAX_PARAM_VAL_LENGTH:  # MLflow rejects the whole batch otherwise
                warn0(f"MLflow: param {k} is {len(text)} characters long; logged cut to {MAX_PARAM_VAL_LENGTH}.")
                text = text[:MAX_PARAM_VAL_LENGTH]
            params[k] = text
        items = list(params.items())
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._mlflow.log_params(dict(items[i : i + MAX_PARAMS_TAGS_PER_BATCH]))

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        self._mlflow.log_metrics(metrics, step=step, synchronous=True)

    def finish(self, summary: dict) -> None:
        numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._mlflow.log_metrics({f"summary.{k}": v for k, v in numbers.items()}, step=int(summary.get("steps") or 0))

    def log_model(self, out: str | Path, *, is_adapter: bool) -> None:
        wanted = self._log_artifacts.lower() in _TRUE if self._log_artifacts is not None else is_adapter
        if not wanted:
            return
        for p in _model_files(out):
            self._mlflow.log_artifact(str(p), artifact_path="model")

    def close(self, finished: bool = True) -> None:
        if self.run is not None:
            self._mlflow.end_run(status="FINISHED" if finished else "KILLED")
            self.run = None
