"""The built-in demo: a small Llama-architecture model, its tokenizer and a chat dataset, all made locally.

Nothing here touches the network. Tests use the same builders with smaller sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
from pathlib import Path

import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from shardtune.commands.chat import generate_reply
from shardtune.commands.demo_rl import grpo_demo
from shardtune.config.accelerate import accelerate_env, read_accelerate_yaml
from shardtune.data.preference import tokenize_pair
from shardtune.inference.load import load_for_chat
from shardtune.parallel import torchrun
from shardtune.runtime.log import setup_logging

BASE_SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Russia": "Moscow",
    "Turkey": "Ankara",
    "Iran": "Tehran",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Australia": "Canberra",
    "Argentina": "Buenos Aires",
    "Morocco": "Rabat",
    "Nigeria": "Abuja",
    "Ghana": "Accra",
    "Cuba": "Havana",
    "Hungary": "Budapest",
    "Belgium": "Brussels",
    "Denmark": "Copenhagen",
    "Iceland": "Reykjavik",
    "Nepal": "Kathmandu",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "up": "down",
    "light": "dark",
    "early": "late",
    "happy": "sad",
    "open": "closed",
    "full": "empty",
    "hard": "soft",
    "old": "young",
    "rich": "poor",
    "wet": "dry",
    "loud": "quiet",
    "strong": "weak",
    "near": "far",
    "high": "low",
    "thick": "thin",
}
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lemon",
    "piano",
    "train",
    "candle",
    "forest",
    "window",
    "garden",
    "silver",
    "rocket",
    "pencil",
    "honey",
    "ocean",
    "planet",
    "bridge",
    "castle",
]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You answer briefly and correctly."]

DEMO_PROMPTS = [
    "What is the capital of France?",
    "What is the opposite of hot?",
    "Reverse this list: apple, river, stone",
]


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
            f.writelines(json.dumps({"messages": _conversation(rng)}) + "\n" for _ in range(n))
    return out


def write_preference_dataset(
    out_dir: str | Path,
    n_train: int = 1000,
    n_test: int = 100,
    seed: int = 0,
    conversational: bool = False,
    copies: bool = False,
) -> Path:
    """Write `train.jsonl` and `test.jsonl` of prompt/chosen/rejected pairs: the right answer and a wrong one
    (another country's capital, a word that is not the opposite, the list not reversed), or with `copies` the
    answer that repeats the question's word (the country as its own capital, the word as its own opposite). Plain text, or TRL's conversational format (lists of role/content turns) with
    `conversational`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                q, good, bad = _preference_pair(rng, copies)
                if conversational:
                    row = {
                        "prompt": [{"role": "user", "content": q}],
                        "chosen": [{"role": "assistant", "content": good}],
                        "rejected": [{"role": "assistant", "content": bad}],
                    }
                else:
                    row = {"prompt": f"Question: {q}\nAnswer:", "chosen": f" {good}", "rejected": f" {bad}"}
                f.write(json.dumps(row) + "\n")
    return out


def _preference_pair(rng: random.Random, copies: bool = False) -> tuple[str, str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        country, other = rng.sample(sorted(CAPITALS), 2)
        q, wrong = f"What is the capital of {country}?", country if copies else CAPITALS[other]
        return q, f"The capital of {country} is {CAPITALS[country]}.", f"The capital of {country} is {wrong}."
    if kind == 1:
        word, other = rng.sample(sorted(OPPOSITES), 2)
        q, wrong = f"What is the opposite of {word}?", word if copies else OPPOSITES[other]
        return q, f"The opposite of {word} is {OPPOSITES[word]}.", f"The opposite of {word} is {wrong}."
    items = rng.sample(WORDS, rng.randint(2, 4))
    return f"Reverse this list: {', '.join(items)}", ", ".join(reversed(items)), ", ".join(items)


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
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(1)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **BASE_SPECIAL_TOKENS)
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(
    out_dir: str | Path,
    vocab_size: int,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
):
    """Create a randomly initialised Llama model and save it (safetensors) into out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or int(hidden_size * 8 / 3 // 16 * 16),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out_dir))
    return model


DEMO_FSDP_YAML = {
    "distributed_type": "FSDP",
    "mixed_precision": "no",
    "num_machines": 1,
    "num_processes": 2,
    "use_cpu": True,
    "fsdp_config": {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_forward_prefetch": False,
        "fsdp_offload_params": False,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_sync_module_states": True,
    },
}


def demo_train_flags(model_dir: Path, data_dir: Path, output_dir: Path, epochs: float) -> list[str]:
    """The guide's flags, scaled to a small model on 2 CPU processes."""
    return [
        "--seed",
        "100",
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(data_dir),
        "--chat_template_format",
        "chatml",
        "--add_special_tokens",
        "False",
        "--append_concat_token",
        "False",
        "--splits",
        "train,test",
        "--max_seq_len",
        "256",
        "--num_train_epochs",
        str(epochs),
        "--logging_steps",
        "5",
        "--log_level",
        "info",
        "--logging_strategy",
        "steps",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "20",
        "--save_strategy",
        "no",
        "--packing",
        "True",
        "--learning_rate",
        "2e-3",
        "--lr_scheduler_type",
        "cosine",
        "--weight_decay",
        "1e-4",
        "--warmup_steps",
        "5",
        "--max_grad_norm",
        "1.0",
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "8",
        "--gradient_accumulation_steps",
        "1",
        "--gradient_checkpointing",
        "True",
        "--use_reentrant",
        "False",
        "--use_flash_attn",
        "True",
        "--use_peft_lora",
        "True",
        "--lora_r",
        "32",
        "--lora_alpha",
        "64",
        "--lora_dropout",
        "0.0",
        "--lora_target_modules",
        "all-linear",
        "--modules_to_save",
        "embed_tokens,lm_head",
    ]


def _answers(model_dir: Path, adapter: Path | None) -> list[str]:
    model, tok = load_for_chat(str(model_dir), str(adapter) if adapter else None)
    return [
        generate_reply(
            model, tok, [{"role": "user", "content": p}], max_new_tokens=24, temperature=0.0, top_p=1.0, seed=0
        ).strip()
        for p in DEMO_PROMPTS
    ]


def main(argv: list[str] | None = None) -> int:
    """`shardtune demo`: build the demo assets, answer before, fine-tune on 2 CPU processes with FSDP, answer after."""

    ap = argparse.ArgumentParser(prog="shardtune demo", description=main.__doc__)
    ap.add_argument("--workdir", default="shardtune-demo", help="Where the model, data and outputs go.")
    ap.add_argument("--epochs", type=float, default=None, help="Training epochs (default: 6 for sft, 2 for dpo).")
    ap.add_argument("--nproc", type=int, default=2, help="Processes (FSDP ranks).")
    ap.add_argument(
        "--objective",
        default="sft",
        choices=["sft", "dpo", "grpo"],
        help="sft: fine-tune on chats; dpo: preference-tune on generated right/wrong answer pairs; grpo: a short SFT "
        "warm start, then online RL (GRPO) rewarded for the right answer.",
    )
    args = ap.parse_args(argv)
    # Before peft and transformers load: their notices that are not about the demo's run (bitsandbytes' missing
    # optional CPU kernel package at import, a deprecation between peft and transformers, progress bars) are
    # quieted at their source, as `shardtune train` and `chat` do (shardtune.runtime.log).
    setup_logging()
    root = Path(args.workdir)
    assets = build_demo_assets(root)
    if args.objective == "dpo":
        return _preference_demo(assets, root, args.nproc, args.epochs)
    if args.objective == "grpo":
        return grpo_demo(assets, root, args.nproc, _launch_train, {"capital": CAPITALS, "opposite": OPPOSITES})
    out = root / "output"
    before = _answers(assets["model"], None)
    flags = demo_train_flags(assets["model"], assets["data"], out, args.epochs or 6.0)
    # A demo run again in the same --workdir replaces the previous one instead of being refused.
    flags += ["--overwrite_output_dir", "True"]
    cmd = torchrun.command(["--standalone", "--nproc_per_node", str(args.nproc), "-m", "shardtune", "train", *flags])
    rc = _launch_train(cmd, root, args.nproc)
    if rc != 0:
        return rc
    after = _answers(assets["model"], out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("type") == "eval"]
    print("\nEval loss: " + " → ".join(f"{r['eval_loss']:.3f}" for r in evals))
    for prompt, b, a in zip(DEMO_PROMPTS, before, after):
        print(f"\nQ: {prompt}\n  before: {b[:80]!r}\n  after:  {a[:80]!r}")
    print(f"\nAdapter: {out}  (chat with it: shardtune chat --model_name_or_path {assets['model']} --adapter {out})")
    return 0


def _launch_train(cmd: list[str], root: Path, nproc: int) -> int:
    """Run `cmd` (a torchrun command line) with the demo's FSDP settings on CPU."""

    yaml_path = root / "fsdp_config_cpu.yaml"
    yaml_path.write_text(yaml.safe_dump({**DEMO_FSDP_YAML, "num_processes": nproc}, sort_keys=False))
    env = {**os.environ, **accelerate_env(read_accelerate_yaml(yaml_path)), "OMP_NUM_THREADS": "1"}
    print("$ " + " ".join(cmd[2:]), flush=True)
    return subprocess.call(cmd, env=env)


def _preference_demo(assets: dict[str, Path], root: Path, nproc: int, epochs: float | None) -> int:
    """DPO with a LoRA adapter on pairs of a right answer and one that repeats the question's word; shows which answer the model prefers on
    held-out questions before and after, and the eval reward accuracy as training goes."""

    data = write_preference_dataset(root / "pairs", n_train=800, n_test=64, seed=1, copies=True)
    out = root / "output-dpo"
    flags = {
        "seed": 100, "model_name_or_path": assets["model"], "dataset_name": data, "objective": "dpo",
        "beta": 0.1, "max_length": 64, "num_train_epochs": epochs or 2.0, "logging_steps": 5,
        "eval_strategy": "steps", "eval_steps": 10, "save_strategy": "no", "learning_rate": 5e-3,
        "lr_scheduler_type": "cosine", "warmup_steps": 3, "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16, "use_peft_lora": True, "lora_r": 16, "lora_alpha": 32,
        "lora_target_modules": "all-linear", "output_dir": out,
    }  # fmt: skip
    train = ["-m", "shardtune", "train", *(x for k, v in flags.items() for x in (f"--{k}", str(v)))]
    cmd = torchrun.command(["--standalone", "--nproc_per_node", str(nproc), *train])
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    before = _preferences(assets["model"], None, rows)
    rc = _launch_train(cmd, root, nproc)
    if rc != 0:
        return rc
    after = _preferences(assets["model"], out, rows)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracies = [f"{r['eval_rewards/accuracies']:.2f}" for r in records if r.get("type") == "eval"]
    print("\nEval reward accuracy (chosen gains more than rejected over the base): " + " → ".join(accuracies))
    print("\nHeld-out pairs where the model prefers the right answer, log p(chosen) > log p(rejected):")
    for kind in ("capital", "opposite", "Reverse"):
        picked = [i for i, r in enumerate(rows) if kind in r["prompt"]]
        share = [sum(x[i] > 0 for i in picked) / max(len(picked), 1) for x in (before, after)]
        print(f"  {kind.lower():<10} ({len(picked):>2} pairs)  base {share[0]:.2f}  →  tuned {share[1]:.2f}")
    print(f"\nAdapter: {out}")
    return 0


def _preferences(model_dir: Path, adapter: Path | None, rows: list[dict]) -> list[float]:
    """log p(chosen | prompt) - log p(rejected | prompt) per row, with the base or base + adapter (plain PEFT)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    with torch.no_grad():
        for i, row in enumerate(rows):
            prompt, chosen, rejected = tokenize_pair(tok, row, "test", i, add_special_tokens=False)
            scores = []
            for completion in (chosen, rejected):
                ids = torch.tensor([prompt + completion])
                logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                scores.append(float(logps[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).sum()))
            out.append(scores[0] - scores[1])
    return out


def build_demo_assets(
    root: str | Path,
    hidden_size: int = 256,
    num_layers: int = 4,
    n_train: int = 2000,
    n_test: int = 200,
    vocab_size: int = 1024,
) -> dict[str, Path]:
    """Build (once) the demo's model, tokenizer and data under root; return their paths."""
    root = Path(root)
    model_dir, data_dir = root / "model", root / "data"
    if not (model_dir / "config.json").exists():
        tok = build_tokenizer(model_dir, vocab_size=vocab_size)
        build_model(model_dir, vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers)
    if not (data_dir / "train.jsonl").exists():
        write_chat_dataset(data_dir, n_train=n_train, n_test=n_test)
    return {"model": model_dir, "data": data_dir}
