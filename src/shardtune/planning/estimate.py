"""Per-GPU and host memory of one shardtune training step, from the model's shapes and the run's settings.

The estimate follows what shardtune's FSDP2 training holds: each decoder block and then the root are
`fully_shard`-ed; every parameter is sharded on dim 0 (padded to a multiple of the shard group); the frozen base is
kept in the compute dtype (or packed 4-bit); LoRA adapters, their gradients and AdamW's two states are fp32; full
fine-tuning keeps fp32 master weights and all-gathers them in the compute dtype. See docs/plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# Not `from shardtune.planning import activations`: that names the package, whose __init__ imports this module.
import shardtune.planning.activations as act
from shardtune.models.training_module import loss_chunk_tokens
from shardtune.planning.buffers import state_and_buffers
from shardtune.planning.checkpoint_save import (  # noqa: F401 - SAVE_*: the estimate's rows and phase names
    SAVE_COPIES_ROW,
    SAVE_PHASE,
    with_checkpoint_save,
)
from shardtune.planning.generation import GenerationTerms, generation_terms, with_generation
from shardtune.planning.inputs import DEFAULTS, PlanInputs, as_json
from shardtune.planning.model import Tensor, resolve_lora_targets
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
    tensor_parallel_problems,
    tensor_parallel_slices,
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
    live_input: int = 0  # offloaded activations: the input of the block running forward (_offloaded)

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
    offload: bool = False,
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
        block = tokens * a * shape.hidden_size
        # The backward's peak or the recomputation's; offloaded, the recomputation copies the block's input back.
        working = max(layer + working, recompute + (block if offload else 0))
    else:
        working, block = working + dora, layer
    stored = shape.num_layers * block + fixed
    peak, kept = act.logits_bytes(tokens, shape.vocab_size, a, loss_impl, loss_chunk_tokens)
    aux = tokens * act.router_aux_bytes_per_token(shape, a)
    peak += act.loss_input_grad_bytes(tokens, shape.hidden_size, a, loss_impl, loss_chunk_tokens) + aux
    forward = tokens * a * shape.hidden_size + mask + inputs
    loss_forward = act.loss_forward_bytes(tokens, shape.vocab_size, a, loss_impl, loss_chunk_tokens) + 2 * aux
    final_norm = tokens * act.final_norm_bytes_per_token(shape, a)
    dynamic = _Dynamic(stored, working, peak, kept, forward, loss_forward, final_norm, block, mask_build)
    return _offloaded(dynamic, shape.num_layers) if offload and gradient_checkpointing else dynamic


def _offloaded(d: _Dynamic, num_layers: int) -> _Dynamic:
    """--enable_activation_offloading with checkpointing (training.trainer.saved_on_host): what the forward saves
    lives in host memory (act.offloaded_tensor_bytes), so every block's input and the final norm's saved tensors
    leave `stored`, which keeps the masks and the micro-batch. A block's input is on the GPU while that block runs
    forward (the decoder's hidden state: the block's forward phase) and while it is recomputed (copied back by the
    checkpoint's first unpack, one block at a time: save_on_cpu prefetches nothing; `working`, in _dynamic), and
    the head's input while the loss runs forward (then it is saved to the host as well)."""
    stored = d.stored - num_layers * d.block - d.final_norm
    return replace(
        d, stored=stored, final_norm=0, block=0, logits_forward=d.logits_forward + d.block, live_input=d.block
    )


def estimate_memory(model: ModelShape | Mapping | Any, inputs: PlanInputs = DEFAULTS) -> MemoryEstimate:
    """Peak memory of one training step on each GPU, by category, and host RAM per machine, for the run `inputs`
    describe (planning.inputs.PlanInputs; planning.fit.plan_inputs builds it from a run's flags), and online RL's
    rollout between steps (planning.generation). fsdp=False: _plain_buffers; context parallelism: _dynamic_kwargs.
    Tensor parallelism: each rank's slices of the blocks' linears (state.tensor_parallel_slices), sharded over the
    world_size / tp ranks of its slice, and the activations of the block one rank computes (tensor_parallel_rank)."""
    s = inputs
    shape = as_shape(model)
    if (s.use_4bit or s.use_8bit) and not s.use_peft_lora:
        raise ValueError("a quantized base cannot be fully fine-tuned: use LoRA (use_peft_lora=True)")
    if s.activation_offloading and not s.gradient_checkpointing:
        raise ValueError("activation offloading is planned with gradient checkpointing, as shardtune trains it")
    if problems := tensor_parallel_problems(shape, s):
        raise ValueError(problems[0])
    shard = shard_group_size(s.world_size // s.tensor_parallel, s.num_nodes, strategy := s.sharding_strategy.upper())
    whole = run_tensors(shape, s)
    tensors = tensor_parallel_slices(whole, s.tensor_parallel)
    state, buffers = state_and_buffers(shape, tensors, s, shard, strategy)
    dyn_kwargs = _dynamic_kwargs(shape, s)
    rank = shape.tensor_parallel_rank(s.tensor_parallel)  # what one rank computes of each block
    dynamic = _dynamic(rank, gradient_checkpointing=s.gradient_checkpointing,
                       attn_implementation=s.attn_implementation, **dyn_kwargs)  # fmt: skip
    parts = _step_parts(rank, s, state, dynamic, buffers)
    by_phase = _with_mask_build(step_phases(parts), parts, dynamic.mask_build)
    gen = generation_terms(shape, s, parts, tensors)
    by_phase, parts = with_generation(by_phase, parts, gen)
    device = dict(by_phase[phase := peak_phase(by_phase)])
    fragmentation = _fragmentation(s.allocator_overhead, s.expandable_segments)
    terms = _allocator_terms(parts, by_phase, fragmentation, s.gather_stream_cache and s.fsdp)
    device["allocator overhead"] = terms["reserved"] - sum(device.values())
    if s.sharded_checkpoint:
        device, phase = with_checkpoint_save(device, state, tensors, shape.num_layers, shard, parts.on_gpu, phase)
    device["CUDA context"] = s.cuda_context_bytes
    table = _activations_table(rank, dyn_kwargs)
    host = host_bytes(state, whole, shape, s.world_size // s.num_nodes, s.offload)  # local rank 0 loads it whole
    if s.activation_offloading:
        host["offloaded activations"] = _offloaded_host_bytes(shape, s, dyn_kwargs)
    notes = _notes(s.use_4bit, s.offload, s.loss_impl, s.sharded_checkpoint, bool(shape.num_experts))
    notes += _offload_notes(s.activation_offloading)
    notes += _layout_notes(shape, whole)
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
        "offload": s.activation_offloading,
        "lora_targets": (
            resolve_lora_targets(shape, s.lora_target_modules, s.lora_target_parameters) if s.use_peft_lora else ()
        ),
        "lora_r": s.lora_r,
        "lora_dropout": s.lora_dropout,
        "full_finetune": not s.use_peft_lora,
        "use_dora": s.use_dora,
        "quantized": s.use_4bit or s.use_8bit,
        "loss_impl": s.loss_impl,
        "loss_chunk_tokens": loss_chunk(shape, s),
        "dropout_mask_bytes": s.dropout_mask_bytes,
        "dropout_scratch_bytes": s.dropout_scratch_bytes,
    }


def _step_parts(
    shape: ModelShape, s: PlanInputs, state: dict[str, int], dynamic: _Dynamic, buffers: dict[str, Any]
) -> StepParts:
    a = compute_dtype_bytes(s.bf16, s.fp16)
    rows = s.batch_size * s.rows_per_example * s.seq_len
    # tensor parallelism's all-reduces of a block's [tokens, hidden] outputs (forward) and inputs' gradients
    reduced = act.tensor_parallel_buffer_bytes(shape, rows // s.context_parallel, a, s.tensor_parallel)
    forward = rows * act.forward_working_bytes_per_token(shape, a, looped=s.use_4bit) + dynamic.live_input
    return StepParts(
        state=state,
        on_gpu=0 if s.offload else 1,
        quant_constants=quant_constants(shape, s.use_4bit, s.use_8bit, s.nested_quant),
        grad_accum=s.grad_accum,
        forward_activations=dynamic.forward,
        stored=dynamic.stored,
        layer_stored=dynamic.stored - dynamic.final_norm,
        working=dynamic.working + reduced,
        logits_peak=dynamic.logits_peak,
        logits_kept=dynamic.logits_kept,
        logits_forward=dynamic.logits_forward,
        forward_working=forward + reduced,
        num_blocks=shape.num_layers,
        block_stored=dynamic.block,
        batch_inputs=act.BATCH_TENSORS * 8 * rows,
        **buffers,
    )


def loss_chunk(shape: ModelShape, s: PlanInputs) -> int:
    """The loss's chunk the run trains with: the given one, or the run's rule on the head's rows."""
    return s.loss_chunk_tokens or loss_chunk_tokens(shape.vocab_size)


def _offloaded_host_bytes(shape: ModelShape, s: PlanInputs, dyn_kwargs: dict[str, Any]) -> int:
    """Host RAM per machine that activation offloading takes: each local rank's copies of what its forward saves
    (act.offloaded_tensor_bytes), each in pinned memory as torch's host allocator rounds it (act.pinned_host_bytes)
    and keeps it cached for the next step."""
    tokens = dyn_kwargs["batch_size"] * dyn_kwargs["seq_len"]
    copies = act.offloaded_tensor_bytes(shape, tokens, dyn_kwargs["a"], loss_chunk(shape, s))
    return s.world_size // s.num_nodes * sum(act.pinned_host_bytes(n) for n in copies)


def _activations_table(shape: ModelShape, dyn_kwargs: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Activations + logits at the peak for each attention implementation, with and without checkpointing."""
    return {
        impl: {
            label: sum(_dynamic(shape, gradient_checkpointing=gc, attn_implementation=impl, **dyn_kwargs).peak[:2])
            for label, gc in (("checkpointing", True), ("no checkpointing", False))
        }
        for impl in act.ATTN_IMPLEMENTATIONS
    }


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


def _offload_notes(activation_offloading: bool) -> list[str]:
    note = (
        "Activation offloading: every block's input and the loss's saved tensors are copied to pinned host memory "
        "in the forward and back for the backward (torch's save_on_cpu, on the compute stream), one block's input "
        "on the GPU at a time; the copies' time is not estimated."
    )
    return [note] if activation_offloading else []


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
