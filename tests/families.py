"""Tiny random models of every architecture family shardtune supports, built locally from each family's
transformers config class, and the tokenizer cases users bring (used by tests/e2e/test_families.py and
bench/family_matrix.py; no network); and `assert_runs_match`, which compares two training runs' per-step losses and
gradient norms and their trained tensors (the matrix, the preference objectives and the speed options use it).

Every model is small (hidden 64, 2 layers) but keeps what sets its family apart: tied embeddings, qkv bias, q/k
norms, soft-capping and sliding windows, fused qkv/gate_up, Conv1D, logit scaling, experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.parity import train_steps
from tests.tolerance import TrainParity

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
# Sliding window shorter than the 96-position packed rows, so that the window really cuts attention.
WINDOW = 32


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str
    kwargs: dict = field(default_factory=dict)
    dense: bool = True  # no mixture of experts
    # False for a family whose forward cannot keep packed documents apart (shardtune refuses --packing there):
    # its runs train on padded rows of one conversation each.
    packing: bool = True
    # A multimodal class that AutoModelForCausalLM loads whole (Gemma 4: Gemma4ForConditionalGeneration): its
    # config_class takes the language model's kwargs as text_config, without vision or audio towers.
    multimodal: bool = False

    def config(self, vocab_size: int):
        import transformers

        cls = getattr(transformers, self.config_class)
        if self.multimodal:
            # Gemma 4's per-layer input embeddings have a vocabulary of their own: the same here.
            text = {"vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size, "bos_token_id": 1,
                    "eos_token_id": 2, "pad_token_id": 0, **self.kwargs}  # fmt: skip
            return cls(text_config=text, vision_config=None, audio_config=None)
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
        # Gemma 4 loads as Gemma4ForConditionalGeneration (soft-capping in its text_config when set), tied; per-layer
        # inputs kept small.
        Family(
            "gemma4",
            "Gemma4Config",
            {
                **_LLAMA,
                "head_dim": 16,
                "sliding_window": WINDOW,
                "hidden_size_per_layer_input": 8,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            multimodal=True,
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
        Family(
            "olmoe",
            "OlmoeConfig",
            {**_LLAMA, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
            dense=False,
        ),
        # DeepSeek-V3: multi-head latent attention, a dense first block, then routed experts beside a shared one
        # (no router loss: its routing balances itself with a bias).
        Family(
            "deepseek-v3",
            "DeepseekV3Config",
            {
                **_LLAMA,
                "num_key_value_heads": HEADS,
                "moe_intermediate_size": 32,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "n_shared_experts": 1,
                "kv_lora_rank": 16,
                "q_lora_rank": 32,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
            },
            dense=False,
        ),
        # GPT-OSS: attention sinks, alternating sliding and full attention, experts stored (E, in, out) with biases
        # and a clamped, interleaved gate; packed, each document decoded as a row of its own (models.documents).
        Family(
            "gpt-oss",
            "GptOssConfig",
            {
                **_LLAMA,
                "head_dim": 16,
                "intermediate_size": 32,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            dense=False,
        ),
        # Falcon-H1: Mamba-2 mixers beside attention in every block (a recurrent state and a short convolution that
        # must restart at each packed document) and muP multipliers on the head and the blocks.
        Family(
            "falcon-h1",
            "FalconH1Config",
            {
                **_LLAMA,
                "mamba_d_ssm": 64,
                "mamba_n_heads": 8,
                "mamba_d_head": 8,
                "mamba_d_state": 16,
                "mamba_n_groups": 1,
                "mamba_chunk_size": 16,
                "lm_head_multiplier": 2.5,
            },
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
    from shardtune.commands.demo import build_tokenizer

    tok = build_tokenizer(out_dir, vocab_size=base_vocab)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    filler = 0
    while len(tok) % 8 == 0 or len(tok) % 8 == 7:  # +chatml's new tokens must not land on a multiple of 8 either
        tok.add_tokens([f"<extra_{filler}>"])
        filler += 1
    tok.save_pretrained(str(out_dir))
    return tok


PLAIN_TOKENIZER = ("llama", "mistral")  # a tokenizer without chat tokens (600 tokens); the others: build_chat_tokenizer


def build_assets(root: Path, families=None) -> dict:
    """The chat data, both tokenizers and a model folder (with its tokenizer) per family under root."""
    from shardtune.commands.demo import build_tokenizer, write_chat_dataset

    write_chat_dataset(root / "data", n_train=64, n_test=12, seed=3)
    toks = {"plain": build_tokenizer(root / "tok-plain", vocab_size=600), "chat": build_chat_tokenizer(root / "tok")}
    for name in families or FAMILIES:
        tok = toks["plain" if name in PLAIN_TOKENIZER else "chat"]
        build_family_model(name, root / name, len(tok))
        tok.save_pretrained(str(root / name))
    return {"root": root, "data": root / "data", "tokenizers": toks}


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
LR = 5e-3
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
    # Mixtures of experts: LoRA on the attention, every expert (PEFT's target_parameters) and the routers.
    "experts": [
        *("--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "16", "--lora_target_modules", "all-linear"),
        *("--lora_target_experts", "True", "--lora_target_parameters", "routers"),
    ],
    "full": ["--use_peft_lora", "False"],
    "qlora": [
        *("--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "16", "--lora_target_modules", "all-linear"),
        *("--use_4bit_quantization", "True", "--bnb_4bit_quant_type", "nf4"),
        *("--bnb_4bit_compute_dtype", "float32", "--bnb_4bit_quant_storage_dtype", "float32"),
    ],
}
# QLoRA on a mixture of experts: 4-bit experts (models.quant_experts) carrying expert LoRA, routers adapted too.
METHODS["qlora-experts"] = [*METHODS["qlora"], *METHODS["experts"][8:]]


def train_argv(model: Path, data: Path, out: Path, method: str, *, batch: int, dropout: float = 0.0) -> list[str]:
    """One matrix run: 3 steps of the global batch 4 (batch × ranks × 2 accumulation... see callers), packed chatml
    rows of 96 positions, evaluated at the end, saved without checkpoints."""
    flags = {
        "model_name_or_path": model,
        "dataset_name": data,
        "chat_template_format": "chatml",
        "packing": FAMILIES[model.name].packing if model.name in FAMILIES else True,
        "max_seq_len": 96,
        "seed": 5,
        "max_steps": STEPS,
        "learning_rate": LR,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": 3,
        "eval_strategy": "epoch",
        "save_strategy": "no",
        "logging_steps": 1,
        "ddp_timeout": 300,
        # The router aux loss of a mixture of experts is a mean per micro-batch (objectives.loss.Objective.step):
        # one process with batch 4 and 2 ranks with batch 2 differ by it, so the matrix compares runs without it.
        "router_aux_loss_coef": 0,
        "output_dir": out,
    }
    argv = ["train", *(x for k, v in flags.items() for x in (f"--{k}", str(v))), *METHODS[method]]
    if method != "full":
        argv += ["--lora_dropout", str(dropout)]
    return argv


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(
    jobs: list[dict], workdir: Path, *, nproc: int, timeout: int = 900, env: dict | None = None, tag: str = ""
) -> dict:
    """Run the jobs in one process (or one torchrun of nproc ranks); return {name: exit code or error text}.
    env: overrides (tests/mutation.py's planted sources); tag: names the jobs, results and log files apart."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    jobs_file, results_file = workdir / f"jobs-{nproc}{tag}.json", workdir / f"results-{nproc}{tag}.json"
    jobs_file.write_text(json.dumps([{**j, "argv": list(map(str, j["argv"]))} for j in jobs]))
    worker = [str(root / "tests" / "family_worker.py"), str(jobs_file), str(results_file)]
    env = {**os.environ, **FSDP_ENV, **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port"]
        cmd += [str(_free_port()), *worker]
    else:
        cmd = [sys.executable, *worker]
    proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
    (workdir / f"log-{nproc}{tag}.txt").write_text(proc.stdout + proc.stderr)
    if not results_file.exists():
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(results_file.read_text())


# ---------------------------------------------------------------- checks shared by the test and the bench

# Runs in a fresh interpreter that never imports shardtune: only torch, transformers and peft.
RELOAD_SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
result = {}
for job in json.loads(sys.argv[1]):
    tok = AutoTokenizer.from_pretrained(job["out"])
    model = AutoModelForCausalLM.from_pretrained(job["base"], dtype=torch.float32)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=8)  # as the README says
    model = PeftModel.from_pretrained(model, job["out"]).eval()
    rows = json.load(open(job["rows"]))
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            # Each packed document alone (a new one wherever the position does not follow): the model's function
            # on it, whatever its mixers would carry across a packed row.
            pos = r["position_ids"]
            starts = [i for i in range(len(pos)) if i == 0 or pos[i] != pos[i - 1] + 1] + [len(pos)]
            for s, e in zip(starts, starts[1:]):
                ids, y = torch.tensor([r["input_ids"][s:e]]), torch.tensor(r["labels"][s:e])
                logits = model(input_ids=ids, position_ids=torch.tensor([pos[s:e]]), use_cache=False).logits[0]
                total += F.cross_entropy(logits.float(), y, reduction="sum", ignore_index=-100).item()
                count += int((y != -100).sum())
    result[job["name"]] = total / count
assert "shardtune" not in sys.modules
print(json.dumps(result))
"""


def eval_rows_file(data: Path, out: Path, workdir: Path, name: str, *, packing: bool = True) -> Path:
    """The eval rows a matrix run evaluated on (tokenized with the tokenizer it saved; packed unless the family
    trains unpacked), as JSON."""
    import json

    from transformers import AutoTokenizer

    from shardtune.data import build_datasets
    from tests.conftest import build_data

    _, ev = build_data(
        build_datasets, tokenizer=AutoTokenizer.from_pretrained(out), dataset_name=str(data), splits="train,test",
        dataset_text_field="text", max_length=96, packing=packing, append_concat_token=False,
        add_special_tokens=False, assistant_only_loss=False, drop_long_samples=False,
        cache_dir=str(workdir / "cache"), seed=5,
    )  # fmt: skip
    rows = [
        {"input_ids": list(map(int, ev.input_ids[i])), "labels": list(map(int, ev.labels[i])),
         "position_ids": list(map(int, ev.position_ids[i]))}
        for i in range(len(ev.input_ids))
    ]  # fmt: skip
    path = workdir / f"rows-{name}.json"
    path.write_text(json.dumps(rows))
    return path


def reload_eval_losses(jobs: list[dict]) -> dict[str, float]:
    """{name: eval loss} of each adapter reloaded with transformers + peft only, in one fresh interpreter.
    jobs: {"name", "base", "out", "rows"}."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, json.dumps(jobs)],
        capture_output=True, text=True, check=False, timeout=900, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peft_and_merged(base: Path, adapter: Path, merged_dir: Path):
    """(PeftModel of base + adapter, the folder `shardtune merge` wrote loaded by transformers), both fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.merge.fold import merge_adapter

    if not merged_dir.exists():
        merge_adapter(base, adapter, merged_dir, dtype="fp32")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(AutoTokenizer.from_pretrained(adapter)), pad_to_multiple_of=8)
    peft = PeftModel.from_pretrained(model, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    return peft, merged


def merge_logit_error(peft, merged, ids: torch.Tensor) -> float:
    """Largest |merged - base+adapter| logit, relative to the largest |logit|."""
    with torch.no_grad():
        want, got = peft(input_ids=ids).logits, merged(input_ids=ids).logits
    return ((got - want).abs().max() / want.abs().max()).item()


def chat_answer_ids(model_dir: Path, adapter: Path | None, n_tokens: int = 6) -> tuple[list[int], int]:
    """Greedy answer ids of `shardtune chat`'s loading path to one question, and the model's embedding rows."""
    from shardtune.commands.chat import encode_messages
    from shardtune.inference.load import load_for_chat

    model, tok = load_for_chat(str(model_dir), str(adapter) if adapter else None)
    inputs = encode_messages(tok, [{"role": "user", "content": "What is the capital of Peru?"}])
    out = model.generate(
        **inputs, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False, pad_token_id=tok.pad_token_id
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist(), model.get_input_embeddings().weight.shape[0]


# ---------------------------------------------------------------- comparing two training runs

# Two fp32 runs of the same batches and schedule whose sums are split differently (1 process vs 2 ranks, 1 vs 2
# micro-batches, compiled vs eager) differ by rounding only. Their loss and grad_norm, each a mean over a step's
# targets of values through the chain of sums of every step so far, get tests/tolerance.py's 8σ bound. A trained
# weight's difference is dominated by AdamW's normalisation instead: an element whose gradient nearly cancels (or is
# near AdamW's eps) has a large relative error in m/sqrt(v), so its atol is a multiple of the measured spread,
# in units of how far AdamW moves an element (lr per step).
#
# The spread measured on this matrix (1 process vs 2 ranks, fp32, AMD EPYC with AVX-512, torch 2.13 CPU, 3 steps at
# lr 5e-3): a step's grad_norm within 5.7e-7 relative and the weights within 4.9e-4 · steps · lr, except Gemma 4,
# whose grad_norm from step 2 on differs by up to 8.7e-5 and whose weights by 7.6e-3 · steps · lr -- and by as much
# between 1 and 2 micro-batches in one process, so summation order, not sharding: its first AdamW update moves
# elements whose gradient is within rounding of zero by a fraction of lr, which the later gradients see.
SPREAD = {"grad_norm": 5.7e-7, "weight_per_lr_step": 4.9e-4}
SENSITIVE = {"gemma4": {"grad_norm": 8.7e-5, "weight_per_lr_step": 7.6e-3}}
# LoRA on the experts and routers of a mixture of experts: 2 ranks and 1 process sum a gradient in other orders, and
# a token whose top-k experts nearly tie may route differently at the next step; the worst element then moves more
# (measured, Qwen3-MoE, 2 ranks vs 1 process, 3 steps: 6.0e-3 per lr·step on a 2-core AMD EPYC with AVX2 (1 of 256
# elements of one lora_A above SPREAD's bound), within SPREAD on an Intel Xeon with AVX-512/AMX).
ROUTED = {**SPREAD, "weight_per_lr_step": 6.0e-3}
# Margin over the measured spread: another CPU blocks its sums differently (AVX2 rather than AVX-512), which changes
# which elements differ, not the size of the differences. The atols stay below one dropped update (lr), 70x for the
# dense families and 4x for Gemma 4; the grad_norm bounds 500x below a halved gradient.
MARGIN = 10


def run_tolerance(*, chain: int, n: int, steps: int, lr: float, spread: dict = SPREAD) -> TrainParity:
    """Bounds of two fp32 runs over `steps` optimizer steps at peak rate `lr`: `chain` is the total length of the
    sums of all steps (tests/tolerance.decoder_chain, times steps), `n` the values a step's loss averages."""
    from tests.tolerance import tol_rounding

    rel = tol_rounding(torch.float32, chain, n=n)
    return TrainParity(
        loss=rel,
        grad_norm=max(rel, MARGIN * spread["grad_norm"]),
        rtol=rel,
        atol=MARGIN * spread["weight_per_lr_step"] * steps * lr,
    )


def matrix_tolerance(family: str, spread: dict | None = None) -> TrainParity:
    """The matrix's bounds: STEPS steps of 4 packed rows of 96 positions, the families' tiny decoders; `spread`:
    a measured spread of the run's kind (ROUTED) instead of the family's."""
    from tests.tolerance import decoder_chain

    chain = {"hidden": HIDDEN, "intermediate": FFN, "layers": LAYERS, "seq": 96, "vocab": 608}
    one_step = decoder_chain(**chain, tokens=4 * 96, backward=True)
    spread = spread or SENSITIVE.get(family, SPREAD)
    return run_tolerance(chain=STEPS * one_step, n=4 * 96, steps=STEPS, lr=LR, spread=spread)


def update_rates(out: Path) -> dict[int, float]:
    """{step: the learning rate its optimizer update used}. metrics.jsonl logs, at step s, the scheduler's rate after
    the step, which is the rate of step s+1's update; step 1's is the configured rate, or 0 under warmup."""
    import json

    records = train_steps(out)
    assert sorted(records) == list(range(1, len(records) + 1)), f"{out}: not every step logged (--logging_steps 1)"
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    config = [r for r in map(json.loads, lines) if r.get("type") == "start"][-1]["config"]["train"]
    first = 0.0 if config["warmup_steps"] or config["warmup_ratio"] else config["learning_rate"]
    return {s: first if s == 1 else records[s - 1]["learning_rate"] for s in records}


def saved_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files at the top of a run's output folder (the adapter, or the model)."""
    from safetensors.torch import load_file

    files = sorted(Path(out).glob("*.safetensors"))
    assert files, f"no safetensors in {out}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def assert_runs_match(ref: Path, got: Path, tol: TrainParity, *, min_updates: int = 1, resumed: bool = False) -> dict:
    """The run in `got` trained as the one in `ref`: every step's loss and grad_norm, then every saved tensor
    elementwise, within `tol`; at least `min_updates` steps updated at a nonzero learning rate (a step at rate 0
    leaves the weights, hence every later number, as they were). `resumed`: `got` resumed `ref`'s run from a
    checkpoint and logged only its later steps. Returns ref's tensors, for a "they moved" check."""
    want, have = train_steps(ref), train_steps(got)
    if resumed:
        assert have and set(have) <= set(want), (sorted(want), sorted(have))
        want = {s: want[s] for s in have}
    assert sorted(have) == sorted(want), (sorted(want), sorted(have))
    rates = {s: r for s, r in update_rates(ref).items() if s in want}
    if resumed:  # its first step's update rate was logged by the run it resumed: compare the rates logged
        logged = [(s, have[s]["learning_rate"], want[s]["learning_rate"]) for s in have]
        assert all(a == b for _, a, b in logged), f"the runs' learning rates differ: {logged}"
    else:
        assert update_rates(got) == rates, "the runs' learning rates differ"  # one schedule: the same floats
    updated = [s for s, lr in rates.items() if lr > 0]
    assert len(updated) >= min_updates, f"only steps {updated} of {sorted(rates)} updated the weights (lr > 0)"
    bad = []
    for s in sorted(want):
        for key, rtol in (("loss", tol.loss), ("grad_norm", tol.grad_norm)):
            rel = abs(have[s][key] - want[s][key]) / max(abs(want[s][key]), 1e-30)
            if not rel <= rtol:  # `not`: a NaN fails
                bad.append(f"step {s} {key}: {have[s][key]!r} vs {want[s][key]!r} (relative {rel:.3g} > {rtol:.3g})")
    assert not bad, "training differs:\n  " + "\n  ".join(bad)
    reference, tensors = _untied(saved_tensors(ref)), _untied(saved_tensors(got))
    assert sorted(tensors) == sorted(reference), sorted(tensors.keys() ^ reference.keys())[:6]
    for key, value in reference.items():
        torch.testing.assert_close(tensors[key], value, rtol=tol.rtol, atol=tol.atol, msg=lambda m, k=key: f"{k}: {m}")
    return reference


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without a tied head stored as a copy of the input embedding (a sharded full save writes it, one process's save
    leaves it out; transformers re-ties it on load either way)."""
    head = tensors.get("lm_head.weight")
    others = [v for k, v in tensors.items() if k != "lm_head.weight"]
    if head is not None and any(v.shape == head.shape and torch.equal(v, head) for v in others):
        return {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return tensors
