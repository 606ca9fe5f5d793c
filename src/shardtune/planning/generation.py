"""Online RL's generation (--objective grpo): what a rollout holds on each training GPU between optimizer steps, as
the phase planning.phases.GENERATION beside the training step's.

With the `transformers` engine (shardtune.rl.generate) each rank samples rows = batch_size × steps_per_generation
completions in one batch: the prompts, left-padded to the longest (max_prompt_length), go through the model once
(the prefill), then one token per row per forward, up to max_completion_length tokens, each forward appending to a
transformers DynamicCache (per decoder layer, keys and values [rows, kv_heads, positions, head_dim] in the compute
dtype; multi-latent attention caches its latent and its rotary key, one head each) and returning the last
position's logits [rows, vocab]. The gradients are freed (the trainer's zero_grad after each step); the parameter
shards and optimizer states stay. With gather_for_generation (the default; parallel.fsdp.kept_gathered, TRL's
ds3_gather_for_generation) every FSDP module keeps its weights gathered for the whole rollout: the whole model in
the compute dtype on every rank (4-bit weights as stored); without it, one block at a time as in the forward.

Two moments can peak: the prefill (the cache of the prompts, the last block gathered with its flat all-gather
output, one block's forward over rows × prompt tokens) and the last decode step (the cache at its longest, prompt +
completion - 1 positions, with torch.cat's copy of one layer's keys as they grow, and the logits with sampling's
fp32 temporaries). The phase is the larger.

With the `vllm` engine a server generates: the training GPUs hold nothing for it but the adapter's sync, which
gathers each trainable tensor in full, one at a time (parallel.gather.gather_trainable), to copy it to rank 0's host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import shardtune.planning.activations as act
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.model import Tensor
from shardtune.planning.phases import GENERATION, StepParts, device_rows
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import compute_dtype_bytes

TRANSFORMERS, VLLM = "transformers", "vllm"
KV_ROW = "KV cache (generation)"
PREFILL, DECODE, SYNC = "prefill", "last decode step", "adapter sync"
# sample_tokens' fp32 [rows, vocab] temporaries at their most, beside the step's logits (compute dtype) and their
# temperature-scaled fp32 copy: the log-softmax (4), top-k's filtered copy (4), top-p's sorted values (4), their
# order (int64, 8), their softmax and its cumulative sum (8). Without top_k/top_p fewer: counted at the most.
SAMPLING_BYTES = 28
# input_ids, position_ids and the attention mask of a generation forward (int64)
INPUT_BYTES = 3 * 8


@dataclass(frozen=True)
class GenerationTerms:
    """Bytes per GPU of a rollout at the moment it peaks (`moment`), beyond the resident state."""

    engine: str
    rows: int  # completions this rank generates at once
    prompt_len: int
    completion_len: int
    moment: str
    weights: int = 0  # gathered weights: the whole model, or the root and one block (vllm: the largest adapter tensor)
    gather_alive: int = 0  # of the all-gather row beyond `weights`: flat all-gather outputs, offloaded shards' copies
    kv_cache: int = 0
    kv_cache_longest: int = 0  # the cache at the last decode step (prompt + completion - 1 positions)
    kv_growth: int = 0  # torch.cat's new copy of one layer's keys (or values) while the old one exists
    activations: int = 0
    logits: int = 0
    sampling: int = 0

    @property
    def allocated(self) -> int:
        parts = (self.weights, self.gather_alive, self.kv_cache, self.kv_growth, self.activations, self.logits)
        return sum(parts) + self.sampling

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_len(s: PlanInputs) -> int:
    """The longest prompt: max_prompt_length, or the row less the completion (plan_inputs made it --max_length)."""
    return s.max_prompt_length if s.max_prompt_length is not None else max(s.seq_len - s.max_completion_length, 0)


def whole_groups(s: PlanInputs) -> bool:
    """Whether a generation batch (batch × data-parallel ranks × steps_per_generation) is whole groups of
    num_generations completions, as recipe.rl.rollout_settings requires."""
    dp = s.world_size // s.context_parallel
    return s.rollout_engine is None or s.batch_size * dp * s.steps_per_generation % s.num_generations == 0


def kv_bytes_per_position(shape: ModelShape, a: int) -> tuple[int, int]:
    """(keys, values) bytes of one row's position in one decoder layer's DynamicCache: grouped-query attention's
    kv_heads × head_dim each; multi-latent attention's latent (kv_lora_rank) and rotary key (qk_rope_head_dim), one
    head each, as transformers' DeepSeek-V2/V3 attention caches them."""
    if shape.latent_attention:
        return shape.kv_lora_rank * a, shape.qk_rope_head_dim * a
    return shape.num_kv_heads * shape.head_dim * a, shape.num_kv_heads * shape.head_dim * a


def kv_cache_bytes(shape: ModelShape, rows: int, positions: int, a: int) -> int:
    """A DynamicCache of `rows` rows and `positions` positions: every decoder layer's keys and values."""
    return shape.num_layers * rows * positions * sum(kv_bytes_per_position(shape, a))


def gathered_weights_bytes(parts: StepParts, whole: bool) -> int:
    """The weights gathered during a rollout: every block's and the root's (whole), or the root's and one block's."""
    return parts.root_gathered + (parts.num_blocks if whole else 1) * parts.block_gathered


def _expanded_kv(shape: ModelShape, tokens: int, a: int) -> int:
    """Multi-latent attention's keys and values of one layer expanded to every head from the cache (kv_b_proj's
    output and the assembled keys), over `tokens` row positions; none elsewhere."""
    return tokens * (shape.v_kept + shape.q_dim) * a if shape.latent_attention else 0


def _token_bytes(shape: ModelShape, a: int, looped: bool) -> int:
    """A block's forward per token under no_grad: the residual stream and the block's normed input (h wide each),
    the rotary cos and sin, the inputs, and the MLP's intermediates."""
    hidden = 2 * shape.hidden_size * a + 2 * shape.head_dim * a + INPUT_BYTES
    return hidden + act.forward_working_bytes_per_token(shape, a, looped=looped)


def _prefill(shape: ModelShape, s: PlanInputs, parts: StepParts, rows: int, prompt: int, a: int) -> GenerationTerms:
    tokens = rows * prompt
    working = tokens * _token_bytes(shape, a, s.use_4bit) + _expanded_kv(shape, tokens, a)
    mask = act.attention_mask_bytes(rows, prompt, a, s.attn_implementation, True)  # left padding: a masked row
    return GenerationTerms(
        TRANSFORMERS,
        rows,
        prompt,
        s.max_completion_length,
        PREFILL,
        weights=gathered_weights_bytes(parts, s.gather_for_generation),
        gather_alive=_in_flight(parts),
        kv_cache=kv_cache_bytes(shape, rows, prompt, a),
        kv_cache_longest=kv_cache_bytes(shape, rows, _positions(s, prompt), a),
        activations=working + mask,
    )


def _decode(shape: ModelShape, s: PlanInputs, parts: StepParts, rows: int, prompt: int, a: int) -> GenerationTerms:
    positions = _positions(s, prompt)
    step = rows * _token_bytes(shape, a, s.use_4bit) + _expanded_kv(shape, rows * positions, a) + rows * positions * 8
    return GenerationTerms(
        TRANSFORMERS,
        rows,
        prompt,
        s.max_completion_length,
        DECODE,
        weights=gathered_weights_bytes(parts, s.gather_for_generation),
        # kept gathered: nothing more is all-gathered after the first forward; else each block again per token
        gather_alive=0 if s.gather_for_generation else _in_flight(parts),
        kv_cache=kv_cache_bytes(shape, rows, positions, a),
        kv_cache_longest=kv_cache_bytes(shape, rows, positions, a),
        kv_growth=rows * (positions - 1) * max(kv_bytes_per_position(shape, a)),
        activations=step,
        logits=rows * shape.vocab_size * (a + 4),
        sampling=rows * shape.vocab_size * SAMPLING_BYTES,
    )


def _positions(s: PlanInputs, prompt: int) -> int:
    """The cache's positions at the last decode step: that forward feeds the next-to-last token."""
    return prompt + max(s.max_completion_length, 1) - 1


def _in_flight(parts: StepParts) -> int:
    """While a block is gathered for its forward: its flat all-gather output (sharded parameters only) and, with
    offload, its shard's host-to-GPU copies."""
    return (parts.block_gathered if parts.flat_copy else 0) + parts.offload_copies


def generation_terms(shape: ModelShape, s: PlanInputs, parts: StepParts, tensors: list[Tensor]):
    """The rollout's terms at its peak moment, or None when the run generates nothing (rollout_engine None)."""
    if s.rollout_engine is None:
        return None
    a = compute_dtype_bytes(s.bf16, s.fp16)
    rows, prompt = s.batch_size * s.steps_per_generation, prompt_len(s)
    if s.rollout_engine == VLLM:
        largest = max((t.numel * t.itemsize for t in tensors if t.trainable), default=0)
        return GenerationTerms(VLLM, rows, prompt, s.max_completion_length, SYNC, weights=largest)
    if s.rollout_engine != TRANSFORMERS:
        raise ValueError(f"rollout_engine {s.rollout_engine!r}: use {TRANSFORMERS!r}, {VLLM!r} or None")
    moments = (_prefill(shape, s, parts, rows, prompt, a), _decode(shape, s, parts, rows, prompt, a))
    return max(moments, key=lambda g: g.allocated)


def with_generation(by_phase: dict, parts: StepParts, g: GenerationTerms | None) -> tuple[dict, StepParts]:
    """The step's phases with the rollout's (the KV cache as a row of its own, 0 in the step's phases), and the
    step's parts with the generation phase's flat all-gather outputs (the allocator's gather stream holds them)."""
    if g is None:
        return by_phase, parts
    rows = device_rows(
        parts,
        gradients=0,  # the trainer's zero_grad(set_to_none=True) freed them after the last step
        activations=g.activations,
        logits=g.logits + g.sampling,
        gather=g.weights + g.gather_alive,
        scatter=0,
    )
    kv = {KV_ROW: g.kv_cache + g.kv_growth} if g.engine == TRANSFORMERS else {}
    out = {name: {**rows_, **dict.fromkeys(kv, 0)} for name, rows_ in by_phase.items()}
    out[GENERATION] = {**rows, **kv}
    flat = min(g.gather_alive, parts.block_gathered) if parts.flat_copy else 0  # not the offloaded shards' copies
    return out, replace(parts, generation_gather_alive=flat)
