"""The conformance sweep: for every causal-LM architecture the installed transformers registers
(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), shardtune's training forward against the model's own, on a tiny random copy
of the config class's defaults (shardtune.models.families.tiny_config, multipliers left at 1.0 set to 2.5 so that a
dropped one shows).

Per family, with the attention shardtune trains it with:
- fast path: whether the decoder + chunked head give the model's own logits on one document (fp32, elementwise,
  relative error <= families.RTOL), with which decoder and head transform;
- packing: whether a packed row gives each document's logits alone, on the path shardtune trains with; where
  neither path keeps documents apart, `shardtune train --packing True` is refused before loading weights;
- all-linear: the LoRA layers shardtune.models.targets picks, and that one forward runs with them attached.
A family that cannot be built on CPU from its defaults (extra packages, sub-models it needs inputs for) is listed
as skipped with the reason. Each family runs in a forked process with a time limit.

Before the sweep, planted bugs must fail the check (a dropped head multiplier on Granite, a leak across packed
documents on Llama), else nothing is written.

    python bench/conformance.py [--types llama,granite] [--readme] [--from_json] [--timeout 120]

Writes bench/results/conformance.json; with --readme, README.md's table between its conformance markers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch

from shardtune.models import documents as document_rows
from shardtune.models import families, fastpath, targets
from shardtune.models.training_module import CausalLMForTraining

RESULTS = ROOT / "bench" / "results" / "conformance.json"
README = ROOT / "README.md"
START, END = "<!-- conformance:start -->", "<!-- conformance:end -->"


def tiny_default(model_type: str):
    from transformers import CONFIG_MAPPING

    return families.tiny_config(CONFIG_MAPPING[model_type](), discriminating=True)


def check_family(model_type: str) -> dict:
    """The row of one family (run in a child process)."""
    fastpath.register_attention()
    try:
        tiny = tiny_default(model_type)
    except Exception as e:  # noqa: BLE001 - recorded as the reason it is skipped
        return {"status": "skipped", "reason": f"config: {_short(e)}"}
    attention = families.family_attention(tiny, fastpath.ATTENTION)
    try:
        v = families.check(tiny, attention, CausalLMForTraining)
    except Exception as e:  # noqa: BLE001
        return {"status": "skipped", "reason": f"tiny model: {_short(e)}"}
    packed = v.layout(True)
    row = {
        "status": "checked",
        "fast": v.fast is not None,
        "decoder": v.fast.decoder if v.fast else None,
        "head": v.fast.head if v.fast else None,
        "packing_path": packed.path,
        "packing_split": packed.split,  # each packed document decoded as a row of its own (models.documents)
        "packing": v.packing_ok(packed),
        "attention": v.attention,
        "reason": v.reason,
        "errors": {k: (None if x == float("inf") else x) for k, x in v.errors.items()},
    }
    row["lora"] = _lora_row(tiny, attention)
    return row


def _lora_row(tiny, attention: str) -> dict:
    from peft import LoraConfig, get_peft_model

    try:
        with families._quiet(), torch.no_grad():
            model = families.build_tiny(tiny, attention)
            plan = targets.plan_all_linear(model)
            if not plan.paths:
                return {"layers": 0, "forward": "no linear layer"}
            peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=plan.paths, task_type="CAUSAL_LM"))
            ids, pos, _ = families.probe_inputs(model.get_input_embeddings().weight.shape[0])
            train = CausalLMForTraining(peft_model, layout=families.OWN)
            ok = bool(torch.isfinite(train.logits(ids, pos)).all())
        return {"layers": len(plan.paths), "left_out": sorted(plan.left_out), "forward": "ok" if ok else "not finite"}
    except Exception as e:  # noqa: BLE001
        return {"layers": None, "forward": _short(e)}


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _child(fn, arg, conn) -> None:
    try:
        conn.send(fn(arg))
    except Exception as e:  # noqa: BLE001
        conn.send({"status": "skipped", "reason": _short(e)})


def _start(fn, arg):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, arg, child))
    proc.start()
    return proc, parent, time.time()


def run_isolated(fn, arg, timeout: float) -> dict:
    """fn(arg) in a forked child, killed after `timeout` seconds. The parent runs no torch operation itself: a
    child forked after the parent started its OpenMP threads would hang."""
    return run_many(fn, [arg], timeout, jobs=1)[arg]


def run_many(fn, args: list, timeout: float, jobs: int, on_row=None) -> dict:
    """fn(a) for each a, in up to `jobs` forked children at a time, each killed after `timeout` seconds;
    on_row(a, row) as each finishes."""
    pending, running, out = list(args), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            a = pending.pop(0)
            running[a] = _start(fn, a)
        for a, (proc, conn, t0) in list(running.items()):
            late = time.time() - t0 > timeout
            if conn.poll() or late:
                row = conn.recv() if not late else {"status": "skipped", "reason": f"over {timeout:.0f} s on CPU"}
                proc.kill()
                proc.join()
                if isinstance(row, dict):
                    row["seconds"] = round(time.time() - t0, 1)
                out[a] = row
                del running[a]
                if on_row is not None:
                    on_row(a, row)
        time.sleep(0.05)
    return out


def planted_bugs_fail(_=None) -> list[str]:
    """The check must catch a dropped head multiplier and a leak across packed documents; returns what it missed."""
    from transformers import GraniteConfig, LlamaConfig, Mamba2Config

    missed = []
    granite = families.tiny_config(GraniteConfig(logits_scaling=4.0))
    transforms = families.head_transforms
    families.head_transforms = lambda cfg: {"identity": transforms(cfg)["identity"]}
    try:
        if families.check(granite, fastpath.ATTENTION, CausalLMForTraining).fast is not None:
            missed.append("Granite's logits_scaling dropped")
    finally:
        families.head_transforms = transforms
    # The leak: each row one causal span, the family's mask not consulted.
    documents, mask = fastpath.packed_documents, fastpath._family_mask
    fastpath.packed_documents = lambda pos, span_tokens=0: tuple((fastpath.Span(pos.shape[1], None),) for _ in pos)
    fastpath._family_mask = lambda *a: None
    try:
        if families.check(families.tiny_config(LlamaConfig()), fastpath.ATTENTION, CausalLMForTraining).fast_packing:
            missed.append("a packed row attended as one document")
    finally:
        fastpath.packed_documents, fastpath._family_mask = documents, mask
    # A recurrent state carried across documents: the split layout's rows taken whole, not one document each.
    rows = document_rows.document_rows
    document_rows.document_rows = _whole_rows
    try:
        if families.check(families.tiny_config(Mamba2Config()), fastpath.ATTENTION, CausalLMForTraining).split_packing:
            missed.append("a recurrent state carried across packed documents")
    finally:
        document_rows.document_rows = rows
    return missed


def _whole_rows(position_ids):
    batch, seq = position_ids.shape
    flat = torch.arange(batch * seq)
    return document_rows.DocumentRows(batch, seq, flat, flat, torch.arange(seq).repeat(batch, 1))


def sweep(types: list[str], timeout: float, jobs: int, out: Path) -> dict:
    """Check `types`, writing `out` after each family; families already in `out` are kept (a resumed sweep)."""
    missed = run_isolated(planted_bugs_fail, None, 600)
    if missed:
        raise SystemExit(f"the check missed planted bugs: {missed}; nothing written.")
    result = json.loads(out.read_text()) if out.exists() else {"families": {}, "seconds": 0.0}
    result.update(_versions())
    t0, before = time.time(), result["seconds"]

    def write(name: str, row: dict) -> None:
        print(f"{name:28s} {json.dumps(row)[:160]}", flush=True)
        result["families"][name] = row
        result["seconds"] = round(before + time.time() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    run_many(check_family, [t for t in types if t not in result["families"]], timeout, jobs, write)
    result["families"] = dict(sorted(result["families"].items()))
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def merge(parts: list[Path], out: Path) -> dict:
    """The union of partial sweeps' rows; a registered family none of them reached is listed as not run."""
    results = [json.loads(p.read_text()) for p in parts]
    rows = {name: row for r in results for name, row in r["families"].items()}
    for name in families.causal_lm_types():
        rows.setdefault(name, {"status": "not run", "reason": "not reached by this sweep"})
    merged = {**results[0], "families": dict(sorted(rows.items())), "seconds": sum(r["seconds"] for r in results)}
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return merged


def _versions() -> dict:
    import peft
    import transformers

    return {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}


def _cells(row: dict) -> list[str]:
    if row["status"] != "checked":
        return [row["status"], "", "", "", row["reason"].replace("|", "/")]
    if row["fast"]:
        head = "" if row["head"] == "identity" else f", logits {row['head']}"
        dec = "" if row["decoder"] == "" else f", decoder `{row['decoder']}`"
        forward = f"fast path{dec}{head}"
    else:
        forward = "own forward"
    split = row.get("packing_split", False)
    if row["packing"]:
        own = " (own forward)" if row["packing_path"] == "own" and row["fast"] else ""
        packing = "ok" + own + (" (rows of their own)" if split else "")
    else:
        packing = "refused"
    e = row["errors"]
    if split:
        packed = e.get("split packed")
    elif row["packing_path"] == "fast":
        packed = e.get("fast packed")
    else:
        packed = _max(e["own packed"], e["own path packed"])
    err = f"{_fmt(e.get('fast'))} / {_fmt(packed)}"
    lora = row["lora"]
    lora_cell = f"{lora['layers']} layers" if lora.get("forward") == "ok" else f"✗ {lora.get('forward', '')}"
    return [forward, packing, err, lora_cell, row["reason"].replace("|", "/")]


def _max(a, b):
    return None if a is None or b is None else max(a, b)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.0e}"


def markdown(result: dict) -> str:
    rows = result["families"]
    n_fast = sum(r.get("fast", False) for r in rows.values())
    n_own = sum(r["status"] == "checked" and not r["fast"] for r in rows.values())
    n_skip = sum(r["status"] == "skipped" for r in rows.values())
    n_not_run = sum(r["status"] == "not run" for r in rows.values())
    n_refused = sum(r["status"] == "checked" and not r["packing"] for r in rows.values())
    n_split = sum(r["status"] == "checked" and r["packing"] and r.get("packing_split", False) for r in rows.values())
    counts = (
        f"{len(rows)} architectures: {n_fast} on the fast path, {n_own} on their own forward, {n_skip} skipped "
        f"(not buildable on CPU from their defaults){f', {n_not_run} not run' if n_not_run else ''}; packed documents "
        f"decoded as rows of their own on {n_split}, packing refused on {n_refused}. Tested with transformers "
        f"{result['transformers']}, peft {result['peft']}, torch {result['torch']}."
    )
    lines = [
        counts,
        "",
        "<details><summary>The table (one row per model_type)</summary>",
        "",
        "| model_type | training forward | packing | error: one doc / packed | all-linear LoRA | note |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in sorted(rows.items()):
        lines.append(f"| {name} | {' | '.join(_cells(row))} |")
    lines += ["", "</details>"]
    return "\n".join(lines)


def write_readme(table: str) -> None:
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} markers under its 'Supported models' heading.")
    head, rest = text.split(START, 1)
    README.write_text(head + START + "\n" + table + "\n" + END + rest.split(END, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="", help="comma-separated model_types (default: every registered one)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per family")
    ap.add_argument("--out", default=str(RESULTS), help="results JSON (written after each family; resumed)")
    ap.add_argument("--merge", default="", help="comma-separated results JSONs of partial sweeps, merged into --out")
    ap.add_argument("--reverse", action="store_true", help="check the families from the last")
    ap.add_argument("--jobs", type=int, default=1, help="families checked at a time")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's conformance table")
    ap.add_argument("--from_json", action="store_true", help="only print (and write) the table of the last results")
    args = ap.parse_args()
    out = Path(args.out)
    if args.merge:
        result = merge([Path(p) for p in args.merge.split(",")], out)
    elif args.from_json:
        result = json.loads(out.read_text())
    else:
        types = [t for t in args.types.split(",") if t] or list(families.causal_lm_types())
        result = sweep(types[::-1] if args.reverse else types, args.timeout, args.jobs, out)
    table = markdown(result)
    print(table)
    if args.readme:
        write_readme(table)


if __name__ == "__main__":
    main()
