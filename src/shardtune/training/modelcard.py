"""Model cards (README.md with the hub's YAML metadata) for adapters and merged or fully fine-tuned models."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardtune.data import templates
from shardtune.runtime.atomic import replace_text
from shardtune.runtime.hub import is_hub_id

METHODS = {"lora": "LoRA", "qlora": "QLoRA", "dora": "DoRA", "full": "full"}
LIBRARIES = ("peft", "transformers")

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## How to use

```python
{{ usage }}
```
{{ method_note }}
## Training data

{{ data }}

## Training hyperparameters

{{ hyperparameters }}

## Results

{{ metrics }}
"""


def write_model_card(
    output_dir: str | Path,
    *,
    base_model: str,
    method: str,
    datasets: str | Sequence[str] | None,
    hyperparameters: Mapping[str, Any],
    metrics: Mapping[str, float | None],
    library_name: str = "peft",
    tags: Sequence[str] | None = None,
    pipeline_tag: str = "text-generation",
    model_name: str | None = None,
) -> Path:
    """Write output_dir/README.md: hub metadata (base model, data, method, results) and a readable summary.

    `method` is LoRA, QLoRA, DoRA or full. Local paths given as base_model or datasets are named in the text but
    left out of the metadata, where the hub accepts only repository ids. `metrics` may hold train_loss,
    eval_loss and perplexity (computed from eval_loss when missing); every entry is listed under Results.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    key = method.strip().lower()
    if key not in METHODS:
        raise ValueError(f"method {method!r}: use one of LoRA, QLoRA, DoRA or full.")
    if library_name not in LIBRARIES:
        raise ValueError(f"library_name {library_name!r}: use peft (an adapter) or transformers (a full model).")
    out = Path(output_dir)
    name = model_name or out.resolve().name
    data = [datasets] if isinstance(datasets, str) else list(datasets or [])
    metrics = _with_perplexity(metrics)
    base_id = base_model if is_hub_id(base_model) else None
    hub_data = [d for d in data if is_hub_id(d)]
    card_data = ModelCardData(
        base_model=base_id,
        base_model_relation=("adapter" if library_name == "peft" else "finetune") if base_id else None,
        datasets=hub_data or None,
        library_name=library_name,
        pipeline_tag=pipeline_tag,
        tags=_tags(key, library_name, base_id, tags),
        model_name=name,
        eval_results=_eval_results(EvalResult, metrics, hub_data, pipeline_tag) or None,
    )
    card = ModelCard.from_template(
        card_data,
        template_str=TEMPLATE,
        title=name,
        summary=_summary(METHODS[key], base_model, base_id, data, library_name),
        usage=_usage(library_name, base_model, name),
        method_note=_method_note(key, library_name),
        data="\n".join(f"- {_link(d, 'datasets/')}" for d in data) or "Not recorded.",
        hyperparameters=_table(("Hyperparameter", "Value"), hyperparameters),
        metrics=_table(("Metric", "Value"), {k: v for k, v in metrics.items() if v is not None}),
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "README.md"
    card.save(path)
    return path


def _with_perplexity(metrics: Mapping[str, float | None]) -> dict[str, float | None]:
    out = dict(metrics)
    eval_loss = out.get("eval_loss")
    if out.get("perplexity") is None and eval_loss is not None:
        out["perplexity"] = math.exp(min(float(eval_loss), 700.0))
    return out


def _tags(method: str, library: str, base_id: str | None, extra: Sequence[str] | None) -> list[str]:
    tags = ["shardtune", "fsdp2", "full-fine-tuning" if method == "full" else method]
    if library == "peft":
        tags.append("lora" if method != "lora" else "peft")
        if base_id:
            tags.append(f"base_model:adapter:{base_id}")
    return list(dict.fromkeys([*tags, *(extra or [])]))


def _eval_results(cls: Any, metrics: Mapping[str, float | None], data: list[str], task: str) -> list[Any]:
    """model-index entries for the evaluation metrics, which the hub shows only when tied to a hub dataset."""
    if not data:
        return []
    names = {"eval_loss": ("loss", "Eval loss"), "perplexity": ("perplexity", "Perplexity")}
    return [
        cls(
            task_type=task,
            dataset_type=data[0],
            dataset_name=data[0],
            metric_type=kind,
            metric_name=label,
            metric_value=round(float(metrics[key]), 4),
        )
        for key, (kind, label) in names.items()
        if metrics.get(key) is not None
    ]


def _link(ref: str, kind: str = "") -> str:
    return f"[{ref}](https://huggingface.co/{kind}{ref})" if is_hub_id(ref) else f"`{ref}`"


def _summary(method: str, base_model: str, base_id: str | None, data: list[str], library: str) -> str:
    what = "adapter" if library == "peft" else "model"
    on = f" on {', '.join(_link(d, 'datasets/') for d in data)}" if data else ""
    text = f"This {what} is a {method} fine-tune of {_link(base_model)}{on}, trained with shardtune on PyTorch FSDP2."
    if base_id is None:
        text += " The base model was a local folder, so the metadata names no base model."
    return text


def _usage(library: str, base_model: str, name: str) -> str:
    if library == "peft":
        return (
            "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")\n'
            f'base = AutoModelForCausalLM.from_pretrained("{base_model}", dtype="auto")\n'
            "if len(tokenizer) > base.get_input_embeddings().num_embeddings:  # the chat template added tokens\n"
            f"    base.resize_token_embeddings(len(tokenizer), pad_to_multiple_of={templates.VOCAB_MULTIPLE})\n"
            f'model = PeftModel.from_pretrained(base, "{name}")'
        )
    return (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{name}", dtype="auto")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")'
    )


def _method_note(method: str, library: str) -> str:
    if method != "qlora":
        return ""
    if library == "peft":
        note = "The adapter was trained on the base quantized to 4 bits (bitsandbytes NF4)."
    else:
        note = "The QLoRA adapter was merged into the base's original-precision weights, not dequantized 4-bit ones."
    return f"\n{note}\n"


def _table(header: tuple[str, str], rows: Mapping[str, Any]) -> str:
    if not rows:
        return "Not recorded."
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows.items()]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value).replace("|", "\\|")


EVAL_BEGIN = "<!-- shardtune eval: begin -->"
EVAL_END = "<!-- shardtune eval: end -->"


def set_eval_section(card_path: str | Path, table: str) -> Path:
    """Put (or replace) the lm-evaluation-harness results table in a model card, between markers so that a later
    `shardtune eval` replaces it instead of adding a second one; the rest of the card is kept as it is."""

    path = Path(card_path)
    text = path.read_text(encoding="utf-8")
    section = f"{EVAL_BEGIN}\n## Evaluation (lm-evaluation-harness)\n\n{table.strip()}\n{EVAL_END}\n"
    if EVAL_BEGIN in text and EVAL_END in text:
        head, rest = text.split(EVAL_BEGIN, 1)
        text = head + section + rest.split(EVAL_END, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section

    replace_text(path, text)
    return path
