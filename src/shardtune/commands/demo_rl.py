"""`shardtune demo --objective grpo`: online RL with a checkable right answer, on the demo's tiny model.

GRPO from the demo's randomly initialised model gets no signal (its sampled answers are almost never a right
answer, so every group's rewards are equal and its advantages zero). So the demo does what practitioners do: a short
SFT stage on the facts, stopped while the sampled answers are only partly right, then GRPO continuing that adapter
(--adapter_path) with the built-in `exact_answer` reward against each prompt's `answer` column.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from shardtune.inference.load import load_for_chat
from shardtune.parallel import torchrun
from shardtune.rl.rewards import exact_answer_reward

# Measured on the demo's model (seed 100): after 36 SFT steps at 3e-3 about 0.25 of the sampled answers are right
# (70% of the greedy ones); 60 GRPO steps at 1e-3 take the sampled reward to ~0.8. 2e-3 and above first drop the
# reward to ~0.05 (the fully trained head moves too far per step); 28 SFT steps leave ~0.03 right, 56 ~0.6.
SFT_STEPS, SFT_LR = 36, 3e-3
GRPO_STEPS, GRPO_LR = 60, 1e-3
SFT_COPIES = 8  # each fact's copies in the SFT rows (448 rows: 14 steps an epoch at 32 rows a step)
WINDOW = 5  # steps averaged per point of the printed reward curve (one step's 8 prompts are a noisy sample)
EXAMPLES = 6  # questions printed with their answers before and after


def rl_facts(tables: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: 'The capital of France is' → 'Paris', from tables named by what they map to."""
    return [
        (f"The {kind} of {key} is", value) for kind, table in tables.items() for key, value in sorted(table.items())
    ]


def write_rl_datasets(out_dir: str | Path, facts: list[tuple[str, str]], seed: int = 0) -> dict[str, Path]:
    """`sft.jsonl` (prompt/completion rows, TRL's format: the loss on ' Paris.' and the EOS after it) and
    `prompts.jsonl` (prompt/answer rows: GRPO's prompts, the answer column reaching the reward function)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p, "completion": f" {a}."} for p, a in facts for _ in range(SFT_COPIES)]
    random.Random(seed).shuffle(rows)
    paths = {"sft": out / "sft.jsonl", "prompts": out / "prompts.jsonl"}
    paths["sft"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["prompts"].write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in facts))
    return paths


def _cli(flags: dict) -> list[str]:
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def sft_flags(model_dir: Path, data: Path, out: Path, steps: int) -> dict:
    """The warm start: plain-text prompt/completion rows, no chat template (no new tokens, so the adapter continues
    cleanly). The head is trained in full: with LoRA alone the random model's normalised last hidden state cannot
    make its logits peaked, and sampled answers stay noise whatever greedy decoding picks."""
    return {
        "seed": 100, "model_name_or_path": model_dir, "dataset_name": data, "splits": "train", "packing": False,
        "max_seq_len": 64, "max_steps": steps, "logging_steps": 6, "eval_strategy": "no", "save_strategy": "no",
        "learning_rate": SFT_LR, "lr_scheduler_type": "constant", "per_device_train_batch_size": 16,
        "use_peft_lora": True, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "lora_target_modules": "all-linear", "modules_to_save": "lm_head", "output_dir": out,
        "overwrite_output_dir": True,
    }  # fmt: skip


def grpo_flags(model_dir: Path, prompts: Path, adapter: Path, out: Path, steps: int) -> dict:
    """GRPO continuing the SFT adapter: 8 completions of at most 4 tokens per prompt (' New Delhi.' and its EOS),
    8 prompts a step over the 2 ranks, the reward logged every step."""
    return {
        "seed": 100, "model_name_or_path": model_dir, "dataset_name": prompts, "splits": "train",
        "objective": "grpo", "reward_funcs": "exact_answer", "num_generations": 8, "max_completion_length": 4,
        "per_device_train_batch_size": 32, "max_steps": steps, "logging_steps": 1, "eval_strategy": "no",
        "save_strategy": "no", "learning_rate": GRPO_LR, "lr_scheduler_type": "constant", "use_peft_lora": True,
        "adapter_path": adapter, "output_dir": out, "overwrite_output_dir": True,
    }  # fmt: skip


def greedy_answers(model_dir: Path, adapter: Path, prompts: list[str]) -> list[str]:
    """Each prompt's greedy completion (at most 4 tokens, up to the EOS) with base + adapter."""
    import torch

    model, tok = load_for_chat(str(model_dir), str(adapter))
    gen = {"do_sample": False, "max_new_tokens": 4, "temperature": None, "top_p": None, "top_k": None}
    gen |= {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids.to(model.device)
            new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)[0, ids.shape[1] :]
            out.append(tok.decode(new, skip_special_tokens=True))
    return out


def train_rewards(out: Path) -> list[tuple[int, float]]:
    """(step, mean right-answer reward of that step's completions) of each train record of metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["reward"]) for r in records if r.get("type") == "train" and "reward" in r]


def windows(values: list[float], size: int = WINDOW) -> list[float]:
    """Means of consecutive windows of `size` values (the last may be shorter)."""
    return [sum(values[i : i + size]) / len(values[i : i + size]) for i in range(0, len(values), size)]


def write_reward_plot(out: Path, rewards: list[tuple[int, float]]) -> Path:
    """`out/reward.png`: each step's mean reward and its running mean over WINDOW steps (loss.png shows GRPO's
    loss, which says little: it is ~0 by construction, the advantages being centred)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, values = zip(*rewards)
    trailing = (values[max(0, i - WINDOW + 1) : i + 1] for i in range(len(values)))
    smooth = [sum(w) / len(w) for w in trailing]
    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, values, color="tab:green", alpha=0.35, label="reward (right answer), per step")
    ax.plot(steps, smooth, color="tab:green", linewidth=2, label=f"mean of the last {WINDOW} steps")
    ax.set(xlabel="GRPO step", ylabel="mean reward", ylim=(0, 1), title="shardtune demo --objective grpo")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out / "reward.png"
    fig.savefig(path, format="png")
    return path


def grpo_demo(
    assets: dict[str, Path],
    root: Path,
    nproc: int,
    launch: Callable[[list[str], Path, int], int],
    tables: dict[str, dict[str, str]],
    sft_steps: int = SFT_STEPS,
    grpo_steps: int = GRPO_STEPS,
) -> int:
    """SFT briefly, then GRPO on the same facts with a right-answer reward; print the answers before and after and
    the reward curve. `launch` runs a torchrun command line with the demo's FSDP settings (demo._launch_train)."""
    facts = rl_facts(tables)
    data = write_rl_datasets(root / "rl-data", facts)
    sft_out, grpo_out = root / "output-sft", root / "output-grpo"
    print(f"Task: complete {len(facts)} facts ('{facts[0][0]}' → '{facts[0][1]}'); reward 1 when the answer is right.")
    for stage, flags in (
        ("SFT warm start", sft_flags(assets["model"], data["sft"], sft_out, sft_steps)),
        ("GRPO", grpo_flags(assets["model"], data["prompts"], sft_out, grpo_out, grpo_steps)),
    ):
        print(f"\n== {stage} ==", flush=True)
        cmd = torchrun.command(
            ["--standalone", "--nproc_per_node", str(nproc), "-m", "shardtune", "train", *_cli(flags)]
        )
        if (rc := launch(cmd, root, nproc)) != 0:
            return rc
    prompts = [p for p, _ in facts]
    answers = [a for _, a in facts]
    before, after = (greedy_answers(assets["model"], out, prompts) for out in (sft_out, grpo_out))
    _report(prompts, answers, before, after, grpo_out)
    return 0


def _report(prompts: list[str], answers: list[str], before: list[str], after: list[str], out: Path) -> None:
    """Print the greedy answers' score before and after GRPO, a few questions, and the reward curve."""
    right = [exact_answer_reward(x, answer=answers) for x in (before, after)]
    n_before, n_after = (int(sum(r)) for r in right)
    print(f"\nRight answers (greedy) of the {len(prompts)} prompts: after SFT {n_before}, after GRPO {n_after}")
    # The questions GRPO got right first, then those it got wrong, then the rest: the ones worth reading.
    order = sorted(range(len(prompts)), key=lambda i: right[0][i] - right[1][i])
    for i in order[:EXAMPLES]:
        print(f"\nQ: {prompts[i]} …  (right: {answers[i]!r})\n  after SFT:  {before[i]!r}\n  after GRPO: {after[i]!r}")
    rewards = train_rewards(out)
    curve = " → ".join(f"{r:.2f}" for r in windows([r for _, r in rewards]))
    print(f"\nReward (right answer, sampled), mean of each {WINDOW} steps: {curve}")
    try:
        print(f"Reward plot: {write_reward_plot(out, rewards)}")
    except ImportError:
        print("No reward plot: matplotlib is not installed (pip install 'shardtune[report]').")
    print(f"\nAdapter: {out}")
