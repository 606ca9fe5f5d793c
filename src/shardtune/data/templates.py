"""Chat formats (chatml, zephyr) as in peft's SFT example, tokenizer setup, and assistant spans for the loss mask.

The templates are kept byte-identical to the reference script, so the rendered text (and hence the tokens) are the
same. Assistant turns are located without changing the template: the conversation is rendered turn by turn and each
assistant turn is the text its message adds after its role header (the add_generation_prompt text), plus the
end-of-turn special token right after the content. Templates that carry `{% generation %}` markers use those.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}\n{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% if loop.last and add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}{% endfor %}"
)
DEFAULT_ZEPHYR_CHAT_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)
ALLOWED_ROLES = ("system", "user", "assistant", "tool")
# A conversation row's columns that go to its chat template besides the turns (TRL 1.16's SFT, DPO and KTO trainers).
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")
# Names a row's chat_template_kwargs cannot set: apply_chat_template's own arguments (shardtune passes them, or they
# change what it returns) and the variables the renderer sets itself; as a template variable any of them would clash.
_RESERVED_TEMPLATE_KWARGS = (
    "conversation", "conversations", "messages", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
)  # fmt: skip
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatFormat:
    """A chat format's special tokens (in the reference's enum order) and its Jinja template."""

    user: str
    assistant: str
    system: str
    eos_token: str
    bos_token: str
    pad_token: str
    template: str

    def tokens(self) -> list[str]:
        return [self.user, self.assistant, self.system, self.eos_token, self.bos_token, self.pad_token]


CHAT_FORMATS = {
    "chatml": ChatFormat(
        "<|im_start|>user",
        "<|im_start|>assistant",
        "<|im_start|>system",
        "<|im_end|>",
        "<s>",
        "<pad>",
        DEFAULT_CHATML_CHAT_TEMPLATE,
    ),
    "zephyr": ChatFormat(
        "<|user|>", "<|assistant|>", "<|system|>", "</s>", "<s>", "<pad>", DEFAULT_ZEPHYR_CHAT_TEMPLATE
    ),
}


def setup_tokenizer(tokenizer, chat_template_format: str) -> list[int]:
    """Prepare the tokenizer for `--chat_template_format`; return the ids of tokens added to its vocabulary.

    chatml/zephyr: set bos/eos/pad, add all of the format's tokens as special tokens and set its template (the
    model's embeddings must then be resized to `padded_vocab_size(tokenizer)`). none/auto: keep the vocabulary
    and use EOS as the pad token when there is none; auto keeps the tokenizer's own chat template.
    """
    if chat_template_format in ("none", "auto"):
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return []
    fmt = CHAT_FORMATS.get(chat_template_format)
    if fmt is None:
        raise ValueError(f"--chat_template_format {chat_template_format!r} is not one of chatml, zephyr, auto, none.")
    before = set(tokenizer.get_vocab().values())
    # Attribute order (bos, eos, pad, then the extra tokens) gives the same ids as the reference's from_pretrained.
    tokenizer.add_special_tokens(
        {
            "bos_token": fmt.bos_token,
            "eos_token": fmt.eos_token,
            "pad_token": fmt.pad_token,
            "extra_special_tokens": fmt.tokens(),
        }
    )
    tokenizer.chat_template = fmt.template
    return sorted(set(tokenizer.get_vocab().values()) - before)


# The embeddings grow to a multiple of this many rows when a chat template adds tokens, as the reference training
# script resizes them (`resize_token_embeddings(..., pad_to_multiple_of=8)`): training, loading to generate, the
# planner and the model card's usage snippet all read it here.
VOCAB_MULTIPLE = 8


def padded_rows(n_tokens: int) -> int:
    """The embedding rows that hold `n_tokens`: n_tokens rounded up to a multiple of VOCAB_MULTIPLE."""
    return -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def padded_vocab_size(tokenizer) -> int:
    """The embedding size the reference resizes to: len(tokenizer) rounded up to a multiple of VOCAB_MULTIPLE."""
    return padded_rows(len(tokenizer))


def validate_messages(messages, *, split: str, row: int, part: str | None = None) -> None:
    """Raise ValueError naming the split and row (and the column, `part`) if `messages` is not a list of
    {role, content} turns; an assistant turn may have `tool_calls` instead of content."""
    where = f"split {split!r}, row {row}" + (f", `{part}`" if part else "")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}} turns, got {messages!r}.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}, message {i}: expected a {{role, content}} mapping, got {m!r}.")  # noqa: TRY004
        role = m.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"{where}, message {i}: unknown role {role!r}; allowed roles are {', '.join(ALLOWED_ROLES)}. "
                "Fix the role in the data."
            )
        content = m.get("content")
        if role == "assistant" and m.get("tool_calls") is not None and content in (None, ""):
            _validate_tool_calls(m["tool_calls"], f"{where}, message {i}")
            continue  # a turn that only calls tools (TRL's format: content null)
        if not isinstance(content, str) or not content:
            problem = (
                "has no content"
                if content is None
                else ("has empty content" if content == "" else f"has non-string content {content!r}")
            )
            raise ValueError(f"{where}, message {i} ({role}) {problem}; every turn needs a non-empty string.")


def _validate_tool_calls(calls, where: str) -> None:
    """An assistant turn's `tool_calls`: a non-empty list of calls ({"type": "function", "function": {"name",
    "arguments"}} as transformers' chat templates read them)."""
    if not isinstance(calls, (list, tuple)) or not calls or not all(isinstance(c, dict) for c in calls):
        raise ValueError(
            f"{where} (assistant) has no content and its `tool_calls` is not a non-empty list of calls, got {calls!r}; "
            'give calls such as {"type": "function", "function": {"name": "f", "arguments": {}}}.'
        )


def template_kwargs(example: dict, where: str) -> dict:
    """What a conversation row gives its chat template besides the turns, as TRL 1.16 reads it (one rule for SFT and
    preference rows): the `tools` column (a list of tool schemas, or its JSON text) and the `chat_template_kwargs`
    column (a mapping of template variables, e.g. {"enable_thinking": false}, with which a Qwen3 template renders the
    empty thinking block of a reply that does not think). Raises ValueError naming `where` (split and row) and the fix.
    """
    tools = example.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: `tools` is text but not JSON ({e}); give a list of tool schemas.") from e
    if tools is not None and not isinstance(tools, list):  # a data mistake: ValueError, which the CLI reports (exit 2)
        bad = f"{where}: `tools` must be a list of tool schemas (JSON objects) or its JSON text, got {tools!r}."
        raise ValueError(bad)
    extra = example.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        bad = (
            f"{where}: `chat_template_kwargs` must be a mapping of template variables, got {extra!r}; give a JSON "
            'object such as {"enable_thinking": false}.'
        )
        raise ValueError(bad)  # noqa: TRY004
    clash = sorted(k for k in extra if k in _RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise ValueError(
            f"{where}: `chat_template_kwargs` sets {', '.join(clash)}, which shardtune sets itself when it renders the "
            "conversation; remove it (tools go in the `tools` column)."
        )
    # datasets fills a key that only other rows have with None: such keys are not this row's settings. An empty tool
    # list is no tools (as trl's apply_chat_template says: Llama's template renders tool boilerplate for []).
    return {**({"tools": tools} if tools else {}), **{k: v for k, v in extra.items() if v is not None}}


def render_chat(tokenizer, messages, *, split: str, row: int, kwargs: dict | None = None) -> str:
    """Render one conversation with the tokenizer's chat template, exactly as the reference does; kwargs: the row's
    template_kwargs."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **(kwargs or {}))
    except Exception as e:  # a template's raise_exception (e.g. roles must alternate) names no row
        raise ValueError(
            f"split {split!r}, row {row}: the chat template could not render this conversation: {e}"
        ) from e


def assistant_spans(
    tokenizer, messages, text: str, *, split: str, row: int, kwargs: dict | None = None
) -> list[tuple[int, int]]:
    """Character spans of `text` (the rendered conversation) that are assistant targets.

    A span covers an assistant message's content and the end-of-turn special token right after it; the role
    header before it is not a target. kwargs: the row's template_kwargs, with which every partial rendering is made
    (so that it is a prefix of `text`).
    """
    kwargs = kwargs or {}
    template = tokenizer.get_chat_template()
    if _GENERATION_RE.search(template):
        return _generation_spans(tokenizer, messages, template, kwargs)
    specials = _special_strings(tokenizer)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            spans.append(_turn_span(tokenizer, messages, k, text, specials, kwargs, split=split, row=row))
    return spans


def token_target_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """True for each token whose characters overlap an assistant span (tokens with empty offsets never do)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for s, e in spans:
        mask |= (starts < e) & (ends > s) & (ends > starts)
    return mask


def _generation_spans(tokenizer, messages, template: str, kwargs: dict) -> list[tuple[int, int]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    # As apply_chat_template calls it: the row's variables override the special tokens of the same name.
    _, indices = render_jinja_template(
        conversations=[messages],
        chat_template=template,
        return_assistant_tokens_mask=True,
        **{**tokenizer.special_tokens_map, **kwargs},
    )
    return [tuple(span) for span in indices[0]]


def _special_strings(tokenizer) -> list[str]:
    """Special tokens, longest first, so the end-of-turn token after a reply is matched whole."""
    found = {str(t) for t in tokenizer.added_tokens_decoder.values() if getattr(t, "special", False)}
    if tokenizer.eos_token:
        found.add(str(tokenizer.eos_token))
    return sorted(found, key=len, reverse=True)


def _render_prefix(tokenizer, messages, k: int, kwargs: dict, add_generation_prompt: bool = False) -> str:
    if k == 0:
        return ""
    return tokenizer.apply_chat_template(
        list(messages[:k]), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _turn_span(tokenizer, messages, k: int, text: str, specials: list[str], kwargs: dict, *, split: str, row: int):
    where = f"split {split!r}, row {row}, message {k}"
    before = _render_prefix(tokenizer, messages, k, kwargs)
    upto = _render_prefix(tokenizer, messages, k + 1, kwargs)
    if not (upto.startswith(before) and text.startswith(upto)):
        raise ValueError(
            f"{where}: --assistant_only_loss cannot locate this assistant turn, because the chat template renders "
            "earlier turns differently once later turns follow. Add {% generation %} markers to the template, or "
            "train on all tokens (--assistant_only_loss False)."
        )
    header_end = len(before)
    prompt = _render_prefix(tokenizer, messages, k, kwargs, add_generation_prompt=True)
    if prompt.startswith(before) and upto.startswith(prompt):
        header_end = len(prompt)
    content = messages[k].get("content")
    if not content:  # a turn that only calls tools: everything it adds after its header, to its end-of-turn token
        return header_end, len(upto.rstrip())
    start = upto.find(content, header_end)
    if start < 0:
        content = content.strip()
        start = upto.find(content, header_end) if content else -1
    if start < 0:
        raise ValueError(
            f"{where}: --assistant_only_loss cannot find this assistant reply in the rendered text (the chat "
            "template changes it). Add {% generation %} markers to the template or use --assistant_only_loss False."
        )
    end = start + len(content)
    for tok in specials:
        if upto.startswith(tok, end):
            end += len(tok)
            break
    return start, end


# ------------------------------------------------------------------ prompt/completion rows (TRL's tokenization)


def tokenize_completions(
    tokenizer, prompt, completions: dict, split: str, row: int, add_special_tokens: bool, example: dict | None = None,
    left_out: list | None = None,
):  # fmt: skip
    """The prompt's tokens and each completion's: the completion starts where the tokenized prompt and
    prompt+completion stop agreeing (for all completions of the row), as in TRL. example: the row, whose chat
    template variables (template_kwargs) a conversation is rendered with. When they stop agreeing before the prompt's
    end (a template that renders the prompt alone differently, or a token merged across the boundary), that end is in
    neither part: it is appended to `left_out`, so that the caller can say so (TRL warns)."""
    where = f"split {split!r}, row {row}"
    if any(isinstance(c, list) for c in completions.values()):
        for name, part in (("prompt", prompt), *completions.items()):
            validate_messages(part, split=split, row=row, part=name)
        encode = chat_encoder(tokenizer, where, template_kwargs(example or {}, where))
        prompt_ids = encode(prompt, add_generation_prompt=True)
        full = [encode(prompt + c) for c in completions.values()]
    else:
        for name, value in (("prompt", prompt), *completions.items()):
            if not isinstance(value, str) or (name != "prompt" and not value):
                raise ValueError(f"{where}: `{name}` must be a non-empty string (or all columns conversations).")
        eos = tokenizer.eos_token or ""

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

        prompt_ids = encode(prompt)
        full = [encode(prompt + c + ("" if c.endswith(eos) else eos)) for c in completions.values()]
    n = min(common_prefix(prompt_ids, f) for f in full)
    if n < len(prompt_ids) and left_out is not None:
        left_out.append(prompt_ids[n:])
    return prompt_ids[:n], [f[n:] for f in full]


def chat_encoder(tokenizer, where: str, extra: dict):
    if not tokenizer.chat_template:
        raise ValueError(
            f"{where}: conversations need a chat template; pass --chat_template_format chatml or zephyr, "
            "or auto with a tokenizer that has one."
        )

    def encode(messages, add_generation_prompt: bool = False) -> list[int]:
        try:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as e:  # a template's raise_exception names no row
            raise ValueError(f"{where}: the chat template could not render this conversation: {e}") from e
        return list(out["input_ids"])

    return encode


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
