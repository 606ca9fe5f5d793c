"""Build the sharded training model, in FSDP2 setup order:

1. Process group and mesh (done by `init_distributed` before this is called).
2. Model skeleton: real weights on rank 0 of each node (or on every rank without cpu_ram_efficient_loading); meta
   elsewhere. A 4-bit base is quantized tensor by tensor while it is read (shardtune.quant).
3. Resize embeddings; attach the PEFT adapter; freeze the base; packed 4-bit weights become plain parameters of
   the storage dtype (= FSDP's param dtype) with their quantization state kept on the layer.
4. Activation checkpointing per decoder block.
5. `fully_shard` each decoder block, then the root (each node's rank 0 first hands its real tensors to the
   loader, so that it shards on meta like the others).
6. Materialize and fill the shards (scattered from the node's rank 0 one tensor at a time / slice from each rank's
   own copy); give every rank the 4-bit quantization states, replicated, on its device.
7. Assert nothing is left on meta and every rank holds 1/N of each sharded tensor.
"""

from __future__ import annotations

import contextlib
import torch
from torch import nn

from shardtune import modeling, quant
from shardtune.builder import ModelSpec
from shardtune.distributed.fsdp import assert_sharded, shard_model
from shardtune.distributed.loading import (
    broadcast_quant_states,
    materialize_from_rank0,
    node_group,
    note_checkpoint_read,
    take_full_tensors,
)
from shardtune.distributed.mesh import DistInfo, all_gather_objects
from shardtune.log import print0


def build_sharded_model(spec: ModelSpec, info: DistInfo) -> modeling.CausalLMForTraining:
    """Steps 2–7 of the setup order; returns the sharded training module."""
    from_rank0 = spec.cpu_ram_efficient_loading and info.world_size > 1 and spec.read_weights
    node = node_group(info.rank, info.local_rank) if from_rank0 else None
    on_meta = (from_rank0 and not info.is_local_main) or not spec.read_weights
    quantized = spec.quantization_config is not None
    if from_rank0:
        print0(
            f"cpu_ram_efficient_loading: rank 0 of each node reads the checkpoint; the other ranks build the model "
            f"on meta and receive their shards from it ({info.world_size} rank(s))."
        )
    if not on_meta:
        note_checkpoint_read(info.rank)
    # Step 2: real weights on rank 0 of each node (or everywhere), a skeleton on meta elsewhere.
    base = modeling.load_base_model(
        spec.model_name_or_path,
        dtype=spec.dtype,
        attn_impl=spec.attn_impl,
        trust_remote_code=spec.trust_remote_code,
        quantization_config=spec.quantization_config,
        on_meta=on_meta,
        quantize_device=info.device if info.device.type == "cuda" else None,
    )
    # Step 3: resize for new tokens, attach the adapter, freeze the base.
    old_rows = base.get_input_embeddings().weight.shape[0]
    new_rows = modeling.resize_embeddings(base, spec.n_tokens)
    # Train and save every row the base checkpoint lacks (new tokens and the padding to a multiple of 8, whose
    # output logits still enter the softmax), so the adapter reproduces the trained model after reload.
    spec.new_token_ids = sorted(set(spec.new_token_ids) | set(range(old_rows, new_rows)))
    # On meta ranks, whatever PEFT allocates stays on meta (DoRA deep-copies a 4-bit layer to dequantize it).
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = _attach(base, spec)
    if spec.use_peft_lora and spec.use_dora:
        from shardtune.adapters import use_fast_dora

        # Same outputs and gradients as peft's DoRA forward, with fewer passes over the weight (docs/adapters.md).
        use_fast_dora(model, peft_dropout=spec.dora_dropout == "peft")
    if spec.use_peft_lora:
        from shardtune.fastpath import use_fast_dropout, use_fast_lora

        use_fast_dropout(model)  # the same dropout, about 3x faster on CPU (fastpath.py)
        use_fast_lora(model)  # peft's LoRA forward as one addmm per layer (fastpath.py)
    if quantized:
        quant.prepare_for_fsdp(model, spec.param_dtype)
    # Step 4: activation checkpointing inside each decoder block.
    if spec.gradient_checkpointing:
        _enable_checkpointing(model, spec)
    train_module = modeling.CausalLMForTraining(
        model, chunk_size=spec.loss_chunk_size, per_document_attention=not spec.torch_compile
    )
    blocks = [
        m
        for m in train_module.modules()
        if isinstance(m, modeling.decoder_block_classes(model, spec.transformer_cls_to_wrap))
    ]
    if spec.torch_compile:
        for b in blocks:
            b.compile()
    full_tensors = take_full_tensors(train_module) if from_rank0 and info.is_local_main else None
    # Step 5: shard each block, then the root.
    # fsdp_offload_params: FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer step in
    # host RAM. Pinned (for asynchronous copies) on CUDA; on a CPU-only machine the same policy runs unpinned, so
    # the offload path (host shards, offloaded gradients, the step on CPU tensors) is the one the tests exercise.
    offload = spec.offload
    if offload and info.device.type != "cuda":
        print0(
            "fsdp_offload_params: on a CPU-only machine the shards already live in host RAM; FSDP2's offload policy "
            "runs without pinned memory."
        )
    shard_model(
        train_module,
        blocks=blocks,
        mesh=info.mesh,
        param_dtype=spec.param_dtype,
        sharding_strategy=spec.sharding_strategy,
        offload=offload,
        pin_memory=info.device.type == "cuda",
        forward_prefetch=spec.forward_prefetch,
        backward_prefetch=spec.backward_prefetch,
        reshard_after_forward=spec.reshard_after_forward,
    )
    # Step 6: fill the shards.
    if not spec.read_weights:
        return train_module
    if from_rank0:
        materialize_from_rank0(train_module, full_tensors, info.device, node, offload=offload)
        del full_tensors
    elif info.device.type == "cuda" and not offload:
        train_module.to(info.device)
    if quantized and from_rank0:
        broadcast_quant_states(train_module, info.device, node)
    elif quantized:
        quant.move_quant_states(train_module, info.device)
    # Step 7.
    shards = info.mesh.size(-1) if info.mesh.ndim > 1 else info.world_size
    assert_sharded(train_module, shards)
    trainable, total = modeling.count_parameters(model)
    print0(
        f"Model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable "
        f"({100 * trainable / max(total, 1):.3f}%), {len(blocks)} blocks sharded over {info.world_size} rank(s)."
    )
    if quantized:
        _report_4bit(train_module, shards, offload)
    return train_module


def _report_4bit(model: nn.Module, shards: int, offload: bool) -> None:
    """Each rank holds 1/N of the packed 4-bit bytes; the quantization states are replicated."""
    per_rank = all_gather_objects(quant.quantized_bytes(model))
    mib = 2**20
    held = ", ".join(f"{b['packed_local'] / mib:.2f}" for b in per_rank)
    print0(
        f"4-bit base: {per_rank[0]['packed_total'] / mib:.2f} MiB of packed weights sharded over {shards} rank(s), "
        f"held per rank: [{held}] MiB{' (in host RAM: fsdp_offload_params)' if offload else ''}; quantization "
        f"states {per_rank[0]['quant_state'] / mib:.2f} MiB replicated on every rank."
    )


def _attach(base: nn.Module, spec: ModelSpec) -> nn.Module:
    if not spec.use_peft_lora:
        for p in base.parameters():
            p.requires_grad_(True)
        return base
    model = modeling.attach_adapter(
        base,
        lora_r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.lora_target_modules,
        use_dora=spec.use_dora,
        modules_to_save=spec.modules_to_save,
        new_token_ids=spec.new_token_ids,
        adapter_name=spec.adapter_name,
        adapter_path=spec.adapter_path,
    )
    # Trainable weights (adapter, saved modules, new token rows) are kept in fp32: the optimizer updates fp32
    # masters; FSDP's mixed precision casts them to the compute dtype for forward and backward.
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def _enable_checkpointing(model: nn.Module, spec: ModelSpec) -> None:
    """Checkpoint every k-th decoder block (k = 1: all); the others keep their activations."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    every = max(1, spec.checkpoint_every)
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": spec.use_reentrant}, every_n_layers=every
        )
    else:
        # transformers < 5.24 has only gradient_checkpointing_enable (every block); then keep every `every`-th
        # block's flag, as 5.24's every_n_layers does (counting GradientCheckpointingLayer modules in order).
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": spec.use_reentrant})
        blocks = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = i % every == 0
    if spec.use_reentrant:
        # Reentrant checkpointing only backpropagates into blocks whose inputs require grad.
        base.enable_input_require_grads()
    flags = [m.gradient_checkpointing for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    print0(f"Activation checkpointing: {sum(flags)} of {len(flags)} decoder blocks recompute their activations.")
