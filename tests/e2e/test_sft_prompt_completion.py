"""SFT on TRL's prompt-completion rows, plain (`{"prompt": str, "completion": str}`) and conversational (lists of
turns, with tool calls: an assistant turn with `tool_calls` and `content: null`, a `tool` turn, a `tools` column):
the tokens and the labels equal trl 1.16's SFTTrainer on the same rows with the same tokenizer, with the loss on the
completion by default (TRL's `completion_only_loss` default for these rows), on every token with
--completion_only_loss False, and on the completion's assistant turns with --assistant_only_loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from shardtune.commands.demo import build_tokenizer
from shardtune.data import build_datasets, setup_tokenizer
from shardtune.data.packing import Document, fit_documents
from tests.conftest import build_data
from tests.families import build_family_model

# A Qwen-style template that renders tools, tool calls and tool replies; {GEN}/{END} mark the assistant's text.
_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{GEN}"
    "{% if m.content %}{{ m.content }}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>{END}{{ '\\n' }}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = _TEMPLATE.replace("{GEN}", "").replace("{END}", "")
MARKED_TEMPLATE = _TEMPLATE.replace("{GEN}", "{% generation %}").replace("{END}", "{% endgeneration %}")
TOOLS = [{"type": "function", "function": {"name": "capital", "description": "A country's capital",
          "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}]  # fmt: skip
CALL = {"type": "function", "function": {"name": "capital", "arguments": {"country": "Peru"}}}
PLAIN = [
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "Two and two make", "completion": " four."},
    {"prompt": "Water boils at", "completion": " one hundred degrees.<|im_end|>"},  # ends with EOS: none added
]
CHAT = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"}],
     "completion": [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "content": "Lima"}, {"role": "assistant", "content": "Lima."}],
     "tools": json.dumps(TOOLS)},
    {"prompt": [{"role": "user", "content": "Hot?"}], "completion": [{"role": "assistant", "content": "cold"}],
     "tools": json.dumps([])},
]  # fmt: skip


def _write(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sft-prompt-completion")
    tok = build_tokenizer(root / "model", vocab_size=600)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(str(root / "model"))
    build_family_model("qwen3", root / "model", len(tok))
    messages = [{"messages": r["prompt"] + r["completion"], "tools": r["tools"]} for r in CHAT]
    return {"root": root, "model": root / "model", "plain": _write(root / "plain", PLAIN),
            "chat": _write(root / "chat", CHAT), "messages": _write(root / "messages", messages)}  # fmt: skip


def _tokenizer(assets, template: str = MARKED_TEMPLATE):
    tok = AutoTokenizer.from_pretrained(assets["model"])
    setup_tokenizer(tok, "auto")
    tok.chat_template = template
    return tok


def _ours(tok, data: Path, **flags):
    args = {"dataset_name": str(data), "splits": "train", "dataset_text_field": "text", "max_length": 512,
            "packing": False, "append_concat_token": False, "add_special_tokens": True, "assistant_only_loss": False,
            "drop_long_samples": False, "seed": 0, "chat_template_format": "auto", "num_proc": 1}  # fmt: skip
    train, _ = build_data(build_datasets, tokenizer=tok, **{**args, **flags})
    return train


def _trl(assets, tok, data: Path, **config):
    trl = pytest.importorskip("trl")
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM

    args = trl.SFTConfig(output_dir=str(assets["root"] / "trl"), report_to="none", use_cpu=True, max_length=None,
                         packing=False, **config)  # fmt: skip
    ds = load_dataset("json", data_files=str(data / "train.jsonl"), split="train")
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    return trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok).train_dataset


CASES = [  # (data, shardtune's flags, TRL's SFTConfig)
    ("plain", {}, {}),
    ("plain", {"completion_only_loss": False}, {"completion_only_loss": False}),
    ("chat", {}, {}),
    ("chat", {"completion_only_loss": False}, {"completion_only_loss": False}),
    ("chat", {"assistant_only_loss": True}, {"assistant_only_loss": True}),
    # The same conversations as `messages` rows (TRL's conversational language modeling), tool calls included.
    ("messages", {"add_special_tokens": False}, {}),
    ("messages", {"add_special_tokens": False, "assistant_only_loss": True}, {"assistant_only_loss": True}),
]


@pytest.mark.parametrize(("data", "ours", "theirs"), CASES)
def test_tokens_and_labels_equal_trl(assets, data, ours, theirs):
    """Token ids and labels, exactly: TRL's labels are unshifted (-100 off the loss), shardtune's shifted by one."""
    tok = _tokenizer(assets)
    mine = _ours(tok, assets[data], **ours)
    trl_rows = _trl(assets, tok, assets[data], **theirs)
    assert len(trl_rows) == len(mine) == len(PLAIN if data == "plain" else CHAT)
    for i, row in enumerate(trl_rows):
        labels = row.get("labels", row["input_ids"])  # without a mask TRL trains on every token
        assert list(mine.input_ids[i]) == row["input_ids"], i
        assert list(mine.labels[i]) == list(labels[1:]) + [-100], i
        if data != "messages":  # the prompt's first token is a target only with --completion_only_loss False
            assert (labels[0] != -100) == (ours.get("completion_only_loss") is False), i


@pytest.mark.parametrize("data", ["plain", "chat"])
def test_negative_control_a_boundary_off_by_one_is_caught(assets, monkeypatch, data):
    """A planted bug of the class the parity test guards (the completion starting one token early): labels differ."""
    from shardtune.data import prepare

    real = prepare.tokenize_completions

    def early(*a, **k):
        prompt_ids, (completion_ids,) = real(*a, **k)
        return prompt_ids[:-1], [prompt_ids[-1:] + completion_ids]

    tok = _tokenizer(assets)
    trl_rows = _trl(assets, tok, assets[data])
    monkeypatch.setattr(prepare, "tokenize_completions", early)
    mine = _ours(tok, assets[data], dataset_cache_dir=None)
    assert all(list(mine.input_ids[i]) == r["input_ids"] for i, r in enumerate(trl_rows))  # same tokens
    assert all(list(mine.labels[i]) != list(r["labels"][1:]) + [-100] for i, r in enumerate(trl_rows))


def test_the_completion_is_the_target(assets):
    """What the targets decode to (the reference, independent of TRL): the completion and its end-of-turn token;
    with --assistant_only_loss the tool's reply inside the completion is context."""
    tok = _tokenizer(assets)

    def targets(split, i):
        return tok.decode([y for y in split.labels[i] if y != -100])

    plain = _ours(tok, assets["plain"])
    assert [targets(plain, i) for i in range(3)] == [" blue.<|im_end|>", " four.<|im_end|>",
                                                      " one hundred degrees.<|im_end|>"]  # fmt: skip
    call = '<tool_call>{"name": "capital", "arguments": {"country": "Peru"}}</tool_call><|im_end|>'
    chat = _ours(tok, assets["chat"])
    assert targets(chat, 0) == f"{call}\n<|im_start|>tool\nLima<|im_end|>\n<|im_start|>assistant\nLima.<|im_end|>\n"
    assert targets(chat, 1) == "cold<|im_end|>\n"
    only = _ours(tok, assets["chat"], assistant_only_loss=True)
    assert targets(only, 0) == f"{call}Lima.<|im_end|>"


def test_tool_call_turns_without_generation_markers(assets):
    """--assistant_only_loss on a template without {% generation %}: the tool-call turn (content null) is located
    from the rendering alone and the labels equal transformers' assistant mask of the marked template."""
    plain, marked = _tokenizer(assets, PLAIN_TEMPLATE), _tokenizer(assets, MARKED_TEMPLATE)
    rows = [{"messages": r["prompt"] + r["completion"], "tools": r["tools"]} for r in CHAT]
    mine = _ours(plain, assets["messages"], assistant_only_loss=True, add_special_tokens=False)
    for i, r in enumerate(rows):
        ref = marked.apply_chat_template(r["messages"], tools=json.loads(r["tools"]) or None, tokenize=True,
                                         return_dict=True, return_assistant_tokens_mask=True)  # fmt: skip
        ids, mask = ref["input_ids"], ref["assistant_masks"]
        assert list(mine.input_ids[i]) == ids and 0 < sum(mask) < len(ids)
        assert list(mine.labels[i]) == [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]


@pytest.mark.parametrize("data", ["plain", "chat"])
def test_streamed_rows_equal_the_cached_rows(assets, data):
    tok = _tokenizer(assets)
    cached = _ours(tok, assets[data])
    _, rows, _ = next(_ours(tok, assets[data], streaming=True).windows(epoch=0, seed=0))
    mine = sorted((tuple(rows["input_ids"].array(k)), tuple(rows["labels"].array(k))) for k in range(len(cached)))
    want = sorted((tuple(cached.input_ids[k]), tuple(cached.labels[k])) for k in range(len(cached)))
    assert len(rows["input_ids"]) == len(cached) and mine == want


def test_a_prompt_filling_max_length_is_dropped():
    """As TRL drops the examples that truncation leaves without a target."""
    kept_doc = Document(np.arange(6, dtype=np.int32), np.array([0, 0, 1, 1, 1, 1], dtype=bool))
    masked = Document(np.arange(6, dtype=np.int32), np.array([0, 0, 0, 0, 1, 1], dtype=bool))
    kept, truncated, dropped = fit_documents([kept_doc, masked], 4, drop_long=False)
    assert (len(kept), truncated, dropped) == (1, 1, 1) and kept[0].targets.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("rows", "flags", "want"),
    [
        ([{"prompt": [{"role": "user", "content": "Hi"}],
           "completion": [{"role": "assistant", "content": None, "tool_calls": []}]}], {},
         "split 'train', row 0, `completion`, message 0 (assistant) has no content and its `tool_calls` is not a non-empty list"),
        (PLAIN, {"assistant_only_loss": True}, "split 'train', row 0: --assistant_only_loss needs conversations"),
        ([{"text": "plain"}], {"completion_only_loss": True}, "--completion_only_loss needs prompt/completion rows"),
        ([{**PLAIN[0], "label": True}], {}, "split 'train' has prompt, completion and label columns, KTO's"),
    ],
)  # fmt: skip
def test_malformed_rows_name_the_row_and_the_fix(assets, tmp_path, rows, flags, want):
    with pytest.raises(ValueError) as e:
        _ours(_tokenizer(assets), _write(tmp_path, rows), **flags)
    assert str(e.value).startswith(want), str(e.value)


def test_cli_trains_on_prompt_completion_rows(assets, tmp_path, capsys, monkeypatch):
    """One short run through the CLI: conversational prompt/completion rows with a tool call, checkpoints at a ratio
    of the steps (--save_steps 0.5 of 4: steps 2 and 4), the precision in one line."""
    from shardtune import cli

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)  # a run in this process sets them; undone after the test
    model = tmp_path / "model"  # the fixture's model with the tool template as its own
    tok = _tokenizer(assets, PLAIN_TEMPLATE)
    tok.save_pretrained(str(model))
    for f in assets["model"].iterdir():
        if not (model / f.name).exists():
            (model / f.name).symlink_to(f)
    argv = ["train", "--model_name_or_path", model, "--dataset_name", assets["chat"], "--splits", "train",
            "--chat_template_format", "auto", "--max_length", 128, "--max_steps", 4, "--save_steps", 0.5,
            "--per_device_train_batch_size", 1, "--logging_steps", 1, "--use_peft_lora", True,
            "--lora_target_modules", "q_proj", "v_proj", "--output_dir", tmp_path / "out"]  # fmt: skip
    assert cli.main([str(a) for a in argv]) == 0
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if x.startswith("precision:")] == [
        "precision: compute float32, storage float32 (neither --bf16 nor --fp16)"
    ]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
