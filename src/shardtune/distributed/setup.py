"""Build the sharded training model, in FSDP2 setup order:

1. Process group and mesh (done by `init_distributed` before this is called).
2. Model skeleton: real weights on rank 0 (or on every rank without cpu_ram_efficient_loading); meta elsewhere.
3. Quantize (4-bit, storage dtype = FSDP's param dtype); resize embeddings; attach the PEFT adapter; freeze the base.
4. Activation checkpointing per decoder block.
5. `fully_shard` each decoder block, then the root.
6. Materialize and fill the shards (broadcast from rank 0 / slice from each rank's own copy).
7. Assert nothing is left on meta and every rank holds 1/N of each sharded tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardtune import modeling
from shardtune.distributed.fsdp import assert_sharded, shard_model
from shardtune.distributed.loading import full_state_dict_for_broadcast, materialize_from_rank0
from shardtune.distributed.mesh import DistInfo
from shardtune.log import print0


@dataclass
class ModelSpec:
    """Everything needed to build the model, as flat values (no config objects)."""

    model_name_or_path: str
    dtype: torch.dtype  # storage dtype of the frozen base
    param_dtype: torch.dtype | None  # FSDP compute dtype (None: as stored)
    attn_impl: str
    trust_remote_code: bool
    n_tokens: int
    new_token_ids: list[int]
    use_peft_lora: bool
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: str
    use_dora: bool
    modules_to_save: str | None
    adapter_name: str
    adapter_path: str | None
    quantization_config: object | None
    gradient_checkpointing: bool
    use_reentrant: bool
    checkpoint_every: int
    sharding_strategy: str
    offload: bool
    cpu_ram_efficient_loading: bool
    forward_prefetch: bool
    backward_prefetch: str
    transformer_cls_to_wrap: str | None
    reshard_after_forward: bool | None
    torch_compile: bool
    loss_chunk_size: int = 1024


def build_sharded_model(spec: ModelSpec, info: DistInfo) -> modeling.CausalLMForTraining:
    """Steps 2–7 of the setup order; returns the sharded training module."""
    on_meta = spec.cpu_ram_efficient_loading and not info.is_main and info.world_size > 1
    assert spec.quantization_config is None or not on_meta, "4-bit meta loading is handled by shardtune.quant"
    # Step 2: real weights on rank 0 (or everywhere), a skeleton on meta elsewhere.
    base = modeling.load_base_model(
        spec.model_name_or_path,
        dtype=spec.dtype,
        attn_impl=spec.attn_impl,
        trust_remote_code=spec.trust_remote_code,
        quantization_config=spec.quantization_config,
        on_meta=on_meta,
    )
    # Step 3: resize for new tokens, attach the adapter, freeze the base.
    old_rows = base.get_input_embeddings().weight.shape[0]
    new_rows = modeling.resize_embeddings(base, spec.n_tokens)
    # Train and save every row the base checkpoint lacks (new tokens and the padding to a multiple of 8, whose
    # output logits still enter the softmax), so the adapter reproduces the trained model after reload.
    spec.new_token_ids = sorted(set(spec.new_token_ids) | set(range(old_rows, new_rows)))
    model = _attach(base, spec)
    # Step 4: activation checkpointing inside each decoder block.
    if spec.gradient_checkpointing:
        _enable_checkpointing(model, spec)
    train_module = modeling.CausalLMForTraining(model, chunk_size=spec.loss_chunk_size)
    blocks = [
        m
        for m in train_module.modules()
        if isinstance(m, modeling.decoder_block_classes(model, spec.transformer_cls_to_wrap))
    ]
    if spec.torch_compile:
        for b in blocks:
            b.compile()
    full_sd = (
        full_state_dict_for_broadcast(train_module)
        if (spec.cpu_ram_efficient_loading and info.is_main and info.world_size > 1)
        else None
    )
    # Step 5: shard each block, then the root.
    offload = spec.offload and info.device.type == "cuda"
    if spec.offload and not offload:
        print0(
            "fsdp_offload_params: on a CPU-only machine the parameters already live in host RAM; nothing to offload."
        )
    shard_model(
        train_module,
        blocks=blocks,
        mesh=info.mesh,
        param_dtype=spec.param_dtype,
        sharding_strategy=spec.sharding_strategy,
        offload=offload,
        forward_prefetch=spec.forward_prefetch,
        backward_prefetch=spec.backward_prefetch,
        reshard_after_forward=spec.reshard_after_forward,
    )
    # Step 6: fill the shards.
    if spec.cpu_ram_efficient_loading and info.world_size > 1:
        materialize_from_rank0(train_module, full_sd, info.device)
        del full_sd
    elif info.device.type == "cuda" and not offload:
        train_module.to(info.device)
    # Step 7.
    assert_sharded(train_module, info.mesh.size(-1) if info.mesh.ndim > 1 else info.world_size)
    trainable, total = modeling.count_parameters(model)
    print0(
        f"Model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable "
        f"({100 * trainable / max(total, 1):.3f}%), {len(blocks)} blocks sharded over {info.world_size} rank(s)."
    )
    return train_module


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
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": spec.use_reentrant},
        every_n_layers=max(1, spec.checkpoint_every),
    )
    if spec.use_reentrant:
        # Reentrant checkpointing only backpropagates into blocks whose inputs require grad.
        base.enable_input_require_grads()
