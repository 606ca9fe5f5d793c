"""Loading a model to train: the tokenizer, the attention implementation, the 4-bit config, the base model (or a
meta skeleton), the embeddings resized for new tokens, and the decoder blocks and parameter counts.

Nothing here imports torch.distributed: sharding lives in shardtune.parallel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from shardtune.config import dtypes
from shardtune.data.templates import padded_rows, setup_tokenizer
from shardtune.models import fastpath, quant, quant_experts
from shardtune.models.families import family_attention
from shardtune.models.weights import causal_lm_class, layout_conversions, stacked_experts
from shardtune.runtime.log import print0


def attn_implementation(use_flash_attn: bool, device_type: str) -> str:
    """flash_attention_2 where it is installed on CUDA, otherwise SDPA run once per packed document
    (shardtune.models.fastpath; said once in the log)."""
    if use_flash_attn:
        if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        reason = "not on CUDA" if device_type != "cuda" else "flash_attn is not installed"
        print0(f"--use_flash_attn: {reason}; using SDPA attention, run per document of each packed row.")
    return fastpath.register_attention()


def context_parallel_attention(attn_impl: str, context_parallel: int, compute_dtype: torch.dtype) -> tuple[str, bool]:
    """(the model's attention, whether context parallelism runs it as one flash-attention varlen call). Under
    context parallelism the model runs shardtune's attention, which holds the split (shardtune.models.fastpath); where
    flash-attention 2 was chosen (CUDA, installed, version 2.1 or later: its causal mask of fewer queries than
    keys is aligned at the bottom right) and the compute dtype is 16-bit, that attention calls flash's varlen."""
    if context_parallel == 1:
        return attn_impl, False
    flash = attn_impl == "flash_attention_2" and compute_dtype in (torch.float16, torch.bfloat16)
    if flash and _flash_version() < (2, 1):
        print0("--context_parallel_size: flash_attn older than 2.1; using SDPA per part of each row.")
        flash = False
    elif flash:
        print0("--context_parallel_size: flash-attention varlen per document, over the gathered keys.")
    return fastpath.register_attention(), flash


def _flash_version() -> tuple[int, ...]:
    version = importlib.metadata.version("flash_attn")
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def load_tokenizer(
    model_name_or_path: str, *, tokenizer_name_or_path: str | None, chat_template_format: str, trust_remote_code: bool
):
    """Load the tokenizer and apply the chat template format; return (tokenizer, ids of tokens it added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        tokenizer_name_or_path or model_name_or_path, trust_remote_code=trust_remote_code
    )
    new_ids = setup_tokenizer(tok, chat_template_format)
    return tok, list(new_ids)


def bnb_config(
    *, use_4bit: bool, use_8bit: bool, quant_type: str, compute_dtype_name: str, nested: bool, storage_dtype_name: str
):
    """A BitsAndBytesConfig for a 4-bit or 8-bit base, or None."""
    if not (use_4bit or use_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if use_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=_named_dtype(compute_dtype_name, "--bnb_4bit_compute_dtype"),
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_quant_storage=_named_dtype(storage_dtype_name, "--bnb_4bit_quant_storage_dtype"),
    )


def _named_dtype(name: str, flag: str) -> torch.dtype:
    dtype = dtypes.parse(name)
    if dtype is None:
        raise ValueError(f"{flag} {name!r} is not a dtype; use bfloat16, float16 or float32.")
    return dtype


def load_base_model(
    model_name_or_path: str,
    *,
    dtype: torch.dtype,
    attn_impl: str,
    trust_remote_code: bool,
    quantization_config=None,
    on_meta: bool = False,
    quantize_device: torch.device | None = None,
) -> nn.Module:
    """Load AutoModelForCausalLM in `dtype` (the frozen base is held in the compute dtype), or its skeleton on meta.

    A 4-bit base is quantized tensor by tensor while it is read (models.quant); 8-bit is refused by the config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    attn_impl = family_attention(config, attn_impl)
    if quantization_config is not None and getattr(quantization_config, "load_in_4bit", False):
        check_4bit_layout(config)  # on every rank, before anything is read
        # Built here, filled (or left on meta) and quantized by shardtune.models.quant one tensor at a time.
        model = build_skeleton(config, dtype=dtype, attn_impl=attn_impl, trust_remote_code=trust_remote_code)
        quant.load_4bit_into(
            model,
            model_name_or_path,
            quantization_config=quantization_config,
            dtype=dtype,
            on_meta=on_meta,
            quantize_device=quantize_device,
        )
    elif on_meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_impl, trust_remote_code=trust_remote_code
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path,
            dtype=dtype,
            attn_implementation=attn_impl,
            trust_remote_code=trust_remote_code,
            quantization_config=quantization_config,
            low_cpu_mem_usage=True,
        )
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while modules compute their buffers (rotary frequencies) for real.

    Parameters are allocated, then moved to meta as they are registered, before any initializer touches them.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = dict(param.__dict__) if type(param) is not nn.Parameter else {}
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad, **kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(config, *, dtype: torch.dtype, attn_impl: str, trust_remote_code: bool) -> nn.Module:
    """The model of a config with every parameter on meta (nothing read, nothing initialised) and real buffers."""
    from transformers import AutoModelForCausalLM

    attn_impl = family_attention(config, attn_impl)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_impl, trust_remote_code=trust_remote_code
        )
    return model


def check_4bit_layout(config, skeleton: nn.Module | None = None) -> None:
    """Refuse a family whose checkpoint the 4-bit loader cannot read: one whose tensors transformers merges while
    loading in any way but stacking experts (and concatenating gate and up), which models.quant_experts inverts;
    given the model's skeleton, also an experts module that computes outside transformers' experts interface."""
    from transformers.core_model_loading import WeightRenaming

    name = getattr(causal_lm_class(config), "__name__", config.model_type)
    for conv in layout_conversions(config):
        if isinstance(conv, WeightRenaming):
            continue
        if not stacked_experts(conv):
            raise ValueError(
                f"--use_4bit_quantization: {name} checkpoints store {_listed(conv.source_patterns)} that "
                f"transformers converts into {_listed(conv.target_patterns)} while loading in a way shardtune's "
                f"4-bit loader cannot invert. Train {name} without --use_4bit_quantization (LoRA, DoRA or full "
                "fine-tuning in bf16)."
            )
    if skeleton is not None:
        quant_experts.expert_parameters_4bit(skeleton)


def _listed(patterns) -> str:
    return ", ".join(patterns) if isinstance(patterns, list) else str(patterns)


# Set by resize_embeddings on every embedding that transformers' resize grew: its rows before. Gemma 3n's per-layer
# input embedding has fewer rows than the vocabulary (vocab_size_per_layer_input), and the resize grows it to the
# new vocabulary, so rows of old token ids are new there too and are trained and saved like the new tokens' rows.
BASE_ROWS_ATTR = "shardtune_base_rows"


def resize_embeddings(model: nn.Module, n_tokens: int) -> int:
    """Resize the embeddings to hold n_tokens, rounded up as the reference does (data.templates.padded_rows)."""
    current = model.get_input_embeddings().weight.shape[0]
    target = padded_rows(n_tokens)
    if n_tokens <= current:
        return current
    is_meta = model.get_input_embeddings().weight.is_meta
    before = {n: m.num_embeddings for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    # mean_resizing samples new rows from the old ones' distribution; on meta there is nothing to sample.
    model.resize_token_embeddings(target, mean_resizing=not is_meta)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and before.get(name, module.num_embeddings) < module.num_embeddings:
            setattr(module, BASE_ROWS_ATTR, before[name])
    print0(f"Resized the embeddings from {current} to {target} rows for the chat template's tokens.")
    return target


def decoder_block_classes(model: nn.Module, override: str | None = None) -> tuple[type, ...]:
    """The decoder block classes to shard one by one: FSDP_TRANSFORMER_CLS_TO_WRAP or the model's _no_split_modules."""
    names = [s.strip() for s in override.split(",")] if override else None
    if not names:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        names = list(getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"no module of the model is of a decoder block class {names}; set "
            "fsdp_transformer_layer_cls_to_wrap in the accelerate config to the block's class name."
        )
    return tuple(classes)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; a packed 4-bit weight counts the values it stands for, not its bytes."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        shape = getattr(getattr(module, "quant_state", None), "shape", None)
        if shape is not None:
            total += math.prod(shape) - module.weight.numel()
    return trainable, total
