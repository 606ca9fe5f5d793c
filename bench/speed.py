"""Training speed: shardtune (1 process, and 2-rank FSDP2) against the reference stack (TRL SFTTrainer + PEFT).

In one run, on the same machine, model, data and settings, each contender trains in its own subprocess for
`--warmup` optimizer steps and is then timed over `--steps` more; contenders are interleaved over `--rounds`
and the fastest round is reported (other load on the machine only ever slows a round down). The script prints a table of tokens/s (non-padding tokens), ratios, achieved
FLOP/s (frozen base + adapter + attention, formula in docs/speed.md), that FLOP/s as a fraction of the matmul
peak measured in the same run for the same dtype and threads, and peak memory per rank; and writes it as JSON.
MFU counts the model's FLOPs only (what the step must compute); with gradient checkpointing the hardware also
recomputes the blocks' forward, and those FLOPs over the peak are the HFU. Both are printed.

    python bench/speed.py                 # ~25M-parameter Llama, 512-token rows, bf16, 2 CPU threads
    python bench/speed.py --quick         # fewer steps, one round
    python bench/speed.py --model 100m    # a larger model
    python bench/speed.py --variant "compile=shardtune --torch_compile True"   # an extra contender

The reference stack follows peft's examples/sft (train.py + utils.py) as the guide runs it: chatml tokens and
template, embeddings resized to a multiple of 8, the base loaded in fp32 with bf16 autocast, SFTConfig(packing=True,
max_length=512, dataset_text_field="content"), LoraConfig(r=8, alpha=16, dropout=0.1, "all-linear"). It runs as
a single process: accelerate refuses FSDP on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import itertools
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# Llama-architecture presets: (hidden, layers, heads, kv_heads, intermediate). The tokenizer has 1024 entries.
MODELS = {
    "25m": (512, 8, 8, 4, 1376),
    "100m": (768, 12, 12, 4, 2048),
    "350m": (1024, 24, 16, 8, 2816),
}


@dataclass
class Settings:
    """What every contender shares: the model, the data and the training settings."""

    model: str = "25m"
    seq_len: int = 512
    batch: int = 4  # rows per optimizer step (all ranks together)
    warmup: int = 2
    steps: int = 4
    rounds: int = 3
    bf16: bool = True
    gradient_checkpointing: bool = True
    threads: int = 2
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.1
    n_train: int = 4000


@dataclass
class Contender:
    """One process layout and code version to time: kind is shardtune, shardtune_fsdp or reference."""

    name: str
    kind: str
    flags: list[str] = field(default_factory=list)
    src: str | None = None  # a different shardtune source tree (PYTHONPATH), for before/after comparisons
    fsdp: dict[str, str] = field(default_factory=dict)  # fsdp_config entries of the accelerate YAML to override

    @property
    def world(self) -> int:
        return 2 if self.kind == "shardtune_fsdp" else 1


# ---------------------------------------------------------------------------------------------------------------
# Assets and FLOP accounting


def build_preset_model(model_dir: Path, preset: tuple[int, int, int, int, int]) -> None:
    """A tokenizer of 1024 entries and a randomly initialised Llama of `preset` (hidden, layers, heads, kv_heads,
    intermediate) in model_dir, unless it is already there (the benches share their models across runs)."""
    from shardtune.commands.demo import build_model, build_tokenizer

    if (model_dir / "config.json").exists():
        return
    hidden, layers, heads, kv, inter = preset
    tok = build_tokenizer(model_dir, vocab_size=1024)
    build_model(
        model_dir,
        vocab_size=len(tok),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=inter,
    )


def build_assets(workdir: Path, model: str, n_train: int) -> dict[str, Path]:
    """The tokenizer, the randomly initialised model and the chat data, built once per preset under workdir."""
    from shardtune.commands.demo import write_chat_dataset

    model_dir, data_dir = workdir / f"model-{model}", workdir / f"data-{n_train}"
    build_preset_model(model_dir, MODELS[model])
    if not (data_dir / "train.jsonl").exists():
        write_chat_dataset(data_dir, n_train=n_train, n_test=50)
    return {"model": model_dir, "data": data_dir}


@dataclass
class FlopModel:
    """Parameter counts that set the FLOPs per token; attention FLOPs depend on the document lengths."""

    block_linear: int  # frozen linear weights in the decoder blocks
    head: int  # output head weights (frozen)
    lora: int  # adapter weights (A and B of every adapted linear layer)
    attn_width: int  # heads × head_dim of the queries
    layers: int
    total_params: int


def flop_model(model_dir: Path, lora_r: int, vocab_rows: int) -> FlopModel:
    """Count the base's linear weights and the all-linear LoRA weights from the model's config (on meta);
    vocab_rows: the embedding rows after chatml's tokens are added (resized to a multiple of 8)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.vocab_size = vocab_rows
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    head = model.get_output_embeddings()
    block_linear = lora = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            block_linear += mod.in_features * mod.out_features
            lora += lora_r * (mod.in_features + mod.out_features)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return FlopModel(
        block_linear=block_linear,
        head=head.in_features * head.out_features,
        lora=lora,
        attn_width=cfg.num_attention_heads * head_dim,
        layers=cfg.num_hidden_layers,
        total_params=sum(p.numel() for p in model.parameters()),
    )


def train_flops(fm: FlopModel, tokens: int, attn_pairs: int, recompute: float = 0.0) -> dict[str, float]:
    """FLOPs of the training steps that processed `tokens` tokens with `attn_pairs` causal (query, key) pairs.

    Frozen base: forward 2N and backward to the activations 2N per token (no weight gradients). Adapter: 6N.
    Attention: QKᵀ and AV, 2 FLOPs per multiply-add, per layer: 4·width per causal pair forward, twice that
    backward. `recompute` is the fraction of decoder blocks whose forward (base, adapter and attention) runs again
    in backward: 0 gives the model FLOPs (MFU), the run's fraction the hardware FLOPs (HFU).
    """
    c = recompute
    base = tokens * ((4 + 2 * c) * fm.block_linear + 4 * fm.head)
    adapter = tokens * (6 + 2 * c) * fm.lora
    attention = attn_pairs * 4 * fm.attn_width * fm.layers * (3 + c)
    return {"base": base, "adapter": adapter, "attention": attention, "total": base + adapter + attention}


def batch_counts(input_ids, position_ids, pad_id: int) -> tuple[int, int]:
    """(non-padding tokens, causal pairs Σ L(L+1)/2 over the documents) of a batch; documents restart at position 0."""
    import torch

    tokens, pairs = 0, 0
    for ids, pos in zip(input_ids.reshape(-1, input_ids.shape[-1]), position_ids.reshape(-1, position_ids.shape[-1])):
        real = ids != pad_id
        tokens += int(real.sum())
        starts = torch.nonzero(pos == 0).flatten().tolist() + [len(pos)]
        for a, b in itertools.pairwise(starts):
            if bool(real[a]):
                n = b - a
                pairs += n * (n + 1) // 2
    return tokens, pairs


def matmul_peak(dtype_name: str, threads: int, device: str, shapes: list[tuple[int, int, int]]) -> float:
    """The best FLOP/s of torch.matmul (x @ Wᵀ, as nn.Linear) over the shapes, in this dtype and thread count."""
    import torch

    dtype = getattr(torch, dtype_name)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = 0.0
    try:
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device).to(dtype)
            w = torch.randn(n, k, device=device).to(dtype)
            for i in range(6):
                _sync(device)
                t0 = time.perf_counter()
                a @ w.t()
                _sync(device)
                if i >= 2:  # the first calls pick kernels and warm the caches
                    best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(old)


def peak_shapes(model_dir: Path, tokens: int, device: str) -> list[tuple[int, int, int]]:
    """Square matmuls and the model's own largest linear layer at the step's token count."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    square = [4096, 8192] if device == "cuda" else [2048, 4096]
    return [(n, n, n) for n in square] + [(tokens, cfg.hidden_size, cfg.intermediate_size)]


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# Worker side: runs inside each contender's process


class StepRecorder:
    """Per-step start times, non-padding tokens and causal pairs; peak memory of setup and of training."""

    def __init__(self, pad_id: int, device: str):
        self.pad_id, self.device = pad_id, device
        self.starts: list[float] = []
        self.cpu: list[float] = []  # process CPU seconds (all threads): robust to other load on the machine
        self.tokens: list[int] = []
        self.pairs: list[int] = []
        self.setup_peak_gb = 0.0

    def step_start(self, batches: list[dict]) -> None:
        _sync(self.device)
        if not self.starts:
            self._reset_peak()
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())
        counts = [batch_counts(b["input_ids"], b["position_ids"], self.pad_id) for b in batches]
        self.tokens.append(sum(c[0] for c in counts))
        self.pairs.append(sum(c[1] for c in counts))

    def _reset_peak(self) -> None:
        self.setup_peak_gb = _rss_peak_gb()
        if self.device == "cuda":
            import torch

            self.setup_peak_gb = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            return
        try:  # Linux: reset the high-water mark so that the training peak is measured on its own
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def result(self) -> dict:
        if self.device == "cuda":
            import torch

            train_peak = torch.cuda.max_memory_allocated() / 2**30
        else:
            train_peak = _rss_peak_gb()
        return {
            "starts": self.starts,
            "cpu": self.cpu,
            "tokens": self.tokens,
            "pairs": self.pairs,
            "setup_peak_gb": self.setup_peak_gb,
            "train_peak_gb": train_peak,
            "peak_gb": max(self.setup_peak_gb, train_peak),
        }


def _rss_peak_gb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# The guide's run_peft_fsdp.sh flags that the benchmark keeps as they are (no eval, no checkpoints here).
GUIDE_FLAGS = shlex.split(
    "--seed 100 --chat_template_format chatml --add_special_tokens False --append_concat_token False --splits "
    "train,test --logging_steps 5 --log_level warning --eval_strategy no --save_strategy no --packing True "
    "--learning_rate 1e-4 --lr_scheduler_type cosine --weight_decay 1e-4 --max_grad_norm 1.0 "
    "--gradient_accumulation_steps 1 --use_reentrant False --use_flash_attn True --use_peft_lora True "
    "--lora_target_modules all-linear"
)


def shardtune_argv(spec: dict) -> list[str]:
    """`shardtune train` flags: the guide's command with the benchmark's model, data, sizes and step count."""
    s = Settings(**spec["settings"])
    flags = {
        "--model_name_or_path": spec["model"],
        "--dataset_name": spec["data"],
        "--output_dir": spec["output_dir"],
        "--dataset_cache_dir": spec["cache_dir"],
        "--max_seq_len": s.seq_len,
        "--max_steps": s.warmup + s.steps + 1,
        "--per_device_train_batch_size": s.batch // spec["world"],
        "--bf16": s.bf16,
        "--gradient_checkpointing": s.gradient_checkpointing,
        "--lora_r": s.lora_r,
        "--lora_alpha": s.lora_alpha,
        "--lora_dropout": s.lora_dropout,
    }
    return GUIDE_FLAGS + [str(x) for kv in flags.items() for x in kv] + list(spec["flags"])


def run_shardtune_worker(spec: dict) -> dict:
    """Run `shardtune train` in this process, timing each optimizer step at the entry of `train_step`."""
    from shardtune.cli import prepare_process

    prepare_process()  # before torch loads OpenMP, as the `shardtune` script does (config.openmp)
    import torch

    from shardtune.cli import run_command
    from shardtune.training import trainer

    torch.set_num_threads(spec["threads"])
    rec = StepRecorder(spec["pad_id"], spec["device"])
    original = trainer.train_step

    def timed_train_step(model, batches, info, *args, **kwargs):
        rec.step_start(batches)
        return original(model, batches, info, *args, **kwargs)

    trainer.train_step = timed_train_step
    # as the `shardtune` script runs it: the process ends with the command (shardtune.runtime.collector)
    rc = run_command("train", shardtune_argv(spec), program=True)
    if rc != 0:
        raise SystemExit(f"shardtune train exited with {rc}")
    # how its OpenMP threads waited: PASSIVE where it found the CPUs busy at start (config.openmp), else the default
    return {**rec.result(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def _reference_model(spec: dict, s: Settings):
    """peft examples/sft/utils.py create_and_prepare_model: fp32 base, chatml tokens, resize to a multiple of 8."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.data.templates import CHAT_FORMATS

    fmt = CHAT_FORMATS["chatml"]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation=spec["attn"])
    tokenizer = AutoTokenizer.from_pretrained(
        spec["model"],
        pad_token=fmt.pad_token,
        bos_token=fmt.bos_token,
        eos_token=fmt.eos_token,
        additional_special_tokens=fmt.tokens(),
    )
    tokenizer.chat_template = fmt.template
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    peft_config = LoraConfig(
        r=s.lora_r,
        lora_alpha=s.lora_alpha,
        lora_dropout=s.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules="all-linear",
    )
    return model, tokenizer, peft_config


def run_reference_worker(spec: dict) -> dict:
    """TRL's SFTTrainer + PEFT as peft's examples/sft/train.py sets it up, timed at each step's start."""
    import torch
    from datasets import load_dataset
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(spec["threads"])
    s = Settings(**spec["settings"])
    set_seed(100)
    model, tokenizer, peft_config = _reference_model(spec, s)
    model.config.use_cache = not s.gradient_checkpointing
    splits = {name: load_dataset(spec["data"], split=name) for name in ("train", "test")}
    content = {
        k: ds.map(
            lambda rows: {"content": [tokenizer.apply_chat_template(m, tokenize=False) for m in rows["messages"]]},
            batched=True,
            remove_columns=ds.column_names,
        )
        for k, ds in splits.items()
    }
    args = SFTConfig(
        output_dir=spec["output_dir"],
        seed=100,
        max_steps=s.warmup + s.steps + 1,
        logging_steps=5,
        logging_strategy="steps",
        eval_strategy="no",
        save_strategy="no",
        bf16=s.bf16,
        packing=True,
        max_length=s.seq_len,
        dataset_text_field="content",
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        weight_decay=1e-4,
        warmup_steps=0,
        max_grad_norm=1.0,
        per_device_train_batch_size=s.batch,
        gradient_accumulation_steps=1,
        gradient_checkpointing=s.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        report_to="none",
        disable_tqdm=True,
        use_cpu=spec["device"] != "cuda",
    )
    rec = StepRecorder(spec["pad_id"], spec["device"])
    trainer = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=content["train"],
        eval_dataset=content["test"],
        peft_config=peft_config,
    )

    # The step's batch is seen in training_step; its start time is taken there, as for shardtune.
    original = trainer.training_step

    def timed_training_step(model, inputs, *a, **kw):
        rec.step_start([inputs])
        return original(model, inputs, *a, **kw)

    trainer.training_step = timed_training_step
    trainer.train()
    return rec.result()


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    run = run_reference_worker if spec["kind"] == "reference" else run_shardtune_worker
    out = run(spec)
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{spec['result']}.rank{rank}.json").write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Parent side: launch the contenders, summarise, print, write JSON


def _env(c: Contender, s: Settings) -> dict[str, str]:
    threads = max(1, s.threads // c.world)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (c.src, env.get("PYTHONPATH")) if p)
    if c.kind == "shardtune_fsdp":
        from shardtune.commands.demo import DEMO_FSDP_YAML
        from shardtune.config.accelerate import accelerate_env

        yaml_cfg = {**DEMO_FSDP_YAML, "num_processes": c.world, "mixed_precision": "bf16" if s.bf16 else "no"}
        yaml_cfg["fsdp_config"] = {**yaml_cfg["fsdp_config"], **c.fsdp}
        env.update(accelerate_env(yaml_cfg))
    if c.kind != "reference":
        env.pop("ACCELERATE_USE_CPU", None)
    return env


def worker_spec(c: Contender, s: Settings, assets: dict, workdir: Path, device: str, pad_id: int) -> dict:
    """What a worker process needs, in a fresh folder under workdir (the data cache is shared)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{c.name}-", dir=workdir))
    flash = device == "cuda" and importlib.util.find_spec("flash_attn") is not None
    return {
        "kind": c.kind,
        "world": c.world,
        "flags": c.flags,
        "settings": asdict(s),
        "model": str(assets["model"]),
        "data": str(assets["data"]),
        "dir": str(tmp),
        "output_dir": str(tmp / "out"),
        "cache_dir": str(workdir / "cache"),
        "result": str(tmp / "result"),
        "threads": max(1, s.threads // c.world),
        "device": device,
        "pad_id": pad_id,
        "attn": "flash_attention_2" if flash else "sdpa",  # the guide's --use_flash_attn, where it can run
    }


def run_contender(c: Contender, s: Settings, assets: dict, workdir: Path, device: str, pad_id: int) -> dict:
    """Train one contender in a fresh process (torchrun for 2 ranks) and return its per-rank records."""
    spec = worker_spec(c, s, assets, workdir, device, pad_id)
    tmp = Path(spec["dir"])
    (tmp / "spec.json").write_text(json.dumps(spec))
    me = [str(Path(__file__).resolve()), "--_worker", str(tmp / "spec.json")]
    if c.world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(c.world), *me]
    else:
        cmd = [sys.executable, *me]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(c, s), capture_output=True, text=True, cwd=tmp, check=False)
    process_s = time.perf_counter() - t0  # the whole process, as a user waits for it: start-up to exit
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"{c.name} failed (exit {proc.returncode}):\n{tail}")
    ranks = {r: json.loads(Path(f"{spec['result']}.rank{r}.json").read_text()) for r in range(c.world)}
    for r in ranks.values():
        r["process_s"] = process_s
    return ranks


def _steps(ranks: dict, s: Settings) -> list[tuple[float, int, int, float]]:
    """(seconds, tokens, pairs, CPU seconds) of each timed step of one run, all ranks together."""
    lo, hi = s.warmup, s.warmup + s.steps  # step i runs from starts[i] to starts[i + 1]
    out = []
    for i in range(lo, hi):
        seconds = max(r["starts"][i + 1] - r["starts"][i] for r in ranks.values())
        cpu = sum(r["cpu"][i + 1] - r["cpu"][i] for r in ranks.values())
        tokens, pairs = (sum(r[k][i] for r in ranks.values()) for k in ("tokens", "pairs"))
        out.append((seconds, tokens, pairs, cpu))
    return out


def summarize(runs: list[dict], s: Settings, fm: FlopModel, peak: float, recompute: float) -> dict:
    """Tokens/s, FLOP/s, MFU and HFU of the fastest round (other load on the machine only ever slows a round down),
    tokens per CPU-second (median step), and the peak memory per rank (the largest over the rounds)."""
    rounds = [_steps(r, s) for r in runs]
    per_round = [sum(st[1] for st in r) / sum(st[0] for st in r) for r in rounds]
    best = rounds[per_round.index(max(per_round))]
    steps = [st for r in rounds for st in r]
    step_s = sum(st[0] for st in best) / len(best)
    tokens = statistics.fmean(st[1] for st in best)
    pairs = round(statistics.fmean(st[2] for st in best))
    model, hardware = (train_flops(fm, round(tokens), pairs, c) for c in (0.0, recompute))
    world = len(runs[0])
    return {
        "tokens_per_s": max(per_round),
        "tokens_per_s_rounds": per_round,
        "tokens_per_s_median_step": statistics.fmean(st[1] for st in steps) / statistics.median(st[0] for st in steps),
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_cpu_s": tokens / statistics.median(st[3] for st in steps),
        "recompute": recompute,
        "model_flops_per_s": model["total"] / step_s,
        "hardware_flops_per_s": hardware["total"] / step_s,
        "flops_split": {k: v / model["total"] for k, v in model.items() if k != "total"},
        "mfu": model["total"] / step_s / peak,
        "hfu": hardware["total"] / step_s / peak,
        "peak_gb_per_rank": [max(r[i]["peak_gb"] for r in runs) for i in range(world)],
        # start to exit, every step (warm-up included): the fastest round, as for tokens/s; None where the runs
        # were not started by run_contender (the device check runs the worker in a process of its own)
        "process_s": min((r[0].get("process_s") for r in runs), default=None, key=lambda x: x or 0.0),
        "process_s_rounds": [r[0].get("process_s") for r in runs],
        "train_peak_gb_per_rank": [max(r[i]["train_peak_gb"] for r in runs) for i in range(world)],
    }


def format_table(report: dict) -> str:
    rows = report["contenders"]
    base = rows.get("reference", {}).get("tokens_per_s")
    single = rows.get("shardtune", {}).get("tokens_per_s")
    whole = rows.get("reference", {}).get("process_s")
    w = max(18, *(len(n) + 2 for n in rows))
    head = (
        f"{'contender':<{w}}{'ranks×thr':>10}{'tokens/s':>10}{'×ref':>7}{'×single':>9}{'process s':>10}"
        f"{'×ref':>7}{'step s':>8}"
        f"{'GFLOP/s':>9}{'MFU':>7}{'HFU':>7}{'tok/CPU-s':>10}{'peak GB/rank':>14}{'train GB/rank':>15}"
    )
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        vs_ref, vs_single = (f"{r['tokens_per_s'] / x:.2f}" if x else "-" for x in (base, single))
        vs_whole = f"{whole / r['process_s']:.2f}" if whole and r["process_s"] else "-"
        lines.append(
            f"{name:<{w}}{r['layout']:>10}{r['tokens_per_s']:>10.0f}{vs_ref:>7}{vs_single:>9}"
            f"{r['process_s'] or float('nan'):>10.1f}{vs_whole:>7}{r['step_s']:>8.2f}{r['model_flops_per_s'] / 1e9:>9.1f}{100 * r['mfu']:>6.1f}%{100 * r['hfu']:>6.1f}%"
            f"{r['tokens_per_cpu_s']:>10.0f}"
            f"{'/'.join(f'{g:.2f}' for g in r['peak_gb_per_rank']):>14}"
            f"{'/'.join(f'{g:.2f}' for g in r['train_peak_gb_per_rank']):>15}"
        )
    p = report["matmul_peak"]
    lines.append(
        f"matmul peak ({report['dtype']}): {p['machine'] / 1e9:.1f} GFLOP/s on {report['settings']['threads']} "
        f"thread(s), {p['one_thread'] / 1e9:.1f} on 1 (best of the run; MFU and HFU are against the first)"
    )
    lines.append(
        "GFLOP/s and MFU: model FLOPs (no recompute); HFU: FLOPs executed, gradient checkpointing's recompute included"
    )
    steps = report["settings"]["warmup"] + report["settings"]["steps"] + 1
    lines.append(f"process s: the whole process of {steps} steps, start to exit (imports, loading, data, training); "
                 "its ×ref is the reference's time over the contender's")  # fmt: skip
    return "\n".join(lines)


def _recompute(c: Contender, s: Settings, layers: int) -> float:
    """The fraction of decoder blocks that recompute their forward in backward (the contender's own
    --gradient_checkpointing flag wins; --checkpoint_every_n_layers k recomputes blocks 0, k, 2k, ...)."""
    on = s.gradient_checkpointing
    if "--gradient_checkpointing" in c.flags:
        on = c.flags[c.flags.index("--gradient_checkpointing") + 1].lower() == "true"
    every = 1
    if "--checkpoint_every_n_layers" in c.flags:
        every = int(c.flags[c.flags.index("--checkpoint_every_n_layers") + 1])
    return -(-layers // every) / layers if on else 0.0


def _parse_variant(text: str) -> Contender:
    """NAME=KIND[@SRC] [FLAGS...] [fsdp_KEY=VALUE...]: an extra contender, e.g. 'compile=shardtune --torch_compile
    True' or 'zero2=shardtune_fsdp fsdp_sharding_strategy=SHARD_GRAD_OP' (an accelerate fsdp_config entry)."""
    head, *rest = text.split()
    name, _, kind_src = head.partition("=")
    kind, _, src = kind_src.partition("@")
    if kind not in ("shardtune", "shardtune_fsdp", "reference") or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=KIND[@SRC] [FLAGS...] with KIND shardtune, ...")
    fsdp = dict(x.split("=", 1) for x in rest if x.startswith("fsdp_"))
    return Contender(name, kind, [x for x in rest if not x.startswith("fsdp_")], src or None, fsdp)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="25m", choices=sorted(MODELS), help="Model preset.")
    ap.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps, one round.")
    ap.add_argument("--steps", type=int, help="Timed optimizer steps per run (default 4).")
    ap.add_argument("--warmup", type=int, help="Untimed optimizer steps first (default 2).")
    ap.add_argument("--rounds", type=int, help="Interleaved rounds; the fastest is reported (default 3).")
    ap.add_argument("--batch", type=int, default=4, help="Rows per optimizer step, all ranks together.")
    ap.add_argument("--seq_len", type=int, default=512, help="Tokens per row.")
    ap.add_argument("--fp32", action="store_true", help="fp32 instead of bf16.")
    ap.add_argument("--no_gradient_checkpointing", action="store_true", help="Keep all activations.")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all (ranks × threads per rank).")
    ap.add_argument("--only", default="shardtune,shardtune_fsdp,reference", help="Comma-separated contenders.")
    ap.add_argument("--shardtune_flags", default="", help="Extra `shardtune train` flags for both shardtune runs.")
    ap.add_argument("--variant", action="append", default=[], help="NAME=KIND[@SRC] [FLAGS...]; repeatable.")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "shardtune-bench"), help="Assets.")
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/speed[-MODEL][-cuda].json).")
    ap.add_argument(
        "--background_load",
        type=int,
        default=0,
        help="Other jobs on the machine while it measures: N processes of one-thread fp32 matmuls (default none).",
    )
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# One other job: a one-thread process that multiplies matrices until it is killed (a neighbour's training).
_LOAD_JOB = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).tanh()"


@contextlib.contextmanager
def background_load(jobs: int):
    """`jobs` other processes loading the CPUs while the contenders run; killed at the end."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_JOB]) for _ in range(jobs)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _settings(a: argparse.Namespace) -> Settings:
    s = Settings(model=a.model, seq_len=a.seq_len, batch=a.batch, threads=a.threads)
    s.bf16, s.gradient_checkpointing = not a.fp32, not a.no_gradient_checkpointing
    if a.quick:
        s.warmup, s.steps, s.rounds = 1, 3, 1
    s.warmup = a.warmup if a.warmup is not None else s.warmup
    s.steps = a.steps if a.steps is not None else s.steps
    s.rounds = a.rounds if a.rounds is not None else s.rounds
    return s


def _contenders(a: argparse.Namespace, device: str) -> list[Contender]:
    extra = a.shardtune_flags.split()
    known = {
        "shardtune": Contender("shardtune", "shardtune", extra),
        "shardtune_fsdp": Contender("shardtune_fsdp", "shardtune_fsdp", extra),
        "reference": Contender("reference", "reference"),
    }
    out = [known[n] for n in a.only.split(",") if n]
    if a.batch % 2:
        raise SystemExit(f"--batch {a.batch}: use an even number of rows, so that 2 ranks get the same share.")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:  # two ranks need two GPUs under NCCL
            out = [c for c in out if c.world == 1]
    return out + [_parse_variant(v) for v in a.variant]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_as_installed(c: Contender) -> None:
    """Byte-compile the shardtune source a contender runs, as `pip install` does for an installed package. An
    editable install compiles nothing, and where PYTHONDONTWRITEBYTECODE is set (these machines set it) every
    start would compile shardtune's modules again (0.2 s measured for the train command's imports), which the
    reference's installed libraries never pay."""
    if c.kind == "reference":
        return
    root = Path(c.src) if c.src else Path(importlib.util.find_spec("shardtune").origin).parent.parent
    compileall.compile_dir(str(root / "shardtune"), quiet=1)


def _measure(contenders: list[Contender], s: Settings, assets: dict, workdir: Path, device: str, pad_id: int):
    """Interleave the contenders over the rounds (alternating their order) and the matmul peaks between them."""
    for c in contenders:
        compile_as_installed(c)
    dtype = "bfloat16" if s.bf16 else "float32"
    shapes = peak_shapes(assets["model"], s.batch * s.seq_len, device)
    peaks = {"machine": 0.0, "one_thread": 0.0}
    raw: dict[str, list[dict]] = {c.name: [] for c in contenders}
    for rnd in range(s.rounds):
        peaks["machine"] = max(peaks["machine"], matmul_peak(dtype, s.threads, device, shapes))
        peaks["one_thread"] = max(peaks["one_thread"], matmul_peak(dtype, 1, device, shapes))
        for c in contenders if rnd % 2 == 0 else contenders[::-1]:
            print(f"round {rnd + 1}/{s.rounds}: {c.name} ...", flush=True)
            raw[c.name].append(run_contender(c, s, assets, workdir, device, pad_id))
    return raw, peaks


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a._worker:
        return worker_main(a._worker)
    import torch

    from shardtune.models.loading import load_tokenizer
    from shardtune.runtime.cpu import bench_line, bench_record

    s = _settings(a)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    assets = build_assets(workdir, s.model, s.n_train)
    tok, _ = load_tokenizer(
        str(assets["model"]), tokenizer_name_or_path=None, chat_template_format="chatml", trust_remote_code=False
    )
    fm = flop_model(assets["model"], s.lora_r, vocab_rows=-(-len(tok) // 8) * 8)
    contenders = _contenders(a, device)
    load_before = os.getloadavg()
    with background_load(a.background_load):
        raw, peaks = _measure(contenders, s, assets, workdir, device, tok.pad_token_id)
    report = {
        "command": "python bench/speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": asdict(s),
        "device": device if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "device_name": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "background_load": a.background_load,  # other one-thread jobs running throughout
        "torch": torch.__version__,
        "dtype": "bfloat16" if s.bf16 else "float32",
        # The CPU case these figures belong to: bf16 native or emulated, measured (shardtune.runtime.cpu).
        "cpu": bench_record("bfloat16" if s.bf16 else "float32"),
        "model": asdict(fm),
        "matmul_peak": peaks,
        "contenders": {},
    }
    for c in contenders:
        summary = summarize(raw[c.name], s, fm, peaks["machine"], _recompute(c, s, fm.layers))
        layout = f"{c.world}×{max(1, s.threads // c.world)}"
        report["contenders"][c.name] = {"layout": layout, "flags": c.flags, "src": c.src, "fsdp": c.fsdp, **summary}
    report["table"] = bench_line(report["cpu"]) + "\n" + format_table(report)
    print(report["table"])
    suffix = ("" if s.model == "25m" else f"-{s.model}") + ("-cuda" if device == "cuda" else "")
    out = Path(a.out) if a.out else RESULTS / f"speed{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
