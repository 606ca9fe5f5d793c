"""Chat formats against peft's SFT example: tokens, ids, rendered text, and assistant spans."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from shardtune.commands.demo import build_tokenizer
from shardtune.data.templates import (
    assistant_spans,
    padded_vocab_size,
    setup_tokenizer,
    token_target_mask,
    validate_messages,
)

# The reference script's templates and tokens, copied here verbatim so that a drift in shardtune's copy shows.
REF_CHATML = "{% for message in messages %}\n{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% if loop.last and add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}{% endfor %}"
REF_ZEPHYR = "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
REF_TOKENS = {
    "chatml": (
        ["<|im_start|>user", "<|im_start|>assistant", "<|im_start|>system", "<|im_end|>", "<s>", "<pad>"],
        REF_CHATML,
    ),
    "zephyr": (["<|user|>", "<|assistant|>", "<|system|>", "</s>", "<s>", "<pad>"], REF_ZEPHYR),
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And the opposite of hot?"},
    {"role": "assistant", "content": "cold"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, vocab_size=400)
    return d


def reference_tokenizer(tok_dir, fmt: str):
    """What peft's example does: reload with the format's tokens, then set its template."""
    tokens, template = REF_TOKENS[fmt]
    tok = AutoTokenizer.from_pretrained(
        tok_dir, pad_token=tokens[5], bos_token=tokens[4], eos_token=tokens[3], additional_special_tokens=tokens
    )
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("fmt", ["chatml", "zephyr"])
def test_setup_matches_reference_vocab_ids_and_text(tok_dir, fmt):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    base = len(tok)
    added = setup_tokenizer(tok, fmt)
    ref = reference_tokenizer(tok_dir, fmt)
    assert tok.get_vocab() == ref.get_vocab()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        ref.pad_token_id,
        ref.bos_token_id,
        ref.eos_token_id,
    )
    new_strings = {"chatml": 5, "zephyr": 4}[fmt]  # <s> (and </s> for zephyr) already exist in the base vocab
    assert added == list(range(base, base + new_strings))
    assert sorted(ref.convert_tokens_to_ids([t for t in REF_TOKENS[fmt][0] if t not in ("<s>", "</s>")])) == added
    assert len(tok) == base + new_strings
    assert padded_vocab_size(tok) % 8 == 0 and 0 <= padded_vocab_size(tok) - len(tok) < 8
    for gen in (False, True):
        ours = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert ours == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert tok(ours)["input_ids"] == ref(ours)["input_ids"]


def test_rendered_text_is_the_reference_format(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    setup_tokenizer(tok, "chatml")
    assert tok.apply_chat_template(CHAT[1:3], tokenize=False) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
    )
    ids = tok(tok.apply_chat_template(CHAT[1:3], tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>user")  # one token, never split
    tok = AutoTokenizer.from_pretrained(tok_dir)
    setup_tokenizer(tok, "zephyr")
    assert tok.apply_chat_template(CHAT[1:3], tokenize=False, add_generation_prompt=False) == (
        "<|user|>\nWhat is the capital of France?</s>\n<|assistant|>\nParis.</s>\n"
    )


@pytest.mark.parametrize("fmt", ["none", "auto"])
def test_none_and_auto_keep_vocab_and_pad_with_eos(tok_dir, fmt):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = REF_CHATML
    vocab = tok.get_vocab()
    assert tok.pad_token is None
    assert setup_tokenizer(tok, fmt) == []
    assert tok.get_vocab() == vocab and tok.pad_token_id == tok.eos_token_id
    assert tok.chat_template == REF_CHATML


def test_unknown_format_is_rejected(tok_dir):
    with pytest.raises(ValueError, match="--chat_template_format 'llama'"):
        setup_tokenizer(AutoTokenizer.from_pretrained(tok_dir), "llama")


@pytest.mark.parametrize("fmt,eot", [("chatml", "<|im_end|>"), ("zephyr", "</s>")])
def test_assistant_spans_cover_content_and_end_of_turn(tok_dir, fmt, eot):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    setup_tokenizer(tok, fmt)
    text = tok.apply_chat_template(CHAT, tokenize=False)
    spans = assistant_spans(tok, CHAT, text, split="train", row=0)
    assert [text[s:e] for s, e in spans] == ["Paris." + eot, "cold" + eot]
    header = "<|im_start|>assistant\n" if fmt == "chatml" else "<|assistant|>\n"
    assert all(text[:s].endswith(header) for s, _ in spans)


def test_assistant_spans_with_a_content_equal_to_the_role_name(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    setup_tokenizer(tok, "chatml")
    chat = [{"role": "user", "content": "assistant"}, {"role": "assistant", "content": "assistant"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    ((s, e),) = assistant_spans(tok, chat, text, split="train", row=0)
    assert text[s:e] == "assistant<|im_end|>" and s == text.rindex("assistant<|im_end|>")


def test_generation_markers_are_used_when_present(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}"
        "{% endgeneration %}\n{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    )
    chat = CHAT[1:]
    text = tok.apply_chat_template(chat, tokenize=False)
    spans = assistant_spans(tok, chat, text, split="train", row=0)
    assert [text[s:e] for s, e in spans] == ["Paris.", "cold"]


def test_template_that_rewrites_earlier_turns_is_rejected(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}{{ m['role'] }}: {{ m['content'] }}{% endif %}{% endfor %}"
    )
    text = tok.apply_chat_template(CHAT, tokenize=False)
    with pytest.raises(ValueError, match="row 7, message 2: --assistant_only_loss cannot locate"):
        assistant_spans(tok, CHAT, text, split="train", row=7)


def test_token_target_mask_uses_overlap_and_skips_empty_offsets():
    offsets = np.array([[0, 0], [0, 3], [3, 5], [5, 9], [9, 10]])
    assert token_target_mask(offsets, [(4, 9)]).tolist() == [False, False, True, True, False]
    assert token_target_mask(offsets, [(0, 3), (9, 10)]).tolist() == [False, True, False, False, True]


@pytest.mark.parametrize(
    "messages,needle",
    [
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": ""}], "has empty content"),
        ([{"role": "user", "content": 5}], "non-string content 5"),
        ([], "non-empty list"),
        ("hello", "non-empty list"),
    ],
)
def test_validate_messages_names_split_row_and_problem(messages, needle):
    with pytest.raises(ValueError, match=r"split 'test', row 12") as e:
        validate_messages(messages, split="test", row=12)
    assert needle in str(e.value)


def test_tool_role_is_allowed():
    validate_messages([{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}], split="s", row=0)
