"""`shardtune plan --trace`: shardtune's own step run under fake tensors, against the estimate and a real run.

The traced configs are the published Llama-2-7B (multi-head attention) and Llama-3-8B (grouped-query attention,
128k vocabulary) configs cut to two decoder blocks. Under fake tensors an op costs Python dispatch time, not
its size, so real widths are cheap; the layer count is what costs. Two blocks keep every per-block term (each
block is sharded, gathered, checkpointed and recomputed alike, and the estimate multiplies one block's terms by
L) and the root's (embeddings, head, loss), so what holds at two blocks holds at 32 or 80 for the per-block
terms; the CLI test traces one 80-block config end to end only for the table, not for numbers.
"""

from __future__ import annotations

import json
import shlex
import socket
from dataclasses import replace

import pytest
import torch

from shardtune.commands.plan import format_plan, format_trace, main, make_plan
from shardtune.objectives.heads import token_loss
from shardtune.planning import activations, estimate_memory, model_state_bytes_per_rank
from shardtune.planning.known_configs import known_config
from shardtune.planning.phases import LAYER
from shardtune.planning.report import category_comparison, trace_comparison, traced_estimate, traced_run_inputs

L7 = "meta-llama/Llama-2-7b-hf"
L8 = "meta-llama/Meta-Llama-3-8B"
_FULL = shlex.split("--bf16 True --max_length 1024 --per_device_train_batch_size 2 --gradient_checkpointing True")
_LORA = [*_FULL, *shlex.split("--use_peft_lora True --lora_r 16 --lora_dropout 0 --lora_target_modules all-linear")]
_QLORA = shlex.split("--use_4bit_quantization True --use_nested_quant True --bnb_4bit_quant_storage_dtype bfloat16")
_REPLICATED = shlex.split("--frozen_base replicated --modules_to_save lm_head")
CASES = {
    "dense LoRA, 2 ranks": (L7, [*_LORA, "--num_processes", "2"]),
    "GQA LoRA, 1 rank": (L8, [*_LORA, "--num_processes", "1"]),
    # the same with Llama-2's 1024-position loss chunks, four times the run's for this vocabulary: the loss peaks
    "GQA LoRA, 1 rank, 1024-position loss chunks": (
        L8,
        [*_LORA, "--num_processes", "1", "--loss_chunk_tokens", "1024"],
    ),
    "GQA LoRA, 8 ranks": (L8, [*_LORA, "--num_processes", "8"]),
    "DoRA, 2 ranks": (L7, [*_LORA, "--use_dora", "True", "--num_processes", "2"]),
    "QLoRA, 2 ranks, 2 micro-batches": (
        L8,
        [*_LORA, *_QLORA, "--num_processes", "2", "--gradient_accumulation_steps", "2"],
    ),
    "full fine-tuning, 8 ranks": (L8, [*_FULL, "--num_processes", "8"]),
    # LoRA dropout on every linear: a block's recomputation peaks at down_proj's dropout (on CPU, FastDropout's
    # mask drawing), above its backward; with four blocks the step peaks in the second block to run backward (one
    # block's gradient shards and the first one's fp32 reduce-scatter input outweigh one stored hidden state)
    "LoRA r=64 with dropout, 4 blocks, 2 ranks": (
        L7,
        [*_LORA, "--lora_r", "64", "--lora_dropout", "0.1", "--per_device_train_batch_size", "1"]
        + ["--max_length", "2048", "--num_processes", "2"],
    ),
}


# The frozen base left out of FSDP: whole on every rank, only the adapters gathered (the head trained in full
# gives the root module parameters of its own, without which FSDP2's tracker has no root to follow). Their state
# is checked byte for byte; their peaks are not held to BOUND: the traced loss backward holds 115 MiB (3.7%) more
# than the estimate on the LoRA case, not yet modelled (docs/plan.md, "The frozen base").
REPLICATED = {
    "LoRA, frozen base replicated, 2 ranks": (L7, [*_LORA, *_REPLICATED, "--num_processes", "2"]),
    "QLoRA, frozen base replicated, 2 ranks": (L8, [*_LORA, *_QLORA, *_REPLICATED, "--num_processes", "2"]),
}


def _config_file(tmp_path_factory, name: str, layers: int = 2) -> str:
    cfg = {**known_config(name), "num_hidden_layers": layers}
    path = tmp_path_factory.mktemp("configs") / f"{name.split('/')[-1]}-{layers}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _layers(case: str) -> int:
    return 4 if "4 blocks" in case else 2


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> dict:
    """One traced plan per case (each a few seconds of fake dispatch)."""
    every = {**CASES, **REPLICATED}
    files = {(m, _layers(c)): _config_file(tmp_path_factory, m, _layers(c)) for c, (m, _) in every.items()}
    return {
        case: make_plan(["--model_name_or_path", files[model, _layers(case)], *flags, "--trace", "True"])
        for case, (model, flags) in every.items()
    }


def _assert_state_equals_planner(p) -> dict:
    """Rank 0's traced parameter shards (frozen, trainable) and optimizer states equal the planner's count for the
    same run's inputs."""
    est = model_state_bytes_per_rank(p.shape, p.inputs, rank=0)
    held = p.trace.state
    assert (held["frozen"], held["trainable"], held["optimizer"]) == (est["frozen"], est["trainable"], est["optimizer"])
    return est


@pytest.mark.parametrize("case", [*CASES, *REPLICATED])
def test_traced_model_state_equals_planner(traced, case):
    """Rank 0's parameter shards (frozen, trainable) and AdamW states after the traced steps are byte for byte
    what the planner counts, for every method and world size."""
    p = traced[case]
    est = _assert_state_equals_planner(p)
    # and the traced peak holds them: every sharded parameter and state is alive throughout the step
    by_type = p.trace.peak_by_type
    assert by_type["Sharded Param"] == est["frozen"] + est["trainable"]
    # plus AdamW's step counters: one 0-dim fp32 tensor per trainable tensor, which the planner leaves out (on a
    # GPU, torch's non-fused AdamW keeps them on the host)
    assert by_type["OptState"] - est["optimizer"] == 4 * p.trace.state["trainable_tensors"]


# The bound the estimate is held to (issue #18's acceptance). Measured residuals of these configs are under 0.5%
# (docs/plan.md, "Per category"), but for full fine-tuning's loss backward (not its peak; see below).
BOUND = 0.03


def _left_out(p) -> int:
    """What the estimate leaves out of the activations, derived from the code: the loss's target selection (a
    bool mask over the tokens and the selected int64 labels, 9 bytes per token) and 0-dim tensors (the loss, its
    chunks' partial sums, the token count, the gradient norm: fewer than 16, each at most one 512-byte block)."""
    tokens = p.inputs.batch_size * p.inputs.rows_per_example * p.inputs.seq_len
    return 9 * tokens + 16 * 512


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_within_3_percent_of_traced_peaks(traced, case):
    """Each traced peak (the root's forward, the blocks' backward, the root's backward, the whole step) against
    the estimate's phases that happen there."""
    rows = trace_comparison(traced[case])
    if case.startswith("full"):
        # Full fine-tuning's loss backward also holds the head's weight gradient while each chunk adds to it,
        # which the estimate does not model; that phase is not its peak (the root's reduce-scatter is).
        rows.pop("backward")
    for name, (got, est) in rows.items():
        assert abs(est - got) <= BOUND * got, (
            f"{case}, {name}: traced {got / 2**20:.1f} MiB, estimate {est / 2**20:.1f}"
        )


def _assert_categories(p, case: str) -> None:
    """Each category at the step's traced peak within BOUND of itself; a category under 1% of the peak (a few
    MiB of inputs, or none) within the derived absolute term of what the estimate leaves out (_left_out)."""
    rows = category_comparison(p)
    peak = p.trace.peak_total
    # every byte the tracker saw at the peak is filed once; the filing reads the storages' sizes when the op that
    # set the peak returns, and that op's small scratch storages may differ by then (measured: at most 512 bytes)
    assert abs(sum(p.trace.step_by_identity.values()) - peak) <= 4096
    # the trace allocates each 4-bit layer its own code tables (nf4's 16 entries, the nested 256, fp32), which the
    # estimate leaves out: 2 blocks x 7 linears
    codes = 2 * 7 * (16 + 256) * 4 if "QLoRA" in case else 0
    assert rows["parameters"][0] - rows["parameters"][1] == codes
    assert rows["optimizer states"][0] == rows["optimizer states"][1]
    for name, (got, est) in rows.items():
        bound = BOUND * got if got >= 0.01 * peak else _left_out(p)
        if name == "gradients" and traced_estimate(p).peak_phase == LAYER:
            # a block's backward peaks (the run's 256-position loss chunks for a 128k vocabulary): the gradients of
            # the adapters already through that block's backward, which the estimate leaves out (0.56 MiB of a
            # 5.7 GiB peak on the 1-rank GQA case, inside the phase's BOUND): at most one block's trainable
            # parameters, in fp32
            bound += p.trace.state["trainable"] // p.shape.num_layers
        assert abs(est - got) <= bound, f"{case}, {name}: traced {got / 2**20:.2f} MiB, estimate {est / 2**20:.2f}"


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_per_category_at_the_traced_step_peak(traced, case):
    """At the step's traced peak, each category (storages filed by what they are, not by the phase that made
    them) against the estimate's rows at its peak phase: parameters (shards, gathered copies, all-gather buffers,
    quantization constants) and optimizer states byte for byte; gradients, activations (made in forward, and the
    inputs) and temporaries (made in backward: a block's recomputation and backward, the loss's backward) each
    within the bound of itself. The peaks differ: forward all-gathers (dense and GQA LoRA on 2 and 8 ranks,
    QLoRA's second micro-batch), the loss's backward (1 rank), a block's recomputation (DoRA), the root's
    reduce-scatter (full fine-tuning)."""
    _assert_categories(traced[case], case)


def test_identity_filing_moves_what_the_tracker_files_by_phase(traced):
    """The tracker files by the phase that allocated: at the 8-rank forward peak (inside the first block's
    all-gather copy-out) the block's gathered weights are "Activation"; at full fine-tuning's peak (inside the
    root's reduce) the fp32 reduce-scatter input is "Temp", twice the bf16 unsharded root gradients."""
    fwd = traced["GQA LoRA, 8 ranks"].trace
    moved = fwd.peak_by_category["activations"] - fwd.step_by_identity["activations"]
    assert moved > 300 * 2**20  # about one block's gathered weights
    by_identity = fwd.step_by_identity["parameters"] + fwd.step_by_identity["buffers"]
    assert by_identity - fwd.peak_by_category["parameters"] == moved
    full = traced["full fine-tuning, 8 ranks"].trace
    tags = full.peak_by_type
    assert tags["Temp"] == 2 * tags["Unsharded Grad"] > 0
    assert full.step_by_identity["gradients"] == tags["Sharded Grad"] + tags["Unsharded Grad"] + tags["Temp"]
    assert full.step_by_identity["temporaries"] == 0


def test_traced_phases_name_the_peak(traced):
    """The phase the estimate reports as the peak is where the trace peaks (different phases across the cases)."""
    got = {case: traced[case].estimate.peak_phase for case in CASES}
    assert got["GQA LoRA, 8 ranks"] == "forward (first block's all-gather)"  # 128k-vocabulary root gathered twice
    # one rank: no flat all-gather copies; the run's 256-position loss chunks (2**25 logits) put the peak in a
    # block's backward, 1024-position ones in the loss's
    assert got["GQA LoRA, 1 rank"] == "decoder-layer backward"
    assert got["GQA LoRA, 1 rank, 1024-position loss chunks"] == "loss backward"
    assert got["full fine-tuning, 8 ranks"].startswith("root backward")
    assert got["DoRA, 2 ranks"] == got["LoRA r=64 with dropout, 4 blocks, 2 ranks"] == "decoder-layer backward"
    # the second block to run backward: one block's gradient shards (fp32, r=64 on 7 linears, half per rank) and
    # the first block's fp32 reduce-scatter input (the whole block's) at the traced step peak
    p = traced["LoRA r=64 with dropout, 4 blocks, 2 ranks"]
    shard = p.trace.state["trainable"] // 4
    assert p.trace.step_by_identity["gradients"] == shard + 2 * shard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_state_bytes(cfg, n_tokens: int, monkeypatch) -> dict[str, int]:
    """A real 1-rank shardtune build (gloo) of the tiny model, one real step, then the bytes it holds."""
    from shardtune.models.builder import model_spec
    from shardtune.parallel.fsdp import local_state_bytes
    from shardtune.parallel.mesh import init_distributed, shutdown
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.training.optimizers import build_optimizer

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    info = init_distributed()
    try:
        model = build_sharded_model(model_spec(cfg, info.device.type, n_tokens, []), info)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = build_optimizer(named, optim="adamw_torch", lr=1e-4, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        ids = torch.randint(0, n_tokens, (2, 16))
        loss, _ = model(input_ids=ids, position_ids=torch.arange(16).expand(2, 16), labels=ids, head=token_loss)
        loss.backward()
        opt.step()
        held = local_state_bytes(model)
        held["optimizer"] = sum(
            (v.to_local() if hasattr(v, "to_local") else v).nbytes
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
        return held
    finally:
        shutdown()


@pytest.mark.parametrize("method", ["lora", "full"])
def test_traced_model_state_equals_real_run(tiny_assets, monkeypatch, method):
    """On CPU the trace holds exactly the bytes a real shardtune run holds: parameters and optimizer states."""
    flags = ["--model_name_or_path", str(tiny_assets["model"]), "--bf16", "True", "--max_length", "16"]
    flags += ["--use_peft_lora", "True", "--lora_r", "4"] if method == "lora" else []
    p = make_plan([*flags, "--num_processes", "1", "--trace", "True"])
    real = _real_state_bytes(p.run, int(p.config.vocab_size), monkeypatch)
    assert real == {k: p.trace.state[k] for k in ("trainable", "frozen", "optimizer")}
    assert real["trainable"] > 0 and real["optimizer"] == 2 * real["trainable"]


def test_cli_prints_traced_beside_estimate(traced, tmp_path_factory, capsys):
    path = _config_file(tmp_path_factory, L7, layers=2)
    rc = main(["--model_name_or_path", path, *_LORA, "--num_processes", "2", "--trace", "True", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    trace = out["trace"]
    assert set(trace["peaks"]) == {"forward", "decoder-layer backward", "backward", "step"}
    step = trace["peaks"]["step"]
    assert abs(step["estimate"] - step["traced"]) <= BOUND * step["traced"]
    assert step["traced"] == sum(trace["step_by_tracker_tag"].values())
    # the planner counts what a GPU holds; AdamW's step counters (4 bytes per tensor) stay on the host there, so
    # the per-category comparison leaves them out of the traced optimizer states
    held = trace["state"]
    assert trace["step_by_tracker_tag"]["optimizer states"] - held["optimizer"] == 4 * 2 * 7 * 2  # 2 blocks x 7 x A, B
    assert trace["step_by_category"]["optimizer states"] == {"traced": held["optimizer"], "estimate": held["optimizer"]}
    # the same run as the fixture's: the table prints those numbers
    p = traced["dense LoRA, 2 ranks"]
    assert p.trace.peak_total == step["traced"]
    text = format_plan(p) + format_trace(p)
    assert "Traced step (rank 0 of 2, fake tensors on cpu" in text and "traced GiB   estimate GiB" in text
    assert f"  step                            {step['traced'] / 2**30:8.2f}" in text
    assert "Step peak by category              traced GiB   estimate GiB" in text


def test_trace_refuses_what_cannot_run_under_fake_tensors(tmp_path_factory, capsys):
    path = _config_file(tmp_path_factory, L7, layers=2)
    rc = main(["--model_name_or_path", path, *_LORA, "--optim", "adamw_8bit", "--trace", "True"])
    assert rc == 2
    assert "--trace with --optim adamw_8bit" in capsys.readouterr().err


# Mixtral-8x7B's published config.json (mistralai/Mixtral-8x7B-v0.1), cut to two blocks as above.
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


def test_mixture_of_experts_traced_against_estimate(tmp_path):
    """Mixtral-shaped, LoRA all-linear on 2 ranks: all-linear wraps the attention only (the experts are fused
    3-D parameters, not nn.Linear); the model state is exact. At batch 2 the peak is the second block's all-gather
    (a block of eight experts outweighs the root); at batch 8 it is a block's backward, where the routing and the
    experts' recomputed activations and backward working memory (transformers' grouped_mm experts) are the
    temporaries: every phase and every category within the bound."""
    path = tmp_path / "mixtral-2.json"
    path.write_text(json.dumps(MIXTRAL))
    for batch, phase in (("2", "forward (a later block's all-gather)"), ("8", "decoder-layer backward")):
        flags = [*_LORA, "--per_device_train_batch_size", batch, "--num_processes", "2", "--trace", "True"]
        flags += ["--loss_chunk_tokens", "1024"]
        p = make_plan(["--model_name_or_path", str(path), *flags])
        # the experts' and router's tensors account for every parameter of the model class (counted on meta)
        assert p.shape.extra_params == 0 and p.shape.num_experts == 8 and p.shape.experts_per_token == 2
        _assert_state_equals_planner(p)
        held = p.trace.state
        assert held["trainable_tensors"] == 2 * 4 * 2  # 2 blocks x q, k, v, o x lora_A, lora_B
        assert p.estimate.peak_phase == phase
        for name, (got, estimated) in trace_comparison(p).items():
            assert abs(estimated - got) <= BOUND * got, (batch, name)
        _assert_categories(p, f"Mixtral LoRA, batch {batch}")
    # at batch 8 the temporaries are most of the activations' memory: the experts' part is on the peak
    assert category_comparison(p)["temporaries"][0] > 3 * 2**30
    assert any(n.startswith("mixture of experts") for n in p.estimate.notes)


# Qwen2-57B-A14B's widths cut to two blocks and eight experts: a shared expert (20480 wide, wider than the two
# routed copies a token takes together) run on every token beside the routed ones, and q/k/v biases.
QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}


def test_shared_expert_traced_against_estimate(tmp_path):
    """Qwen2-MoE-shaped, LoRA all-linear on 2 ranks (all-linear wraps the shared expert's linears here): the
    shared expert's weights and its activations are planned, and the parameters beyond the layout (its gate, the
    biases) held. The state equals the trace's up to those extras' sharding (held as one flat tensor per kind,
    chunked unlike the real tensors: less than their own bytes apart); every phase within the bound at batch 2
    (the peak is the second block's all-gather) and 8 (a block's backward). Planted: the shape without the shared
    expert and the extras (as it was read before): rank 0's frozen weights fall short by a fifth and more."""
    path = tmp_path / "qwen2-moe-2.json"
    path.write_text(json.dumps(QWEN2_MOE))
    for batch in ("2", "8"):
        flags = [*_LORA, "--per_device_train_batch_size", batch, "--num_processes", "2", "--trace", "True"]
        flags += ["--loss_chunk_tokens", "1024"]
        p = make_plan(["--model_name_or_path", str(path), *flags])
        est, held = model_state_bytes_per_rank(p.shape, p.inputs, rank=0), p.trace.state
        extras = p.shape.num_layers * (p.shape.block_extra_linear + p.shape.block_extra_other) * 2  # bf16
        assert 0 < extras and abs(held["frozen"] - est["frozen"]) < extras
        assert (held["trainable"], held["optimizer"]) == (est["trainable"], est["optimizer"])
        for name, (got, estimated) in trace_comparison(p).items():
            assert abs(estimated - got) <= BOUND * got, (batch, name)
    planted = replace(p.shape, shared_expert_intermediate_size=0, block_extra_linear=0, block_extra_other=0)
    assert held["frozen"] - model_state_bytes_per_rank(planted, p.inputs, rank=0)["frozen"] > 0.2 * held["frozen"]


# DeepSeek-V2-Lite's widths, 3 blocks (the first dense) and 8 of its 64 experts. Its value heads are 128 wide
# beside 192-wide query heads; here 192: CPU's fused SDPA kernel needs equal widths (else the math kernel runs,
# which a GPU's memory-efficient kernel does not: the trace notes it), and the estimate's attention terms are the
# same function of each width either way.
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 192,
    "vocab_size": 102400,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
}


def test_latent_attention_and_narrow_experts_traced_against_estimate(tmp_path, monkeypatch):
    """DeepSeek-V2-Lite-shaped, LoRA all-linear on 2 ranks: multi-latent attention's widths (the latents, their
    norms, keys expanded to every head, values that keep kv_b_proj's output) and the combine of 6 narrow experts
    (fp32 routing weights: three k·h-wide fp32 gradients, above the experts' own) are planned: every phase within
    the bound at batch 2 and 8. Planted, each alone: the attention read as Llama's of the rotary width (as before),
    or the combine left out: the traced step at batch 8 is above the estimate by more than the bound. With the
    published 128-wide value heads the trace notes CPU's math kernel. With 1024-position loss chunks (not the
    run's 320 for this vocabulary), so that the loss, not the first block's all-gather, is the step's peak: the
    planner's blocks are the mean of the dense first block and the MoE ones, which over-counts the first block's
    gathered copies by 3.4% of that phase at batch 2 (docs/plan.md, "Known gaps")."""
    path = tmp_path / "deepseek-v2-lite-3.json"
    path.write_text(json.dumps(DEEPSEEK_V2_LITE))
    for batch in ("2", "8"):
        flags = [*_LORA, "--per_device_train_batch_size", batch, "--num_processes", "2", "--trace", "True"]
        flags += ["--loss_chunk_tokens", "1024"]
        p = make_plan(["--model_name_or_path", str(path), *flags])
        assert p.shape.latent_attention and p.shape.routing_weight_bytes == 4
        for name, (got, estimated) in trace_comparison(p).items():
            assert abs(estimated - got) <= BOUND * got, (batch, name, got, estimated)
    got, inputs = p.trace.peaks["step"]["Total"], traced_run_inputs(p.inputs, p.trace.device)
    llama_like = replace(p.shape, kv_lora_rank=0, q_lora_rank=0)
    assert estimate_memory(llama_like, inputs).allocated < (1 - BOUND) * got
    monkeypatch.setattr(activations, "routed_combine_bytes", lambda *a: (0, 0))
    assert estimate_memory(p.shape, inputs).allocated < (1 - BOUND) * got
    monkeypatch.undo()
    path.write_text(json.dumps({**DEEPSEEK_V2_LITE, "v_head_dim": 128, "num_hidden_layers": 1}))
    narrow = make_plan(["--model_name_or_path", str(path), *_LORA, "--num_processes", "2", "--trace", "True"])
    assert any("math kernel" in n for n in narrow.trace.notes)


# Gemma-3-12B's widths, two blocks: per-head query and key norms, and a norm after the attention and after the MLP.
GEMMA3 = {
    "model_type": "gemma3_text",
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "num_hidden_layers": 2,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06,
    "sliding_window": 1024,
    "query_pre_attn_scalar": 256,
}


def test_further_norms_traced_against_estimate(tmp_path):
    """Gemma-3-shaped at batch 8, LoRA all-linear on 2 ranks: the norms beyond the layout's two (read off the class
    on meta) keep their fp32 inputs; every phase within the bound. Planted: those norms not read (as before), the
    blocks' backward is short by more than the bound (7.9% measured)."""
    path = tmp_path / "gemma3-2.json"
    path.write_text(json.dumps(GEMMA3))
    flags = [*_LORA, "--per_device_train_batch_size", "8", "--num_processes", "2", "--trace", "True"]
    p = make_plan(["--model_name_or_path", str(path), *flags])
    assert len(p.shape.extra_norms) == 4
    for name, (got, estimated) in trace_comparison(p).items():
        assert abs(estimated - got) <= BOUND * got, (name, got, estimated)
    inputs = traced_run_inputs(p.inputs, p.trace.device)
    planted = estimate_memory(replace(p.shape, extra_norms=()), inputs).phase_bytes["decoder-layer backward"]
    assert planted < (1 - BOUND) * p.trace.peaks["decoder-layer backward"]["Total"]


def test_expert_lora_and_full_fine_tuning_of_experts_traced_against_estimate(tmp_path):
    """Mixtral-shaped on 2 ranks, gradient checkpointing. Expert LoRA (--lora_target_experts): the state is exact
    (the expert factors, A (r·E, in) and B (out, r·E), fp32 with AdamW's states), and the step peaks in a block's
    backward, where PEFT keeps the block's merged expert copy (W + s·B·A, about 2.6 GiB here) and the gradient of
    one merged tensor: within the bound at batch 2 and 8. Full fine-tuning of the experts: the state is exact; the
    estimate of the peak (a block's reduce-scatter) is above the trace, by 7.1% measured, held here to 8%: the
    unsharded expert gradients are planned as living longer than FSDP2 keeps them (docs/moe.md)."""
    path = tmp_path / "mixtral-2.json"
    path.write_text(json.dumps(MIXTRAL))
    experts = [*_LORA, "--lora_target_experts", "True", "--num_processes", "2", "--trace", "True"]
    for batch in ("2", "8"):
        p = make_plan(["--model_name_or_path", str(path), *experts, "--per_device_train_batch_size", batch])
        _assert_state_equals_planner(p)
        assert p.trace.state["trainable_tensors"] == 2 * (4 + 2) * 2  # 2 blocks x (q, k, v, o, 2 expert tensors) x A, B
        assert p.estimate.peak_phase == "decoder-layer backward"
        got, estimated = trace_comparison(p)["step"]
        assert abs(estimated - got) <= BOUND * got, (batch, got, estimated)
    full = make_plan(["--model_name_or_path", str(path), *_FULL, "--num_processes", "2", "--trace", "True"])
    _assert_state_equals_planner(full)
    got, estimated = trace_comparison(full)["step"]
    assert got <= estimated <= 1.08 * got, (got, estimated)


def test_4bit_experts_traced_against_estimate(tmp_path):
    """QLoRA on Mixtral-shaped experts, 2 ranks: each expert packed on its own (E, packed) with its own state,
    the state exact; the experts run one at a time (models.quant_experts), so the forward and backward hold one
    expert's routed copies and one dequantized expert matrix, not grouped_mm's all; expert LoRA on them merges no
    copy (each expert's input and r-wide product kept instead): every phase within the bound at batch 2 and 8, with
    and without expert LoRA. The 4-bit experts take the frozen base to under a third of its bf16 bytes."""
    path = tmp_path / "mixtral-2.json"
    path.write_text(json.dumps(MIXTRAL))
    flags = [*_LORA, *_QLORA, "--num_processes", "2", "--trace", "True"]
    for batch, experts in (("2", []), ("8", []), ("2", ["--lora_target_experts", "True"]),
                           ("8", ["--lora_target_experts", "True"])):  # fmt: skip
        p = make_plan(["--model_name_or_path", str(path), *flags, *experts, "--per_device_train_batch_size", batch])
        _assert_state_equals_planner(p)
        assert p.estimate.peak_phase == "decoder-layer backward"
        for name, (got, estimated) in trace_comparison(p).items():
            assert abs(estimated - got) <= BOUND * got, (batch, experts, name, got, estimated)
    bf16 = make_plan(["--model_name_or_path", str(path), *_LORA, *experts, "--num_processes", "2"])
    frozen = [plan.estimate.device["frozen base weights"] for plan in (p, bf16)]
    assert frozen[0] < frozen[1] / 3, frozen


def test_allocator_replay_of_the_traced_history(traced):
    """The recorder sees what FSDP2's tracker sees: the replayed history's largest sum of requested bytes is the
    traced step peak, to the byte. FSDP2's forward all-gather outputs are cached on their own stream as the
    estimate derives it (planning.phases.forward_gather_cache), within 2% (where the small casts' blocks go). Expandable segments never reserve more than the default allocator."""
    for case, p in traced.items():  # the replicated cases too: the recorder against the tracker
        t = p.trace
        # The replay's history is steps 1-2, the tracker's step 3. With 4-bit weights and two micro-batches the
        # tracker's peak is one 512-byte block above the replay's (not found which tensor; 1e-7 of the peak).
        slack = 512 if "QLoRA" in case else 0
        assert abs(t.replay.requested - t.peak_total) <= slack, case
        assert abs(t.replay_expandable.requested - t.peak_total) <= slack, case
        assert t.replay.allocated >= t.peak_total
        assert t.replay_expandable.reserved <= t.replay.reserved, case
        derived = p.estimate.allocator_terms["forward all-gather cache"]
        if p.launch.world_size == 1:
            assert derived == 0, case
            continue
        replayed = t.replay.by_stream[t.gather_stream]
        assert abs(replayed - derived) <= 0.02 * replayed, (case, replayed, derived)


def test_estimated_reserved_against_the_replay(traced):
    """The estimate's max_memory_reserved (the allocated peak, the forward all-gather cache, the root gradients'
    own segments and the calibrated fragmentation) against the replay of the traced history, for both allocator
    settings. The fragmentation constants are the largest of the full-depth calibration runs
    (bench/allocator_replay.py), which are not these two- and four-block configs. The estimate may not be under
    the replay by more than the allocated peak's own tolerance (BOUND), nor over it by more than its fragmentation
    term (what a history with no fragmentation at all would leave) plus BOUND, and, when the root trains, the root
    gradients' segments (see below)."""
    from shardtune.planning.estimate import ALLOCATOR_OVERHEAD, ALLOCATOR_OVERHEAD_EXPANDABLE

    for case, p in ((c, traced[c]) for c in CASES):
        for expandable, frag, replayed in (
            (False, ALLOCATOR_OVERHEAD, p.trace.replay),
            (True, ALLOCATOR_OVERHEAD_EXPANDABLE, p.trace.replay_expandable),
        ):
            est = traced_estimate(p, expandable_segments=expandable)
            assert est.reserved >= (1 - BOUND) * replayed.reserved, (case, expandable)
            # When the root trains, its gradients' own segments (exact at full depth, bench/allocator_replay.py)
            # partly reuse what a two-block step leaves cached: only bounded by that term here.
            over = est.allocator_terms["root gradients' segments"] + frag * replayed.reserved
            assert est.reserved <= replayed.reserved + over + BOUND * replayed.reserved, (case, expandable)
