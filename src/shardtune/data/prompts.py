"""Prompt-only data for online RL (--objective grpo), in TRL's prompt-only format: a `prompt` column holding plain
text or a conversation (a list of {"role", "content"} messages). A plain prompt is tokenized as it is (with the
tokenizer's special tokens when --add_special_tokens); a conversation through the chat template with the generation
prompt appended, with its row's `tools` and `chat_template_kwargs` (templates.template_kwargs), as TRL's
GRPOTrainer renders it. A prompt longer than --max_prompt_length keeps its last tokens (the end of a prompt is what
the completion follows). Every other column is kept as it is and reaches the reward functions by name (TRL passes
them as keyword arguments), e.g. the `answer` or `solution` a verifier compares with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardtune.runtime.log import print0

from .sources import requested_splits
from .templates import chat_encoder, template_kwargs, validate_messages

if TYPE_CHECKING:
    from shardtune.config.arguments import DataArguments

PROMPT_COLUMN = "prompt"


@dataclass
class PromptSplit:
    """Tokenized prompts, their raw form (for the reward functions) and the rows' other columns."""

    prompt_ids: list[list[int]]
    prompts: list  # str, or a list of messages
    columns: dict[str, list] = field(default_factory=dict)
    truncated: int = 0  # prompts cut to --max_prompt_length
    digest: str = ""  # of the tokenized prompts: equal digests, equal prompts (compared across ranks and on resume)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def row_columns(self, rows: list[int]) -> dict[str, list]:
        """The extra columns of `rows`, as lists in that order (what a reward function receives)."""
        return {name: [values[r] for r in rows] for name, values in self.columns.items()}

    def summary(self, evals: PromptSplit | None, max_length: int) -> str:
        n_eval = len(evals) if evals is not None else 0
        longest = max((len(p) for p in self.prompt_ids), default=0)
        cut = f", {self.truncated} cut to --max_prompt_length" if self.truncated else ""
        return f"Data: {len(self)} prompts (longest {longest} tokens{cut}); eval prompts: {n_eval}."


def build_prompt_datasets(
    data: DataArguments, *, tokenizer, max_prompt_length: int | None
) -> tuple[PromptSplit, PromptSplit | None]:
    """The train split's and the optional eval split's prompts (--splits), each cut to --max_train_samples /
    --max_eval_samples."""
    out = []
    for requested in requested_splits(data):
        if requested is None:
            out.append(None)
            continue
        split, ds = requested
        if PROMPT_COLUMN not in ds.column_names:
            raise ValueError(
                f"--dataset_name {data.dataset_name}, split {split!r}: --objective grpo reads TRL's prompt-only "
                f"format, a `prompt` column (text or a conversation); found columns {ds.column_names}."
            )
        prepared = tokenize_prompts(tokenizer, ds, split, data.add_special_tokens, max_prompt_length)
        print0(f"Prompts of split {split!r}: {len(prepared)} rows.")
        out.append(prepared)
    return out[0], out[1]


def tokenize_prompts(tokenizer, ds, split: str, add_special_tokens: bool, max_prompt_length: int | None):
    """A PromptSplit from a dataset with a `prompt` column."""
    prompts, ids, truncated = [], [], 0
    for row, example in enumerate(ds):
        tokens = encode_prompt(tokenizer, example, split, row, add_special_tokens)
        if max_prompt_length is not None and len(tokens) > max_prompt_length:
            tokens, truncated = tokens[-max_prompt_length:], truncated + 1
        prompts.append(example[PROMPT_COLUMN])
        ids.append(tokens)
    columns = {c: list(ds[c]) for c in ds.column_names if c != PROMPT_COLUMN}
    digest = hashlib.sha256(json.dumps(["prompts-1", ids]).encode()).hexdigest()
    return PromptSplit(ids, prompts, columns, truncated, digest)


def encode_prompt(tokenizer, example: dict, split: str, row: int, add_special_tokens: bool) -> list[int]:
    """One row's prompt tokens: a conversation through the chat template with the generation prompt, a text as it
    is. Raises ValueError naming the split and row."""
    prompt, where = example[PROMPT_COLUMN], f"split {split!r}, row {row}"
    if isinstance(prompt, list):
        validate_messages(prompt, split=split, row=row, part=PROMPT_COLUMN)
        return chat_encoder(tokenizer, where, template_kwargs(example, where))(prompt, add_generation_prompt=True)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: `prompt` must be a non-empty string or a list of messages, got {prompt!r}.")
    tokens = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    if not tokens:
        raise ValueError(f"{where}: `prompt` {prompt!r} gives no token.")
    return tokens
