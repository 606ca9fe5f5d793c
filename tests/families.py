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
        Family(
            "gemma3",
            "Gemma3TextConfig",
            {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2},
        ),
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
        # GPT-2's config turns dropout on by default; off here, so that 2 ranks and 1 process draw no masks.
        Family(
            "gpt2",
            "GPT2Config",
            {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_inner": FFN}
            | dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0),
        ),
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


# ---------------------------------------------------------------- the matrix's runs

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
STEPS = 3
METHODS = {
    "lora": ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "16", "--lora_target_modules", "all-linear"],
    "dora": [
        "--use_peft_lora",
        "True",
        "--lora_r",
        "4",
        "--lora_alpha",
        "16",
        "--lora_target_modules",
        "all-linear",
        "--use_dora",
        "True",
    ],
    "full": ["--use_peft_lora", "False"],
    "qlora": [
        *("--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "16", "--lora_target_modules", "all-linear"),
        *("--use_4bit_quantization", "True", "--bnb_4bit_quant_type", "nf4"),
        *("--bnb_4bit_compute_dtype", "float32", "--bnb_4bit_quant_storage_dtype", "float32"),
    ],
}


def train_argv(model: Path, data: Path, out: Path, method: str, *, batch: int, dropout: float = 0.0) -> list[str]:
    """One matrix run: 3 steps of the global batch 4 (batch × ranks × 2 accumulation... see callers), packed chatml
    rows of 96 positions, evaluated at the end, saved without checkpoints."""
    flags = {
        "model_name_or_path": model,
        "dataset_name": data,
        "chat_template_format": "chatml",
        "packing": True,
        "max_seq_len": 96,
        "seed": 5,
        "max_steps": STEPS,
        "learning_rate": 5e-3,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": 3,
        "eval_strategy": "epoch",
        "save_strategy": "no",
        "logging_steps": 1,
        "ddp_timeout": 300,
        "output_dir": out,
    }
    argv = ["train", *(x for k, v in flags.items() for x in (f"--{k}", str(v))), *METHODS[method]]
    if method != "full":
        argv += ["--lora_dropout", str(dropout)]
    return argv


def run_jobs(jobs: list[dict], workdir: Path, *, nproc: int, timeout: int = 900) -> dict:
    """Run the jobs in one process (or one torchrun of nproc ranks); return {name: exit code or error text}."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    jobs_file, results_file = workdir / f"jobs-{nproc}.json", workdir / f"results-{nproc}.json"
    jobs_file.write_text(json.dumps([{**j, "argv": list(map(str, j["argv"]))} for j in jobs]))
    worker = [str(root / "tests" / "family_worker.py"), str(jobs_file), str(results_file)]
    env = {**os.environ, **FSDP_ENV}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *worker]
    else:
        cmd = [sys.executable, *worker]
    proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
    (workdir / f"log-{nproc}.txt").write_text(proc.stdout + proc.stderr)
    if not results_file.exists():
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(results_file.read_text())
