"""`shardtune plan` with tensor parallelism (shardtune.parallel.tensor): each rank holds 1/tp of every block's linear
layers, FSDP shards the slices and the whole embeddings, norms and head over the world / tp ranks of a slice; a
rank computes 1/tp of each block's heads and MLP width, with the block's input and the residual stream whole; the
recommender proposes tp where it helps and never where training refuses it. The expected numbers are derived
here from a Llama-2-70B-shaped config (built locally, nothing downloaded), and each main check is shown to catch
a planted bug."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from shardtune.commands.plan import main, make_plan
from shardtune.config.errors import ConfigError
from shardtune.parallel.tensor import model_problems
from shardtune.planning import activations as act
from shardtune.planning import state as state_module
from shardtune.planning.buffers import state_and_buffers
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.fit import plan_shape
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import resolve_lora_targets
from shardtune.planning.recommend import candidates, recommend
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import (
    model_state_bytes_per_rank,
    run_tensors,
    tensor_parallel_slices,
)

H, LAYERS, HEADS, KV_HEADS, I, VOCAB = 8192, 80, 64, 8, 28672, 32000
HEAD_DIM = H // HEADS
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # q and o are Q wide; k and v KV wide
R, A = 16, 2  # LoRA rank; bf16
# One block's linear weights: q, k, v, o, gate, up, down (all sliced under tp), and its two norms (whole).
BLOCK_LINEAR = H * (Q + 2 * KV) + Q * H + 3 * H * I
BLOCK_NORMS = 2 * H
ROOT = 2 * VOCAB * H + H  # embeddings, head (untied), final norm: whole on every tp rank
# One block's LoRA factors (r x in and out x r): the side that tp slices, and the side it keeps whole
# (column-parallel q, k, v, gate, up: lora_A whole, lora_B sliced; row-parallel o, down: lora_A sliced, lora_B whole).
LORA_SLICED = R * (Q + 2 * KV + 2 * I) + R * (Q + I)
LORA_WHOLE = 5 * R * H + 2 * H * R
LORA = {"use_peft_lora": True, "lora_r": R, "lora_target_modules": "all-linear", "bf16": True}
ARGV = shlex.split(
    "--use_peft_lora True --lora_r 16 --lora_target_modules all-linear --bf16 True --per_device_train_batch_size 1 "
    "--gradient_checkpointing True"
)


def llama70_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        intermediate_size=I, vocab_size=VOCAB,
    )  # fmt: skip


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return plan_shape(llama70_config())  # the family's verified plan read off LlamaConfig


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama70")
    llama70_config().save_pretrained(folder)  # config.json only
    return str(folder)


def _frozen(shape: ModelShape, world: int, tp: int) -> int:
    return model_state_bytes_per_rank(shape, PlanInputs(world_size=world, tensor_parallel=tp, **LORA))["frozen"]


def _halves_the_sliced_share(shape: ModelShape) -> bool:
    """At 4 data-parallel ranks, tp=2 (8 GPUs) holds half of tp=1's (4 GPUs) share of the blocks' linear weights,
    and the same share of everything else: tp=1 less tp=2 is half of LAYERS x BLOCK_LINEAR / 4 in bf16."""
    sliced_share = LAYERS * BLOCK_LINEAR * A // 4
    return _frozen(shape, 4, 1) - _frozen(shape, 8, 2) == sliced_share // 2


def test_the_sliced_weights_per_rank_halve_at_tp_2_with_the_same_data_parallel_ranks(shape, monkeypatch):
    assert shape.tensor_parallel_plan and shape.block_extra_linear == shape.root_extra == 0
    assert _halves_the_sliced_share(shape)
    # the rest is each rank's 1/4 of the norms, embeddings and head, whole on the tp ranks
    assert _frozen(shape, 8, 2) == (LAYERS * (BLOCK_LINEAR // 2 + BLOCK_NORMS) + ROOT) * A // 4
    # LoRA: the sliced factors halve, the whole ones do not (fp32, 4 data-parallel ranks)
    lora = model_state_bytes_per_rank(shape, PlanInputs(world_size=8, tensor_parallel=2, **LORA))["trainable"]
    assert lora == LAYERS * (LORA_SLICED // 2 + LORA_WHOLE) * 4 // 4
    # planted bug: a planner that forgets to slice the layers holds tp=1's share at tp=2
    monkeypatch.setattr(state_module, "_tp_slice", lambda t, tp: t)
    assert not _halves_the_sliced_share(shape)


def test_fsdp_gathers_a_slice_of_each_block_and_its_whole_norms(shape):
    """The all-gathered block at tp=4: a quarter of its linear weights and of LoRA's sliced factors, its norms and
    LoRA's whole factors in full, all in the compute dtype."""
    inputs = PlanInputs(world_size=8, tensor_parallel=4, **LORA)
    tensors = tensor_parallel_slices(run_tensors(shape, inputs), 4)
    buffers = state_and_buffers(shape, tensors, inputs, 2, "FULL_SHARD")[1]
    assert buffers["block_gathered"] == A * (BLOCK_LINEAR // 4 + BLOCK_NORMS + LORA_SLICED // 4 + LORA_WHOLE)
    whole = state_and_buffers(shape, run_tensors(shape, inputs), inputs, 8, "FULL_SHARD")[1]
    assert whole["block_gathered"] == A * (BLOCK_LINEAR + BLOCK_NORMS + LORA_SLICED + LORA_WHOLE)


# Per token, what a block keeps for backward (flash attention, LoRA on all seven linears, no dropout): the part
# that follows the rank's heads and MLP width (q, k, v, the output and its fp32 logsumexp; gate, up, act(gate);
# down_proj's input, which its lora_A keeps), and the part that stays whole (the two norms' fp32 inputs and rsqrt,
# the hidden-wide input of q/k/v and of gate/up that their lora_A keep, LoRA's r-wide products).
INTERNAL = A * (2 * Q + 2 * KV) + 4 * HEADS + 3 * A * I + A * I
RESIDUAL = 2 * (4 * H + 4) + 2 * A * H + 7 * A * R


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_attention_and_mlp_activations_scale_with_tp_the_residual_does_not(shape, tp):
    rank = shape.tensor_parallel_rank(tp)
    targets = resolve_lora_targets(shape, "all-linear")
    layer = act.layer_saved_bytes_per_token(
        rank, seq_len=2048, compute_bytes=A, attn_implementation="flash_attention_2", lora_targets=targets, lora_r=R
    )
    assert layer == RESIDUAL + INTERNAL // tp
    assert act.kernel_attention_bytes(rank, A) * tp == act.kernel_attention_bytes(shape, A)
    assert act.forward_working_bytes_per_token(rank, A) * tp == act.forward_working_bytes_per_token(shape, A)
    # the block's input (kept by its checkpoint), the final norm and the head's input stay whole
    assert (rank.hidden_size, rank.vocab_size, rank.head_dim) == (H, VOCAB, HEAD_DIM)
    # the all-reduce buffers: two [tokens, hidden] in the compute dtype, none without tp
    assert act.tensor_parallel_buffer_bytes(rank, 2048, A, tp) == (2 * 2048 * H * A if tp > 1 else 0)


def _activations_fall_by_the_sliced_part(shape: ModelShape) -> bool:
    """Without checkpointing every block keeps LAYERS x tokens x layer bytes: at tp=4 on the same 8 GPUs a rank's
    activations (the table's flash row) fall by at least three quarters of INTERNAL for each block and token, and
    keep at least RESIDUAL for each."""
    tokens, flash = 2048, "flash_attention_2"
    run = {"world_size": 8, "seq_len": tokens, "gradient_checkpointing": False, "attn_implementation": flash, **LORA}
    tables = [estimate_memory(shape, PlanInputs(**run, tensor_parallel=tp)).activations_by_attention for tp in (1, 4)]
    one, four = (t[flash]["no checkpointing"] for t in tables)
    return one - four >= LAYERS * tokens * INTERNAL * 3 // 4 and four >= LAYERS * tokens * RESIDUAL


def test_a_ranks_activations_lose_the_sliced_terms_only(shape, monkeypatch):
    assert _activations_fall_by_the_sliced_part(shape)
    # planted bug: the activations of the whole block, as if each rank computed every head
    monkeypatch.setattr(ModelShape, "tensor_parallel_rank", lambda self, tp: self)
    assert not _activations_fall_by_the_sliced_part(shape)


def _tp4_costs_and_saves_what_is_derived(shape: ModelShape) -> bool:
    """tp=4 x dp=2 against tp=1 x dp=8 on 8 GPUs (batch 1 x 2048, checkpointing): the sliced layers are split 8
    ways either way, so the frozen base per rank rises by exactly the unsliced weights' share, 1/2 - 1/8 of them
    (norms, embeddings, head); the all-gathered blocks (at least two in flight, each three quarters smaller) fall
    by more than that, so the total falls."""
    run = {"world_size": 8, "seq_len": 2048, **LORA}
    one = estimate_memory(shape, PlanInputs(**run))
    four = estimate_memory(shape, PlanInputs(**run, tensor_parallel=4))
    unsliced = (LAYERS * BLOCK_NORMS + ROOT) * A
    rise = four.device["frozen base weights"] - one.device["frozen base weights"]
    gathers = one.device["FSDP all-gather buffers"] - four.device["FSDP all-gather buffers"]
    block = A * BLOCK_LINEAR
    return rise == unsliced // 2 - unsliced // 8 and gathers >= 2 * block * 3 // 4 > rise and four.total < one.total


def test_tp4_by_dp2_needs_less_per_rank_than_tp1_by_dp8(shape, monkeypatch):
    assert _tp4_costs_and_saves_what_is_derived(shape)
    monkeypatch.setattr(state_module, "_tp_slice", lambda t, tp: t)  # planted bug: the layers never sliced
    assert not _tp4_costs_and_saves_what_is_derived(shape)


def test_plan_refuses_tp_on_a_mixture_of_experts_with_the_setups_message(tmp_path):
    config = Qwen3MoeConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=1000,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    want = model_problems(config, 2)
    assert any("experts" in p for p in want)
    with pytest.raises(ConfigError) as e:
        make_plan(["--model_name_or_path", str(tmp_path), *ARGV, "--num_processes", "2", "--tensor_parallel_size", "2"])
    assert e.value.problems == want
    # the planner's own check, on the shape alone
    with pytest.raises(ValueError, match="tensor_parallel 2: qwen3_moe has no tensor-parallel plan"):
        estimate_memory(plan_shape(config), PlanInputs(world_size=2, tensor_parallel=2, **LORA))


def test_plan_prints_the_tp_degree_and_what_a_rank_holds(config_path, capsys):
    argv = ["--model_name_or_path", config_path, *ARGV, "--num_processes", "8", "--tensor_parallel_size", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 4 within each machine (2 data-parallel ranks x 1 cp x 4 tp)" in out
    assert "16 of 64 heads, 2 of 8 KV heads, 7168 of 28672 MLP width" in out
    assert "embeddings, norms and head whole on the tp ranks (sharded over the same 2)" in out


@pytest.mark.parametrize(
    ("flags", "want"),
    [("2 --use_4bit_quantization True", "--tensor_parallel_size 2 with a quantized base (QLoRA)"),
     ("2 --offload_params True", "--tensor_parallel_size 2 with fsdp_offload_params"),
     ("3", "--tensor_parallel_size 3: it must be a whole number ≥ 1 that divides the 8 processes of a machine"),
     ("2 --trace True", "--trace with --tensor_parallel_size 2: the traced step runs without tensor parallelism")],
)  # fmt: skip
def test_what_training_refuses_under_tp_is_one_line_and_exit_2(config_path, capsys, flags, want):
    argv = ["--model_name_or_path", config_path, *ARGV, "--num_processes", "8", "--tensor_parallel_size"]
    assert main([*argv, *flags.split()]) == 2
    err = capsys.readouterr().err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and want in problems[0], err


@pytest.fixture(scope="module")
def two_machines(config_path):
    """70B LoRA on 2 machines of 8 GPUs, rows of 1024: the all-gathered blocks, not the activations, make the peak,
    so splitting rows (cp) helps little and slicing the blocks (tp) much."""
    return make_plan(["--model_name_or_path", config_path, *ARGV, "--num_processes", "16", "--num_machines", "2",
                      "--max_seq_len", "1024", "--frozen_base", "sharded"])  # fmt: skip


def _at(p, **change) -> int:
    return estimate_memory(p.shape, replace(p.inputs, **change)).total


def test_recommends_the_smallest_tp_that_fits_when_nothing_before_it_does(two_machines, capsys):
    p = two_machines
    tp2, tp4 = _at(p, tensor_parallel=2, grad_accum=2), _at(p, tensor_parallel=4, grad_accum=4)
    budget = (tp2 + tp4) // 2
    assert tp4 < budget < tp2 < p.estimate.total
    assert all(_at(p, context_parallel=cp, grad_accum=cp) > budget for cp in (2, 4, 8, 16))  # tried before tp
    rec = recommend(p.inputs, budget, 1, model=p.shape)
    assert rec.fits and rec.flags == {"tensor_parallel_size": 4, "gradient_accumulation_steps": 4}
    argv = ["--model_name_or_path", p.name, *ARGV, "--num_processes", "16", "--num_machines", "2",
            "--max_seq_len", "1024", "--frozen_base", "sharded", "--gpu_memory", f"{budget}B"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "Smallest change that fits: tensor parallel size 4" in out
    assert "set --tensor_parallel_size 4, --gradient_accumulation_steps 4" in out


def test_never_recommends_tp_for_qlora_a_family_without_the_plan_or_with_cp(two_machines):
    p = two_machines
    budget = _at(p, tensor_parallel=4, grad_accum=4)  # tp 4 fits, as above
    for inputs, shape in [
        (replace(p.inputs, use_4bit=True), p.shape),
        (p.inputs, replace(p.shape, tensor_parallel_plan=False)),
        (replace(p.inputs, context_parallel=2), p.shape),
    ]:
        rec = recommend(inputs, budget, 1, model=shape)
        assert "tensor_parallel_size" not in rec.flags, rec.description
    for settings in ({"use_4bit": True}, {"rows_per_example": 2}, {"offload": True}, {"context_parallel": 2}):
        tried = [change for _, _, change in candidates(replace(p.inputs, **settings), 1)]
        assert not any("tensor_parallel" in change for change in tried), settings
    # the sft run's candidates are runs the planner accepts, tp among them
    tried = [change for _, _, change in candidates(p.inputs, 1)]
    assert [c["tensor_parallel"] for c in tried if "tensor_parallel" in c][:3] == [2, 4, 8]
    for change in tried:
        estimate_memory(p.shape, replace(p.inputs, **change))
    with pytest.raises(ValueError, match="quantized"):  # the estimate refuses what training refuses
        estimate_memory(p.shape, replace(p.inputs, tensor_parallel=2, use_4bit=True))


def test_a_run_near_the_limit_is_shown_the_tp_that_restores_the_margin(two_machines, capsys):
    p = two_machines
    budget = int(p.estimate.total / 0.95)  # fits, 5% left: within the planner's 13% error
    argv = ["--model_name_or_path", p.name, *ARGV, "--num_processes", "16", "--num_machines", "2",
            "--max_seq_len", "1024", "--frozen_base", "sharded", "--gpu_memory", f"{budget}B"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Fits (estimate)" in out and "Near the limit" in out
    assert "set --tensor_parallel_size 2, --gradient_accumulation_steps 2" in out
