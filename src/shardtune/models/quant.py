"""4-bit frozen bases (bitsandbytes) under FSDP2.

- `quantization_problems`: flag combinations that would train wrongly, refused before loading.
- `load_4bit_into`: turns the model's meta skeleton (built by shardtune.models.loading) into 4-bit layers and fills it
  tensor by tensor from the safetensors files (shardtune.models.weights), quantizing each linear weight as soon as it is
  read, so the whole bf16 model is never in memory. On ranks that receive their shards from rank 0 it reads
  nothing (packed shapes, quantization state on meta).
- Fused expert tensors of a mixture of experts are quantized expert by expert into shardtune.models.quant_experts'
  `Experts4bit`, which holds a packed weight and a (stacked) QuantState as a Linear4bit does: `packed_modules`
  yields both, and everything below that shards, moves or broadcasts 4-bit weights and states goes through it.
- `prepare_for_fsdp`: each packed weight becomes an ordinary parameter of the storage dtype (which FSDP2 shards
  and all-gathers like any bf16 tensor) and its `QuantState` stays on the layer, replicated on every rank.

FSDP2 turns parameters into DTensors, which drops `Params4bit.quant_state`. bitsandbytes' `Linear4bit.forward`
rebuilds the `Params4bit` from `module.quant_state` when the weight has lost it
(`fix_4bit_weight_quant_state_from_module`, written for FSDP), so the all-gathered weight finds its state on
every forward; PEFT's DoRA dequantizes that same rebuilt `Params4bit`.

Nothing here imports torch.distributed: broadcasting the states lives in shardtune.parallel.loading.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

from shardtune.config import dtypes
from shardtune.config.precision import Precision
from shardtune.models import quant_experts
from shardtune.models.weights import checkpoint_renaming, load_checkpoint_into

# How to ask for each precision, for the message when the storage dtype and the run's precision differ.
_PRECISION_FOR = {"bfloat16": "--bf16 True", "float16": "--fp16 True", "float32": "neither --bf16 nor --fp16"}


def bitsandbytes_missing(flag: str) -> str | None:
    """Why `flag` cannot run when bitsandbytes is not installed (None when it is): it is the optional extra
    `qlora`, so that shardtune installs where no bitsandbytes build exists."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        return (
            f"{flag} needs bitsandbytes, which is not installed ({e}): pip install 'shardtune[qlora]' "
            "(or pip install bitsandbytes)."
        )
    return None


# peft's cached answers to "is bitsandbytes installed?" (peft.import_utils), which decide whether it imports
# bitsandbytes to wrap a layer; transformers' own (transformers.utils.import_utils), in case peft's import asked it.
_BITSANDBYTES_CHECKS = (
    ("peft.import_utils", "is_bnb_available"),
    ("peft.import_utils", "is_bnb_4bit_available"),
    ("transformers.utils.import_utils", "is_bitsandbytes_available"),
)


@contextlib.contextmanager
def bitsandbytes_for_peft(needed: bool) -> Iterator[None]:
    """A run without a 4-bit base does not import bitsandbytes (0.7 s or more of start-up: it imports
    torch.compile's machinery). peft imports it when peft is first imported (peft.helpers, which does without it)
    and whenever it wraps a layer in LoRA, if peft.import_utils.is_bnb_available() says it is installed (a cached
    answer). Unless `needed`, peft is imported here and asked with bitsandbytes hidden (`import bitsandbytes`
    fails, find_spec finds nothing), so that it answers "absent" for the run; on leaving, every cached answer is
    forgotten, so that what runs next in this process (a 4-bit run, the eval harness) is answered afresh. A run
    that needs it, or a process that has imported it already, is answered afresh now."""
    if not needed and "bitsandbytes" not in sys.modules:
        _peft_without_bitsandbytes()
    else:
        _forget_bitsandbytes_checks()
    try:
        yield
    finally:
        _forget_bitsandbytes_checks()


def _peft_without_bitsandbytes() -> None:
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        import peft  # noqa: F401  (peft.helpers tries bitsandbytes at import and does without it)

        for module, name in _BITSANDBYTES_CHECKS[:2]:
            check = getattr(sys.modules[module], name, None)
            if check is not None:
                check()  # cached: "absent" for the run
    except ImportError:  # a peft (or transformers) that cannot import without it: it imports it as usual
        _forget_bitsandbytes_checks()
    finally:
        if sys.modules.get("bitsandbytes", 0) is None:
            del sys.modules["bitsandbytes"]
        _forget_bitsandbytes_checks(_BITSANDBYTES_CHECKS[2:])  # answered during peft's import, if it was


def _forget_bitsandbytes_checks(checks=_BITSANDBYTES_CHECKS) -> None:
    for module, name in checks:
        check = getattr(sys.modules.get(module), name, None)
        if hasattr(check, "cache_clear"):
            check.cache_clear()


def quantization_problems(
    *,
    use_4bit: bool,
    use_8bit: bool,
    quant_storage_dtype: str,
    precision: Precision,
    fsdp_enabled: bool,
    compute_dtype: str = "float16",
) -> list[str]:
    """Combinations that would train wrongly under FSDP, each with the flags to set, and a 4-bit compute dtype that
    is not one (read when the run's spec is derived, which the start-up plan does on rank 0 alone: refused here,
    on every rank). `precision`: the run's (`RunConfig.precision`), whose compute dtype the messages ask for and
    whose `flags` say how it was asked for."""
    problems = []
    # The packed weights are FSDP parameters: they must be stored in the dtype FSDP computes in.
    want = dtypes.name_of(precision.compute)
    if use_8bit:
        problems.append(
            "--use_8bit_quantization is not supported: shardtune shards every model with FSDP2 (a single process "
            "too), and bitsandbytes' 8-bit layers keep int8 weights with per-row scales that FSDP2 can neither cast "
            "nor all-gather with their scales. Use 4-bit QLoRA instead: --use_4bit_quantization True "
            f"--bnb_4bit_quant_storage_dtype {want}."
        )
    if not use_4bit:
        return problems
    missing = bitsandbytes_missing("--use_4bit_quantization True")
    if missing:
        return [*problems, missing]
    if dtypes.parse(compute_dtype) is None:  # the line models.loading.bnb_config would raise
        problems.append(f"--bnb_4bit_compute_dtype {compute_dtype!r} is not a dtype; use bfloat16, float16 or float32.")
    storage = dtypes.canonical(quant_storage_dtype)
    if storage not in (*dtypes.FLOATING, "uint8"):
        problems.append(
            f"--bnb_4bit_quant_storage_dtype {quant_storage_dtype!r} is not a dtype; use {want} "
            "(the dtype FSDP computes in)."
        )
    elif storage == "uint8" and fsdp_enabled:
        problems.append(
            "--bnb_4bit_quant_storage_dtype uint8 (the default) cannot be used under FSDP: the packed 4-bit weights "
            "are sharded and all-gathered as FSDP parameters, which must be of FSDP's floating parameter dtype. "
            f"Set --bnb_4bit_quant_storage_dtype {want} (with {precision.flags})."
        )
    elif storage != "uint8" and storage != want and (fsdp_enabled or want != "float32"):
        problems.append(
            f"--bnb_4bit_quant_storage_dtype {storage} differs from FSDP's parameter dtype {want} "
            f"({precision.flags}): FSDP would cast the packed 4-bit bytes as if they "
            f"were numbers. Set --bnb_4bit_quant_storage_dtype {want}, or match the precision to the storage "
            f"({_PRECISION_FOR[storage]})."
        )
    return problems


def linear4bit_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every bitsandbytes 4-bit linear layer, in module order (the same order on every rank)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # never imported (a run without a 4-bit base does not import it): none of its layers here
        return
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            yield name, module


def packed_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module holding a packed 4-bit `weight` and its `quant_state`: bitsandbytes' Linear4bit layers and
    shardtune's 4-bit experts, in module order."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: none of its layers here (a run without 4-bit skips it)
    kinds = (quant_experts.Experts4bit,) if bnb is None else (bnb.nn.Linear4bit, quant_experts.Experts4bit)
    for name, module in model.named_modules():
        if isinstance(module, kinds):
            yield name, module


def load_4bit_into(
    model: nn.Module,
    model_name_or_path: str,
    *,
    quantization_config,
    dtype: torch.dtype,
    on_meta: bool = False,
    quantize_device: torch.device | None = None,
) -> nn.Module:
    """Make a meta skeleton (shardtune.models.loading.build_skeleton) a 4-bit model whose linear weights are quantized
    one tensor at a time while the checkpoint is read; returns it.

    dtype is the dtype the checkpoint is cast to before quantizing (as transformers does) and that of the
    unquantized parameters. With on_meta, nothing is read: packed weights and quantization states are on meta,
    with the shapes rank 0 will send. quantize_device (CUDA) only speeds quantization up; results return to CPU.
    """
    from transformers.quantizers import AutoHfQuantizer

    if getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(
            f"{model_name_or_path} is already quantized; --use_4bit_quantization quantizes an unquantized base "
            "while loading it. Point --model_name_or_path at the unquantized model."
        )
    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    # Replaces nn.Linear by bnb Linear4bit on meta, skipping the output head (transformers' own choice).
    quantizer.preprocess_model(model, device_map=None)
    experts = quant_experts.quantize_skeleton(model, dtype=dtype, settings=_settings(model))
    if on_meta:
        for _, module in linear4bit_modules(model):
            _quantize_on_meta(module, dtype)
    else:
        device = quantize_device or torch.device("cpu")
        rename = checkpoint_renaming(model.config, type(model))
        reader = quant_experts.ExpertReader(model, model_name_or_path, experts, rename=rename, device=device)
        load_checkpoint_into(
            model, model_name_or_path, dtype=dtype, convert=lambda m, n, t: _quantize_into(m, n, t, device),
            take=reader.take, finish=lambda: reader.check_complete(model_name_or_path),
        )  # fmt: skip
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    for _, module in linear4bit_modules(model):
        # bitsandbytes repacks weights in place for its AVX512-BF16 inference kernel on CPU in eval mode; under
        # FSDP that would rewrite the all-gathered buffer and the shared QuantState.
        module.support_avx512bf16_for_cpu = False
    return model


def _settings(model: nn.Module) -> dict:
    """The bitsandbytes settings of the model's Linear4bit layers, which its 4-bit experts use too."""
    _, module = next(linear4bit_modules(model))
    w = module.weight
    keys = ("blocksize", "quant_type", "compress_statistics", "quant_storage")
    return {k: getattr(w, k) for k in keys}


def _quantize_into(module: nn.Module, name: str, tensor: torch.Tensor, device: torch.device) -> bool:
    """Quantize a Linear4bit weight as it is read (True); anything else is left to the caller (False)."""
    import bitsandbytes as bnb

    if not (isinstance(module, bnb.nn.Linear4bit) and name == "weight"):
        return False
    old = module._parameters["weight"]
    if tuple(tensor.shape) == (module.in_features, module.out_features) and _from_conv1d(module):
        tensor = tensor.T  # GPT-2's Conv1D stores (in, out); Linear4bit takes (out, in), as transformers transposes
    # The same construction as transformers' Bnb4bitQuantize, so the packed bytes match its from_pretrained.
    param = bnb.nn.Params4bit(tensor, requires_grad=False, **old.__dict__).to(device)  # sets module.quant_state
    if param.device.type != "cpu":
        param = param.to("cpu")  # the state moves with it: rank 0 holds the model in host memory until sharding
    module._parameters["weight"] = param
    return True


def _from_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    source = getattr(module, "source_cls", None)
    return isinstance(source, type) and issubclass(source, Conv1D)


def _quantize_on_meta(module: nn.Module, dtype: torch.dtype) -> None:
    """The packed weight and its QuantState on meta, shaped as bitsandbytes' quantize_4bit makes them."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    old = module._parameters["weight"]
    n = old.numel()
    storage = old.quant_storage
    blocks = -(-n // old.blocksize)
    meta = torch.device("meta")
    state2 = offset = None
    absmax_dtype = torch.float32
    if old.compress_statistics:
        absmax_dtype = torch.uint8
        offset = torch.empty((), dtype=torch.float32, device=meta)
        state2 = QuantState(
            absmax=torch.empty(-(-blocks // 256), dtype=torch.float32, device=meta),
            code=torch.empty(256, dtype=torch.float32, device=meta),
            blocksize=256,
            dtype=torch.float32,
        )
    state = QuantState(
        absmax=torch.empty(blocks, dtype=absmax_dtype, device=meta),
        shape=old.shape,
        code=torch.empty(16, dtype=torch.float32, device=meta),
        blocksize=old.blocksize,
        quant_type=old.quant_type,
        dtype=dtype,
        offset=offset,
        state2=state2,
    )
    packed = torch.empty(((n + 1) // (storage.itemsize * 2), 1), dtype=storage, device=meta)
    kwargs = {k: v for k, v in old.__dict__.items() if k not in ("quant_state", "bnb_quantized")}
    module._parameters["weight"] = bnb.nn.Params4bit(
        packed, requires_grad=False, quant_state=state, bnb_quantized=True, **kwargs
    )
    module.quant_state = state


def quant_state_tensors(state) -> list[tuple[object, str]]:
    """(holder, attribute) of every tensor in a QuantState, nested state included, in a fixed order."""
    out = [(state, "absmax"), (state, "code")]
    if state.nested:
        out += [(state, "offset"), (state.state2, "absmax"), (state.state2, "code")]
    return out


def prepare_for_fsdp(model: nn.Module, param_dtype: torch.dtype | None) -> int:
    """Make every packed 4-bit weight a plain frozen parameter of its storage dtype; keep its state on the layer.

    FSDP2 casts floating parameters to param_dtype before all-gathering them: a packed weight stored in
    another floating dtype would have its bytes converted as numbers. Returns the number of layers prepared.
    """
    count = 0
    for name, module in packed_modules(model):
        weight = module.weight
        state = getattr(weight, "quant_state", None)
        state = module.quant_state if state is None else state
        assert state is not None, f"{name}: 4-bit layer without a quantization state"
        if weight.dtype.is_floating_point and param_dtype is not None and weight.dtype != param_dtype:
            raise ValueError(
                f"{name}: packed 4-bit weights are stored as {weight.dtype} but FSDP computes in {param_dtype}; "
                f"set --bnb_4bit_quant_storage_dtype to {str(param_dtype).removeprefix('torch.')}."
            )
        module.quant_state = state
        module.quant_storage = weight.dtype
        module._parameters["weight"] = nn.Parameter(weight.data, requires_grad=False)
        count += 1
    return count


def move_quant_states(model: nn.Module, device: torch.device) -> None:
    for _, module in packed_modules(model):
        module.quant_state.to(device)


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the packed 4-bit weights held here (local shards), in full (of which the experts'), and of the
    replicated states."""
    out = {"packed_local": 0, "packed_total": 0, "packed_experts": 0, "quant_state": 0}
    for _, module in packed_modules(model):
        w = module.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        out["packed_local"] += local.numel() * local.element_size()
        out["packed_total"] += w.numel() * w.element_size()
        if isinstance(module, quant_experts.Experts4bit):
            out["packed_experts"] += w.numel() * w.element_size()
        for holder, attr in quant_state_tensors(module.quant_state):
            t = getattr(holder, attr)
            out["quant_state"] += t.numel() * t.element_size()
    return out


def drop_quant_state_keys(model: nn.Module) -> None:
    """Keep the packed weights' quantization state out of state dicts on a model whose packed weights FSDP does not
    manage (one process without FSDP; the frozen base replicated).

    Without FSDP, bitsandbytes' forward wraps the plain packed weight as Params4bit with its state (what
    `fix_4bit_weight_quant_state_from_module` does once the state is missing), and Linear4bit's state dict then
    adds the state's tensors as `weight.absmax`, `weight.quant_map`, ... Under FSDP2 the weight between steps is
    the sharded parameter, which carries no state: dropping these keys keeps one layout for checkpoints and
    exports, so a checkpoint written by one process resumes on several ranks and the reverse."""
    for _, module in linear4bit_modules(model):
        module.register_state_dict_post_hook(_drop_weight_state)


def _drop_weight_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(f"{prefix}weight.")]:
        del state_dict[key]
