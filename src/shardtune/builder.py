"""What the model builder is given: `ModelSpec`, and the one place that reads it off a run's configuration.

`shardtune.distributed.setup.build_sharded_model(spec, info)` builds from it; `shardtune train` and
`shardtune plan --trace` both get their spec from `model_spec`, so the traced step is the trained one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardtune import modeling
from shardtune.config import RunConfig


@dataclass
class ModelSpec:
    """Everything needed to build the model, as flat values (no config objects). The defaults are a LoRA run of
    the guide's shape: all-linear LoRA, FULL_SHARD, every rank loading, no checkpointing."""

    model_name_or_path: str
    dtype: torch.dtype  # storage dtype of the frozen base
    n_tokens: int  # rows of the embeddings after new tokens
    param_dtype: torch.dtype | None = None  # FSDP compute dtype (None: as stored)
    attn_impl: str = "sdpa"
    trust_remote_code: bool = False
    new_token_ids: list[int] = field(default_factory=list)
    use_peft_lora: bool = True
    lora_r: int = 8
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    use_dora: bool = False
    dora_dropout: str = "lora_path"  # lora_path or peft (adapters.use_fast_dora)
    modules_to_save: str | None = None
    adapter_name: str = "default"
    adapter_path: str | None = None
    quantization_config: object | None = None
    gradient_checkpointing: bool = False
    use_reentrant: bool = False
    checkpoint_every: int = 1
    sharding_strategy: str = "FULL_SHARD"
    offload: bool = False
    cpu_ram_efficient_loading: bool = False
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    transformer_cls_to_wrap: str | None = None
    reshard_after_forward: bool | None = None
    torch_compile: bool = False
    loss_chunk_size: int = 1024
    # False: read no weights; the model is built and sharded on meta and returned there, for the caller to
    # allocate with `loading.allocate_unread` (`shardtune plan --trace` does it under fake tensors).
    read_weights: bool = True


def model_spec(cfg: RunConfig, device_type: str, n_tokens: int, new_token_ids: list[int]) -> ModelSpec:
    """The spec of a run: its model flags, its FSDP settings and its precision (decided once, cfg.precision)."""
    m, t, f = cfg.model, cfg.train, cfg.fsdp
    precision = cfg.precision
    qcfg = modeling.bnb_config(
        use_4bit=m.use_4bit_quantization,
        use_8bit=m.use_8bit_quantization,
        quant_type=m.bnb_4bit_quant_type,
        compute_dtype_name=m.bnb_4bit_compute_dtype,
        nested=m.use_nested_quant,
        storage_dtype_name=m.bnb_4bit_quant_storage_dtype,
    )
    return ModelSpec(
        model_name_or_path=m.model_name_or_path,
        dtype=precision.storage,
        param_dtype=precision.param_dtype,
        attn_impl=modeling.attn_implementation(m.use_flash_attn, device_type),
        trust_remote_code=m.trust_remote_code,
        n_tokens=n_tokens,
        new_token_ids=list(new_token_ids),
        use_peft_lora=m.use_peft_lora,
        lora_r=m.lora_r,
        lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout,
        lora_target_modules=m.lora_target_modules,
        use_dora=m.use_dora,
        modules_to_save=m.modules_to_save,
        adapter_name=m.adapter_name,
        adapter_path=m.adapter_path,
        quantization_config=qcfg,
        gradient_checkpointing=t.gradient_checkpointing or f.activation_checkpointing,
        use_reentrant=m.use_reentrant,
        checkpoint_every=t.checkpoint_every_n_layers,
        dora_dropout=m.dora_dropout,
        sharding_strategy=f.sharding_strategy,
        offload=f.offload_params,
        cpu_ram_efficient_loading=f.cpu_ram_efficient_loading,
        forward_prefetch=f.forward_prefetch,
        backward_prefetch=f.backward_prefetch,
        transformer_cls_to_wrap=f.transformer_cls_to_wrap,
        reshard_after_forward=f.reshard_after_forward,
        torch_compile=t.torch_compile,
    )
