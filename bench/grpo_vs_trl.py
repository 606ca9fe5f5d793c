"""GRPO speed: shardtune `--objective grpo` (1 process, and 2 FSDP2 ranks) against TRL's GRPOTrainer + PEFT, on CPU.

In one run, on the same machine, model, prompts, reward function and settings, each contender trains in its own
fresh process for `--warmup` + `--steps` + 1 optimizer steps (the last step only closes the last timed interval);
contenders are interleaved over `--rounds` (order alternating) and each measure's best round is reported (other
load on the machine only ever slows a round down). Measures, per contender and as ratios shardtune / TRL:

- wall s: the whole process, from its start to its exit (imports, loading, training; as a user waits for it);
- gen tok/s: completion tokens generated / seconds in generation (shardtune: `TransformersEngine.generate`;
  TRL: `GRPOTrainer._generate_single_turn`, i.e. `model.generate` with its padding), warm-up step left out;
- train tok/s: prompt + completion tokens trained / seconds in forward + backward + gradient clipping + optimizer
  step (shardtune: `training.trainer.train_step` + `clip_grad_norm` + `Optimizer.step`; TRL: `training_step` less
  its `_prepare_inputs`, which is where it generates, + `_clip_grad_norm` + `Optimizer.step`);
- step s: the median interval between consecutive steps' starts (one whole cycle: rollout, rewards, training,
  optimizer, logging), warm-up left out;
- CPU s: the CPU-seconds the whole run took (all its processes and threads): robust to other jobs on the machine.

It also reports the rollout's parts (generation, the other work of a rollout: sync probe, the trainer's log-probs,
rewards), the first step's mean reward of both (a sanity check that they sample from the same kind of policy, not a
parity check: the seeds differ), and writes everything, with the exact GRPOConfig, to bench/results/grpo_vs_trl.json.

    python bench/grpo_vs_trl.py --model medium --warmup 2 --steps 6 --rounds 2 --threads 1 \
        --out bench/results/grpo_vs_trl-1thread.json   # docs/rl.md's first table (1 thread per process)
    python bench/grpo_vs_trl.py --model medium --steps 3 --rounds 2   # 2 threads, as bench/speed.py: the second
    python bench/grpo_vs_trl.py --dtype fp32 --rounds 1 --only shardtune,trl,shardtune_fsdp@fp32
    python bench/grpo_vs_trl.py --model small --steps 1 --warmup 1 --rounds 1   # a quick check

--dtype auto (the default) runs fp32, and bf16 too where the CPU has AVX-512 BF16 or AMX. --threads is the CPU
threads in all: one process gets all of them, each of the 2 FSDP ranks max(1, threads // 2).

Settings follow shardtune's GRPO defaults, which are TRL's: loss_type dapo, beta 0 (no reference forward),
epsilon 0.2, scale_rewards group, temperature 1, top_p 1, top_k 0, num_iterations 1, steps_per_generation =
gradient_accumulation_steps = 1 (so neither computes old log-probs), dropout off (TRL disable_dropout=True;
shardtune turns dropout off for GRPO), LoRA r=16 alpha 32 on all linear layers, AdamW, linear schedule, no warmup,
clipping at 1.0, no gradient checkpointing (TRL's default is on: turned off here, as shardtune's). TRL runs as one
process: accelerate refuses FSDP on a CPU-only machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# Llama presets (hidden, layers, heads, kv_heads, intermediate); the demo tokenizer has 1024 entries.
MODELS = {
    "small": (256, 4, 4, 2, 688),
    "medium": (384, 4, 6, 2, 1024),
    "large": (512, 4, 8, 4, 1376),
}
REWARD_FN = "low_id_fraction"
REWARDS_PY = '''"""The bench's reward: the fraction of a completion's tokens whose id is below 512 (a random policy scores about
0.5 with some spread in a group, so advantages are not all zero). TRL's signature."""


def low_id_fraction(prompts, completions, completion_ids, **kwargs):
    return [sum(t < 512 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@dataclass
class Settings:
    model: str = "medium"
    dtype: str = "fp32"  # fp32 or bf16
    batch: int = 16  # completions per optimizer step, all ranks together (per_device_train_batch_size × ranks)
    num_generations: int = 4
    max_completion_length: int = 48
    warmup: int = 1
    steps: int = 4
    rounds: int = 2
    threads: int = 2
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.1  # turned off by both (disable_dropout), kept to show that it is
    learning_rate: float = 1e-4
    seed: int = 100
    n_prompts: int = 512

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + 1


# ---------------------------------------------------------------------------------------------------------------
# Assets


def build_assets(workdir: Path, model: str, n_prompts: int) -> dict[str, Path]:
    """The tokenizer and randomly initialised Llama (once per preset), the prompt-only data and the reward file."""
    from speed import build_preset_model

    from shardtune.commands.demo import _conversation

    model_dir, data_dir = workdir / f"model-{model}", workdir / f"prompts-{n_prompts}"
    build_preset_model(model_dir, MODELS[model])
    if not (data_dir / "train.jsonl").exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        rows = [
            {"prompt": next(m["content"] for m in _conversation(rng) if m["role"] == "user")} for _ in range(n_prompts)
        ]
        (data_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = workdir / "rewards.py"
    rewards.write_text(REWARDS_PY)
    return {"model": model_dir, "data": data_dir, "rewards": rewards}


# ---------------------------------------------------------------------------------------------------------------
# Worker side: runs inside each contender's process


class Recorder:
    """Durations of what a process does, with the step each belongs to (index = steps started so far - 1)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.step_starts: list[float] = []
        self.events: dict[str, list[tuple[int, float, float]]] = {}  # name -> [(step, seconds, CPU-seconds)]
        self.counts: dict[str, list[tuple[int, int]]] = {}  # name -> [(step, count)]
        self.notes: dict = {}

    @property
    def step(self) -> int:
        return len(self.step_starts)  # a rollout before step k's start belongs to step k (shardtune)

    def add(self, name: str, seconds: float, step: int | None = None, cpu: float = 0.0) -> None:
        """seconds of wall time (and cpu: CPU-seconds of this process, all threads) spent in `name`."""
        self.events.setdefault(name, []).append((self.step if step is None else step, seconds, cpu))

    def count(self, name: str, n: int, step: int | None = None) -> None:
        self.counts.setdefault(name, []).append((self.step if step is None else step, n))

    def timed(self, name: str, fn, *, count=None, step_of=None):
        """fn wrapped: its duration recorded under name (and count(result) under name + '_tokens')."""

        def wrapper(*args, **kwargs):
            step = self.step if step_of is None else step_of()
            t, c = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            self.add(name, time.perf_counter() - t, step, time.process_time() - c)
            if count is not None:
                self.count(name + "_tokens", count(out), step)
            return out

        return wrapper

    def result(self) -> dict:
        return {
            "step_starts": [s - self.t0 for s in self.step_starts],
            "events": self.events,
            "counts": self.counts,
            "notes": self.notes,
            "cpu_s": time.process_time(),
        }


def _optimizer_hooks(rec: Recorder) -> None:
    """Time every Optimizer.step (global hooks: the same for both stacks, whichever optimizer class they build)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    box = {}

    def pre(opt, a, kw):
        box["t"], box["c"] = time.perf_counter(), time.process_time()

    def post(opt, a, kw):
        rec.add("optimizer", time.perf_counter() - box["t"], rec.step - 1, time.process_time() - box["c"])

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def shardtune_argv(spec: dict) -> list[str]:
    s = Settings(**spec["settings"])
    flags = {
        "--model_name_or_path": spec["model"],
        "--dataset_name": spec["data"],
        "--splits": "train",
        "--objective": "grpo",
        "--reward_funcs": f"{spec['rewards']}:{REWARD_FN}",
        "--num_generations": s.num_generations,
        "--max_completion_length": s.max_completion_length,
        "--temperature": 1.0,
        "--per_device_train_batch_size": s.batch // spec["world"],
        "--gradient_accumulation_steps": 1,
        "--max_steps": s.total_steps,
        "--logging_steps": 1,
        "--log_level": "warning",
        "--save_strategy": "no",
        "--eval_strategy": "no",
        "--use_peft_lora": True,
        "--lora_r": s.lora_r,
        "--lora_alpha": s.lora_alpha,
        "--lora_dropout": s.lora_dropout,
        "--lora_target_modules": "all-linear",
        "--learning_rate": s.learning_rate,
        "--lr_scheduler_type": "linear",
        "--max_grad_norm": 1.0,
        "--bf16": s.dtype == "bf16",
        "--gradient_checkpointing": False,
        "--seed": s.seed,
        "--add_special_tokens": True,
        "--output_dir": spec["output_dir"],
    }
    return ["train"] + [str(x) for kv in flags.items() for x in kv] + list(spec.get("flags", []))


def _trained_tokens(batch: dict) -> int:
    """Prompt + completion tokens of a shardtune micro-batch: per row, its last position + 1 (padding is at 0)."""
    return int((batch["position_ids"].max(dim=1).values + 1).sum())


def run_shardtune_worker(spec: dict) -> dict:
    """`shardtune train` in this process (shardtune.cli.main), its rollout and training parts timed."""
    import torch

    from shardtune import cli
    from shardtune.rl import generate as rl_generate
    from shardtune.rl import probe as rl_probe
    from shardtune.rl import rollout as rl_rollout
    from shardtune.training import trainer

    torch.set_num_threads(spec["threads"])
    rec = Recorder()
    _optimizer_hooks(rec)
    train_step = trainer.train_step

    def timed_train_step(model, batches, info, *args, **kwargs):
        rec.step_starts.append(time.perf_counter())
        rec.count("train_tokens", sum(_trained_tokens(b) for b in batches), rec.step - 1)
        t, c = time.perf_counter(), time.process_time()
        out = train_step(model, batches, info, *args, **kwargs)
        rec.add("fwd_bwd", time.perf_counter() - t, rec.step - 1, time.process_time() - c)
        return out

    trainer.train_step = timed_train_step
    trainer.clip_grad_norm = rec.timed("clip", trainer.clip_grad_norm, step_of=lambda: rec.step - 1)
    E = rl_generate.TransformersEngine
    E.generate = rec.timed("generate", E.generate, count=lambda out: sum(len(c.token_ids) for c in out))
    R = rl_rollout.Rollouts
    R._generate = rec.timed("rollout", R._generate)
    R._rewards = rec.timed("rewards", R._rewards)
    R._trainer_side = rec.timed("trainer_logps", R._trainer_side)
    rl_probe.SyncProbe.check = rec.timed("sync_probe", rl_probe.SyncProbe.check)
    rc = cli.main(shardtune_argv(spec))
    if rc:
        raise SystemExit(f"shardtune train exited with {rc}")
    first = None
    metrics = Path(spec["output_dir"]) / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            r = json.loads(line)
            if r.get("type") == "train" and "reward" in r:
                first = {k: r.get(k) for k in ("step", "reward", "reward_std", "completions/mean_length", "loss")}
                break
    rec.notes["first_step"] = first
    return rec.result()


def trl_config(spec: dict) -> dict:
    """The GRPOConfig keyword arguments (recorded in the results as they were used)."""
    s = Settings(**spec["settings"])
    return {
        "output_dir": spec["output_dir"],
        "seed": s.seed,
        "max_steps": s.total_steps,
        "per_device_train_batch_size": s.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "num_generations": s.num_generations,
        "max_completion_length": s.max_completion_length,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,
        "loss_type": "dapo",
        "epsilon": 0.2,
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        "disable_dropout": True,
        "use_vllm": False,
        "learning_rate": s.learning_rate,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": s.dtype == "bf16",
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "log_completions": False,
        "use_cpu": True,
        "dataloader_num_workers": 0,
    }


def trl_lora(s: Settings) -> dict:
    return {
        "r": s.lora_r,
        "lora_alpha": s.lora_alpha,
        "lora_dropout": s.lora_dropout,
        "target_modules": "all-linear",
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def run_trl_worker(spec: dict) -> dict:
    """TRL's GRPOTrainer with a PEFT LoRA (transformers generation, no vLLM), its parts timed."""
    import importlib.util

    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    s = Settings(**spec["settings"])
    set_seed(s.seed)
    rec = Recorder()
    _optimizer_hooks(rec)
    mod_spec = importlib.util.spec_from_file_location("bench_rewards", spec["rewards"])
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ds = load_dataset("json", data_files=str(Path(spec["data"]) / "train.jsonl"), split="train")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=getattr(mod, REWARD_FN),
        args=GRPOConfig(**trl_config(spec)),
        train_dataset=ds,
        processing_class=tokenizer,
        peft_config=LoraConfig(**trl_lora(s)),
    )
    # What the generation and the training actually compute in: the first adapted projection's output dtype.
    dtypes: dict[str, set] = {"generate": set(), "train": set()}
    phase = {"now": "train"}
    q = next(m for n, m in trainer.model.named_modules() if n.endswith("q_proj.base_layer"))
    q.register_forward_hook(lambda m, a, out: dtypes[phase["now"]].add(str(out.dtype)))

    single_turn = trainer._generate_single_turn

    def timed_single_turn(*a, **kw):
        phase["now"] = "generate"
        t, c = time.perf_counter(), time.process_time()
        try:
            out = single_turn(*a, **kw)
        finally:
            phase["now"] = "train"
        rec.add("generate", time.perf_counter() - t, rec.step - 1, time.process_time() - c)
        rec.count("generate_tokens", sum(len(c) for c in out[0]), rec.step - 1)
        return out

    trainer._generate_single_turn = timed_single_turn
    trainer._generate_and_score_completions = rec.timed(
        "rollout", trainer._generate_and_score_completions, step_of=lambda: rec.step - 1
    )
    trainer._calculate_rewards = rec.timed("rewards", trainer._calculate_rewards, step_of=lambda: rec.step - 1)
    prepare = trainer._prepare_inputs

    def timed_prepare(inputs):
        t, c = time.perf_counter(), time.process_time()
        out = prepare(inputs)
        rec.add("prepare_inputs", time.perf_counter() - t, rec.step - 1, time.process_time() - c)
        tokens = out["prompt_mask"].sum() + out["completion_mask"].sum()
        rec.count("train_tokens", int(tokens), rec.step - 1)
        return out

    trainer._prepare_inputs = timed_prepare
    training_step = trainer.training_step

    def timed_training_step(*a, **kw):
        rec.step_starts.append(time.perf_counter())
        t, c = time.perf_counter(), time.process_time()
        out = training_step(*a, **kw)
        rec.add("training_step", time.perf_counter() - t, rec.step - 1, time.process_time() - c)
        return out

    trainer.training_step = timed_training_step
    trainer._clip_grad_norm = rec.timed("clip", trainer._clip_grad_norm, step_of=lambda: rec.step - 1)
    trainer.train()
    # fwd_bwd: training_step less the generation inside it (its _prepare_inputs)
    prep = {k: (v, c) for k, v, c in rec.events.get("prepare_inputs", [])}
    rec.events["fwd_bwd"] = [
        (k, v - prep.get(k, (0.0, 0.0))[0], c - prep.get(k, (0.0, 0.0))[1]) for k, v, c in rec.events["training_step"]
    ]
    first = next((h for h in trainer.state.log_history if "reward" in h), None)
    if first:
        first = {k: first.get(k) for k in ("step", "reward", "reward_std", "completions/mean_length", "loss")}
    rec.notes["first_step"] = first
    rec.notes["compute_dtypes"] = {k: sorted(v) for k, v in dtypes.items()}
    rec.notes["grpo_config_resolved"] = {k: str(v) for k, v in trainer.args.to_dict().items()}
    rec.notes["generation_config"] = trainer.generation_config.to_dict() if trainer.generation_config else None
    return rec.result()


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = run_trl_worker(spec) if spec["kind"] == "trl" else run_shardtune_worker(spec)
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{spec['result']}.rank{rank}.json").write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Parent side


@dataclass
class Contender:
    name: str
    kind: str  # shardtune, shardtune_fsdp, trl

    @property
    def world(self) -> int:
        return 2 if self.kind == "shardtune_fsdp" else 1


def _env(c: Contender, s: Settings) -> dict[str, str]:
    threads = max(1, s.threads // c.world)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if c.kind == "shardtune_fsdp":  # the accelerate FSDP variables (ACCELERATE_USE_FSDP, FSDP_SHARDING_STRATEGY, ...)
        from shardtune.commands.demo import DEMO_FSDP_YAML
        from shardtune.config.accelerate import accelerate_env

        cfg = {**DEMO_FSDP_YAML, "num_processes": c.world, "mixed_precision": "bf16" if s.dtype == "bf16" else "no"}
        env.update(accelerate_env(cfg))
    if c.kind != "trl":
        env.pop("ACCELERATE_USE_CPU", None)
    return env


def run_contender(c: Contender, s: Settings, assets: dict, workdir: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"{c.name}-{s.dtype}-", dir=workdir))
    spec = {
        "kind": c.kind,
        "world": c.world,
        "settings": asdict(s),
        "model": str(assets["model"]),
        "data": str(assets["data"]),
        "rewards": str(assets["rewards"]),
        "output_dir": str(tmp / "out"),
        "result": str(tmp / "result"),
        "threads": max(1, s.threads // c.world),
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    me = [str(Path(__file__).resolve()), "--_worker", str(tmp / "spec.json")]
    if c.world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(c.world), *me]
    else:
        cmd = [sys.executable, *me]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(c, s), capture_output=True, text=True, cwd=tmp, check=False)
    wall = time.perf_counter() - t
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{c.name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    ranks = {r: json.loads(Path(f"{spec['result']}.rank{r}.json").read_text()) for r in range(c.world)}
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "load_1m": [load0, os.getloadavg()[0]], "ranks": ranks, "dir": str(tmp)}


def _per_step(ranks: dict, name: str, kind: str = "events", col: int = 1) -> dict[int, list[float]]:
    """step -> each rank's total of `name` in that step (events: col 1 wall seconds, col 2 CPU-seconds)."""
    out: dict[int, list[float]] = {}
    for r in ranks.values():
        acc: dict[int, float] = {}
        for row in r[kind].get(name, []):
            acc[row[0]] = acc.get(row[0], 0.0) + row[col]
        for step, v in acc.items():
            out.setdefault(step, []).append(v)
    return out


def summarize_run(run: dict, s: Settings) -> dict:
    """One run's measures over its timed steps (warm-up steps and the closing step left out). Over ranks: tokens
    and CPU-seconds are summed, wall seconds are the slowest rank's (the ranks wait for each other)."""
    ranks = run["ranks"]
    timed = range(s.warmup, s.warmup + s.steps)

    def seconds(name):
        per = _per_step(ranks, name)
        return sum(max(per.get(k, [0.0])) for k in timed)

    def cpu(name):
        per = _per_step(ranks, name, col=2)
        return sum(sum(per.get(k, [0.0])) for k in timed)

    def tokens(name):
        per = _per_step(ranks, name, "counts")
        return sum(sum(per.get(k, [0])) for k in timed)

    def rate(n, d):
        return n / d if d else float("nan")

    starts = [r["step_starts"] for r in ranks.values()]
    intervals = [max(st[k + 1] - st[k] for st in starts) for k in timed]
    train_s = seconds("fwd_bwd") + seconds("clip") + seconds("optimizer")
    train_cpu = cpu("fwd_bwd") + cpu("clip") + cpu("optimizer")
    gen_tokens, train_tokens = tokens("generate_tokens"), tokens("train_tokens")
    out = {
        "wall_s": run["wall_s"],
        "cpu_s": run["cpu_s"],
        "step_s": statistics.median(intervals),
        "step_s_all": intervals,
        "gen_tokens": gen_tokens,
        "gen_s": seconds("generate"),
        "gen_cpu_s": cpu("generate"),
        "gen_tok_s": rate(gen_tokens, seconds("generate")),
        "gen_tok_cpu_s": rate(gen_tokens, cpu("generate")),
        "train_tokens": train_tokens,
        "train_s": train_s,
        "train_cpu_s": train_cpu,
        "train_tok_s": rate(train_tokens, train_s),
        "train_tok_cpu_s": rate(train_tokens, train_cpu),
        "fwd_bwd_s": seconds("fwd_bwd"),
        "clip_s": seconds("clip"),
        "optimizer_s": seconds("optimizer"),
        "rollout_s": seconds("rollout"),
        "rewards_s": seconds("rewards"),
        "sync_probe_s": seconds("sync_probe"),
        "trainer_logps_s": seconds("trainer_logps"),
        "first_step": ranks[0]["notes"].get("first_step"),
        "load_1m": run["load_1m"],
    }
    if "compute_dtypes" in ranks[0]["notes"]:
        out["compute_dtypes"] = ranks[0]["notes"]["compute_dtypes"]
    return out


BEST = {
    "wall_s": min,
    "cpu_s": min,
    "step_s": min,
    "gen_tok_s": max,
    "gen_tok_cpu_s": max,
    "train_tok_s": max,
    "train_tok_cpu_s": max,
}


def summarize(runs: list[dict], s: Settings) -> dict:
    rounds = [summarize_run(r, s) for r in runs]
    best = {k: f(r[k] for r in rounds) for k, f in BEST.items()}
    return {"best": best, "rounds": rounds}


COLUMNS = [
    ("wall s", "wall_s", "{:.1f}"),
    ("CPU s", "cpu_s", "{:.0f}"),
    ("step s", "step_s", "{:.2f}"),
    ("gen tok/s", "gen_tok_s", "{:.0f}"),
    ("train tok/s", "train_tok_s", "{:.0f}"),
    ("gen tok/CPU-s", "gen_tok_cpu_s", "{:.0f}"),
    ("trn tok/CPU-s", "train_tok_cpu_s", "{:.0f}"),
]


def format_table(report: dict) -> str:
    lines = []
    for dtype, block in report["results"].items():
        rows = block["contenders"]
        ref = rows.get("trl", {}).get("best")
        head = f"{dtype:<16}{'ranks×thr':>10}" + "".join(f"{h:>14}" for h, _, _ in COLUMNS)
        lines += [head, "-" * len(head)]
        for name, r in rows.items():
            cells = "".join(f"{fmt.format(r['best'][k]):>14}" for _, k, fmt in COLUMNS)
            lines.append(f"{name:<16}{r['layout']:>10}{cells}")
            if ref and name != "trl":
                ratio = "".join(f"{r['best'][k] / ref[k]:>13.2f}×" for _, k, _ in COLUMNS)
                lines.append(f"{'  ÷ trl':<16}{'':>10}{ratio}")
        for name, r in rows.items():
            parts = r["rounds"][0]
            first = parts.get("first_step") or {}
            lines.append(
                f"  {name}: per timed step (round 1) rollout {parts['rollout_s'] / s_steps(report):.2f} s = generate "
                f"{parts['gen_s'] / s_steps(report):.2f} + probe {parts['sync_probe_s'] / s_steps(report):.2f} + "
                f"trainer log-probs {parts['trainer_logps_s'] / s_steps(report):.2f} + rewards "
                f"{parts['rewards_s'] / s_steps(report):.3f} + other; train {parts['train_s'] / s_steps(report):.2f} s "
                f"(fwd+bwd {parts['fwd_bwd_s'] / s_steps(report):.2f}, optimizer "
                f"{(parts['optimizer_s'] + parts['clip_s']) / s_steps(report):.3f}); first-step reward "
                f"{first.get('reward', float('nan')):.3f} ± {first.get('reward_std') or float('nan'):.3f}, mean length "
                f"{first.get('completions/mean_length', float('nan')):.1f}"
            )
        lines.append("")
    return "\n".join(lines)


def s_steps(report: dict) -> int:
    return report["settings"]["steps"]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="medium", choices=sorted(MODELS), help="Llama preset (MODELS).")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="fp32, bf16, fp32,bf16 or auto (bf16 too where the CPU has AVX-512 BF16 or AMX).",
    )
    ap.add_argument("--batch", type=int, default=16, help="Completions per optimizer step, all ranks together.")
    ap.add_argument("--max_completion_length", type=int, default=48)
    ap.add_argument("--steps", type=int, default=4, help="Timed optimizer steps.")
    ap.add_argument("--warmup", type=int, default=1, help="Untimed steps first.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all (ranks × threads per rank).")
    ap.add_argument(
        "--only",
        default="shardtune,shardtune_fsdp,trl",
        help="Comma-separated contenders, each NAME or NAME@DTYPE (only in that dtype): shardtune, shardtune_fsdp, trl.",
    )
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "shardtune-grpo-bench"))
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/grpo_vs_trl.json).")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _dtypes(choice: str) -> list[str]:
    if choice != "auto":
        return choice.split(",")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return ["fp32", "bf16"] if ("amx_bf16" in flags or "avx512_bf16" in flags) else ["fp32"]


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a._worker:
        return worker_main(a._worker)
    import torch

    from shardtune.runtime.cpu import bench_line, bench_record

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    base = Settings(
        model=a.model,
        batch=a.batch,
        max_completion_length=a.max_completion_length,
        warmup=a.warmup,
        steps=a.steps,
        rounds=a.rounds,
        threads=a.threads,
    )
    assets = build_assets(workdir, base.model, base.n_prompts)
    # NAME or NAME@DTYPE (that contender in that dtype only, e.g. shardtune_fsdp@fp32)
    picks = [n.partition("@") for n in a.only.split(",") if n]
    if unknown := sorted({n for n, _, _ in picks} - {"shardtune", "shardtune_fsdp", "trl"}):
        raise SystemExit(f"--only: unknown contender(s) {unknown}; known: shardtune, shardtune_fsdp, trl.")
    dtypes = _dtypes(a.dtype)
    report = {
        "command": "python bench/grpo_vs_trl.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": asdict(base),
        "model_preset": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate"), MODELS[base.model])),
        "torch": torch.__version__,
        "versions": _versions(),
        "load_average_1m_before": os.getloadavg()[0],
        "results": {},
    }
    for dtype in dtypes:
        s = Settings(**{**asdict(base), "dtype": dtype})
        contenders = [Contender(n, n) for n, _, only in picks if only in ("", dtype)]
        raw: dict[str, list[dict]] = {c.name: [] for c in contenders}
        for rnd in range(s.rounds):
            for c in contenders if rnd % 2 == 0 else contenders[::-1]:
                print(f"{dtype} round {rnd + 1}/{s.rounds}: {c.name} ...", flush=True)
                raw[c.name].append(run_contender(c, s, assets, workdir))
                print(f"  {raw[c.name][-1]['wall_s']:.1f} s", flush=True)
        spec_trl = {"settings": asdict(s), "output_dir": "OUT"}
        block = {
            "cpu": bench_record("bfloat16" if dtype == "bf16" else "float32"),
            "grpo_config": trl_config(spec_trl) if "trl" in raw else None,
            "lora_config": trl_lora(s),
            "shardtune_argv": shardtune_argv(
                {
                    "settings": asdict(s),
                    "model": "M",
                    "data": "D",
                    "rewards": "rewards.py",
                    "output_dir": "OUT",
                    "world": 1,
                }
            ),
            "contenders": {},
        }
        if raw.get("trl"):
            block["grpo_config_resolved"] = raw["trl"][0]["ranks"][0]["notes"].get("grpo_config_resolved")
        for c in contenders:
            block["contenders"][c.name] = {
                "layout": f"{c.world}×{max(1, s.threads // c.world)}",
                **summarize(raw[c.name], s),
            }
        report["results"][dtype] = block
    report["load_average_1m_after"] = os.getloadavg()[0]
    first_cpu = next(iter(report["results"].values()))["cpu"]
    report["table"] = bench_line(first_cpu) + "\n" + format_table(report)
    print(report["table"])
    out = Path(a.out) if a.out else RESULTS / "grpo_vs_trl.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"written: {out}")
    return 0


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "peft", "trl", "accelerate")}


if __name__ == "__main__":
    sys.exit(main())
