"""What the planner holds of a model: its config, its parameter tensors as shardtune holds them (base, LoRA,
4-bit packed) for the shape planning.shape reads, and the bytes each rank keeps once FSDP2 has sharded them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardtune.config.errors import ConfigError
from shardtune.planning.known_configs import known_config
from shardtune.planning.shape import (
    ROOT_LINEARS,
    SHARED_LINEARS,
    SHARED_PATH,
    ModelShape,
)

QUANT_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
NESTED_BLOCK = 256  # nested (double) quantization: one fp32 absmax per 256 first-level absmax values


def load_model_config(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """config.json of a local folder, a .json file, a cached or known hub id, or (last) the Hub. No weights are read.

    Known ids (see known_configs.py) are answered without the network, so gated Llama repositories plan offline.
    """
    from transformers import AutoConfig

    path = Path(name_or_path).expanduser()
    try:
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if path.is_file() and path.suffix == ".json":
            data = json.loads(path.read_text())
            return AutoConfig.for_model(data.pop("model_type", "llama"), **data)
        try:
            return AutoConfig.from_pretrained(name_or_path, local_files_only=True, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            pass
        known = known_config(name_or_path)
        if known is not None:
            return AutoConfig.for_model(known.pop("model_type"), **known)
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(
            [
                (
                    f"--model_name_or_path {name_or_path}: cannot read its config.json ({e}). Give a local "
                    "model folder, a config.json file, or a hub id you can reach."
                )
            ]
        ) from e


class AllLinear(tuple):
    """The Llama names all-linear stands for (the activation estimate's), marked so that the LoRA count and the
    adapter's bytes use the layers training really wraps (ModelShape.all_linear_layers) where they are known."""


# LoRA on parameters (--lora_target_experts, --lora_target_parameters; PEFT's target_parameters), as planner names
# after the linear layers': each fused expert tensor holds one LoRA per expert, A (r·E, in) and B (out, r·E).
EXPERT_LORA = ("experts.gate_up_proj", "experts.down_proj")
ROUTER_LORA = "router"


def _parameter_targets(words: Sequence[str], shape: ModelShape) -> tuple[str, ...]:
    """Planner names of the parameter targets ("experts" -> both expert tensors; a name by its ending)."""
    out: list[str] = []
    for word in words:
        if word in ("experts", "routers"):
            found = list(EXPERT_LORA) if word == "experts" else [ROUTER_LORA]
        else:
            leaf = word.removesuffix(".weight")
            found = [n for n in EXPERT_LORA if leaf.endswith(n.rpartition(".")[2])] or [ROUTER_LORA]
        out += [n for n in found if n not in out and shape.num_experts]
    return tuple(out)


def resolve_lora_targets(
    shape: ModelShape, target_modules: str | Sequence[str], target_parameters: Sequence[str] = ()
) -> tuple[str, ...]:
    """The linear layers LoRA wraps, as Llama-style names (q_proj ... down_proj, lm_head), then the parameters it
    adapts (`target_parameters`: "experts", "routers" or a parameter's name or ending; PlanInputs'
    lora_target_parameters). all-linear: AllLinear of those names; its LoRA parameters are counted on the model's
    own layers where the class builds here (shardtune.models.targets by module path: routers, experts' fused tensors and
    the head excluded), and assume the Llama names otherwise. Explicit names are matched against the Llama names."""
    names = [t.strip() for t in target_modules.split(",")] if isinstance(target_modules, str) else list(target_modules)
    names = [n for n in names if n]
    params = _parameter_targets(target_parameters, shape)
    if names == ["all-linear"]:
        return AllLinear(tuple(n for n in shape.block_linears() if _all_linear_wraps(shape, n)) + params)
    known = shape.block_linears() + ROOT_LINEARS
    targets = tuple(n for n in known if any(t == n or t.endswith("." + n) for t in names)) + params
    if not targets:
        raise ConfigError(
            [
                (
                    f"--lora_target_modules {','.join(names)!r} matches none of the linear layers of a "
                    f"{shape.model_type} model ({', '.join(known)}); use names from that list or all-linear."
                )
            ]
        )
    return targets


def _all_linear_wraps(shape: ModelShape, name: str) -> bool:
    """Whether all-linear wraps the planner's linear `name`: a shared expert's only where the family's layers say so
    (PEFT reads gate_proj, up_proj and down_proj as the fused experts on DeepSeek and its kin, and leaves them)."""
    if name not in SHARED_LINEARS or not shape.all_linear_layers:
        return True
    return any(SHARED_PATH.search(pattern) for pattern, *_ in shape.all_linear_layers)


def lora_param_count(shape: ModelShape, lora_r: int, targets: Iterable[str], use_dora: bool = False) -> int:
    """LoRA parameters of the whole model: r * (in + out) per wrapped linear (+ out for DoRA's magnitude)."""
    targets = targets if isinstance(targets, AllLinear) else tuple(targets)
    return sum(
        _numel(shp) * (shape.num_layers if group == "block" else 1)
        for _, shp, group in _lora_tensors(shape, lora_r, targets, use_dora)
    )


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as FSDP2 sees it: shape, bytes per element, trainable or frozen, block or root."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    trainable: bool
    group: str  # "block" (one decoder layer, repeated num_layers times) or "root"
    quantized: bool = False  # bitsandbytes storage: all-gathered as stored, never cast to the compute dtype

    @property
    def numel(self) -> int:
        return _numel(self.shape)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _parameter_lora_tensors(shape: ModelShape, r: int, targets: tuple[str, ...]):
    e, h, i = shape.num_experts, shape.hidden_size, shape.expert_intermediate_size
    dims = {"experts.gate_up_proj": (h, 2 * i, e), "experts.down_proj": (i, h, e), ROUTER_LORA: (h, e, 1)}
    for name in (t for t in targets if t in dims):
        fan_in, fan_out, copies = dims[name]
        yield f"{name}.lora_A", (r * copies, fan_in), "block"
        yield f"{name}.lora_B", (fan_out, r * copies), "block"


def _lora_tensors(shape: ModelShape, r: int, targets: tuple[str, ...], use_dora: bool):
    yield from _parameter_lora_tensors(shape, r, targets)
    if isinstance(targets, AllLinear) and shape.all_linear_layers:
        yield from _real_lora_tensors(shape, r, use_dora)
        return
    dims = {**shape.linear_dims(), "lm_head": (shape.hidden_size, shape.vocab_size)}
    for name in (t for t in targets if t not in (*EXPERT_LORA, ROUTER_LORA)):
        fan_in, fan_out = dims[name]
        group = "root" if name in ROOT_LINEARS else "block"
        yield f"{name}.lora_A", (r, fan_in), group
        yield f"{name}.lora_B", (fan_out, r), group
        if use_dora:
            yield f"{name}.lora_magnitude_vector", (fan_out,), group


def _real_lora_tensors(shape: ModelShape, r: int, use_dora: bool):
    """LoRA tensors of the layers all-linear wraps: a pattern found once per decoder layer is a block tensor; any
    other (hybrid models' layer kinds, a shared expert on some layers) is counted whole, in the root group."""
    for pattern, fan_in, fan_out, n in shape.all_linear_layers:
        per_layer = n == shape.num_layers and "*" in pattern
        k = 1 if per_layer else n
        group = "block" if per_layer else "root"
        yield f"{pattern}.lora_A", (k * r, fan_in), group
        yield f"{pattern}.lora_B", (k * fan_out, r), group
        if use_dora:
            yield f"{pattern}.lora_magnitude_vector", (k * fan_out,), group


def packed_4bit_shape(numel: int, storage_bytes: int) -> tuple[int, int]:
    """bitsandbytes packs two 4-bit values per byte into a [(n+1)//(2*itemsize), 1] tensor of the storage dtype."""
    return ((numel + 1) // (2 * storage_bytes), 1)


def quant_constant_bytes(fan_in: int, fan_out: int, nested: bool = False, bits: int = 4) -> int:
    """Quantization constants of one weight. 4-bit: absmax, fp32 per 64-block, or with nested quantization uint8
    per block + fp32 per 256 blocks + an fp32 offset (the 256-entry code is one tensor shared by all weights).
    8-bit: one fp32 scale per output row."""
    if bits == 8:
        return 4 * fan_out
    blocks = -(-(fan_in * fan_out) // QUANT_BLOCK)
    if not nested:
        return 4 * blocks
    return blocks + 4 * -(-blocks // NESTED_BLOCK) + 4


def model_tensors(
    shape: ModelShape,
    *,
    base_bytes: int,
    trainable_bytes: int = 4,
    use_4bit: bool = False,
    use_8bit: bool = False,
    quant_storage_bytes: int = 2,
    full_finetune: bool = False,
    lora_r: int = 8,
    lora_targets: tuple[str, ...] = (),
    use_dora: bool = False,
    modules_to_save: Sequence[str] = (),
) -> list[Tensor]:
    """Every parameter tensor of one decoder block (group "block") and of the root (embeddings, final norm, head).

    Full fine-tuning holds every parameter trainable in `trainable_bytes` (fp32 master weights); LoRA keeps the
    base frozen in `base_bytes` (or packed 4-bit) and adds fp32 adapters.
    """
    h, v = shape.hidden_size, shape.vocab_size
    frozen = not full_finetune
    out: list[Tensor] = []
    quant = "4bit" if use_4bit and frozen else "8bit" if use_8bit and frozen else None
    itemsize = _bytes(frozen, base_bytes, trainable_bytes)
    for name, (fan_in, fan_out) in shape.linear_dims().items():
        if name not in shape.block_linears():
            continue
        out.append(_weight(f"{name}.weight", (fan_out, fan_in), quant, quant_storage_bytes, itemsize, not frozen))
        if shape.has_bias(name):
            out.append(Tensor(f"{name}.bias", (fan_out,), itemsize, not frozen, "block"))
    for name, shp in shape.expert_tensors().items():
        if use_4bit and frozen and len(shp) == 3:  # models.quant_experts: (E, packed), each expert packed alone
            packed = packed_4bit_shape(math.prod(shp[1:]), quant_storage_bytes)[0]
            out.append(Tensor(name, (shp[0], packed), quant_storage_bytes, False, "block", quantized=True))
        else:
            out.append(Tensor(name, shp, itemsize, not frozen, "block"))
    for norm, width in shape.block_norms().items():
        out.append(Tensor(f"{norm}.weight", (width,), itemsize, not frozen, "block"))
    out += _unmodelled_tensors(shape, quant, quant_storage_bytes, itemsize, not frozen)
    root = [(f"{name}.weight", shp) for name, shp in shape.token_tables().items()] + [("norm.weight", (h,))]
    if not shape.tie_word_embeddings:
        root.append(("lm_head.weight", (v, h)))
    for name, shp in root:
        out.append(Tensor(name, shp, itemsize, not frozen, "root"))
    if frozen:
        for name, shp, group in _lora_tensors(shape, lora_r, lora_targets, use_dora):
            out.append(Tensor(name, shp, trainable_bytes, True, group))
        for module in modules_to_save:
            key = "embed_tokens.weight" if module == "embed_tokens" else f"{module}.weight"
            for t in [t for t in out if t.name == key and t.group == "root"]:
                out.append(Tensor(f"{module}.modules_to_save.weight", t.shape, trainable_bytes, True, "root"))
        widths = {name: shp[1] for name, shp in shape.token_tables().items()}
        if not shape.tie_word_embeddings:
            widths["lm_head"] = h
        for module in [m for m in widths if m not in modules_to_save] if shape.new_token_rows else []:
            delta = (shape.new_token_rows, widths[module])
            out.append(Tensor(f"{module}.token_adapter.trainable_tokens_delta", delta, trainable_bytes, True, "root"))
    return out


def _weight(name: str, shp: tuple[int, ...], quant: str | None, storage_bytes: int, itemsize: int, trained: bool):
    """A block's linear weight as held: packed 4-bit or int8 (frozen), or in `itemsize`."""
    if quant == "4bit":
        return Tensor(name, packed_4bit_shape(math.prod(shp), storage_bytes), storage_bytes, False, "block", True)
    if quant == "8bit":
        return Tensor(name, shp, 1, False, "block", quantized=True)
    return Tensor(name, shp, itemsize, trained, "block")


def _unmodelled_tensors(
    shape: ModelShape, quant: str | None, storage_bytes: int, itemsize: int, trained: bool
) -> list[Tensor]:
    """The parameters beyond the layout (ModelShape.block_extra_linear ...), as one flat tensor per kind: their
    bytes and their share of each FSDP unit, not their layers' shapes. The linear weights are quantized as the
    layout's are."""
    out = []
    if shape.block_extra_linear > 0:
        out.append(_weight("unmodelled.linear", (shape.block_extra_linear,), quant, storage_bytes, itemsize, trained))
    if shape.block_extra_other > 0:
        out.append(Tensor("unmodelled.other", (shape.block_extra_other,), itemsize, trained, "block"))
    if shape.root_extra > 0:
        out.append(Tensor("unmodelled.root", (shape.root_extra,), itemsize, trained, "root"))
    return out


def _bytes(frozen: bool, base_bytes: int, trainable_bytes: int) -> int:
    return base_bytes if frozen else trainable_bytes


def shard_rows(rows: int, shard_size: int, rank: int | None = None) -> int:
    """Rows of dim 0 one rank holds: FSDP2 pads every rank to ceil(rows/S); with `rank`, the rank's real chunk."""
    chunk = -(-rows // shard_size)
    if rank is None:
        return chunk
    return max(0, min(chunk, rows - rank * chunk))


def sharded_bytes(t: Tensor, shard_size: int, rank: int | None = None, itemsize: int | None = None) -> int:
    """Bytes of one rank's dim-0 shard of `t` (torch.chunk semantics, as fully_shard does)."""
    rest = _numel(t.shape[1:])
    return shard_rows(t.shape[0], shard_size, rank) * rest * (itemsize or t.itemsize)
