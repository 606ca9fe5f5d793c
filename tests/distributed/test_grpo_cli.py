"""`shardtune train --objective grpo` end to end from the command line, LoRA on the tiny Llama, fp32:

- 2 FSDP2 ranks with 4 completions per micro-batch train as 1 process with 8: the same rollouts (a seed per row), the
  same rewards and group advantages (a group's 4 completions spread over both ranks, normalised as one group), the
  same losses, gradient norms and trained adapter; off-policy steps (steps_per_generation 4 > accumulation 2: the
  old log-probs) and the KL to the adapter-disabled reference (beta 0.04) included;
- a run killed inside a generation batch on 2 ranks and resumed on 1 process from its checkpoint continues exactly: the
  generation batch, the data position and the policy version come back from the checkpoint;
- the same with QLoRA (the 4-bit base sampled from and, adapter disabled, the reference);
- planted: advantages normalised per rank (each rank's half of a group as if it were the group) make the 2-rank run
  differ from the 1-process one beyond the tolerance.

Tolerance (`tests.families.run_tolerance`): the runs differ only in how their sums are split; the GRPO loss is a
mean of advantage-weighted ratios of magnitude ~1, compared absolutely at that scale (a relative test of a loss
that is ~0 on-policy would be meaningless); grad_norm relatively; the adapter elementwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import _free_port, run_cli, train_records
from tests.distributed.test_preference_cli import FSDP_ENV
from tests.families import run_tolerance
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain

STEPS, LR, SEQ = 4, 5e-3, 24
REWARDS = '''
def even_tokens(completions, completion_ids, **kwargs):
    """The share of a completion's tokens with an even id: a dense, verifiable signal."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


def _data(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(4) for b in range(8)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


def _args(assets, data: Path, out: Path, *, per_device: int, **flags) -> list[str]:
    base = {
        "model_name_or_path": assets["model"],
        "dataset_name": data / "train.jsonl",
        "splits": "train",
        "objective": "grpo",
        "reward_funcs": f"{data / 'rewards.py'}:even_tokens,exact_answer",
        "reward_weights": "1.0,0.5",
        "num_generations": 4,
        "max_completion_length": 12,
        "temperature": 0.9,
        "beta": 0.04,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 4,
        "max_steps": STEPS,
        "learning_rate": LR,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "add_special_tokens": True,
        "seed": 5,
        "output_dir": out,
        "use_peft_lora": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": "all-linear",
    }
    return ["train", *(x for k, v in {**base, **flags}.items() for x in (f"--{k}", str(v)))]


PLANT = """
import sys
import shardtune.rl.rollout as rollout
real = rollout.group_advantages
# planted: each rank normalises its own half of every group (2 ranks, 4 generations)
rollout.group_advantages = lambda rewards, n, scale: real(rewards, n // 2, scale)
from shardtune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _torchrun_script(script: Path, args: list[str], nproc: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), str(script), *args]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **FSDP_ENV}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    data = _data(root / "data")
    out = {k: root / k for k in ("single", "sharded", "stopped", "planted")}
    run_cli(_args(tiny_assets, data, out["single"], per_device=8), nproc=1)
    run_cli(_args(tiny_assets, data, out["sharded"], per_device=4), nproc=2, env=FSDP_ENV)
    # checkpoints after every step; rank 0 killed after step 2, before its save: the run resumes from step 1
    kill = {**FSDP_ENV, "SHARDTUNE_FAULT": "step:2:0"}
    saving = {"save_strategy": "steps", "save_steps": 1}
    stopped = run_cli(_args(tiny_assets, data, out["stopped"], per_device=4, **saving), nproc=2, env=kill, check=False)
    resume = {"resume_from_checkpoint": "latest", **saving}
    resumed = run_cli(_args(tiny_assets, data, out["stopped"], per_device=8, **resume), nproc=1)
    script = root / "plant.py"
    script.write_text(PLANT)
    planted = _torchrun_script(script, _args(tiny_assets, data, out["planted"], per_device=4), nproc=2)
    assert planted.returncode == 0, planted.stderr[-3000:]
    return {**out, "stopped_rc": stopped.returncode, "resumed_log": resumed.stdout + resumed.stderr}


def _tolerance():
    step = decoder_chain(**TINY, seq=SEQ, vocab=TINY_VOCAB, tokens=16 * 12, backward=True)
    return run_tolerance(chain=STEPS * step, n=16 * 12, steps=STEPS, lr=LR)


def _by_step(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in train_records(out)}


def _differences(ref: Path, got: Path, steps) -> list[str]:
    t, want, have = _tolerance(), _by_step(ref), _by_step(got)
    bad = []
    for s in steps:
        for key, limit, scale in (("loss", t.loss, 1.0), ("grad_norm", t.grad_norm, abs(want[s]["grad_norm"]))):
            if not abs(have[s][key] - want[s][key]) <= limit * scale:
                bad.append(f"step {s} {key}: {have[s][key]!r} vs {want[s][key]!r}")
        if "reward" in want[s] and have[s].get("reward") != want[s]["reward"]:
            bad.append(f"step {s} reward: {have[s].get('reward')!r} vs {want[s]['reward']!r}")
    a, b = load_file(ref / "adapter_model.safetensors"), load_file(got / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        if not torch.allclose(b[name], a[name], rtol=t.rtol, atol=t.atol):
            bad.append(f"{name}: max |diff| {float((b[name] - a[name]).abs().max()):.3g}")
    return bad


def test_two_ranks_train_as_one_process(runs):
    records = _by_step(runs["single"])
    assert sorted(records) == list(range(1, STEPS + 1))
    first = records[1]
    for key in ("reward", "reward_std", "rewards/even_tokens/mean", "rewards/exact_answer_reward/mean", "kl",
                "completions/mean_length", "sync/probe_gap", "sampling/sampling_logp_difference/mean"):  # fmt: skip
        assert key in first, sorted(first)
    assert first["sync/probe_gap"] <= 1e-3 and first["sampling/sampling_logp_difference/mean"] <= 1e-4
    assert any(r["grad_norm"] > 0 for r in records.values())
    assert _differences(runs["single"], runs["sharded"], range(1, STEPS + 1)) == []


def test_stopped_inside_a_generation_on_two_ranks_resumes_on_one_process_exactly(runs):
    assert runs["stopped_rc"] != 0
    assert "at step 1" in runs["resumed_log"]
    assert sorted(_by_step(runs["stopped"])) == list(range(1, STEPS + 1))
    # step 2 trains on the generation batch sampled before the stop; steps 3-4 on one sampled after the resume
    assert _differences(runs["single"], runs["stopped"], range(2, STEPS + 1)) == []


QLORA = {
    "use_4bit_quantization": True, "use_nested_quant": True, "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_quant_storage_dtype": "float32", "bnb_4bit_compute_dtype": "float32",
}  # fmt: skip


@pytest.fixture(scope="module")
def qlora_runs(tiny_assets, tmp_path_factory):
    """QLoRA: the rollouts sample from the 4-bit base with the adapter, the reference is that base alone."""
    root = tmp_path_factory.mktemp("grpo_qlora")
    data = _data(root / "data")
    one, two = root / "single", root / "sharded"
    run_cli(_args(tiny_assets, data, one, per_device=8, **QLORA), nproc=1)
    run_cli(_args(tiny_assets, data, two, per_device=4, **QLORA), nproc=2, env=FSDP_ENV)
    return one, two


def test_qlora_two_ranks_train_as_one_process(qlora_runs):
    one, two = qlora_runs
    first = _by_step(one)[1]
    assert first["sync/probe_gap"] <= 1e-3 and first["kl"] >= 0.0
    assert _differences(one, two, range(1, STEPS + 1)) == []


def test_planted_per_rank_advantages_differ_from_one_process(runs):
    assert _differences(runs["single"], runs["planted"], range(1, STEPS + 1)) != []
