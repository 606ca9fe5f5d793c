"""SFT conversations rendered with their row's `tools` and `chat_template_kwargs` columns, as trl 1.16's SFTTrainer
renders them (one rule with the preference path: shardtune.data.templates.template_kwargs).

A Qwen3-style template (built here, nothing from the Hub) that lists the tools in a system turn and, with
enable_thinking=false, opens every reply with the empty thinking block: the tokens equal transformers'
apply_chat_template with the row's variables, the assistant mask still covers exactly the replies (the thinking block
is not a target), the streamed split gives the same rows, and the tokens and labels equal TRL's. A malformed value is
refused through the CLI with the row and the fix before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shardtune.commands.demo import build_tokenizer
from shardtune.data import build_datasets, setup_tokenizer
from shardtune.data.templates import template_kwargs
from tests.conftest import build_data, train_args
from tests.families import build_family_model

# Qwen3-style: tools in a system turn, every reply opened by the empty thinking block when enable_thinking is false
# (Qwen3's hybrid templates and SmolLM3 render the conversation itself differently with it, not only the prompt).
_THINK = (
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}" + _THINK
    + "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + _THINK + "{%- endif %}"
)  # fmt: skip
# The same text with {% generation %} markers around each reply and its <|im_end|>: what TRL's assistant_only_loss
# needs, and transformers' own assistant mask for the plain template's text.
QWEN3_MARKED = QWEN3.replace(
    "{{- m.content + '<|im_end|>\\n' }}",
    "{% generation %}{{- m.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}",
)
TOOLS = [{"type": "function", "function": {"name": "capital", "description": "A country's capital",
          "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}]  # fmt: skip
TWO_TURNS = [
    {"role": "user", "content": "What is the capital of Peru?"},
    {"role": "assistant", "content": "Lima."},
    {"role": "user", "content": "And of Chile?"},
    {"role": "assistant", "content": "Santiago."},
]
ONE_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hot?"},
            {"role": "assistant", "content": "cold"}]  # fmt: skip
# Every row has chat_template_kwargs: TRL 1.16's SFT reads it with example.get(key, {}) and fails on a row that
# lacks it (datasets fills the column with None). tools: JSON text (TRL's advice) or absent.
ROWS = [
    {"messages": TWO_TURNS, "chat_template_kwargs": {"enable_thinking": False}, "tools": json.dumps(TOOLS)},
    {"messages": TWO_TURNS, "chat_template_kwargs": {"enable_thinking": True}},
    {"messages": ONE_TURN, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": ONE_TURN, "chat_template_kwargs": {"enable_thinking": True}, "tools": json.dumps(TOOLS)},
]


def _write(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sft-template-kwargs")
    tok = build_tokenizer(root / "model", vocab_size=600)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN3
    tok.save_pretrained(str(root / "model"))
    build_family_model("qwen3", root / "model", len(tok))  # tied embeddings, as Qwen3's small models
    return {"root": root, "model": root / "model", "data": _write(root / "data", ROWS)}


def _tokenizer(assets, template: str = QWEN3):
    tok = AutoTokenizer.from_pretrained(assets["model"])
    setup_tokenizer(tok, "auto")
    tok.chat_template = template
    return tok


def _split(tok, data: Path, *, assistant_only: bool, streaming: bool = False):
    train, _ = build_data(
        build_datasets, tokenizer=tok, dataset_name=str(data), splits="train", dataset_text_field="text",
        max_length=512, packing=False, append_concat_token=False, add_special_tokens=False,
        assistant_only_loss=assistant_only, drop_long_samples=False, seed=0, chat_template_format="auto", num_proc=1,
        streaming=streaming,
    )  # fmt: skip
    return train


def _kwargs(row: dict) -> dict:
    return {**({"tools": json.loads(row["tools"])} if "tools" in row else {}), **row["chat_template_kwargs"]}


def _shifted(ids: list[int], mask: list[int]) -> list[int]:
    """shardtune's label layout: labels[t] is token t+1 where it is a target."""
    return [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]


@pytest.mark.parametrize("assistant_only", [False, True])
def test_rows_render_with_their_tools_and_template_kwargs(assets, assistant_only):
    tok = _tokenizer(assets)
    marked = _tokenizer(assets, QWEN3_MARKED)
    train = _split(tok, assets["data"], assistant_only=assistant_only)
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    for i, row in enumerate(ROWS):
        kw = _kwargs(row)
        want = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True, **kw)["input_ids"]
        assert list(train.input_ids[i]) == list(want), i
        bare = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert (list(want) != list(bare)) == (row["chat_template_kwargs"]["enable_thinking"] is False or "tools" in row)
        if not assistant_only:  # every token but the first is a target
            assert list(train.labels[i]) == list(want[1:]) + [-100]
            continue
        # transformers' assistant mask of the same text ({% generation %} markers): the replies and their <|im_end|>
        ref = marked.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True, **kw)  # fmt: skip
        assert ref["input_ids"] == want and 0 < sum(ref["assistant_masks"]) < len(want)
        assert list(train.labels[i]) == _shifted(want, ref["assistant_masks"]), i
        targets = [y for y in train.labels[i] if y != -100]
        assert tok.decode(targets).replace("<|im_end|>", "|") in ("Lima.|Santiago.|", "cold|")
        assert not set(think) & set(targets)  # the thinking block is context, never a target


def test_streamed_rows_equal_the_cached_rows(assets):
    tok = _tokenizer(assets)
    cached = _split(tok, assets["data"], assistant_only=True)
    stream = _split(tok, assets["data"], assistant_only=True, streaming=True)
    _, rows, _ = next(stream.windows(epoch=0, seed=0))

    def as_set(ids, labels, n):
        return sorted((tuple(map(int, ids(k))), tuple(map(int, labels(k)))) for k in range(n))

    mine = as_set(rows["input_ids"].array, rows["labels"].array, len(rows["input_ids"]))
    want = as_set(cached.input_ids.__getitem__, cached.labels.__getitem__, len(cached))
    assert len(mine) == len(ROWS) and mine == want


@pytest.mark.parametrize("assistant_only", [False, True])
def test_tokens_and_labels_equal_trl(assets, assistant_only):
    """trl 1.16's SFTTrainer on the same rows (it renders them itself): equal tokens, and labels (TRL's unshifted,
    -100 off the assistant mask) shifted by one as shardtune stores them; no tolerance, these are token ids."""
    trl = pytest.importorskip("trl")
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(assets, QWEN3_MARKED)
    ours = _split(tok, assets["data"], assistant_only=assistant_only)
    args = trl.SFTConfig(output_dir=str(assets["root"] / "trl"), report_to="none", use_cpu=True, max_length=None,
                         packing=False, assistant_only_loss=assistant_only)  # fmt: skip
    ds = load_dataset("json", data_files=str(assets["data"] / "train.jsonl"), split="train")
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    theirs = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok).train_dataset
    assert len(theirs) == len(ours) == len(ROWS)
    for i, row in enumerate(theirs):
        assert list(ours.input_ids[i]) == row["input_ids"], i
        labels = row.get("labels", row["input_ids"])  # without a mask TRL trains on every token
        assert list(ours.labels[i]) == list(labels[1:]) + [-100], i
        if assistant_only:
            assert -100 in labels


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ({"chat_template_kwargs": "enable_thinking"},
         '`chat_template_kwargs` must be a mapping of template variables, got \'enable_thinking\'; give a JSON object'),
        ({"chat_template_kwargs": {"add_generation_prompt": True}},
         "`chat_template_kwargs` sets add_generation_prompt, which shardtune sets itself"),
        ({"tools": TOOLS[0]}, "`tools` must be a list of tool schemas (JSON objects) or its JSON text, got {"),
        ({"tools": "{not json"}, "`tools` is text but not JSON"),
    ],
)  # fmt: skip
def test_malformed_values_name_the_row_and_the_fix(value, want):
    with pytest.raises(ValueError) as e:
        template_kwargs({"messages": ONE_TURN, **value}, "split 'train', row 5")
    assert str(e.value).startswith(f"split 'train', row 5: {want}"), str(e.value)


@pytest.mark.parametrize(
    ("bad", "want"),
    [
        ({"chat_template_kwargs": "enable_thinking=False"},
         "error: split 'train', row 2: `chat_template_kwargs` must be a mapping of template variables"),
        ({"tools": json.dumps(TOOLS[0])},
         "error: split 'train', row 2: `tools` must be a list of tool schemas (JSON objects) or its JSON text"),
    ],
)  # fmt: skip
def test_cli_refuses_a_malformed_row_before_the_model_loads(assets, bad, want, tmp_path, capsys, monkeypatch):
    from shardtune import cli
    from shardtune.parallel import setup

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)  # a run in this process sets them; undone after the test

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(setup, "build_sharded_model", loaded)
    rows = [{"messages": r["messages"], "tools": r.get("tools")} for r in ROWS]
    rows[2].update(bad)  # row 2 alone is malformed
    data = _write(tmp_path / "bad", rows)
    argv = train_args({"model": assets["model"], "data": data}, tmp_path / "out", chat_template_format="auto",
                      packing=False, max_seq_len=128, max_steps=1)  # fmt: skip
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith(want), line
