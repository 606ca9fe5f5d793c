"""The model builder: `ModelSpec` (what it is given), `model_facts` and `model_spec` (the one place that reads it
off a run's configuration) and `build_training_module` (load or skeleton, resize, adapter, fast paths, 4-bit
preparation, activation checkpointing: steps 2-4 of docs/architecture.md's setup order). Nothing here knows about
ranks or FSDP: `shardtune.parallel.setup.build_sharded_model(spec, info, sharding)` decides which ranks read weights,
then shards as its `ShardingSettings` say. `shardtune train` and `shardtune plan --trace` both get their spec from
`model_spec`, so the traced step is the trained one; the planner reads the same facts (`model_facts`,
planning.fit.plan_inputs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from shardtune.config.arguments import RunConfig
from shardtune.config.errors import ConfigError
from shardtune.models import adapter, families, fastpath, loading, quant, training_module
from shardtune.models.dora import use_fast_dora
from shardtune.models.fastpath import use_fast_dropout, use_fast_lora
from shardtune.runtime.log import print0


@dataclass
class ModelSpec:
    """Everything needed to build the model, as flat values (no config objects); how it is sharded is not the
    model's (parallel.parallelize.ShardingSettings). The defaults are a LoRA run of the guide's shape: all-linear
    LoRA, no checkpointing."""

    model_name_or_path: str
    dtype: torch.dtype  # storage dtype of the frozen base
    n_tokens: int  # rows of the embeddings after new tokens (0: as the checkpoint has them)
    param_dtype: torch.dtype | None = None  # the compute dtype (None: fp32, as stored)
    # The attention: as asked for ("flash_attention_2" or "sdpa", model_facts) until model_spec resolves it on the
    # device (loading.attn_implementation).
    attn_impl: str = "sdpa"
    trust_remote_code: bool = False
    new_token_ids: list[int] = field(default_factory=list)
    use_peft_lora: bool = True
    lora_r: int = 8
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    lora_target_parameters: str | None = None  # PEFT's target_parameters, words included (shardtune.models.targets)
    lora_target_experts: bool = False
    use_dora: bool = False
    dora_dropout: str = "lora_path"  # lora_path or peft (dora.use_fast_dora)
    modules_to_save: str | None = None
    adapter_name: str = "default"
    adapter_path: str | None = None
    quantization_config: object | None = None
    gradient_checkpointing: bool = False
    use_reentrant: bool = False
    checkpoint_every: int = 1
    torch_compile: bool = False
    loss_chunk_size: int | None = None  # None: training_module.loss_chunk_tokens of the head's rows
    router_aux_loss_coef: float | None = None  # None: the config's (shardtune.models.router_aux)
    # Rows hold several documents (DataArguments.packed_rows): the training forward must keep them apart.
    packing: bool = False
    # Ranks each row's positions are split over (shardtune.parallel.split); the fast path's attention only.
    context_parallel: int = 1
    # With context parallelism: its attention as one flash-attention varlen call (CUDA, flash_attn installed),
    # or SDPA per part (loading.context_parallel_attention).
    cp_varlen: bool = False
    # False: read no weights; the model is built and sharded on meta and returned there, for the caller to
    # allocate with `loading.allocate_unread` (`shardtune plan --trace` does it under fake tensors).
    read_weights: bool = True


def model_facts(cfg: RunConfig) -> ModelSpec:
    """The run's model as its flags and precision (decided once, cfg.precision) make it, before a device or a
    tokenizer: the attention as asked for, the embeddings as the checkpoint has them. The planner's model inputs are
    read off it (planning.fit.plan_inputs); `model_spec` completes it for the run. Prints nothing."""
    m, t = cfg.model, cfg.train
    precision = cfg.precision
    qcfg = loading.bnb_config(
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
        attn_impl="flash_attention_2" if m.use_flash_attn else "sdpa",
        trust_remote_code=m.trust_remote_code,
        n_tokens=0,
        use_peft_lora=m.use_peft_lora,
        lora_r=m.lora_r,
        lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout,
        lora_target_modules=m.lora_target_modules,
        lora_target_parameters=m.lora_target_parameters,
        lora_target_experts=m.lora_target_experts,
        use_dora=m.use_dora,
        modules_to_save=m.modules_to_save,
        adapter_name=m.adapter_name,
        adapter_path=m.adapter_path,
        quantization_config=qcfg,
        gradient_checkpointing=cfg.activation_checkpointing,
        use_reentrant=m.use_reentrant,
        checkpoint_every=t.checkpoint_every_n_layers,
        dora_dropout=m.dora_dropout,
        torch_compile=t.torch_compile,
        packing=cfg.data.packed_rows,
        router_aux_loss_coef=t.router_aux_loss_coef,
        context_parallel=t.context_parallel_size,
    )


def model_spec(cfg: RunConfig, device_type: str, n_tokens: int, new_token_ids: list[int]) -> ModelSpec:
    """The spec of a run on `device_type`: its facts (`model_facts`), the attention this device runs (said in the
    log where it is not the one asked for) and the embeddings' rows after the tokenizer's new tokens."""
    facts = model_facts(cfg)
    attn, cp_varlen = loading.context_parallel_attention(
        loading.attn_implementation(facts.attn_impl == "flash_attention_2", device_type),
        facts.context_parallel,
        cfg.precision.compute,
    )
    return replace(facts, attn_impl=attn, cp_varlen=cp_varlen, n_tokens=n_tokens, new_token_ids=list(new_token_ids))


def build_training_module(
    spec: ModelSpec, *, on_meta: bool, quantize_device: torch.device | None, block_classes: str | None = None
) -> tuple[training_module.CausalLMForTraining, list[nn.Module]]:
    """The unsharded training module and its decoder blocks (the units FSDP shards and torch.compile compiles).

    on_meta: build a skeleton on the meta device (no weights read); quantize_device: where 4-bit weights are
    quantized while they are read (CUDA), or None; block_classes: the decoder block classes by name (FSDP's
    transformer_cls_to_wrap, parallel.parallelize.ShardingSettings; None: the model's _no_split_modules)."""
    layout = training_layout(spec)  # before any weight is read: a refusal costs nothing
    # Step 2: real weights, or a skeleton on meta.
    base = loading.load_base_model(
        spec.model_name_or_path,
        dtype=spec.dtype,
        attn_impl=spec.attn_impl,
        trust_remote_code=spec.trust_remote_code,
        quantization_config=spec.quantization_config,
        on_meta=on_meta,
        quantize_device=quantize_device,
    )
    # Step 3: resize for new tokens, attach the adapter, freeze the base.
    old_rows = base.get_input_embeddings().weight.shape[0]
    new_rows = loading.resize_embeddings(base, spec.n_tokens)
    # Train and save every row the base checkpoint lacks (new tokens and the padding to a multiple of 8, whose
    # output logits still enter the softmax), so the adapter reproduces the trained model after reload.
    spec.new_token_ids = sorted(set(spec.new_token_ids) | set(range(old_rows, new_rows)))
    # On meta ranks, whatever PEFT allocates stays on meta (DoRA deep-copies a 4-bit layer to dequantize it).
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = _attach(base, spec)
    _use_fast_paths(model, spec)
    if spec.quantization_config is not None:
        quant.prepare_for_fsdp(model, spec.param_dtype)
    # Step 4: activation checkpointing inside each decoder block.
    if spec.gradient_checkpointing:
        _enable_checkpointing(model, spec)
    train_module = training_module.CausalLMForTraining(
        model,
        chunk_size=spec.loss_chunk_size,
        per_document_attention=not spec.torch_compile,
        layout=layout,
        router_aux_loss_coef=spec.router_aux_loss_coef,
        cp_varlen=spec.cp_varlen,
    )
    block_types = loading.decoder_block_classes(model, block_classes)
    blocks = [m for m in train_module.modules() if isinstance(m, block_types)]
    if spec.torch_compile:
        for b in blocks:
            b.compile()
    return train_module, blocks


def training_layout(spec: ModelSpec) -> families.Layout:
    """How the training module computes the family's logits, from the conformance check on a tiny copy of the
    model's config (shardtune.models.families): the fast path where it is the model's own function, else the model's own
    forward; said in the log. Packed rows on a family whose forward cannot keep documents apart are refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.model_name_or_path, trust_remote_code=spec.trust_remote_code)
    attn = families.family_attention(config, spec.attn_impl)
    verdict = families.verdict(config, attn, training_module.CausalLMForTraining)
    layout = verdict.layout(spec.packing)
    print0(families.summary(verdict, layout, spec.packing))
    if spec.packing and not verdict.packing_ok(layout):
        if not verdict.checked:
            print0(f"warning: --packing: packed documents are not verified to stay apart on {config.model_type} "
                   "(the check could not run); train with --packing False to be sure.")  # fmt: skip
        else:
            problem = (
                f"--packing: {config.model_type} cannot keep packed documents apart ({verdict.reason}: a "
                "recurrent state or a mask runs across them); train it with --packing False."
            )
            raise ConfigError([problem])
    if spec.context_parallel > 1:
        problems = context_parallel_problems(config, layout, verdict, attn, spec)
        if problems:
            raise ConfigError(problems)
    return layout


def context_parallel_problems(
    config, layout: families.Layout, verdict: families.Verdict, attn: str, spec: ModelSpec
) -> list[str]:
    """What the model needs for context parallelism: shardtune's own per-document attention on the fast path (the
    gathered keys and values are attended there), and no sliding window or soft-capped scores (not in that
    attention yet)."""
    flag = f"--context_parallel_size {spec.context_parallel}"
    text = config.get_text_config()
    p = []
    if layout.split:
        p.append(f"{flag}: {config.model_type}'s packed documents are decoded as rows of their own (its recurrent "
                 "mixers or attention sinks would carry across documents), and context parallelism does not split "
                 "those rows over ranks yet; use --context_parallel_size 1 for this model.")  # fmt: skip
    elif layout.path != "fast" or not verdict.fast_packing or attn != fastpath.ATTENTION:
        p.append(f"{flag}: {config.model_type} trains through its own forward or attention here ({attn}), not "
                 "shardtune's per-document attention, which context parallelism runs in; use "
                 "--context_parallel_size 1 for this model.")  # fmt: skip
    if not families.plain_causal(config) or getattr(text, "attn_logit_softcapping", None):
        p.append(f"{flag}: {config.model_type} has sliding-window, chunked or soft-capped attention, which the "
                 "context-parallel attention does not implement yet; use --context_parallel_size 1.")  # fmt: skip
    return p


def _use_fast_paths(model: nn.Module, spec: ModelSpec) -> None:
    """Same outputs and gradients as peft's forward, with fewer passes (docs/adapters.md, fastpath.py)."""
    if not spec.use_peft_lora:
        return

    if spec.use_dora:
        use_fast_dora(model, peft_dropout=spec.dora_dropout == "peft")
    use_fast_dropout(model)  # the same dropout, about 3x faster on CPU
    use_fast_lora(model)  # peft's LoRA forward as one addmm per layer


def _attach(base: nn.Module, spec: ModelSpec) -> nn.Module:
    if not spec.use_peft_lora:
        for p in base.parameters():
            p.requires_grad_(True)
        return base
    model = adapter.attach_adapter(
        base,
        lora_r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.lora_target_modules,
        target_parameters=spec.lora_target_parameters,
        target_experts=spec.lora_target_experts,
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
