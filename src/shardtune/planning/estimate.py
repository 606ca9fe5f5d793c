"""Per-GPU and host memory of one shardtune training step, from the model's shapes and the run's settings.

The estimate follows what shardtune's FSDP2 training holds: each decoder block and then the root are
`fully_shard`-ed; every parameter is sharded on dim 0 (padded to a multiple of the shard group); the frozen base is
kept in the compute dtype (or packed 4-bit); LoRA adapters, their gradients and AdamW's two states are fp32; full
fine-tuning keeps fp32 master weights and all-gathers them in the compute dtype. See docs/plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Not `from shardtune.planning import activations`: that names the package, whose __init__ imports this module.
import shardtune.planning.activations as act
from shardtune.planning.buffers import state_and_buffers
from shardtune.planning.generation import GenerationTerms, generation_terms, with_generation
from shardtune.planning.inputs import DEFAULTS, PlanInputs, as_json
from shardtune.planning.model import Tensor, resolve_lora_targets, sharded_bytes
from shardtune.planning.phases import (
    FORWARD,
    StepParts,
    forward_gather_alive,
    forward_gather_cache,
    peak_phase,
    step_phases,
    temporaries,
)
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import (
    as_shape,
    compute_dtype_bytes,
    host_bytes,
    quant_constants,
    run_tensors,
    shard_group_size,
)

# The caching allocator's fragmentation beyond the streams' high-water marks (_allocator_terms), as a fraction of
# what the step allocates and frees (the other streams' largest sum less the resident state), without and with
# expandable segments. Calibrated, not derived: the largest residual of the nine calibration runs of
# bench/allocator_replay.py (shardtune's own steps on published model configs at full depth, traced and replayed
# through the allocator's rules), 31.9% and 13.3%, rounded up. The published rows docs/plan.md compares with were
# in view when this formula and rule were chosen (and the default's value sits where their mean error is least),
# so they are no independent check of it: docs/plan.md ("How the fragmentation constant was chosen") gives the
# history and the rows' leave-one-out error (bench/plan_loo.py).
ALLOCATOR_OVERHEAD = 0.32
ALLOCATOR_OVERHEAD_EXPANDABLE = 0.14
DEVICE_ROWS = (
    "frozen base weights",
    "quantization constants",
    "trainable weights",
    "gradients",
    "optimizer state",
    "activations",
    "logits and loss",
    "FSDP all-gather buffers",
    "FSDP reduce-scatter buffers",
    "allocator overhead",
    "CUDA context",
)
_NOT_ALLOCATED = ("allocator overhead", "CUDA context")
# Present only with sharded_checkpoint=True: the GPU copies a SHARDED_STATE_DICT save makes (see _sharded_save).
SAVE_COPIES_ROW = "state dict copies (checkpoint save)"
SAVE_PHASE = "checkpoint save (FSDP1 SHARDED_STATE_DICT)"


@dataclass
class MemoryEstimate:
    """Bytes per GPU by category (`device`), host RAM per machine (`host`), and what they were computed for."""

    device: dict[str, int]
    host: dict[str, int]
    activations_by_attention: dict[str, dict[str, int]]
    peak_phase: str
    logits_peak: int
    inputs: PlanInputs  # what the estimate was computed for
    notes: list[str] = field(default_factory=list)
    # Allocated bytes at each of the step's phases (planning.phases), of which `device` is the largest.
    phase_bytes: dict[str, int] = field(default_factory=dict)
    # Of the peak's activations and logits rows, what its backward makes (a block's recomputation and backward
    # working memory, the loss's backward): FSDP2's tracker calls these temporaries.
    temporaries: int = 0
    # The caching allocator's terms behind the "allocator overhead" row (_allocator_terms): FSDP2's forward
    # all-gather cache, the other streams' largest allocated sum, its resident part, the root gradients' own
    # segments, the fragmentation, and the reserved bytes they add up to.
    allocator_terms: dict[str, int] = field(default_factory=dict)
    generation: GenerationTerms | None = None  # online RL's rollout at its peak (planning.generation), if any

    @property
    def allocated(self) -> int:
        """Peak bytes of live tensors (what torch.cuda.max_memory_allocated reports)."""
        return sum(v for k, v in self.device.items() if k not in _NOT_ALLOCATED)

    @property
    def reserved(self) -> int:
        """Peak bytes the caching allocator holds (torch.cuda.max_memory_reserved)."""
        return self.allocated + self.device["allocator overhead"]

    @property
    def total(self) -> int:
        """What one GPU needs, as nvidia-smi would show it."""
        return self.reserved + self.device["CUDA context"]

    @property
    def host_total(self) -> int:
        """Peak host RAM per machine: the processes plus the larger of loading and the offloaded state."""
        offloaded = sum(v for k, v in self.host.items() if k.startswith("offloaded"))
        return self.host["processes"] + max(self.host["model loading (local rank 0)"], offloaded)

    def fits(self, gpu_bytes: int) -> bool:
        return self.total <= gpu_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": dict(self.device),
            "allocated_bytes": self.allocated,
            "reserved_bytes": self.reserved,
            "device_total_bytes": self.total,
            "host": dict(self.host),
            "host_total_bytes": self.host_total,
            "activations_by_attention": self.activations_by_attention,
            "peak_phase": self.peak_phase,
            "logits_peak_bytes": self.logits_peak,
            "settings": as_json(self.inputs),
            "notes": list(self.notes),
            "phase_bytes": dict(self.phase_bytes),
            "temporaries_bytes": self.temporaries,
            "allocator": {"expandable_segments": self.inputs.expandable_segments, **self.allocator_terms},
            "generation": self.generation.to_dict() if self.generation else None,
        }


def _sharded_save(tensors: list[Tensor], num_layers: int, shard: int) -> tuple[int, int]:
    """(copies, gathered) bytes at the peak of an FSDP1 SHARDED_STATE_DICT `model.state_dict()`.

    torch's `_sharded_pre_state_dict_hook` unshards each FSDP unit on the GPU (offload_to_cpu=False whatever the
    config), and `_sharded_post_state_dict_hook` replaces every parameter by a ShardedTensor holding a GPU clone of
    its `torch.chunk` for this rank (`_create_chunk_sharded_tensor`); accelerate's default ShardedStateDictConfig
    does not move it to the CPU. The root unit stays unsharded until its own post-hook, which runs after every
    block's, so the peak is either the last block (all block copies, that block and the root unsharded) or the
    root (all copies, the root unsharded). Parameters are gathered in their stored dtype (summon_full_params
    forces full precision).
    """

    def per_rank(group: str) -> int:
        return sum(sharded_bytes(t, shard) for t in tensors if t.group == group)

    def full(group: str) -> int:
        return sum(t.numel * t.itemsize for t in tensors if t.group == group)

    block_copies = per_rank("block") * num_layers
    last_block = (block_copies, full("root") + full("block"))
    root = (block_copies + per_rank("root"), full("root"))
    return max(last_block, root, key=sum)


@dataclass
class _Dynamic:
    stored: int
    working: int
    logits_peak: int
    logits_kept: int
    forward: int = 0  # alive when the first block is gathered: the embeddings' output and the attention mask
    logits_forward: int = 0  # the loss's forward peak
    final_norm: int = 0  # the final norm's saved tensors and the head's input: freed before any block's backward
    block: int = 0  # one block's part of `stored`
    mask_build: int = 0  # beyond `forward`, while transformers builds the attention mask (_with_mask_build)

    @property
    def peak(self) -> tuple[int, int, str]:
        """(activations, logits) at the peak, and whether it is in the loss's or in the layers' backward."""
        loss_phase = self.stored + self.logits_peak
        layer_phase = self.stored + self.working + self.logits_kept
        if loss_phase >= layer_phase:
            return self.stored, self.logits_peak, "loss backward"
        return self.stored + self.working, self.logits_kept, "decoder-layer backward"


def _adapter_block_terms(
    shape: ModelShape, a: int, lora_targets: tuple[str, ...], lora_r: int, use_dora: bool, quantized: bool
):
    """Per block, not per token: (kept for backward, backward's transient, DoRA's transient). Expert LoRA (PEFT's,
    on 16-bit experts) keeps the block's merged expert copies and forms one merged tensor's gradient; on 4-bit
    experts it merges nothing (its per-token terms: act.expert_lora_4bit_saved_bytes_per_token) but a router's
    LoRA is still PEFT's; DoRA keeps its norms and scales."""
    merged = tuple(t for t in lora_targets if not (quantized and t.startswith("experts.")))
    saved = act.expert_lora_saved_bytes(shape, a, merged)
    if use_dora:
        saved += act.dora_saved_bytes(shape, a, lora_targets)
    dora = act.dora_transient_bytes(shape, a, lora_targets, lora_r) if use_dora else 0
    return saved, act.expert_lora_backward_bytes(shape, a, merged), dora


def _dequant_bytes(shape: ModelShape, a: int) -> int:
    """A quantized linear is dequantized to a full compute-dtype weight for its matmul, forward and backward;
    4-bit experts likewise, one expert's matrix at a time (shardtune.models.quant_experts): the largest such matrix."""
    experts = [math.prod(s[1:]) for s in shape.expert_tensors().values() if len(s) == 3]
    return a * max([i * o for i, o in shape.linear_dims().values()] + experts)


def _check_attention(attn_implementation: str) -> None:
    if attn_implementation not in act.ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {attn_implementation!r}: use one of {', '.join(act.ATTN_IMPLEMENTATIONS)}"
        )


def _masks(
    batch: int, seq_len: int, a: int, attn: str, packing: bool, per_document: bool, plain: bool
) -> tuple[int, int]:
    """(the masks alive through the step: transformers' and the span masks, what building transformers' adds).
    Per document on a family that masks nothing more (`plain`), transformers builds no mask
    (fastpath.without_row_mask)."""
    if per_document and plain and attn == "sdpa":
        return act.span_mask_bytes(batch, seq_len, packing, True), 0
    row = act.attention_mask_bytes(batch, seq_len, a, attn, packing)
    spans = act.span_mask_bytes(batch, seq_len, packing, per_document and attn == "sdpa")  # shardtune's SDPA only
    return row + spans, act.mask_build_bytes(batch, seq_len, a, attn, packing) - row


def _dynamic(
    shape: ModelShape,
    *,
    a: int,
    batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    attn_implementation: str,
    packing: bool,
    lora_targets: tuple[str, ...],
    lora_r: int,
    lora_dropout: float,
    full_finetune: bool,
    use_dora: bool,
    quantized: bool,
    loss_impl: str,
    loss_chunk_tokens: int,
    dropout_mask_bytes: int,
    dropout_scratch_bytes: int = 0,
    row_len: int | None = None,
    per_document_attention: bool = False,
) -> _Dynamic:
    _check_attention(attn_implementation)
    tokens = batch_size * seq_len
    layer = tokens * act.layer_saved_bytes_per_token(
        shape,
        seq_len=seq_len,
        compute_bytes=a,
        attn_implementation=attn_implementation,
        lora_targets=lora_targets,
        lora_r=lora_r,
        lora_dropout=lora_dropout,
        full_finetune=full_finetune,
        use_dora=use_dora,
        masked=packing,
        per_document=per_document_attention,
        dropout_mask_bytes=dropout_mask_bytes,
    )
    mask, mask_build = _masks(
        batch_size, seq_len, a, attn_implementation, packing, per_document_attention, shape.plain_mask
    )
    inputs = act.step_input_bytes(shape, tokens, a)
    layer += act.context_parallel_bytes(shape, batch_size, seq_len, row_len or seq_len, a)
    fixed = tokens * act.final_norm_bytes_per_token(shape, a) + mask + inputs
    dequant = _dequant_bytes(shape, a) if quantized else 0
    saved, backward, dora = _adapter_block_terms(shape, a, lora_targets, lora_r, use_dora, quantized)
    layer += saved
    if quantized:
        layer += tokens * act.expert_lora_4bit_saved_bytes_per_token(shape, a, lora_targets, lora_r)
    working = tokens * act.backward_working_bytes_per_token(shape, a, looped=quantized) + dequant + backward
    if gradient_checkpointing:  # one saved input per block, and one block recomputed at a time
        recompute = act.recompute_peak_bytes(
            shape,
            tokens=tokens,
            compute_bytes=a,
            layer=layer,
            lora_targets=lora_targets,
            lora_r=lora_r,
            lora_dropout=lora_dropout,
            full_finetune=full_finetune,
            dropout_mask_bytes=dropout_mask_bytes,
            dropout_scratch_bytes=dropout_scratch_bytes,
            dora=dora,
            dequant=dequant,
        )
        working = max(layer + working, recompute)  # the backward's peak or the recomputation's
        block = tokens * a * shape.hidden_size
    else:
        working, block = working + dora, layer
    stored = shape.num_layers * block + fixed
    peak, kept = act.logits_bytes(tokens, shape.vocab_size, a, loss_impl, loss_chunk_tokens)
    aux = tokens * act.router_aux_bytes_per_token(shape, a)
    peak += act.loss_input_grad_bytes(tokens, shape.hidden_size, a, loss_impl, loss_chunk_tokens) + aux
    forward = tokens * a * shape.hidden_size + mask + inputs
    loss_forward = act.loss_forward_bytes(tokens, shape.vocab_size, a, loss_impl, loss_chunk_tokens) + 2 * aux
    final_norm = tokens * act.final_norm_bytes_per_token(shape, a)
    return _Dynamic(stored, working, peak, kept, forward, loss_forward, final_norm, block, mask_build)


def estimate_memory(model: ModelShape | Mapping | Any, inputs: PlanInputs = DEFAULTS) -> MemoryEstimate:
    """Peak memory of one training step on each GPU, by category, and host RAM per machine, for the run `inputs`
    describe (planning.inputs.PlanInputs; planning.fit.plan_inputs builds it from a run's flags), and online RL's
    rollout between steps (planning.generation). fsdp=False: _plain_buffers; context parallelism: _dynamic_kwargs."""
    s = inputs
    shape = as_shape(model)
    if (s.use_4bit or s.use_8bit) and not s.use_peft_lora:
        raise ValueError("a quantized base cannot be fully fine-tuned: use LoRA (use_peft_lora=True)")
    shard = shard_group_size(s.world_size, s.num_nodes, strategy := s.sharding_strategy.upper())
    tensors = run_tensors(shape, s)
    state, buffers = state_and_buffers(shape, tensors, s, shard, strategy)
    dyn_kwargs = _dynamic_kwargs(shape, s)
    dynamic = _dynamic(shape, gradient_checkpointing=s.gradient_checkpointing,
                       attn_implementation=s.attn_implementation, **dyn_kwargs)  # fmt: skip
    parts = _step_parts(shape, s, state, dynamic, buffers)
    by_phase = _with_mask_build(step_phases(parts), parts, dynamic.mask_build)
    gen = generation_terms(shape, s, parts, tensors)
    by_phase, parts = with_generation(by_phase, parts, gen)
    device = dict(by_phase[phase := peak_phase(by_phase)])
    fragmentation = _fragmentation(s.allocator_overhead, s.expandable_segments)
    terms = _allocator_terms(parts, by_phase, fragmentation, s.gather_stream_cache and s.fsdp)
    device["allocator overhead"] = terms["reserved"] - sum(device.values())
    if s.sharded_checkpoint:
        device, phase = _with_checkpoint_save(device, state, tensors, shape.num_layers, shard, parts.on_gpu, phase)
    device["CUDA context"] = s.cuda_context_bytes
    table = _activations_table(shape, dyn_kwargs)
    host = host_bytes(state, tensors, shape, s.world_size // s.num_nodes, s.offload)
    notes = _notes(s.use_4bit, s.offload, s.loss_impl, s.sharded_checkpoint, bool(shape.num_experts))
    notes += _layout_notes(shape, tensors)
    phase_bytes = {k: sum(v.values()) for k, v in by_phase.items()}
    temps = temporaries(parts, phase)  # none in the checkpoint save's phase
    return MemoryEstimate(device, host, table, phase, dynamic.logits_peak, s, notes, phase_bytes, temps, terms, gen)


MASK_BUILD = "attention mask build"


def _with_mask_build(by_phase: dict, parts: StepParts, extra: int) -> dict:
    """The phases, and the moment transformers builds the attention mask (act.mask_build_bytes), when that holds
    more than the mask it leaves: in the decoder's forward after the embeddings, before the first block's
    pre-forward gathers that block, so the first block's all-gather phase less that block's gathered copies and
    plus the building's transients (the span masks already exist: the training module makes them first)."""
    if extra <= 0:
        return by_phase
    rows = dict(by_phase[FORWARD])
    rows["activations"] += extra
    rows["FSDP all-gather buffers"] -= (2 if parts.flat_copy else 1) * parts.block_gathered
    return {**by_phase, MASK_BUILD: rows}


def _gather_alive(parts: StepParts, phase: str) -> int:
    """forward_gather_alive, and at the mask's building the root's flat all-gather output (its copy-out waits for
    the first block's all-gather, as at FORWARD)."""
    if phase == MASK_BUILD:
        return parts.root_gathered if parts.flat_copy else 0
    return forward_gather_alive(parts, phase)


def _fragmentation(allocator_overhead: float | None, expandable_segments: bool) -> float:
    """The allocator's fragmentation factor: the one given, or the calibrated one for the allocator setting."""
    if allocator_overhead is not None:
        return allocator_overhead
    return ALLOCATOR_OVERHEAD_EXPANDABLE if expandable_segments else ALLOCATOR_OVERHEAD


def _allocator_terms(parts: StepParts, by_phase: dict, fragmentation: float, gather_stream: bool) -> dict[str, int]:
    """What the caching allocator reserves at most over the step (bench/allocator_replay.py replays it from the
    traced history). Its cached blocks serve one stream each, so each stream's pool holds at least its own
    high-water mark:

    - FSDP2's forward all-gather outputs have a stream of their own (planning.phases.forward_gather_cache);
    - the other streams together hold their largest sum over the phases, plus `fragmentation` times the part of
      it that comes and goes during the step (blocks cached in sizes the next request does not fit; calibrated,
      see ALLOCATOR_OVERHEAD). The resident state (parameter shards, quantization constants, optimizer states) is
      allocated once, tensor by tensor, into segments of its own size, and does not fragment;
    - when the root trains, its unsharded gradients and their fp32 reduce-scatter input (embedding-sized: larger
      than any block the step frees before them) take segments of their own, beyond what the blocks' backward
      left cached.
    """
    cache = forward_gather_cache(parts) if gather_stream else 0
    rest = max(sum(rows.values()) - (_gather_alive(parts, ph) if gather_stream else 0) for ph, rows in by_phase.items())
    root = parts.root_scatter
    state = parts.state
    resident = (state["frozen"] + state["trainable"] + state["optimizer"]) * parts.on_gpu + parts.quant_constants
    frag = int(fragmentation * (rest - resident))
    return {
        "forward all-gather cache": cache,
        "other streams": rest,
        "resident": resident,
        "root gradients' segments": root,
        "fragmentation": frag,
        "reserved": cache + rest + root + frag,
    }


def _dynamic_kwargs(shape: ModelShape, s: PlanInputs) -> dict[str, Any]:
    """_dynamic's arguments for the run's inputs, less the two the activations table varies. With context
    parallelism a rank holds 1/cp of every row's activations and logits (seq_len), plus, per block, the row's
    (row_len) gathered keys and values; FSDP still shards over all world_size ranks."""
    cp = s.context_parallel
    return {
        "a": compute_dtype_bytes(s.bf16, s.fp16),
        "batch_size": s.batch_size * s.rows_per_example,  # the rows of one micro-batch: a preference pair is two
        # A rank's part of each row: rows are padded to a multiple of 2·cp (the zigzag split's chunks).
        "seq_len": -(-s.seq_len // (2 * cp)) * 2 if cp > 1 else s.seq_len,
        "row_len": s.seq_len,
        "packing": s.packing,
        # decided once: by the family (planning.fit.plan_shape) and by the run (planning.fit.plan_inputs)
        "per_document_attention": shape.per_document_attention and s.per_document_attention,
        "lora_targets": (
            resolve_lora_targets(shape, s.lora_target_modules, s.lora_target_parameters) if s.use_peft_lora else ()
        ),
        "lora_r": s.lora_r,
        "lora_dropout": s.lora_dropout,
        "full_finetune": not s.use_peft_lora,
        "use_dora": s.use_dora,
        "quantized": s.use_4bit or s.use_8bit,
        "loss_impl": s.loss_impl,
        "loss_chunk_tokens": s.loss_chunk_tokens,
        "dropout_mask_bytes": s.dropout_mask_bytes,
        "dropout_scratch_bytes": s.dropout_scratch_bytes,
    }


def _step_parts(
    shape: ModelShape, s: PlanInputs, state: dict[str, int], dynamic: _Dynamic, buffers: dict[str, Any]
) -> StepParts:
    a = compute_dtype_bytes(s.bf16, s.fp16)
    rows = s.batch_size * s.rows_per_example * s.seq_len
    return StepParts(
        state=state,
        on_gpu=0 if s.offload else 1,
        quant_constants=quant_constants(shape, s.use_4bit, s.use_8bit, s.nested_quant),
        grad_accum=s.grad_accum,
        forward_activations=dynamic.forward,
        stored=dynamic.stored,
        layer_stored=dynamic.stored - dynamic.final_norm,
        working=dynamic.working,
        logits_peak=dynamic.logits_peak,
        logits_kept=dynamic.logits_kept,
        logits_forward=dynamic.logits_forward,
        forward_working=rows * act.forward_working_bytes_per_token(shape, a, looped=s.use_4bit),
        num_blocks=shape.num_layers,
        block_stored=dynamic.block,
        batch_inputs=act.BATCH_TENSORS * 8 * rows,
        **buffers,
    )


def _activations_table(shape: ModelShape, dyn_kwargs: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Activations + logits at the peak for each attention implementation, with and without checkpointing."""
    return {
        impl: {
            label: sum(_dynamic(shape, gradient_checkpointing=gc, attn_implementation=impl, **dyn_kwargs).peak[:2])
            for label, gc in (("checkpointing", True), ("no checkpointing", False))
        }
        for impl in act.ATTN_IMPLEMENTATIONS
    }


def _with_checkpoint_save(
    step: dict[str, int],
    state: dict[str, int],
    tensors: list[Tensor],
    num_layers: int,
    shard: int,
    on_gpu: int,
    step_phase: str,
) -> tuple[dict[str, int], str]:
    """The step's rows, or the checkpoint save's if it needs more: the resident model state (gradients are
    freed by the Trainer's zero_grad before it saves), the quantization constants, the units gathered for the
    save and the copies of `_sharded_save`.

    The save runs after the step, with the step's blocks cached: the allocator takes new memory only for what
    exceeds them, so the reserved peak is the larger of the step's reserved bytes and the save's live bytes. The
    save gets no fragmentation term: replayed through the allocator's rules its own sequence reserves at most
    0.17 GiB beyond its live bytes (bench/allocator_replay.py --save), and the only measured saves (the guide's
    QLoRA rows) sit at their live bytes. A modelling choice made with those rows in view, so they do not check
    it; docs/plan.md ("The checkpoint save") says which rows depend on it and what GPU run would settle it.
    """
    copies, gathered = _sharded_save(tensors, num_layers, shard)
    rows = [k for k in step if k != "allocator overhead"] + [SAVE_COPIES_ROW, "allocator overhead"]
    save = dict.fromkeys(rows, 0)  # "allocator overhead" stays 0: no fragmentation in the save
    save.update(
        {
            "frozen base weights": state["frozen"] * on_gpu,
            "quantization constants": step["quantization constants"],
            "trainable weights": state["trainable"] * on_gpu,
            "optimizer state": state["optimizer"] * on_gpu,
            "FSDP all-gather buffers": gathered,
            SAVE_COPIES_ROW: copies,
        }
    )
    if sum(save.values()) <= sum(step.values()):  # within what the step already reserved
        return {k: step.get(k, 0) for k in rows}, step_phase
    return save, SAVE_PHASE


# Parameters beyond the layout, as a share of a block, above which the plan says the family's blocks differ from it.
_LAYOUT_SHARE = 0.01


def _layout_notes(shape: ModelShape, tensors: list[Tensor]) -> list[str]:
    """A family whose blocks differ from the layout the activations are estimated for (multi-latent attention, a
    dense first block among mixture-of-experts blocks, ...): its weights are held as counted, its activations
    are the layout's."""
    extra = shape.block_extra_linear + shape.block_extra_other
    block = sum(t.numel for t in tensors if t.group == "block" and not t.name.startswith("unmodelled."))
    if not block or abs(extra) <= _LAYOUT_SHARE * block:
        return []
    more = "more" if extra > 0 else "fewer"
    note = (
        f"{shape.model_type}: its blocks hold {abs(extra) / 1e6:.1f}M parameters {more} on average than the layout "
        f"the activations are estimated for ({100 * abs(extra) / block:.0f}% of a block: another attention, or "
        "dense blocks among experts); the weights are counted on the model itself, the activations are the "
        "layout's: --trace runs the real step."
    )
    return [note]


def _notes(use_4bit: bool, offload: bool, loss_impl: str, sharded_checkpoint: bool, moe: bool) -> list[str]:
    notes = []
    if use_4bit:
        notes.append("4-bit quantization constants are not FSDP parameters: every GPU keeps all of them.")
    if offload:
        notes.append(
            "CPU offload: sharded parameters, gradients and optimizer states live in host RAM; the GPU "
            "holds the blocks being gathered, the root, activations and logits."
        )
    if sharded_checkpoint:
        notes.append(
            "FSDP1 SHARDED_STATE_DICT checkpoint save: every parameter's shard is copied on the GPU while the "
            "state dict is built (offloaded or not, frozen or not)."
        )
    if loss_impl == "chunked":
        notes.append(
            "The loss runs lm_head + cross-entropy on chunks of positions, recomputed in backward, so the "
            "[batch, seq, vocab] logits never exist at once."
        )
    if moe:
        notes.append(
            "mixture of experts: the routing and the experts' activations are those of transformers' grouped_mm "
            "experts (its default); another experts implementation keeps other tensors: --trace runs the real step."
        )
    return notes
