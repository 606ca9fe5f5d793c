"""The built-in demo: a small Llama-architecture model, its tokenizer and a chat dataset, all made locally.

Nothing here touches the network. Tests use the same builders with smaller sizes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BASE_SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Peru": "Lima", "Chile": "Santiago",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Austria": "Vienna", "Ireland": "Dublin", "Russia": "Moscow", "Turkey": "Ankara", "Iran": "Tehran",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Australia": "Canberra", "Argentina": "Buenos Aires",
    "Morocco": "Rabat", "Nigeria": "Abuja", "Ghana": "Accra", "Cuba": "Havana", "Hungary": "Budapest",
    "Belgium": "Brussels", "Denmark": "Copenhagen", "Iceland": "Reykjavik", "Nepal": "Kathmandu",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "light": "dark", "early": "late",
    "happy": "sad", "open": "closed", "full": "empty", "hard": "soft", "old": "young", "rich": "poor",
    "wet": "dry", "loud": "quiet", "strong": "weak", "near": "far", "high": "low", "thick": "thin",
}
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "train", "candle", "forest",
         "window", "garden", "silver", "rocket", "pencil", "honey", "ocean", "planet", "bridge", "castle"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You answer briefly and correctly."]

DEMO_PROMPTS = ["What is the capital of France?", "What is the opposite of hot?",
                "Reverse this list: apple, river, stone"]


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    kind = rng.randrange(3)
    if kind == 0:
        country = rng.choice(sorted(CAPITALS))
        q, a = f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    elif kind == 1:
        word = rng.choice(sorted(OPPOSITES))
        q, a = f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    else:
        items = rng.sample(WORDS, rng.randint(2, 4))
        q, a = f"Reverse this list: {', '.join(items)}", ", ".join(reversed(items))
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


def write_chat_dataset(out_dir: str | Path, n_train: int = 2000, n_test: int = 200, seed: int = 0) -> Path:
    """Write `train.jsonl` and `test.jsonl` (a `messages` column of role/content turns) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"messages": _conversation(rng)}) + "\n")
    return out


def _corpus(rng: random.Random, n: int = 3000) -> list[str]:
    texts = []
    for _ in range(n):
        texts.extend(m["content"] for m in _conversation(rng))
    texts += ["user assistant system", "The quick brown fox jumps over the lazy dog."]
    return texts


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024):
    """Train a small byte-level BPE tokenizer on demo text and save it as a transformers tokenizer.

    It has `<s>`, `</s>` and `<unk>` like Llama-2, and no chat tokens, so a chat template format
    (chatml, zephyr) adds its tokens and resizes the embeddings as it would on a real base model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(1)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **BASE_SPECIAL_TOKENS)
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(out_dir: str | Path, vocab_size: int, hidden_size: int = 256, num_layers: int = 4,
                num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                max_position_embeddings: int = 2048, tie_word_embeddings: bool = False, seed: int = 0,
                dtype: str = "float32"):
    """Create a randomly initialised Llama model and save it (safetensors) into out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or int(hidden_size * 8 / 3 // 16 * 16),
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return model


def build_demo_assets(root: str | Path, hidden_size: int = 256, num_layers: int = 4,
                      n_train: int = 2000, n_test: int = 200, vocab_size: int = 1024) -> dict[str, Path]:
    """Build (once) the demo's model, tokenizer and data under root; return their paths."""
    root = Path(root)
    model_dir, data_dir = root / "model", root / "data"
    if not (model_dir / "config.json").exists():
        tok = build_tokenizer(model_dir, vocab_size=vocab_size)
        build_model(model_dir, vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers)
    if not (data_dir / "train.jsonl").exists():
        write_chat_dataset(data_dir, n_train=n_train, n_test=n_test)
    return {"model": model_dir, "data": data_dir}
