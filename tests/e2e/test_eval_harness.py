"""lm-evaluation-harness on local tasks (YAML over local jsonl, no network): at the end of a training run
(--eval_harness_tasks, on the adapter with chat tokens) and with `shardtune eval` on the merged model, checked
against log-likelihoods and greedy decoding computed here with transformers and peft alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, train_args

FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}

pytest.importorskip("lm_eval")

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""
QUESTIONS = [f"Q{i}: which word fits the story about the {w}?" for i, w in enumerate(["cat", "sea", "map", "sun"] * 2)]
CHOICES = ["the river", "a small house", "green"]
PROMPTS = ["The cat sat on", "Once upon a time", "Tell me about the", "In the morning we"]


def _reference_model(assets, adapter: Path):
    """The adapter on its base with transformers and peft only, as the model card says to load it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    base.resize_token_embeddings(len(tok), pad_to_multiple_of=8)
    return PeftModel.from_pretrained(base, adapter).eval(), tok


def _choice_logliks(model, tok, question: str) -> list[float]:
    """log p(" " + choice | question), summed over the choice's tokens, with the tokenizer's defaults (BOS)."""
    import torch

    out = []
    n_ctx = len(tok(question)["input_ids"])
    for choice in CHOICES:
        ids = torch.tensor([tok(f"{question} {choice}")["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        out.append(sum(logp[i - 1, ids[0, i]].item() for i in range(n_ctx, ids.shape[1])))
    return out


def _greedy(model, tok, prompt: str) -> str:
    import torch

    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
    return tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).split("\n")[0]


def _write_tasks(root: Path, gen_targets: list[str]) -> Path:
    answers = [i % 3 for i in range(len(QUESTIONS))]
    mc = [{"question": q, "choices": CHOICES, "answer": a} for q, a in zip(QUESTIONS, answers)]
    gen = [{"prompt": p, "target": g} for p, g in zip(PROMPTS, gen_targets)]
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    for name, rows, yaml in (("mc", mc, MC_YAML), ("gen", gen, GEN_YAML)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"tiny_{name}.yaml").write_text(yaml.format(data=root / f"{name}.jsonl"))
    return tasks


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory):
    """A 2-rank LoRA run with chat tokens (vocabulary padded to a multiple of 8, new rows as trainable tokens)
    that ends with --eval_harness_tasks on the two local tasks, and the answers computed here from its adapter."""
    root = tmp_path_factory.mktemp("harness")
    tasks = _write_tasks(root, ["@@never@@"] * len(PROMPTS))
    out = root / "out"
    args = train_args(
        tiny_assets,
        out,
        max_seq_len=96,
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        use_peft_lora=True,
        lora_r=4,
        merge_adapter=True,
        eval_harness_tasks="tiny_mc,tiny_gen",
        eval_harness_include_path=tasks,
        per_device_eval_batch_size=4,
    )
    proc = run_cli(args, nproc=2, env={**FSDP_ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, cwd=root)

    ref, tok = _reference_model(tiny_assets, out)
    logliks = [_choice_logliks(ref, tok, q) for q in QUESTIONS]
    # acc compares log-likelihoods: the test's float tolerance must not decide which choice wins
    assert min(max(ll) - sorted(ll)[-2] for ll in logliks) > 1e-3
    answers = [i % 3 for i in range(len(QUESTIONS))]
    acc = sum(max(range(3), key=lambda c: ll[c]) == a for ll, a in zip(logliks, answers)) / len(answers)
    greedy = [_greedy(ref, tok, p) for p in PROMPTS]
    assert all(greedy[:2]), greedy  # non-empty, so that matching them says something
    return {"root": root, "out": out, "tasks": tasks, "proc": proc, "logliks": logliks, "acc": acc, "greedy": greedy}


def _check_results(out: Path, s: dict) -> None:
    results = json.loads((out / "eval_results.json").read_text())["results"]
    assert results["tiny_mc"]["acc,none"] == pytest.approx(s["acc"], abs=1e-12)
    assert results["tiny_gen"]["exact_match,none"] == pytest.approx(0.5, abs=1e-12)  # 2 of 4 by construction
    samples = [json.loads(x) for x in (out / "eval_samples_tiny_mc.jsonl").read_text().splitlines()]
    # float32 forward of a 2-layer, 64-wide model: each log-probability is off by ~1e-6 relative (a few ulps of
    # the 608-way log-softmax); sums of <= 8 of them of size ~6-7 stay well inside 1e-4.
    for sample in samples:
        got = [r[0][0] for r in sample["resps"]]
        assert got == pytest.approx(s["logliks"][sample["doc_id"]], abs=1e-4)
    gen = {
        json.loads(x)["doc_id"]: json.loads(x) for x in (out / "eval_samples_tiny_gen.jsonl").read_text().splitlines()
    }
    assert [gen[i]["filtered_resps"][0] for i in range(len(PROMPTS))] == s["greedy"]


def test_end_of_run_harness_matches_hand_computation(trained):
    s, out = trained, trained["out"]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(s["acc"], abs=1e-12)
    assert results["results"]["tiny_gen"]["exact_match,none"] == 0.0  # no target can be generated
    assert "with the adapter" in results["model"]
    assert _table_acc((out / "eval_results.md").read_text()) == pytest.approx(s["acc"], abs=1e-3)
    card = (out / "README.md").read_text()
    assert card.count("## Evaluation (lm-evaluation-harness)") == 1 and "## Training hyperparameters" in card
    assert _table_acc(card) == pytest.approx(s["acc"], abs=1e-3)
    text = s["proc"].stdout + s["proc"].stderr
    assert text.count("Running lm-evaluation-harness") == 1  # the main process only


def test_eval_command_on_merged_folder_matches_hand_computation(trained, tmp_path):
    s = trained
    # The first two targets are now the model's own greedy answers; the others still cannot be generated.
    _write_tasks(s["root"], [g if i < 2 else "@@never@@" for i, g in enumerate(s["greedy"])])
    merged = s["out"] / "merged"
    proc = run_cli(
        [
            "eval",
            "--model_name_or_path",
            str(merged),
            "--tasks",
            "tiny_mc,tiny_gen",
            "--include_path",
            str(s["tasks"]),
            "--batch_size",
            "3",
            "--log_samples",
            "True",
            "--output_dir",
            str(tmp_path),
        ],
        env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        cwd=s["root"],
    )
    _check_results(tmp_path, s)
    assert _table_acc(proc.stdout) == pytest.approx(s["acc"], abs=1e-3)
    card = (merged / "README.md").read_text()
    assert card.count("## Evaluation (lm-evaluation-harness)") == 1 and "exact_match" in card


def _table_acc(text: str) -> float:
    """The acc of tiny_mc in lm_eval's markdown table (printed to 3-4 digits)."""
    import re

    return float(re.search(r"\|tiny_mc\s*\|[^\n]*\|acc\s*\|[^|]*\|([0-9.]+)\|", text).group(1))


def test_eval_refuses_a_missing_task_folder_before_loading(trained, capsys):
    from shardtune.commands.evaluate import main

    missing = trained["root"] / "no-tasks"
    rc = main(["--adapter", str(trained["out"]), "--tasks", "tiny_mc", "--include_path", str(missing)])
    cap = capsys.readouterr()
    assert rc == 2
    assert f"--include_path {missing}: no such folder; give a folder of lm_eval task YAML files." in cap.err
    assert "Loaded" not in cap.out + cap.err  # refused before the model loads
