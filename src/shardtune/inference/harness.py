"""EleutherAI's lm-evaluation-harness (`lm_eval`) on a trained adapter with its base, or on a
merged or fully fine-tuned model folder.

The model is loaded as `shardtune chat` loads it (the base's embeddings resized to the adapter's vocabulary when
a chat template added tokens, which lm_eval's own `peft=` loading does not do: it resizes to len(tokenizer), not
to the multiple of 8 that training used) and handed to lm_eval's `HFLM` wrapper, so that every lm_eval task
works: the registry's (which download their data from the hub) and local ones, a task YAML over local files
(`--include_path`), which need no network. The results land beside the model: `eval_results.json` (lm_eval's
results, versions, configs and sample counts), `eval_results.md` (lm_eval's table) and a section of the model
card (README.md).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardtune.inference.load import load_for_chat, resolve_paths
from shardtune.runtime.atomic import replace_text
from shardtune.runtime.log import print0
from shardtune.training.modelcard import set_eval_section

RESULTS_JSON = "eval_results.json"
RESULTS_MD = "eval_results.md"
EVAL_EXTRA = "pip install 'shardtune[eval]'"


@dataclass
class EvalArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A merged or fully fine-tuned model folder, or the base model of --adapter (hub id or folder)."
        },
    )
    adapter: str | None = field(
        default=None,
        metadata={"help": "The adapter folder (a LoRA/DoRA run's --output_dir); its base is read from it."},
    )
    tasks: str | None = field(
        default=None, metadata={"help": "Comma-separated lm_eval task or group names (see --include_path)."}
    )
    include_path: str | None = field(
        default=None, metadata={"help": "A folder of task YAML files (local tasks over local data files)."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where eval_results.json/.md go (default: the adapter or model folder)."}
    )
    batch_size: int = field(default=8, metadata={"help": "Requests per forward pass."})
    num_fewshot: int | None = field(default=None, metadata={"help": "Few-shot examples (default: each task's own)."})
    limit: float | None = field(
        default=None, metadata={"help": "Only the first N documents of each task (a fraction if < 1); for tests."}
    )
    apply_chat_template: bool = field(default=False, metadata={"help": "Wrap each prompt in the chat template."})
    max_length: int | None = field(default=None, metadata={"help": "Longest context in tokens (default: the model's)."})
    log_samples: bool = field(
        default=False,
        metadata={"help": "Also write each document's prompt, answers and scores to eval_samples_<task>.jsonl."},
    )
    seed: int = field(default=1234, metadata={"help": "Seed of few-shot sampling and of torch/numpy."})
    use_4bit_quantization: bool = field(default=False, metadata={"help": "Load the base in 4-bit (bitsandbytes)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code from the hub repository."})


def split_tasks(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def task_manager(include_path: str | None, tasks: list[str]):
    """lm_eval's TaskManager: only the tasks under include_path when they are all there (indexing lm_eval's
    ~15k registry tasks takes seconds), else the registry's too."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
        return TaskManager(include_path=include_path)
    return TaskManager()


def check_tasks(
    tasks: list[str], include_path: str | None, flags: tuple[str, str] = ("--tasks", "--include_path")
) -> tuple[Any, list[str]]:
    """(task manager, problems): each unknown task named with the closest known names; `flags` name the tasks
    and include-path flags in the messages."""

    tasks_flag, include_flag = flags
    if include_path and not Path(include_path).expanduser().is_dir():
        return None, [f"{include_flag} {include_path}: no such folder; give a folder of lm_eval task YAML files."]
    if not tasks:
        return None, [f"{tasks_flag} is required: comma-separated lm_eval task names, e.g. hellaswag,arc_easy."]
    tm = task_manager(include_path, tasks)
    known = set(tm.all_tasks)
    problems = []
    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            if not close and not include_path:
                hint = f"; a local task needs {include_flag} with its YAML."
            problems.append(f"{tasks_flag} {t}: lm_eval knows no such task{hint}")
    return tm, problems


def run_harness(model, tokenizer, tasks: list[str], tm, args: EvalArguments) -> dict:
    """lm_eval's `simple_evaluate` on an already loaded model; returns its results dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, max_length=args.max_length)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=tm,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        log_samples=args.log_samples,
        apply_chat_template=args.apply_chat_template,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )


def write_results(results: dict, out: Path, *, model_desc: str) -> tuple[Path, str]:
    """eval_results.json, eval_results.md (and eval_samples_<task>.jsonl when samples were logged) in `out`;
    returns the json path and the markdown table."""
    from lm_eval.utils import handle_non_serializable, make_table

    out.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None) or {}
    for task, rows in samples.items():
        lines = (json.dumps(r, default=handle_non_serializable) for r in rows)
        replace_text(out / f"eval_samples_{task}.jsonl", "\n".join(lines) + "\n")
    record = {"model": model_desc, **results}
    path = out / RESULTS_JSON
    replace_text(path, json.dumps(record, indent=2, default=handle_non_serializable) + "\n")
    table = make_table(results)
    if "groups" in results:
        table += "\n" + make_table(results, "groups")
    replace_text(out / RESULTS_MD, f"# lm-evaluation-harness results\n\n{model_desc}\n\n{table}\n")
    return path, table


def evaluate_model(args: EvalArguments) -> int:
    """Check everything that is cheap to check, load the model, run the tasks, write the results."""

    tasks = split_tasks(args.tasks)
    base, adapter = resolve_paths(args.model_name_or_path, args.adapter)
    tm, problems = check_tasks(tasks, args.include_path)
    if problems:
        raise ValueError("; ".join(problems))
    if not (args.output_dir or adapter or Path(base).expanduser().is_dir()):
        raise ValueError(f"--model_name_or_path {base} is not a local folder: give --output_dir for the results.")
    out = Path(args.output_dir or adapter or base)
    model, tokenizer = load_for_chat(
        base, adapter, use_4bit=args.use_4bit_quantization, trust_remote_code=args.trust_remote_code
    )
    results = run_harness(model, tokenizer, tasks, tm, args)
    desc = f"`{base}`" + (f" with the adapter `{adapter}`" if adapter else "")
    path, table = write_results(results, out, model_desc=desc)
    print(table)
    print0(f"Results written to {path} and {out / RESULTS_MD}.")
    card_dir = Path(adapter) if adapter else Path(base)
    if (card_dir / "README.md").is_file():
        set_eval_section(card_dir / "README.md", table)
        print0(f"Model card {card_dir / 'README.md'}: evaluation section updated.")
    return 0
