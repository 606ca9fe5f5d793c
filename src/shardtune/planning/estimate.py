"""Per-GPU and host memory of one shardtune training step, from the model's shapes and the run's settings.

The estimate follows what shardtune's FSDP2 training holds: each decoder block and then the root are
`fully_shard`-ed; every parameter is sharded on dim 0 (padded to a multiple of the shard group); the frozen base is
kept in the compute dtype (or packed 4-bit); LoRA adapters, their gradients and AdamW's two states are fp32; full
fine-tuning keeps fp32 master weights and all-gathers them in the compute dtype. See docs/plan.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardtune.planning import activations as act
from shardtune.planning import phases
from shardtune.planning.model import (
    DTYPE_BYTES,
    ModelShape,
    Tensor,
    model_tensors,
    quant_constant_bytes,
    resolve_lora_targets,
    sharded_bytes,
)

GiB = 1024**3
# nvidia-smi counts the CUDA context, cuBLAS workspaces and NCCL's buffers besides PyTorch's allocations.
CUDA_CONTEXT_BYTES = int(0.8 * GiB)
# PyTorch's caching allocator reserves more than the peak of live tensors (blocks split and cached between the
# many differently sized activations); reserved ~ allocated * (1 + this).
ALLOCATOR_OVERHEAD = 0.15
# Each host process (Python, torch, CUDA runtime, data loading) before any model state.
HOST_PROCESS_BYTES = 2 * GiB
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit")
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
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    # Allocated bytes at each of the step's phases (planning.phases), of which `device` is the largest.
    phase_bytes: dict[str, int] = field(default_factory=dict)

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
            "settings": dict(self.settings),
            "notes": list(self.notes),
            "phase_bytes": dict(self.phase_bytes),
        }


def _as_shape(model: ModelShape | Mapping | Any) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape.from_config(model)


def compute_dtype_bytes(bf16: bool, fp16: bool) -> int:
    return 2 if (bf16 or fp16) else 4


def shard_group_size(world_size: int, num_nodes: int, sharding_strategy: str) -> int:
    """Ranks one parameter is split over: all of them, those of one node (hybrid), or none (NO_SHARD)."""
    strategy = sharding_strategy.upper()
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding strategy {sharding_strategy!r}: use one of {', '.join(SHARDING_STRATEGIES)}")
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"world size {world_size} must be a positive multiple of the number of machines {num_nodes}")
    if strategy == "NO_SHARD":
        return 1
    return world_size // num_nodes if strategy.startswith("HYBRID") else world_size


def _state_bytes_per_element(t: Tensor, optim: str) -> int:
    """AdamW keeps two states like the parameter; bitsandbytes' 8-bit AdamW two uint8 states (+ fp32 absmax per
    256) for tensors of at least 4096 elements, and 32-bit states below that."""
    if optim not in OPTIMIZERS:
        raise ValueError(f"--optim {optim!r}: use one of {', '.join(OPTIMIZERS)}")
    if optim.endswith("8bit") and t.numel >= 4096:
        return 2  # the fp32 absmax per 256-block adds 8/256 bytes, counted in _optimizer_bytes
    return 2 * t.itemsize


def _optimizer_bytes(t: Tensor, shard: int, optim: str, rank: int | None) -> int:
    per = _state_bytes_per_element(t, optim)
    local = sharded_bytes(t, shard, rank, itemsize=per)
    if optim.endswith("8bit") and t.numel >= 4096:
        local += 2 * 4 * -(-(local // 2) // 256)
    return local


def _dtype_bytes(name: str, what: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"{what} {name!r}: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _tensors(
    shape: ModelShape,
    *,
    bf16: bool,
    fp16: bool,
    use_4bit: bool,
    use_8bit: bool,
    quant_storage_dtype: str,
    use_peft_lora: bool,
    lora_r: int,
    lora_target_modules: str | Sequence[str],
    use_dora: bool,
    modules_to_save: Sequence[str],
    base_dtype: str | None,
    adapter_dtype: str,
) -> list[Tensor]:
    a = compute_dtype_bytes(bf16, fp16)
    targets = resolve_lora_targets(shape, lora_target_modules) if use_peft_lora else ()
    return model_tensors(
        shape,
        base_bytes=_dtype_bytes(base_dtype, "base_dtype") if base_dtype else a,
        trainable_bytes=_dtype_bytes(adapter_dtype, "adapter_dtype") if use_peft_lora else 4,
        use_4bit=use_4bit,
        use_8bit=use_8bit,
        quant_storage_bytes=_dtype_bytes(quant_storage_dtype, "quant_storage_dtype"),
        full_finetune=not use_peft_lora,
        lora_r=lora_r,
        lora_targets=targets,
        use_dora=use_dora,
        modules_to_save=modules_to_save,
    )


def _quant_constants(shape: ModelShape, use_4bit: bool, use_8bit: bool, nested_quant: bool) -> int:
    """Constants bitsandbytes keeps beside the quantized weights; they are not FSDP parameters, so every rank
    holds all of them on its GPU."""
    if not (use_4bit or use_8bit):
        return 0
    bits = 4 if use_4bit else 8
    dims = shape.linear_dims().values()
    return shape.num_layers * sum(quant_constant_bytes(i, o, nested_quant, bits) for i, o in dims)


def _state_per_rank(
    shape: ModelShape, tensors: list[Tensor], shard: int, optim: str, rank: int | None
) -> dict[str, int]:
    out = {"frozen": 0, "trainable": 0, "gradients": 0, "optimizer": 0}
    for t in tensors:
        n = shape.num_layers if t.group == "block" else 1
        local = sharded_bytes(t, shard, rank) * n
        if t.trainable:
            out["trainable"] += local
            out["gradients"] += local
            out["optimizer"] += _optimizer_bytes(t, shard, optim, rank) * n
        else:
            out["frozen"] += local
    return out


def model_state_bytes_per_rank(
    model: ModelShape | Mapping | Any,
    *,
    world_size: int = 1,
    num_nodes: int = 1,
    sharding_strategy: str = "FULL_SHARD",
    bf16: bool = True,
    fp16: bool = False,
    use_4bit: bool = False,
    use_8bit: bool = False,
    nested_quant: bool = False,
    quant_storage_dtype: str = "bfloat16",
    use_peft_lora: bool = True,
    lora_r: int = 8,
    lora_target_modules: str | Sequence[str] = "all-linear",
    use_dora: bool = False,
    modules_to_save: Sequence[str] = (),
    optim: str = "adamw_torch",
    base_dtype: str | None = None,
    adapter_dtype: str = "float32",
    rank: int | None = None,
) -> dict[str, int]:
    """Bytes of model state one rank holds after `fully_shard`: frozen and trainable parameters, gradients and
    optimizer states (each tensor split on dim 0 with torch.chunk), plus the replicated quantization constants.

    rank=None gives the padded shard every rank allocates; a rank number gives that rank's real chunk, i.e.
    what `param.to_local()` holds there.
    """
    shape = _as_shape(model)
    shard = shard_group_size(world_size, num_nodes, sharding_strategy)
    tensors = _tensors(
        shape,
        bf16=bf16,
        fp16=fp16,
        use_4bit=use_4bit,
        use_8bit=use_8bit,
        quant_storage_dtype=quant_storage_dtype,
        use_peft_lora=use_peft_lora,
        lora_r=lora_r,
        lora_target_modules=lora_target_modules,
        use_dora=use_dora,
        modules_to_save=modules_to_save,
        base_dtype=base_dtype,
        adapter_dtype=adapter_dtype,
    )
    out = _state_per_rank(shape, tensors, shard, optim, None if rank is None else rank % shard)
    out["quant_constants"] = _quant_constants(
        shape, use_4bit and use_peft_lora, use_8bit and use_peft_lora, nested_quant
    )
    out["total"] = sum(out.values())
    return out


def _unsharded_bytes(tensors: list[Tensor], group: str, compute_bytes: int, trainable_only: bool = False) -> int:
    """Bytes of one group's parameters once all-gathered: quantized weights as stored, the rest in the compute
    dtype (FSDP2's MixedPrecisionPolicy casts them)."""
    return sum(
        t.numel * (t.itemsize if t.quantized else compute_bytes)
        for t in tensors
        if t.group == group and (t.trainable or not trainable_only)
    )


def _fsdp_buffers(
    shape: ModelShape, tensors: list[Tensor], *, a: int, shard: int, strategy: str, prefetch: bool, offload: bool
) -> dict[str, int]:
    """The FSDP pieces of phases.StepParts: one block's and the root's unsharded parameters in the compute dtype
    (4-bit weights as stored), how many blocks are gathered at once, the host-to-GPU copies of offloaded shards,
    and a block's or the root's unsharded gradients plus their fp32 reduce-scatter input (`a + 4` bytes each)."""
    keep_all = strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")
    # With one rank per shard group FSDP2 copies a prefetched block's shard at its wait, not at its issue, so
    # one block is gathered at a time in backward; otherwise the prefetched block's all-gather output exists.
    in_flight = (2 if prefetch and shard > 1 else 1) if not keep_all else shape.num_layers
    block_shard = sum(sharded_bytes(t, shard) for t in tensors if t.group == "block")
    return {
        "root_gathered": _unsharded_bytes(tensors, "root", a),
        "block_gathered": _unsharded_bytes(tensors, "block", a),
        "blocks_in_flight": min(in_flight, shape.num_layers),
        "kept_after_forward": shape.num_layers if keep_all else 1,
        "flat_copy": shard > 1,
        "offload_copies": block_shard * (2 if prefetch else 1) if offload else 0,
        "block_scatter": _unsharded_bytes(tensors, "block", a + 4, trainable_only=True),
        "root_scatter": _unsharded_bytes(tensors, "root", a + 4, trainable_only=True),
        "root_grad_shard": sum(sharded_bytes(t, shard) for t in tensors if t.group == "root" and t.trainable),
        # The head's and final norm's gradients are made in the loss's backward and wait, unsharded in the compute
        # dtype, for the root's reduce-scatter after every block; the embeddings' come last.
        "root_early_grads": a
        * sum(t.numel for t in tensors if t.group == "root" and t.trainable and not t.name.startswith("embed_")),
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

    @property
    def peak(self) -> tuple[int, int, str]:
        """(activations, logits) at the peak, and whether it is in the loss's or in the layers' backward."""
        loss_phase = self.stored + self.logits_peak
        layer_phase = self.stored + self.working + self.logits_kept
        if loss_phase >= layer_phase:
            return self.stored, self.logits_peak, "loss backward"
        return self.stored + self.working, self.logits_kept, "decoder-layer backward"


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
) -> _Dynamic:
    if attn_implementation not in act.ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {attn_implementation!r}: use one of {', '.join(act.ATTN_IMPLEMENTATIONS)}"
        )
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
        dropout_mask_bytes=dropout_mask_bytes,
    )
    fixed = tokens * act.final_norm_bytes_per_token(shape, a) + act.attention_mask_bytes(
        batch_size, seq_len, a, attn_implementation, packing
    )
    # A quantized linear is dequantized to a full compute-dtype weight for its matmul, forward and backward.
    dequant = a * max(i * o for i, o in shape.linear_dims().values()) if quantized else 0
    working = tokens * act.backward_working_bytes_per_token(shape, a) + dequant
    if use_dora:
        working += act.dora_transient_bytes(shape, a, lora_targets)
    if gradient_checkpointing:  # one saved input per block, and one block recomputed at a time
        stored, working = shape.num_layers * tokens * a * shape.hidden_size + fixed, working + layer
    else:
        stored = shape.num_layers * layer + fixed
    peak, kept = act.logits_bytes(tokens, shape.vocab_size, a, loss_impl, loss_chunk_tokens)
    forward = tokens * a * shape.hidden_size + act.attention_mask_bytes(
        batch_size, seq_len, a, attn_implementation, packing
    )
    return _Dynamic(
        stored,
        working,
        peak,
        kept,
        forward,
        act.loss_forward_bytes(tokens, shape.vocab_size, a, loss_impl, loss_chunk_tokens),
        tokens * act.final_norm_bytes_per_token(shape, a),
    )


def estimate_memory(
    model: ModelShape | Mapping | Any,
    *,
    world_size: int = 1,
    num_nodes: int = 1,
    sharding_strategy: str = "FULL_SHARD",
    offload: bool = False,
    bf16: bool = True,
    fp16: bool = False,
    use_4bit: bool = False,
    use_8bit: bool = False,
    nested_quant: bool = False,
    quant_storage_dtype: str = "bfloat16",
    use_peft_lora: bool = True,
    lora_r: int = 8,
    lora_target_modules: str | Sequence[str] = "all-linear",
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    modules_to_save: Sequence[str] = (),
    batch_size: int = 1,
    rows_per_example: int = 1,
    seq_len: int = 2048,
    gradient_checkpointing: bool = True,
    attn_implementation: str = "sdpa",
    packing: bool = False,
    optim: str = "adamw_torch",
    grad_accum: int = 1,
    loss_impl: str = "chunked",
    loss_chunk_tokens: int = 1024,
    base_dtype: str | None = None,
    adapter_dtype: str = "float32",
    prefetch: bool = True,
    sharded_checkpoint: bool = False,
    dropout_mask_bytes: int = act.CUDA_DROPOUT_MASK_BYTES,
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES,
    allocator_overhead: float = ALLOCATOR_OVERHEAD,
) -> MemoryEstimate:
    """Peak memory of one training step on each GPU, by category, and host RAM per machine.

    The defaults describe shardtune itself. base_dtype, adapter_dtype, loss_impl, prefetch and sharded_checkpoint
    describe other trainers (e.g. a base held in fp32 with bf16 autocast; the HF Trainer saving FSDP1 checkpoints
    with SHARDED_STATE_DICT, which copies every parameter's shard on the GPU), which the published comparisons use.
    """
    settings = {k: v for k, v in locals().items() if k != "model"}
    shape = _as_shape(model)
    strategy = sharding_strategy.upper()
    shard = shard_group_size(world_size, num_nodes, strategy)
    a = compute_dtype_bytes(bf16, fp16)
    rows = batch_size * rows_per_example  # the rows of one micro-batch: a preference pair is two
    if (use_4bit or use_8bit) and not use_peft_lora:
        raise ValueError("a quantized base cannot be fully fine-tuned: use LoRA (use_peft_lora=True)")
    tensors = _tensors(
        shape,
        bf16=bf16,
        fp16=fp16,
        use_4bit=use_4bit,
        use_8bit=use_8bit,
        quant_storage_dtype=quant_storage_dtype,
        use_peft_lora=use_peft_lora,
        lora_r=lora_r,
        lora_target_modules=lora_target_modules,
        use_dora=use_dora,
        modules_to_save=modules_to_save,
        base_dtype=base_dtype,
        adapter_dtype=adapter_dtype,
    )
    state = _state_per_rank(shape, tensors, shard, optim, None)
    buffers = _fsdp_buffers(shape, tensors, a=a, shard=shard, strategy=strategy, prefetch=prefetch, offload=offload)
    targets = resolve_lora_targets(shape, lora_target_modules) if use_peft_lora else ()
    dyn_kwargs = {
        "a": a,
        "batch_size": rows,
        "seq_len": seq_len,
        "packing": packing,
        "lora_targets": targets,
        "lora_r": lora_r,
        "lora_dropout": lora_dropout,
        "full_finetune": not use_peft_lora,
        "use_dora": use_dora,
        "quantized": use_4bit or use_8bit,
        "loss_impl": loss_impl,
        "loss_chunk_tokens": loss_chunk_tokens,
        "dropout_mask_bytes": dropout_mask_bytes,
    }
    dynamic = _dynamic(
        shape, gradient_checkpointing=gradient_checkpointing, attn_implementation=attn_implementation, **dyn_kwargs
    )
    parts = phases.StepParts(
        state=state,
        on_gpu=0 if offload else 1,
        quant_constants=_quant_constants(shape, use_4bit, use_8bit, nested_quant),
        grad_accum=grad_accum,
        forward_activations=dynamic.forward,
        stored=dynamic.stored,
        layer_stored=dynamic.stored - dynamic.final_norm,
        working=dynamic.working,
        logits_peak=dynamic.logits_peak,
        logits_kept=dynamic.logits_kept,
        logits_forward=dynamic.logits_forward,
        forward_working=rows * seq_len * 4 * a * shape.intermediate_size,
        num_blocks=shape.num_layers,
        **buffers,
    )
    by_phase = phases.step_phases(parts)
    phase = phases.peak_phase(by_phase)
    device = dict(by_phase[phase])
    on_gpu = parts.on_gpu
    device["allocator overhead"] = int(allocator_overhead * sum(device.values()))
    if sharded_checkpoint:
        device, phase = _with_checkpoint_save(device, state, tensors, shape.num_layers, shard, on_gpu, phase)
    device["CUDA context"] = cuda_context_bytes
    table = {
        impl: {
            label: sum(_dynamic(shape, gradient_checkpointing=gc, attn_implementation=impl, **dyn_kwargs).peak[:2])
            for label, gc in (("checkpointing", True), ("no checkpointing", False))
        }
        for impl in act.ATTN_IMPLEMENTATIONS
    }
    host = _host(state, tensors, shape, world_size // num_nodes, offload)
    notes = _notes(use_4bit, offload, loss_impl, sharded_checkpoint)
    if shape.num_experts:
        notes.append(
            "mixture of experts: the parameters, gradients and optimizer states are exact and the forward phases "
            "model the experts' all-gathers, but not the routing nor the experts' activations and backward "
            "working memory (they are taken as one dense MLP of the experts' width); --trace runs the real step."
        )
    phase_bytes = {k: sum(v.values()) for k, v in by_phase.items()}
    return MemoryEstimate(device, host, table, phase, dynamic.logits_peak, settings, notes, phase_bytes)


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
    exceeds them, so the reserved peak is the larger of the step's reserved bytes and the save's live bytes.
    """
    copies, gathered = _sharded_save(tensors, num_layers, shard)
    rows = [k for k in step if k != "allocator overhead"] + [SAVE_COPIES_ROW, "allocator overhead"]
    save = dict.fromkeys(rows, 0)
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


def _host(
    state: dict[str, int], tensors: list[Tensor], shape: ModelShape, local_ranks: int, offload: bool
) -> dict[str, int]:
    """Host RAM per machine: offloaded shards of every local rank, and the full model that local rank 0 builds
    in its training dtypes (4-bit packed once quantized) before it is sharded."""
    full = sum(t.numel * t.itemsize * (shape.num_layers if t.group == "block" else 1) for t in tensors)
    on_host = local_ranks if offload else 0
    return {
        "offloaded parameters": (state["frozen"] + state["trainable"]) * on_host,
        "offloaded gradients": state["gradients"] * on_host,
        "offloaded optimizer state": state["optimizer"] * on_host,
        "model loading (local rank 0)": full,
        "processes": HOST_PROCESS_BYTES * local_ranks,
    }


def _notes(use_4bit: bool, offload: bool, loss_impl: str, sharded_checkpoint: bool) -> list[str]:
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
    return notes
