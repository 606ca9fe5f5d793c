"""`shardtune plan` of an online-RL run (--objective grpo): the rollout's generation phase (planning.generation).

The KV cache and the gathered weights are checked exactly against real tensors on CPU: a transformers DynamicCache
filled as shardtune.rl.generate fills it (left-padded prompts prefilled, then one token per row per forward) on a
tiny Llama-style GQA model and a tiny DeepSeek-V3 (multi-latent attention), and the parameters of a tiny model in
the compute dtype. A planted bug (the cache counted with the attention heads instead of the key-value heads) fails
the exactness check.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shardtune.commands import plan as plan_command
from shardtune.config.arguments import DataArguments, ModelArguments, RunConfig, TrainArguments
from shardtune.config.fsdp import FSDPSettings
from shardtune.planning import generation
from shardtune.planning.estimate import estimate_memory
from shardtune.planning.fit import plan_inputs
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.known_configs import known_config
from shardtune.planning.model import lora_param_count, resolve_lora_targets
from shardtune.planning.phases import GENERATION
from shardtune.planning.recommend import generation_candidates, recommend
from shardtune.planning.report import Launch
from shardtune.planning.shape import ModelShape, base_param_count
from shardtune.planning.state import GiB

ROWS, PROMPT, COMPLETION = 3, 5, 4


def _llama_config():
    from transformers import LlamaConfig

    # GQA: 4 attention heads share 2 key-value heads
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, tie_word_embeddings=False,
    )  # fmt: skip


def _deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, vocab_size=256,
        n_group=1, topk_group=1,
    )  # fmt: skip


CONFIGS = {"llama-gqa": _llama_config, "deepseek-v3-mla": _deepseek_config}


def _tiny_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


@torch.no_grad()
def _filled_cache_bytes(model, rows: int, prompt: int, completion: int) -> int:
    """The bytes of a DynamicCache filled as rl.generate.TransformersEngine fills it: prompts of different lengths
    left-padded to the longest and prefilled, then completion - 1 forwards of one token per row (the last sampled
    token is not fed back). Counted from the cache's own tensors."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (rows, prompt))
    mask = torch.ones(rows, prompt, dtype=torch.long)
    mask[0, : prompt // 2] = 0  # a shorter prompt, left-padded
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, logits_to_keep=1).logits
    pos = pos[:, -1:]
    for _ in range(completion - 1):
        token = logits[:, -1].float().argmax(-1, keepdim=True)
        mask, pos = torch.cat([mask, mask.new_ones(rows, 1)], 1), pos + 1
        logits = model(input_ids=token, attention_mask=mask, position_ids=pos, cache=cache, logits_to_keep=1).logits
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(tensors) == 2 * model.config.num_hidden_layers
    return sum(t.numel() * t.element_size() for t in tensors)


def _rl_inputs(**overrides) -> PlanInputs:
    kwargs = {
        "world_size": 2, "bf16": True, "use_peft_lora": False, "rollout_engine": "transformers", "batch_size": ROWS,
        "steps_per_generation": 1, "max_prompt_length": PROMPT, "max_completion_length": COMPLETION,
        "seq_len": PROMPT + COMPLETION, "gradient_checkpointing": True,
    }  # fmt: skip
    return PlanInputs(**{**kwargs, **overrides})


def _exact(kv_cache_bytes, config) -> bool:
    """Whether `kv_cache_bytes(shape, rows, positions, a)` gives the bytes of the filled cache."""
    real = _filled_cache_bytes(_tiny_model(config), ROWS, PROMPT, COMPLETION)
    return kv_cache_bytes(ModelShape.from_config(config), ROWS, PROMPT + COMPLETION - 1, 2) == real


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_kv_cache_term_equals_a_filled_dynamic_cache(family):
    config = CONFIGS[family]()
    real = _filled_cache_bytes(_tiny_model(config), ROWS, PROMPT, COMPLETION)
    shape = ModelShape.from_config(config)
    assert generation.kv_cache_bytes(shape, ROWS, PROMPT + COMPLETION - 1, 2) == real
    # and the plan's term, at the last decode step, for a run generating those rows
    g = estimate_memory(shape, _rl_inputs()).generation
    assert g.kv_cache_longest == real


def test_a_kv_term_without_the_kv_heads_ratio_fails_the_exactness_check():
    """Planted control: the cache counted with every attention head (no grouped-query sharing) is caught."""

    def forgets_kv_heads(shape, rows, positions, a):
        return generation.kv_cache_bytes(replace(shape, num_kv_heads=shape.num_heads), rows, positions, a)

    config = _llama_config()
    assert _exact(generation.kv_cache_bytes, config)
    assert not _exact(forgets_kv_heads, config)


def test_gathered_weights_equal_the_parameters_in_the_compute_dtype():
    """--gather_for_generation True holds every parameter in bf16 (full fine-tuning: the fp32 masters cast; LoRA: the
    base and the adapters); False, the root's and one block's."""
    import peft

    config = _llama_config()
    shape = ModelShape.from_config(config)
    model = _tiny_model(config)
    params = sum(p.numel() for p in model.parameters())
    assert estimate_memory(shape, _rl_inputs()).generation.weights == 2 * params
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    root = params - config.num_hidden_layers * block
    per_block = estimate_memory(shape, _rl_inputs(gather_for_generation=False)).generation
    assert per_block.weights == 2 * (root + block)

    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    with_adapters = sum(p.numel() for p in lora.parameters())
    inputs = _rl_inputs(use_peft_lora=True, lora_r=8, lora_target_modules="all-linear")
    assert estimate_memory(shape, inputs).generation.weights == 2 * with_adapters > 2 * params


def _grpo_inputs(world_size: int = 8, **train) -> PlanInputs:
    train = {"objective": "grpo", "max_prompt_length": 256, "max_completion_length": 2048, **train}
    model = ModelArguments(model_name_or_path="x", use_peft_lora=True, lora_r=8)
    args = TrainArguments(bf16=True, gradient_checkpointing=True, **train)
    return plan_inputs(
        RunConfig(model, DataArguments(max_length=1024), args, FSDPSettings()), Launch(world_size=world_size)
    )


def test_plan_inputs_of_a_grpo_run():
    """plan_inputs fills the generation fields from the flags only for an objective that generates; training rows
    are prompt + completion long, the prompt --max_length's when --max_prompt_length is unset."""
    k = _grpo_inputs(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    assert (k.rollout_engine, k.steps_per_generation, k.num_generations) == ("transformers", 2, 4)
    assert k.seq_len == 256 + 2048 and k.max_prompt_length == 256 and k.gather_for_generation
    unset = _grpo_inputs(max_prompt_length=None)
    assert unset.seq_len == 1024 + 2048 and generation.prompt_len(unset) == 1024
    sft = plan_inputs(
        RunConfig(ModelArguments(model_name_or_path="x"), DataArguments(), TrainArguments(), FSDPSettings()), Launch()
    )
    assert sft.rollout_engine is None and estimate_memory(_shape_8b(), sft).generation is None


def _shape_8b() -> ModelShape:
    return ModelShape.from_config(known_config("meta-llama/Llama-3.1-8B"))


def test_generation_phase_grows_with_the_completions_a_rank_generates():
    """A rank generates per_device_train_batch_size × steps_per_generation rows (num_generations × the prompts it
    takes); the phase's bytes beyond the state and the gathered weights grow by the same amount per row."""
    shape = _shape_8b()

    def gen(**train):
        est = estimate_memory(shape, _grpo_inputs(**train))
        assert GENERATION in est.phase_bytes and est.phase_bytes[GENERATION] <= est.allocated
        return est.generation, est.phase_bytes[GENERATION]

    # 8 completions per prompt: 1, 2, 3 prompts per rank
    (g1, p1), (g2, p2), (g3, p3) = (gen(num_generations=8, per_device_train_batch_size=8 * n) for n in (1, 2, 3))
    assert g1.moment == g2.moment == g3.moment == generation.DECODE  # long completions: the last step peaks
    assert (g1.rows, g2.rows, g3.rows) == (8, 16, 24)
    assert g2.kv_cache == 2 * g1.kv_cache and g3.kv_cache == 3 * g1.kv_cache
    assert g1.kv_cache == 8 * 32 * (256 + 2048 - 1) * 2 * (8 * 128 * 2)  # rows × layers × positions × K, V
    assert g2.logits + g2.sampling == 2 * (g1.logits + g1.sampling)
    assert p3 - p2 == p2 - p1 > 0
    per_row = (g1.kv_cache + g1.kv_growth + g1.logits + g1.sampling + g1.activations) // 8
    assert p2 - p1 == 8 * per_row
    # the same rows as 2 prompts × 4 completions, or as 2 micro-batches of 4 per generation
    assert gen(num_generations=4, per_device_train_batch_size=8)[0] == g1
    steps = gen(num_generations=8, per_device_train_batch_size=4, steps_per_generation=2)[0]
    assert steps == g1


def test_the_peak_takes_the_rollout_and_the_recommendation_changes_it():
    """70B LoRA on 8 GPUs: the whole model gathered for the rollout (129 GiB) is the peak; the recommendation is to
    gather per block, and without that change each of the other rollout changes is tried first."""
    shape = ModelShape.from_config(known_config("meta-llama/Llama-2-70b-hf"))
    inputs = _grpo_inputs(per_device_train_batch_size=8, num_generations=8, max_completion_length=1024)
    inputs = replace(inputs, attn_implementation="flash_attention_2")
    est = estimate_memory(shape, inputs)
    assert est.peak_phase == GENERATION and est.generation.weights > 128 * GiB
    assert est.device[generation.KV_ROW] == est.generation.kv_cache + est.generation.kv_growth
    rec = recommend(inputs, 80 * 10**9, 1, model=shape)
    assert rec.fits and rec.flags == {"gather_for_generation": False}
    assert estimate_memory(shape, replace(inputs, gather_for_generation=False)).peak_phase != GENERATION
    flags = [f for _, f, _ in generation_candidates(inputs, 1)]
    assert flags[0] == {"gather_for_generation": False}
    assert {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 1} in flags
    assert flags[-1] == {"rollout_engine": "vllm"}


def test_vllm_engine_holds_only_the_adapter_sync():
    shape = _shape_8b()
    est = estimate_memory(shape, _grpo_inputs(rollout_engine="vllm"))
    g = est.generation
    assert g.engine == "vllm" and g.kv_cache == 0 and generation.KV_ROW not in est.device
    assert 0 < g.weights < 64 * 2**20 and est.peak_phase != GENERATION  # one fp32 LoRA tensor at a time


def test_shardtune_plan_prints_the_generation_lines(capsys):
    argv = [
        "--model_name_or_path", "meta-llama/Llama-3.1-8B", "--objective", "grpo", "--use_peft_lora", "True",
        "--lora_r", "8", "--bf16", "True", "--num_processes", "2", "--per_device_train_batch_size", "8", "--num_generations", "8",
        "--max_completion_length", "512", "--max_seq_len", "512", "--gradient_checkpointing", "True",
    ]  # fmt: skip
    assert plan_command.main(argv) == 0
    out = capsys.readouterr().out
    assert "Generation, per GPU (estimate)" in out
    assert "KV cache (generation)" in out and "--max_prompt_length unset: prompts planned at --max_length" in out
    weights = next(line for line in out.splitlines() if line.strip().startswith("gathered weights (whole model)"))
    kv = next(line for line in out.splitlines() if line.strip().startswith("KV cache at its longest"))
    shape = _shape_8b()
    params = base_param_count(shape) + lora_param_count(shape, 8, resolve_lora_targets(shape, "all-linear", ()))
    assert float(weights.split(")")[1].split()[0]) == round(2 * params / GiB, 2)  # 8.03B + LoRA's in bf16
    # 8 rows x 1023 positions x 32 layers x 2 x 8 KV heads x 128 x 2 bytes
    assert float(kv.split()[5]) == pytest.approx(8 * 1023 * 32 * 2 * 8 * 128 * 2 / GiB, abs=0.01)
    assert "peak during the generation" in out
