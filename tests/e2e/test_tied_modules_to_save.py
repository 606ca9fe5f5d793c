"""`--modules_to_save lm_head` on a model whose head is tied to its embedding (Qwen3-style, tie_word_embeddings),
when new chat tokens are added: PEFT trains the new rows on the tied embedding and head as trainable tokens and
cannot also train the head in full (it failed inside PEFT at the first step: "TrainableTokensLayer wraps an unknown
layer type"). shardtune refuses it with the flag and the fix: before anything is read when the chat format adds the
tokens, and when the model is built for any other way rows are added. The fix it names, `--modules_to_save
embed_tokens,lm_head`, trains, reloads with transformers + peft to the trained eval loss, and merges (untied).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, train_args
from tests.families import (
    FFN,
    HIDDEN,
    LAYERS,
    build_family_model,
    eval_rows_file,
    merge_logit_error,
    peft_and_merged,
    reload_eval_losses,
)
from tests.tolerance import decoder_chain, tol

REFUSAL = "--modules_to_save lm_head: this model ties its output head to its input embedding"
FIX = "Use --modules_to_save embed_tokens,lm_head"
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from shardtune.commands.demo import build_tokenizer, write_chat_dataset

    root = tmp_path_factory.mktemp("tied-mts")
    tok = build_tokenizer(root / "model", vocab_size=600)  # no chat tokens: chatml adds them (600 -> 608 rows)
    build_family_model("qwen3", root / "model", len(tok))  # tie_word_embeddings
    write_chat_dataset(root / "data", n_train=24, n_test=6, seed=3)
    return {"root": root, "model": root / "model", "data": root / "data"}


def _argv(assets, out: Path, modules_to_save: str, **flags) -> list[str]:
    lora = {"use_peft_lora": True, "lora_r": 4, "lora_alpha": 16, "lora_target_modules": "all-linear"}
    return train_args(assets, out, modules_to_save=modules_to_save, max_seq_len=96, per_device_train_batch_size=4,
                      max_steps=3, learning_rate=1e-2, seed=5, **{**lora, **flags})  # fmt: skip


def _main(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """`shardtune <argv>` in this process: (exit code, the one line of the problem), no traceback."""
    from shardtune import cli

    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)  # a run in this process sets them; undone after the test
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x.strip() for x in err.splitlines() if x.strip().startswith(("- ", "error: "))]
    assert len(lines) == 1, err
    return rc, lines[0]


def test_refused_before_anything_is_read_when_chatml_adds_tokens(assets, tmp_path, capsys, monkeypatch):
    from shardtune.data import prepare
    from shardtune.parallel import setup

    def never(*a, **k):
        raise AssertionError("the data was prepared or the model loaded")

    monkeypatch.setattr(setup, "build_sharded_model", never)
    monkeypatch.setattr(prepare, "tokenize_to_parts", never)
    rc, line = _main(_argv(assets, tmp_path / "out", "lm_head"), capsys, monkeypatch)
    assert rc == 2 and line.startswith(f"- {REFUSAL}") and FIX in line, line
    assert not (tmp_path / "out").exists()
    # Without added tokens (the tokenizer's own template), the head trained in full is PEFT's plain case: not refused.
    from shardtune.models.preflight import model_input_problems
    from shardtune.recipe.run_config import load_run_config

    cfg = load_run_config(_argv(assets, tmp_path / "out", "lm_head", chat_template_format="auto")[1:])
    assert not [p for p in model_input_problems(cfg) if "modules_to_save" in p]


def test_refused_when_the_model_is_built_with_added_rows(assets, tmp_path, capsys, monkeypatch):
    """--chat_template_format auto with a tokenizer longer than the embedding (602 tokens, 600 rows): the rows are
    added when the model is built, where the same rule stops the run (exit 2, one line) before training."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    )
    tok.save_pretrained(str(model))
    argv = _argv({**assets, "model": model}, tmp_path / "out", "lm_head", chat_template_format="auto")
    rc, line = _main(argv, capsys, monkeypatch)
    assert rc == 2 and line.startswith(f"error: {REFUSAL}") and FIX in line, line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_named_fix_trains_reloads_and_merges(assets):
    """--modules_to_save embed_tokens,lm_head on the tied model with chatml: both trained in full (two copies), the
    adapter reloaded by transformers + peft gives the run's final eval loss, and the merged folder (untied) equals
    base + adapter."""
    root, out = assets["root"], assets["root"] / "fixed"
    run_cli(_argv(assets, out, "embed_tokens,lm_head", eval_strategy="epoch"))
    trained = json.loads((out / "train_summary.json").read_text())["final_eval_loss"]
    rows = eval_rows_file(assets["data"], out, root, "fixed")
    got = reload_eval_losses([{"name": "fixed", "base": str(assets["model"]), "out": str(out), "rows": str(rows)}])
    # fp32 on both sides, the training forward summing in another order (tests/families.py's matrix bound)
    chain = {"hidden": HIDDEN, "intermediate": FFN, "layers": LAYERS, "seq": 96, "vocab": 608}
    assert got["fixed"] == pytest.approx(trained, rel=tol(torch.float32, decoder_chain(**chain, tokens=6 * 96)))
    peft, merged = peft_and_merged(assets["model"], out, root / "merged")
    config = json.loads((root / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert merged.get_output_embeddings().weight.data_ptr() != merged.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 40, 77, 600, 603, 605, 9, 300]])  # includes the chat tokens
    assert merge_logit_error(peft, merged, ids) < tol(torch.float32, decoder_chain(**{**chain, "vocab": 0, "seq": 8}))
