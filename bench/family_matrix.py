"""The full family matrix: every family × LoRA / QLoRA / DoRA / full fine-tuning on 2 FSDP2 ranks (gloo), then
merge and chat, on tiny random models built from each family's transformers config (tests/families.py).

What counts as working, per cell:
- LoRA: 2 ranks train as 1 process does, per-step loss and grad_norm and every adapter tensor elementwise
  (tests/families.py's assert_runs_match and matrix_tolerance), and the adapter, reloaded with transformers + peft
  only in a fresh process, gives the trained eval loss (rel 1e-5);
- full: 2 ranks train as 1 process does, as for LoRA, every tensor of the saved model;
- QLoRA, DoRA: the 2-rank run exits 0 with finite losses that moved (trains only: no 1-process twin here, for time;
  tests/distributed/test_qlora.py and test_adapters.py compare them with 1 process on the Llama model); a refusal
  (exit 2) is listed as such;
- merge: the merged folder loads with AutoModelForCausalLM and its fp32 logits equal base + adapter (rel 1e-5),
  with tied embeddings still tied;
- chat: `shardtune chat`'s loading path answers the same greedy tokens with the adapter and with the merged folder.

Prints a table, writes bench/results/family_matrix.json, and with --readme rewrites README.md's "Supported models"
table (between its markers). The suite's tests/e2e/test_families.py runs the LoRA column on every family, full
fine-tuning against 1 process on two and the other methods on some; this script runs all of them (5.7 minutes
measured on 2 CPU cores shared with other jobs).

    python bench/family_matrix.py [--workdir /tmp/family_matrix] [--families llama,gpt2] [--readme] [--from_json]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.families import (
    FAMILIES,
    STEPS,
    assert_runs_match,
    build_assets,
    chat_answer_ids,
    eval_rows_file,
    matrix_tolerance,
    merge_logit_error,
    peft_and_merged,
    reload_eval_losses,
    run_jobs,
    train_argv,
)

RESULTS = ROOT / "bench" / "results" / "family_matrix.json"
README = ROOT / "README.md"
START, END = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"
METHODS = ("lora", "qlora", "dora", "full")
COLUMNS = ("LoRA", "QLoRA", "DoRA", "full", "expert LoRA", "merge", "chat")


def _losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [r["loss"] for r in map(json.loads, lines) if r.get("type") == "train"]


def _refusal(log: str, family: str) -> str:
    """The one-line reason shardtune printed for the family's refused run ("error: ..." or a "- " item of
    "Invalid configuration:")."""
    for line in map(str.strip, log.splitlines()):
        if line.startswith(("error: ", "- ")) and FAMILIES[family].config_class[:-6] in line:
            return line.split(" ", 1)[1]
    return "exit 2"


def _trained(rc, out: Path, log: str, family: str) -> str:
    if rc == 2:
        return "refused: " + _refusal(log, family)
    if rc != 0:
        return f"failed: {str(rc).strip().splitlines()[-1][:200]}"
    losses = _losses(out)
    ok = len(losses) > 1 and all(map(math.isfinite, losses)) and abs(losses[-1] - losses[0]) > 1e-3
    return "yes" if ok else f"no: losses {losses}"


def train_all(root: Path, data: Path, families: list[str]) -> tuple[dict, dict, str]:
    one = [{"name": n, "argv": train_argv(root / n, data, root / "one" / n, "lora", batch=4)} for n in families]
    one += [{"name": f"{n}/full", "argv": train_argv(root / n, data, root / "one-full" / n, "full", batch=4)}
            for n in families]  # fmt: skip
    two = [
        {"name": f"{n}/{m}", "argv": train_argv(root / n, data, root / m / n, m, batch=2)}
        for n in families
        for m in METHODS
    ]
    for n in (n for n in families if not FAMILIES[n].dense):  # expert LoRA, 1 process and 2 ranks
        one.append(
            {"name": f"{n}/experts", "argv": train_argv(root / n, data, root / "one-experts" / n, "experts", batch=4)}
        )
        two.append(
            {"name": f"{n}/experts", "argv": train_argv(root / n, data, root / "experts" / n, "experts", batch=2)}
        )
    r1, r2 = run_jobs(one, root, nproc=1, timeout=3600), run_jobs(two, root, nproc=2, timeout=3600)
    return r1, r2, (root / "log-2.txt").read_text()


def parity_cell(root: Path, family: str, one: str, two: str) -> str:
    """The cell: "yes", or how the 2-rank run's losses, gradient norms or tensors differ from the 1-process run's."""
    try:
        assert_runs_match(root / one / family, root / two / family, matrix_tolerance(family), min_updates=STEPS)
    except AssertionError as e:
        return "no: 2 ranks vs 1 process: " + " ".join(str(e).split())[:300]
    return "yes"


def lora_cell(root: Path, family: str, r1, r2, reloaded: dict) -> str:
    if r1 != 0 or r2 != 0:
        return "failed"
    if (parity := parity_cell(root, family, "one", "lora")) != "yes":
        return parity
    trained = json.loads((root / "lora" / family / "train_summary.json").read_text())["final_eval_loss"]
    if abs(reloaded[family] - trained) > 1e-5 * abs(trained):
        return f"no: reloaded eval loss {reloaded[family]} vs trained {trained}"
    return "yes"


def merge_and_chat_cells(root: Path, family: str) -> tuple[str, str]:
    import torch

    adapter, merged_dir = root / "lora" / family, root / "merged" / family
    peft, merged = peft_and_merged(root / family, adapter, merged_dir)
    error = merge_logit_error(peft, merged, torch.tensor([[1, 40, 77, 602, 605, 607, 9, 300]]))
    config = json.loads((merged_dir / "config.json").read_text())
    tied_base = json.loads((root / family / "config.json").read_text()).get("tie_word_embeddings", False)
    untied = tied_base and not config.get("tie_word_embeddings", True)
    merge = "yes" if error < 1e-5 and not untied else f"no: logit error {error:.1e}, untied {untied}"
    a, _ = chat_answer_ids(root / family, adapter)
    b, _ = chat_answer_ids(merged_dir, None)
    return merge, ("yes" if a == b and len(a) == 6 else f"no: {a} vs {b}")


def _experts_cell(root: Path, family: str, r1: dict, r2: dict) -> str:
    """A mixture of experts' expert and router LoRA: 2 ranks against 1 process, as the LoRA cell; "-" when dense."""
    if FAMILIES[family].dense:
        return "-"
    if r1[f"{family}/experts"] != 0 or r2[f"{family}/experts"] != 0:
        return f"failed: {r1[f'{family}/experts']} / {r2[f'{family}/experts']}"
    return parity_cell(root, family, "one-experts", "experts")


def run_matrix(workdir: Path, families: list[str]) -> dict:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    t0 = time.time()
    assets = build_assets(workdir, families)
    r1, r2, log = train_all(workdir, assets["data"], families)
    ok = [n for n in families if r1[n] == 0 and r2[f"{n}/lora"] == 0]
    reload_jobs = [
        {"name": n, "base": str(workdir / n), "out": str(workdir / "lora" / n),
         "rows": str(eval_rows_file(assets["data"], workdir / "lora" / n, workdir, n, packing=FAMILIES[n].packing))}
        for n in ok
    ]  # fmt: skip
    reloaded = reload_eval_losses(reload_jobs) if reload_jobs else {}
    table = {}
    for n in families:
        row = {"LoRA": lora_cell(workdir, n, r1[n], r2[f"{n}/lora"], reloaded)}
        for method, col in zip(METHODS[1:], COLUMNS[1:4], strict=True):
            row[col] = _trained(r2[f"{n}/{method}"], workdir / method / n, log, n)
        if row["full"] == "yes":
            row["full"] = parity_cell(workdir, n, "one-full", "full") if r1[f"{n}/full"] == 0 else "failed: 1 process"
        row["expert LoRA"] = _experts_cell(workdir, n, r1, r2)
        row["merge"], row["chat"] = merge_and_chat_cells(workdir, n) if n in ok else ("-", "-")
        table[n] = row
    return {"families": table, "seconds": round(time.time() - t0, 1), **_versions()}


def _versions() -> dict:
    import peft
    import torch
    import transformers

    return {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}


def _cell(value: str) -> str:
    return (
        "✓"
        if value == "yes"
        else "✗"
        if value.startswith(("no", "failed"))
        else "refused"
        if "refused" in value
        else value
    )


def markdown(result: dict) -> str:
    lines = [
        f"| family (config class) | {' | '.join(COLUMNS)} |",
        f"|---|{'---|' * len(COLUMNS)}",
    ]
    for name, row in result["families"].items():
        cells = " | ".join(_cell(row[c]) for c in COLUMNS)
        lines.append(f"| {name} ({FAMILIES[name].config_class}) | {cells} |")
    # The first clause of each message (the full one is in the JSON).
    notes = sorted(
        {
            f"{n}, {c}: {v.split('; ')[0]}"
            for n, row in result["families"].items()
            for c, v in row.items()
            if v not in ("yes", "-")
        }
    )
    lines += [
        "",
        LEGEND,
        "",
        f"Tested with transformers {result['transformers']}, peft {result['peft']}, torch {result['torch']}.",
    ]
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


LEGEND = (
    "LoRA and full: 2 FSDP2 ranks equal 1 process in every step's loss and grad_norm and in every trained tensor, "
    "elementwise. QLoRA and DoRA: trained on 2 ranks (finite losses that moved), not compared with 1 process here. "
    "expert LoRA (mixtures of experts, `--lora_target_experts True --lora_target_parameters routers`): as LoRA; its "
    "reload, merge and chat are tests/e2e/test_families.py's; - : a dense family."
)


def write_readme(table: str) -> None:
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} markers under its 'Supported models' heading.")
    head, rest = text.split(START, 1)
    README.write_text(head + START + "\n" + table + "\n" + END + rest.split(END, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/family_matrix")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's Supported models table")
    ap.add_argument("--from_json", action="store_true", help="only print (and write) the table of the last results")
    args = ap.parse_args()
    if args.from_json:
        result = json.loads(RESULTS.read_text())
    else:
        result = run_matrix(Path(args.workdir), [f for f in args.families.split(",") if f])
    table = markdown(result)
    print(table)
    if not args.from_json:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    if args.readme:
        write_readme(table)


if __name__ == "__main__":
    main()
