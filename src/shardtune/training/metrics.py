"""Run metrics: the progress bar, `metrics.jsonl`, TensorBoard scalars, the loss plot and the summary table.

W&B and MLflow runs (`--report_to wandb,mlflow`) get the same records through `shardtune.training.trackers`.

`metrics.jsonl` (in the run's output_dir) holds one JSON object per line, appended and flushed as it is logged:

- `{"type": "start", "time", "elapsed_s": 0, "total_steps", "config"}` when a run (or a resumed run) starts;
- `{"type": "train", "step", "time", "elapsed_s", "loss", "learning_rate", ...}` per logged optimizer step;
- `{"type": "eval", "step", "time", "elapsed_s", "eval_loss", "eval_perplexity"}` per evaluation;
- `{"type": "event", "step", "time", "elapsed_s", "kind", "message"}` when the loop finds something wrong that does
  not stop it: kind `collapse` (the gradient norm 0 for several steps in a row, shardtune.training.trainer);
- `{"type": "summary", "step", "time", "elapsed_s", "runtime_s", "train_tokens", ...}` when the run ends (with
  `collapsed_at_step` after a collapse).

`time` is Unix time in seconds and `elapsed_s` the seconds since that run (segment) started.
`shardtune report OUTPUT_DIR` rebuilds the summary and the plot from this file alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from shardtune.runtime.atomic import replaced_file
from shardtune.runtime.log import print0, warn0
from shardtune.training.trackers import parse_report_to

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "runs"
REPORT_EXTRA = "pip install 'shardtune[report]'"
# metrics key -> TensorBoard tag; other numeric keys go to train/<key> or eval/<key without the eval_ prefix>.
TB_TAGS = {
    "loss": "train/loss",
    "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "memory_gb": "train/memory_gb",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}
_RESERVED = ("type", "step", "time", "elapsed_s")


def _require(module: str, what: str):
    """Import an optional dependency, or raise an ImportError that names the pip extra to install."""

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the `{module.split('.')[0]}` package, which is not installed: {REPORT_EXTRA}"
        ) from e


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers (lists element-wise) so that json can write them."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(key, v) for v in value) + "]"
    if not isinstance(value, float):
        return str(value)
    if "learning_rate" in key or key == "lr":
        return f"{value:.2e}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if "loss" in key or "perplexity" in key:
        return f"{value:.4f}"
    return f"{value:.2f}" if "memory" in key else f"{value:.4g}"


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers among a record's metrics, plus `memory_gb` (the largest rank's) from memory_per_rank_gb."""
    out = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "memory_gb" not in out and metrics.get("memory_per_rank_gb"):
        out["memory_gb"] = max(metrics["memory_per_rank_gb"])
    return out


def _tagged(kind: str, scalars: dict[str, float]) -> dict[str, float]:
    """Metric names as TensorBoard and W&B show them: train/<key>, eval/<key without eval_>."""
    return {
        TB_TAGS.get(k) or (f"eval/{k.removeprefix('eval_')}" if kind == "eval" else f"train/{k}"): v
        for k, v in scalars.items()
    }


class RunLogger:
    """Everything a training run reports, written by the main process only (elsewhere every method is a no-op).

    Each `log_train`/`log_eval` appends a flushed line to `metrics.jsonl` (so an interrupted run keeps what it
    logged and a resumed run appends), writes TensorBoard scalars with `report_to="tensorboard"`, passes the
    numbers to the W&B/MLflow `trackers` it is given, and prints one line. `progress` moves the tqdm bar;
    `finish` writes the summary record (also to the trackers), draws `loss.png` and prints the table.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        is_main: bool,
        report_to: str = "none",
        total_steps: int,
        config: dict | None = None,
        disable_progress: bool = False,
        trackers: list | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self.disable_progress = disable_progress
        self.config = config
        self.last_step: int | None = None
        self._bar = None
        self._tb = None
        self._tb_wanted = "tensorboard" in parse_report_to(report_to)
        # W&B and MLflow runs, opened by the caller before the model loads (see trackers.open_trackers).
        self._trackers = list(trackers or []) if is_main else []
        self._file = None
        self._t0 = time.time()
        self.collapsed_at: int | None = None  # the step of a `collapse` event (log_event)
        if not is_main:
            return
        if self._tb_wanted:
            _require("torch.utils.tensorboard", "--report_to tensorboard")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = self._open_metrics_file()
        self._write({"type": "start", "total_steps": total_steps, "config": config or {}})
        for tracker in self._trackers:
            tracker.log_config(config or {})

    def _open_metrics_file(self):
        path = self.output_dir / METRICS_FILE
        torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the run, closed by close()
        if torn:  # a killed run left half a line: end it so that our first record starts on its own line
            f.write("\n")
        return f

    def _write(self, record: dict) -> dict:
        now = time.time()
        record = {"type": record.pop("type"), **record, "time": now, "elapsed_s": round(now - self._t0, 3)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        return record

    def _log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: _plain(v) for k, v in metrics.items() if k not in _RESERVED}
        self._write({"type": kind, "step": int(step), **metrics})
        self.last_step = int(step)
        scalars = _scalars(metrics)
        if self._tb_wanted:
            self._tensorboard(kind, int(step), scalars)
        for tracker in self._trackers:
            # MLflow keeps metrics.jsonl's names (as transformers' MLflowCallback); W&B the TensorBoard tags.
            tracker.log(kind, int(step), scalars if tracker.raw_keys else _tagged(kind, scalars))
        head = f"step {step}/{self.total_steps}" + (" eval" if kind == "eval" else "")
        self._print("  ".join([head] + [f"{k} {_fmt(k, v)}" for k, v in metrics.items()]))

    def log_train(self, step: int, metrics: dict[str, float]) -> None:
        """Record training metrics of optimizer step `step` (loss, learning_rate, grad_norm, tokens_per_s, ...)."""
        if self.is_main:
            self._log("train", step, metrics)

    def log_event(self, step: int, kind: str, message: str) -> None:
        """Record something wrong that does not stop the run (kind `collapse`: see training.trainer); a collapse
        goes into the summary, and the trackers' runs are not marked finished."""
        if kind == "collapse":
            self.collapsed_at = int(step)
        if self.is_main:
            self._write({"type": "event", "step": int(step), "kind": kind, "message": message})

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Record evaluation metrics (eval_loss, eval_perplexity) at optimizer step `step`."""
        if self.is_main:
            self._log("eval", step, metrics)

    def _tensorboard(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = self.output_dir / TENSORBOARD_DIR
            resumed = tb_dir.is_dir() and any(p.name.startswith("events.") for p in tb_dir.iterdir())
            # On resume, drop the events that the previous run logged at or after this step (they are redone).
            self._tb = SummaryWriter(log_dir=str(tb_dir), purge_step=step if resumed else None)
            if self.config:
                self._tb.add_text("config", "```\n" + json.dumps(self.config, indent=2, default=str) + "\n```", step)
        for tag, value in _tagged(kind, scalars).items():
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def progress(self, step: int, postfix: dict[str, float]) -> None:
        """Move the progress bar to `step` and show `postfix` (loss, lr, tokens/s, memory) beside it."""
        if not self.is_main or self.disable_progress:
            return
        if self._bar is None:
            # A resumed run starts the bar where it resumed, so that its rate and ETA are right.
            self._bar = tqdm(
                total=self.total_steps, initial=max(step - 1, 0), desc="training", dynamic_ncols=True, file=sys.stderr
            )
        self._bar.set_postfix_str(", ".join(f"{k} {_fmt(k, _plain(v))}" for k, v in postfix.items()), refresh=False)
        self._bar.update(step - self._bar.n)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print0(line)

    def finish(self, summary: dict) -> None:
        """Write the summary record (runtime_s, train_tokens, tokens_per_s, peak_memory_gb_per_rank,
        final_train_loss, final_eval_loss, final_eval_perplexity, output_path, interrupted), draw the plot
        and print the summary table."""
        if not self.is_main:
            return
        if self.collapsed_at is not None:
            summary = {**summary, "collapsed_at_step": self.collapsed_at}
        step = summary.get("step", self.last_step)
        self._write({"type": "summary", "step": step, **{k: _plain(v) for k, v in summary.items() if k != "step"}})
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.flush()
        for tracker in self._trackers:
            tracker.finish({k: _plain(v) for k, v in summary.items()})
        records = read_metrics(self.output_dir)
        try:
            print0(f"Loss plot: {plot_run(self.output_dir, records)}")
        except ImportError as e:
            warn0(f"No loss plot: {e}")
        print0(summary_table(records))

    def log_model(self, out: str | Path, *, is_adapter: bool) -> None:
        """Hand the finished output folder to the trackers that keep models (MLflow artifacts, W&B artifacts)."""
        for tracker in self._trackers:
            tracker.log_model(out, is_adapter=is_adapter)

    def close(self, finished: bool = False) -> None:
        """Close the bar, the TensorBoard writer, the W&B/MLflow runs (marked finished, or failed/killed) and
        metrics.jsonl (safe to call twice). A run that collapsed is not marked finished."""
        for tracker in self._trackers:
            tracker.close(finished=finished and self.collapsed_at is None)
        self._trackers = []
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(output_dir: str | Path) -> list[dict]:
    """All records of `output_dir/metrics.jsonl` in order; lines cut short by a killed run are skipped."""
    path = Path(output_dir) / METRICS_FILE
    records, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    if bad:
        warn0(f"{path}: skipped {bad} incomplete line(s) (a run was interrupted while writing).")
    return records


def _by_step(records: list[dict], kind: str) -> list[dict]:
    """Records of one type, one per step (a step redone after a resume keeps its latest record), by step."""
    latest = {r["step"]: r for r in records if r.get("type") == kind and r.get("step") is not None}
    return [latest[s] for s in sorted(latest)]


def _segments(records: list[dict]) -> list[list[dict]]:
    """Records split at each `start` record: one list per run or resumed run."""
    segments: list[list[dict]] = []
    for r in records:
        if r.get("type") == "start" or not segments:
            segments.append([])
        segments[-1].append(r)
    return segments


def build_summary(records: list[dict]) -> dict:
    """The run's summary: its summary record if the last run finished, else one built from its train/eval
    records with `interrupted: True`. Also gives `steps` (last logged step) and `total_steps`."""
    segments = _segments(records)
    last = segments[-1] if segments else []
    start = next((r for r in reversed(records) if r.get("type") == "start"), {})
    train, evals = _by_step(records, "train"), _by_step(records, "eval")
    base = {"steps": train[-1]["step"] if train else None, "total_steps": start.get("total_steps")}
    done = [r for r in last if r.get("type") == "summary"]
    collapses = [r["step"] for r in last if r.get("type") == "event" and r.get("kind") == "collapse"]
    if collapses:
        base["collapsed_at_step"] = collapses[0]
    if done:
        summary = {k: v for k, v in done[-1].items() if k not in _RESERVED}
        return {**base, "interrupted": False, **summary}
    runtime = sum(seg[-1].get("elapsed_s", 0.0) for seg in segments) if segments else None
    tokens = train[-1].get("tokens") if train else None
    rates = [r["tokens_per_s"] for r in train if r.get("tokens_per_s") is not None]
    tps = tokens / runtime if tokens and runtime else (sum(rates) / len(rates) if rates else None)
    return {
        **base,
        "runtime_s": runtime,
        "train_tokens": tokens,
        "tokens_per_s": tps,
        "peak_memory_gb_per_rank": _peak_memory(train),
        "final_train_loss": train[-1].get("loss") if train else None,
        "final_eval_loss": evals[-1].get("eval_loss") if evals else None,
        "final_eval_perplexity": evals[-1].get("eval_perplexity") if evals else None,
        "output_path": None,
        "interrupted": True,
    }


def _peak_memory(train: list[dict]) -> list[float] | None:
    per_rank = [r["memory_per_rank_gb"] for r in train if r.get("memory_per_rank_gb")]
    if per_rank:
        n = max(len(p) for p in per_rank)
        return [max(p[i] for p in per_rank if i < len(p)) for i in range(n)]
    mem = [r["memory_gb"] for r in train if r.get("memory_gb") is not None]
    return [max(mem)] if mem else None


def _num(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d} ({seconds:.1f} s)"


def summary_table(records: list[dict]) -> str:
    """The run's summary (see `build_summary`) as an aligned text table."""
    s = build_summary(records)
    memory = s.get("peak_memory_gb_per_rank")
    if isinstance(memory, (int, float)):
        memory = [memory]
    steps = f"{_num(s.get('steps'), 'd')} / {_num(s.get('total_steps'), 'd')}"
    output = s.get("output_path") or (
        "none: the run did not finish (resume it with --resume_from_checkpoint latest)" if s.get("interrupted") else "-"
    )
    status = "INTERRUPTED (or still running)" if s.get("interrupted") else "finished"
    if s.get("output_error"):  # a full disk at a checkpoint or the final save (shardtune.recipe.train)
        status, output = "FAILED", f"NOT WRITTEN: {s['output_error']}"
    elif s.get("collapsed_at_step") is not None:  # shardtune.training.trainer's collapse check
        status = (
            f"COLLAPSED at step {s['collapsed_at_step']}: zero gradient norm, the loss stuck; the output is not a "
            "trained model (lower --learning_rate and train again)"
        )
    rows = [
        ("status", status),
        ("steps", steps),
        (
            "train tokens",
            _num(s.get("train_tokens"), ",d")
            if isinstance(s.get("train_tokens"), int)
            else _num(s.get("train_tokens"), ",.0f"),
        ),
        ("time", _duration(s.get("runtime_s"))),
        ("tokens/s", _num(s.get("tokens_per_s"), ",.1f")),
        ("peak memory (GB)", ", ".join(f"rank {i}: {m:.2f}" for i, m in enumerate(memory)) if memory else "-"),
        ("final train loss", _num(s.get("final_train_loss"), ".4f")),
        ("final eval loss", _num(s.get("final_eval_loss"), ".4f")),
        ("final eval perplexity", _num(s.get("final_eval_perplexity"), ".4f")),
        ("output", str(output)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["Run summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])


def plot_run(output_dir: str | Path, records: list[dict] | None = None) -> Path:
    """Draw training and eval loss against step, and the learning rate on a second axis, into
    `output_dir/loss.png` (1000x400 px; 1000x700 with an online-RL run's rewards below); return its path."""
    _require("matplotlib", "The loss plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    output_dir = Path(output_dir)
    records = read_metrics(output_dir) if records is None else records
    train, evals = _by_step(records, "train"), _by_step(records, "eval")
    if not train and not evals:
        raise ValueError(f"{output_dir / METRICS_FILE} has no train or eval records to plot.")
    # A Figure on its own Agg canvas: no pyplot global state, no display needed.
    rewarded = any(r.get("reward") is not None for r in train)  # online RL: the reward curve below the loss
    fig = Figure(figsize=(10, 7 if rewarded else 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if rewarded else fig.add_subplot()
    if rewarded:
        _plot_rewards(fig.add_subplot(2, 1, 2), train)
    lines = _plot_series(ax, train, "loss", label="train loss", color="tab:blue")
    lines += _plot_series(ax, evals, "eval_loss", label="eval loss", color="tab:orange", marker="o")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if any(r.get("learning_rate") is not None for r in train):
        ax2 = ax.twinx()
        lines += _plot_series(ax2, train, "learning_rate", label="learning rate", color="tab:gray", linestyle="--")
        ax2.set_ylabel("learning rate")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    interrupted = build_summary(records).get("interrupted")
    ax.set_title(f"{output_dir.resolve().name}" + (" (interrupted)" if interrupted else ""))
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right")
    fig.tight_layout()

    path = output_dir / PLOT_FILE
    with replaced_file(path) as f:  # a viewer open on loss.png never sees half a file
        fig.savefig(f, dpi=100, format="png")
    return path


def _plot_rewards(ax, train: list[dict]) -> None:
    """The mean reward and each reward function's (TRL's names: reward, rewards/<function>/mean) against step."""
    from matplotlib.ticker import MaxNLocator

    lines = _plot_series(ax, train, "reward", label="reward", color="tab:green")
    per_function = sorted({k for r in train for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    for key in per_function:
        lines += _plot_series(ax, train, key, label=key.removeprefix("rewards/").removesuffix("/mean"), alpha=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right")


def _plot_series(ax, records: list[dict], key: str, **style) -> list:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not points:
        return []
    steps, values = zip(*points)
    return ax.plot(steps, values, **style)


def report_main(argv: list[str]) -> int:
    """`shardtune report OUTPUT_DIR`: print a run's summary and (re)draw its loss plot."""
    parser = argparse.ArgumentParser(
        prog="shardtune report",
        description="Print a run's summary and draw OUTPUT_DIR/loss.png from its "
        "metrics.jsonl; works on finished and interrupted runs.",
    )
    parser.add_argument("output_dir", help="The --output_dir of a shardtune train run.")
    parser.add_argument("--no_plot", action="store_true", help="Only print the summary.")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    if not out.is_dir():
        print(f"shardtune report: {out} is not a folder; give the --output_dir of a training run.", file=sys.stderr)
        return 2
    if not (out / METRICS_FILE).is_file():
        print(
            f"shardtune report: no {METRICS_FILE} in {out}; is it the --output_dir of a shardtune train run?",
            file=sys.stderr,
        )
        return 2
    records = read_metrics(out)
    if not any(r.get("type") in ("train", "eval", "summary") for r in records):
        print(f"shardtune report: {out / METRICS_FILE} holds no train, eval or summary record yet.", file=sys.stderr)
        return 2
    print(summary_table(records))
    if args.no_plot:
        return 0
    try:
        path = plot_run(out, records)
    except ImportError as e:
        print(f"shardtune report: no plot drawn. {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # only a summary record: nothing to draw
        print(f"shardtune report: no plot drawn. {e}", file=sys.stderr)
        return 0
    print(f"  {'loss plot':<21}  {path}")
    return 0
