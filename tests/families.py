"""Tiny random models of every architecture family shardtune supports, built locally from each family's
transformers config class, and the tokenizer cases users bring (used by tests/e2e/test_families.py and
bench/family_matrix.py; no network).

Every model is small (hidden 64, 2 layers) but keeps what sets its family apart: tied embeddings, qkv bias, q/k
norms, soft-capping and sliding windows, fused qkv/gate_up, Conv1D, logit scaling, experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
# Sliding window shorter than the 96-position packed rows, so that the window really cuts attention.
WINDOW = 32


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    kwargs: dict = field(default_factory=dict)
    dense: bool = True  # no mixture of experts

    def config(self, vocab_size: int):
        import transformers

        cls = getattr(transformers, self.config_class)
        return cls(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=None, **self.kwargs)


_LLAMA = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": FFN,
}
_NEOX = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": FFN}

FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", {**_LLAMA, "tie_word_embeddings": False}),
        Family("llama-tied", "LlamaConfig", {**_LLAMA, "tie_word_embeddings": True}),
        Family("mistral", "MistralConfig", {**_LLAMA, "sliding_window": WINDOW}),
        Family("qwen2", "Qwen2Config", {**_LLAMA, "tie_word_embeddings": False}),
        Family("qwen3", "Qwen3Config", {**_LLAMA, "head_dim": 16, "tie_word_embeddings": True}),
        Family(
            "gemma2",
            "Gemma2Config",
            {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16},
        ),
        Family("gemma3", "Gemma3TextConfig", {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2}),
        Family("phi3", "Phi3Config", _LLAMA),
        Family("olmo2", "Olmo2Config", _LLAMA),
        Family("granite", "GraniteConfig", {**_LLAMA, "logits_scaling": 4.0, "embedding_multiplier": 2.0}),
        Family(
            "mixtral",
            "MixtralConfig",
            {**_LLAMA, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
            dense=False,
        ),
        Family(
            "qwen3-moe",
            "Qwen3MoeConfig",
            {**_LLAMA, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
            dense=False,
        ),
        Family("gpt-neox", "GPTNeoXConfig", _NEOX),
        Family("gpt2", "GPT2Config", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_inner": FFN}),
    )
}


def build_chat_tokenizer(out_dir: Path, *, base_vocab: int = 600):
    """A tokenizer that already has <|im_start|>/<|im_end|> (as many instruct models) and a length that is not a
    multiple of 8, so that chatml still adds tokens and the embeddings are padded past len(tokenizer)."""
    from shardtune.demo import build_tokenizer

    tok = build_tokenizer(out_dir, vocab_size=base_vocab)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    filler = 0
    while len(tok) % 8 == 0 or len(tok) % 8 == 7:  # +chatml's new tokens must not land on a multiple of 8 either
        tok.add_tokens([f"<extra_{filler}>"])
        filler += 1
    tok.save_pretrained(str(out_dir))
    return tok


def build_family_model(family: Family | str, out_dir: Path, vocab_size: int, *, seed: int = 0):
    """A random fp32 model of the family, saved as safetensors into out_dir."""
    from transformers import AutoModelForCausalLM

    family = FAMILIES[family] if isinstance(family, str) else family
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family.config(vocab_size), dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    return model
