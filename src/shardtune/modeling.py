"""Tokenizer, base model, quantization config and PEFT adapter; and the training module with a chunked loss.

Nothing here imports torch.distributed: sharding lives in shardtune.distributed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shardtune import fastpath
from shardtune.log import print0

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "uint8": torch.uint8,
}


def compute_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def attn_implementation(use_flash_attn: bool, device_type: str) -> str:
    """flash_attention_2 where it is installed on CUDA, otherwise SDPA run once per packed document
    (shardtune.fastpath; said once in the log)."""
    if use_flash_attn:
        if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        reason = "not on CUDA" if device_type != "cuda" else "flash_attn is not installed"
        print0(f"--use_flash_attn: {reason}; using SDPA attention, run per document of each packed row.")
    return fastpath.register_attention()


def load_tokenizer(
    model_name_or_path: str, *, tokenizer_name_or_path: str | None, chat_template_format: str, trust_remote_code: bool
):
    """Load the tokenizer and apply the chat template format; return (tokenizer, ids of tokens it added)."""
    from transformers import AutoTokenizer

    from shardtune.data.templates import setup_tokenizer

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
    dtype = DTYPES.get(name.strip().lower().removeprefix("torch."))
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

    A 4-bit base is quantized tensor by tensor while it is read (shardtune.quant); 8-bit is refused by the config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if quantization_config is not None and getattr(quantization_config, "load_in_4bit", False):
        from shardtune.quant import load_4bit_model

        model = load_4bit_model(
            model_name_or_path,
            quantization_config=quantization_config,
            dtype=dtype,
            attn_impl=attn_impl,
            trust_remote_code=trust_remote_code,
            on_meta=on_meta,
            quantize_device=quantize_device,
        )
    elif on_meta:
        config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
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


def build_skeleton(model_name_or_path: str, *, dtype: torch.dtype, attn_impl: str, trust_remote_code: bool):
    """The model with every parameter on meta (nothing read, nothing initialised) and real buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_impl, trust_remote_code=trust_remote_code
        )
    return model


def checkpoint_files(model_name_or_path: str) -> list[Path]:
    """The model's .safetensors files (downloaded from the hub when it is not a local folder)."""
    path = Path(model_name_or_path).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model_name_or_path, allow_patterns=["*.safetensors", "*.json"]))
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    raise ValueError(
        f"{model_name_or_path}: no model.safetensors (or index) found; shardtune reads safetensors checkpoints "
        "tensor by tensor. Convert the weights with transformers' save_pretrained(safe_serialization=True)."
    )


def iter_checkpoint(model_name_or_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time; pread, not mmap, so a tensor's memory is returned once it is dropped."""
    from safetensors import safe_open

    for file in checkpoint_files(model_name_or_path):
        with safe_open(str(file), framework="pt", device="cpu", backend="pread") as f:
            for name in f.offset_keys():  # in file order: sequential reads
                yield name, f.get_tensor(name)


def load_checkpoint_into(
    model: nn.Module,
    model_name_or_path: str,
    *,
    dtype: torch.dtype,
    convert: Callable[[nn.Module, str, torch.Tensor], bool] | None = None,
) -> None:
    """Fill a meta skeleton from the checkpoint one tensor at a time, each cast to dtype (as from_pretrained does).

    convert(module, name, tensor) may place a tensor itself (e.g. quantize it) and return True.
    """
    unexpected = []
    for key, tensor in iter_checkpoint(model_name_or_path):
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name) if _has_submodule(model, module_name) else None
        if module is None or (name not in module._parameters and name not in module._buffers):
            unexpected.append(key)
            continue
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if convert is not None and convert(module, name, tensor):
            continue
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(tensor, requires_grad=module._parameters[name].requires_grad)
        else:
            module._buffers[name] = tensor
        del tensor
        release_free_memory()
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{model_name_or_path}: the checkpoint lacks {len(missing)} of the model's weights (e.g. {missing[:3]}); "
            f"its tensor names (e.g. {unexpected[:3]}) do not match the model's. Load this model without "
            "--use_4bit_quantization, or save it again with transformers' save_pretrained."
        )


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc only; elsewhere a no-op).

    glibc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) in its heap; reading and quantizing
    tensor after tensor, or receiving shard after shard, then leaves a fragmented heap that holds on to memory
    nothing uses. Measured on a 1.1 GB checkpoint quantized to a 0.44 GiB 4-bit model: 0.83 GiB resident without
    this, 0.47 GiB with it.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # musl and macOS have none


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def resize_embeddings(model: nn.Module, n_tokens: int, multiple_of: int = 8) -> int:
    """Resize the embeddings to hold n_tokens, rounded up to a multiple of 8 as the reference does."""
    current = model.get_input_embeddings().weight.shape[0]
    target = -(-n_tokens // multiple_of) * multiple_of
    if n_tokens <= current:
        return current
    is_meta = model.get_input_embeddings().weight.is_meta
    # mean_resizing samples new rows from the old ones' distribution; on meta there is nothing to sample.
    model.resize_token_embeddings(n_tokens, pad_to_multiple_of=multiple_of, mean_resizing=not is_meta)
    print0(f"Resized the embeddings from {current} to {target} rows for the chat template's tokens.")
    return target


def _target_modules(spec: str) -> str | list[str]:
    """all-linear, one regular expression (peft full-matches a string against module names), or a list of names."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all-linear"] or len(names) == 1 and any(c in names[0] for c in "*+?[](){}|^$\\"):
        return names[0]
    return names


def attach_adapter(
    model: nn.Module,
    *,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    target_modules: str,
    use_dora: bool,
    modules_to_save: str | None,
    new_token_ids: list[int],
    adapter_name: str = "default",
    adapter_path: str | None = None,
) -> nn.Module:
    """Wrap the base in a PEFT LoRA/DoRA adapter; rows of newly added tokens are trained as trainable tokens."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path:
        model = PeftModel.from_pretrained(model, adapter_path, adapter_name=adapter_name, is_trainable=True)
        print0(f"Continuing training of the adapter in {adapter_path}.")
        return model
    mts = [s.strip() for s in (modules_to_save or "").split(",") if s.strip()] or None
    tti = None
    if new_token_ids:
        tti = {name: list(new_token_ids) for name in _token_modules(model, mts)}
    cfg = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=_target_modules(target_modules),
        use_dora=use_dora,
        modules_to_save=mts,
        trainable_token_indices=tti or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, cfg, adapter_name=adapter_name)
    except ValueError as e:
        if "not found in the base model" in str(e) or "Target modules" in str(e):
            raise ValueError(f"--lora_target_modules {target_modules!r} matched no module of the model: {e}") from e
        raise
    return model


def _token_modules(model: nn.Module, modules_to_save: list[str] | None) -> list[str]:
    """Embedding (and untied output head) modules whose new-token rows must be trained, unless saved in full."""
    names = []
    full = set(modules_to_save or [])
    emb_name = _module_name(model, model.get_input_embeddings())
    if emb_name and emb_name.split(".")[-1] not in full:
        names.append(emb_name.split(".")[-1])
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is model.get_input_embeddings().weight
    if out is not None and not tied:
        out_name = _module_name(model, out)
        if out_name and out_name.split(".")[-1] not in full:
            names.append(out_name.split(".")[-1])
    return names


def _module_name(root: nn.Module, target: nn.Module) -> str | None:
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


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


class CausalLMForTraining(nn.Module):
    """Wraps a (PEFT) causal LM: runs the decoder, then the output head and cross-entropy in chunks of
    positions, recomputing each chunk's logits in backward, so full fp32 [batch, seq, vocab] logits are never held.

    Labels are already shifted (labels[i] is the target of position i; -100 means none). Returns the summed
    loss and the number of targets, so that the caller normalises over the whole global batch.
    """

    def __init__(self, model: nn.Module, chunk_size: int = 1024, per_document_attention: bool = True):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.per_document_attention = per_document_attention  # see shardtune.fastpath
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # Plain attributes, not registered submodules: they are already registered under self.model.
        object.__setattr__(self, "_decoder", base.get_decoder())
        object.__setattr__(self, "_head", base.get_output_embeddings())
        cfg = base.config
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            raise ValueError(
                f"{type(base).__name__} scales its logits; shardtune's chunked loss does not support it yet."
            )

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        extra = {}
        # Compiled blocks take the masked path: spans that change every batch would recompile them.
        if self.per_document_attention and self._decoder.config._attn_implementation == fastpath.ATTENTION:
            extra[fastpath.DOCUMENTS_KWARG] = fastpath.packed_documents(position_ids)
        out = self._decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        return out.last_hidden_state

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, per_sequence: bool = False
    ):
        h = self.hidden_states(input_ids, position_ids)
        if per_sequence:  # a preference objective: through forward, so that FSDP's root hooks run
            return self._sequence_logps(h, labels)
        h, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        keep = y != -100
        if not keep.any():
            # No target in this batch (--assistant_only_loss and no assistant turn in it): a loss of exactly zero
            # that still runs through the head, so that backward reaches every parameter and this rank's FSDP
            # reduce-scatters run like the other ranks'. Its gradient is zero (0 * finite), the sum unchanged.
            return self._chunk_loss(h[:1], torch.zeros_like(y[:1])) * 0.0, keep.sum()
        h, y = h[keep], y[keep]
        total = h.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], self.chunk_size):
            hc, yc = h[start : start + self.chunk_size], y[start : start + self.chunk_size]
            if torch.is_grad_enabled():
                total = total + torch.utils.checkpoint.checkpoint(self._chunk_loss, hc, yc, use_reentrant=False)
            else:
                total = total + self._chunk_loss(hc, yc)
        return total, keep.sum()

    def _chunk_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.chunk_logits(h), y, reduction="sum")

    def chunk_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of a chunk of hidden states: the one place every loss gets its logits from."""
        return self._head(h).float()

    def _sequence_logps(self, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the targets' log-probs, number of targets) per row, through the same chunked head as the loss.

        Positions are chunked over the whole batch as in forward; each chunk's log-probs are added to their rows.
        """
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels).reshape(-1)
        h, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
        keep = y != -100
        h, y, rows = h[keep], y[keep], rows[keep]
        total = h.new_zeros(labels.shape[0], dtype=torch.float32)
        for start in range(0, h.shape[0], self.chunk_size):
            hc, yc = h[start : start + self.chunk_size], y[start : start + self.chunk_size]
            if torch.is_grad_enabled():
                lp = torch.utils.checkpoint.checkpoint(self._chunk_token_logps, hc, yc, use_reentrant=False)
            else:
                lp = self._chunk_token_logps(hc, yc)
            total = total.index_add(0, rows[start : start + self.chunk_size], lp)
        return total, torch.bincount(rows, minlength=labels.shape[0])

    def _chunk_token_logps(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -F.cross_entropy(self.chunk_logits(h), y, reduction="none")

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Full logits (for tests and evaluation of small batches)."""
        if hasattr(self, "unshard"):
            # Sharded root: calling the decoder directly skips the root's FSDP hooks, so gather its weights here.
            self.unshard()
        return self._head(self.hidden_states(input_ids, position_ids)).float()


def write_tokenizer(tokenizer, out_dir: str | Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
