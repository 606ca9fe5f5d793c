"""`shardtune plan` with context parallelism: a rank's activations and logits are its part of each row, plus the
row's gathered keys and values per block; the recommendation and the longest
sequence that fits try cp degrees; the traced step with cp; what the plan cannot do with cp is refused."""

from __future__ import annotations

import itertools
import json
import shlex
from dataclasses import replace

import pytest

from shardtune.commands.plan import main, make_plan
from shardtune.config.errors import ConfigError
from shardtune.planning import activations as act
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.known_configs import known_config
from shardtune.planning.recommend import longest_sequences
from shardtune.planning.report import category_comparison, trace_comparison
from tests.unit.test_plan_trace import BOUND

L8 = "meta-llama/Meta-Llama-3-8B"
L70 = "meta-llama/Llama-2-70b-hf"
RUN = shlex.split(
    "--use_peft_lora True --lora_target_modules all-linear --bf16 True --per_device_train_batch_size 1 "
    "--gradient_checkpointing True --num_processes 8"
)


def _plan(*flags: str):
    return make_plan(["--model_name_or_path", L8, *RUN, *flags])


def test_a_rank_holds_its_part_of_the_row_and_the_rows_gathered_keys_and_values():
    """cp=2 at 16384 positions is the estimate at 8192 positions per rank, plus per block the other half of the
    row's gathered keys and values (at the key heads' width): nothing else changes."""
    full = _plan("--max_seq_len", "16384", "--context_parallel_size", "2")
    half = _plan("--max_seq_len", "8192")
    shape, a = full.shape, 2
    gathered = act.context_parallel_bytes(shape, 1, 8192, 16384, a)
    assert gathered == 8192 * 2 * a * shape.kv_dim > 0
    # with gradient checkpointing one block's saved activations are live at the backward's peak
    got = full.estimate.device["activations"] - half.estimate.device["activations"]
    assert got == gathered
    for category in ("frozen base weights", "trainable weights", "gradients", "optimizer state"):
        assert full.estimate.device[category] == half.estimate.device[category]  # FSDP shards over all 8 either way
    assert full.estimate.device["logits and loss"] == half.estimate.device["logits and loss"]


def test_memory_per_rank_falls_with_cp_at_a_long_sequence():
    """At 32768 positions on 8 GPUs each doubling of cp lowers the activations per rank (by less than half: the
    gathered keys and values do not shrink)."""
    acts = [_plan("--max_seq_len", "32768", "--context_parallel_size", str(cp)).estimate.device["activations"]
            for cp in (1, 2, 4, 8)]  # fmt: skip
    assert all(b < a for a, b in itertools.pairwise(acts))
    assert all(b > a / 2 for a, b in itertools.pairwise(acts))


def test_the_recommendation_splits_rows_over_more_gpus_and_keeps_the_global_batch(capsys):
    argv = ["--model_name_or_path", L70, *RUN, "--max_seq_len", "32768", "--gpu_memory", "80"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "Smallest change that fits: context parallel size 2 (each row over 2 GPUs, same global batch)" in out
    assert "set --context_parallel_size 2, --gradient_accumulation_steps 2" in out
    fixed = make_plan([*argv, "--context_parallel_size", "2", "--gradient_accumulation_steps", "2"])
    assert fixed.estimate.fits(fixed.gpu_bytes)


def test_the_longest_sequence_that_fits_grows_with_cp(capsys):
    p = make_plan(["--model_name_or_path", L70, *RUN, "--gpu_memory", "80", "--longest_seq_len", "True"])
    assert sorted(p.longest) == [1, 2, 4, 8]
    lengths = [p.longest[cp] for cp in (1, 2, 4, 8)]
    assert all(b > a for a, b in itertools.pairwise(lengths)) and lengths[0] > 0
    for cp, n in p.longest.items():  # the longest fits, one more step of 2·cp·64 positions does not
        at = replace(p.inputs, context_parallel=cp)
        assert estimate_memory(p.shape, replace(at, seq_len=n)).total <= p.gpu_bytes
        assert estimate_memory(p.shape, replace(at, seq_len=n + 2 * cp * 64)).total > p.gpu_bytes
    assert longest_sequences(p.inputs, p.gpu_bytes, 8, p.shape) == p.longest


@pytest.mark.parametrize(
    ("flags", "want"),
    [(["--context_parallel_size", "3"], "--context_parallel_size 3: it must be a whole number ≥ 1 that divides the 8 processes."),
     (["--longest_seq_len", "True"], "--longest_seq_len needs --gpu_memory")],
)  # fmt: skip
def test_what_the_plan_cannot_do_with_cp_is_refused(flags, want):
    with pytest.raises(ConfigError, match=want.replace("(", r"\(").replace(")", r"\)")):
        _plan("--max_seq_len", "4096", *flags)


def test_the_traced_context_parallel_step_agrees_with_the_estimate(tmp_path):
    """`plan --trace` with cp runs rank 0's context-parallel step under fake tensors (its part of each row, the
    gathered keys and values, the all-gather's backward): each traced phase within the traced planner's bound
    (tests/unit/test_plan_trace.py's BOUND, 3%) of the estimate, and a block's backward below the cp=1 trace's by
    about the half of the row a rank no longer holds. A trace that ignored cp would keep cp=1's activations at
    the step's peak, 2.4x the estimate's."""
    cfg = {**known_config(L8), "num_hidden_layers": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    flags = shlex.split("--bf16 True --per_device_train_batch_size 1 --gradient_checkpointing True --use_peft_lora "
                        "True --lora_r 16 --lora_target_modules all-linear --num_processes 2 --max_length 4096 "
                        "--trace True")  # fmt: skip
    one, two = (make_plan(["--model_name_or_path", str(path), *flags, "--context_parallel_size", cp]) for cp in "12")
    for name, (got, est) in trace_comparison(two).items():
        assert abs(est - got) <= BOUND * got, f"{name}: traced {got / 2**20:.1f} MiB, estimate {est / 2**20:.1f}"
    # a block's backward: its recomputed activations and the backward's temporaries, per rank (measured 0.49x)
    block = [sum(p.trace.by_category("decoder-layer backward")[c] for c in ("activations", "temporaries"))
             for p in (one, two)]  # fmt: skip
    assert block[1] < 0.6 * block[0], block
    rows = category_comparison(two)
    assert abs(rows["activations"][0] - rows["activations"][1]) <= BOUND * rows["activations"][0]
