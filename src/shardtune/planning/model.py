"""What the planner knows about a model: its shapes from config.json, its parameter tensors as shardtune holds
them (base, LoRA, 4-bit packed), and the bytes each rank keeps once FSDP2 has sharded them.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shardtune.config.errors import ConfigError
from shardtune.planning.known_configs import known_config
from shardtune.runtime.log import warn0

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
BLOCK_LINEARS = ATTN_LINEARS + MLP_LINEARS
ROOT_LINEARS = ("lm_head",)
QUANT_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
NESTED_BLOCK = 256  # nested (double) quantization: one fp32 absmax per 256 first-level absmax values


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder (Llama, Mistral, Qwen2, ...) that decide its memory."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Embedding rows the base checkpoint lacks (chat tokens + padding to a multiple of 8): trained as LoRA's
    # trainable token rows in the input embedding and the untied output head.
    new_token_rows: int = 0
    # Parameters the family has beyond the Llama layout below (biases, q/k norms, experts, routers, fused or
    # renamed layers), counted on the real model class: base_param_count is then exact for every family.
    extra_params: int = 0
    # Mixture-of-experts blocks (Mixtral, Qwen3-MoE, ... as transformers 5 builds them): the MLP is a router
    # `mlp.gate` (E, h) and fused experts `mlp.experts.gate_up_proj` (E, 2I, h) and `down_proj` (E, h, I), with I
    # the experts' width; none of them is an nn.Linear, so LoRA's all-linear wraps the attention only.
    num_experts: int = 0
    expert_intermediate_size: int = 0
    experts_per_token: int = 0  # the router's top-k
    # The coefficient of the router load-balancing loss the run adds (the config's unless --router_aux_loss_coef).
    router_aux_loss_coef: float = 0.0
    # A second token-indexed embedding (Gemma 4 and Gemma 3n: embed_tokens_per_layer, rows
    # vocab_size_per_layer_input, width num_layers · hidden_size_per_layer_input), in the root FSDP unit beside
    # embed_tokens; it grows with the vocabulary when tokens are added, and its new rows are trainable tokens too.
    per_layer_vocab_size: int = 0
    per_layer_width: int = 0
    # The layers `all-linear` really wraps on this family (shardtune.models.targets, read off the model class built on
    # meta): (module-path pattern, fan_in, fan_out, count). Empty when the class cannot be built here: the LoRA
    # count then assumes the Llama names above.
    all_linear_layers: tuple[tuple[str, int, int, int], ...] = ()
    # Whether the family trains its attention with shardtune's per-document SDPA (shardtune.models.fastpath) on the fast
    # path; False where it runs its own forward or attention classes, which attend over whole rows with
    # transformers' mask. Read off the family's conformance verdict by planning.fit.plan_shape, as the builder
    # reads it; True (shardtune's Llama-style default) for a shape given as numbers.
    per_document_attention: bool = True
    # Whether the family's mask is causal within each document and nothing more (models.families.plain_causal):
    # shardtune's per-document attention then has transformers build no row-wide mask. Set by plan_shape.
    plain_mask: bool = True

    def block_linears(self) -> tuple[str, ...]:
        """The nn.Linear layers of one block: attention only when the MLP is a mixture of experts."""
        return ATTN_LINEARS if self.num_experts else BLOCK_LINEARS

    def expert_tensors(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one block's router (2-D) and fused expert tensors (3-D) (empty for a dense MLP)."""
        if not self.num_experts:
            return {}
        e, h, i = self.num_experts, self.hidden_size, self.expert_intermediate_size
        return {
            "mlp.gate.weight": (e, h),
            "mlp.experts.gate_up_proj": (e, 2 * i, h),
            "mlp.experts.down_proj": (e, h, i),
        }

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of one decoder block."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def with_vocab(self, vocab_size: int) -> ModelShape:
        """The shape after transformers' resize_token_embeddings, which gives the per-layer embedding as many rows."""
        per_layer = {"per_layer_vocab_size": vocab_size} if self.per_layer_width else {}
        return ModelShape(**{**asdict(self), "vocab_size": vocab_size, **per_layer})

    def token_tables(self) -> dict[str, tuple[int, int]]:
        """The embeddings looked up by token id, whose new-token rows are trained (not the tied output head)."""
        tables = {"embed_tokens": (self.vocab_size, self.hidden_size)}
        if self.per_layer_width:
            tables["embed_tokens_per_layer"] = (self.per_layer_vocab_size, self.per_layer_width)
        return tables

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read the shapes from a transformers config (or a config.json dict); for a multimodal config (Gemma 4),
        from its language model's text_config. The vision and audio towers are not counted."""
        model_type = (config.get if isinstance(config, dict) else lambda k: getattr(config, k, None))("model_type")
        text = _text_config(config)
        get = _reader(text)
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
            if get(k) is None
        ]
        if missing:
            raise ConfigError(
                [
                    (
                        f"model_type {model_type!r} is not a Llama-style decoder: its config has no "
                        f"{', '.join(missing)}; shardtune plan supports Llama-style models (llama, mistral, "
                        "qwen2, ...)."
                    )
                ]
            )
        heads = int(get("num_attention_heads"))
        per_layer_input = int(get("hidden_size_per_layer_input") or 0)
        shape = cls(
            model_type=str(model_type or "llama"),
            hidden_size=int(get("hidden_size")),
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            num_experts=int(get("num_local_experts") or get("num_experts") or 0),
            expert_intermediate_size=int(get("moe_intermediate_size") or get("intermediate_size")),
            experts_per_token=int(get("num_experts_per_tok") or 0),
            router_aux_loss_coef=float(get("router_aux_loss_coef") or 0.0),
            per_layer_vocab_size=int(get("vocab_size_per_layer_input") or 0) if per_layer_input else 0,
            per_layer_width=int(get("num_hidden_layers")) * per_layer_input,
        )
        meta = None if isinstance(config, dict) else _meta_model(text)
        real = None if meta is None else sum(p.numel() for p in meta.parameters())
        if real is not None and text is not config:
            _warn_uncounted_towers(config, real)
        if meta is not None:
            shape = replace(shape, all_linear_layers=all_linear_layers(meta))
        return shape if real is None else replace(shape, extra_params=real - base_param_count(shape))


def _text_config(config: Any) -> Any:
    """The language model's config of a multimodal config (Gemma 4's text_config), else the config itself."""
    if isinstance(config, dict):
        text = config.get("text_config")
        return text if isinstance(text, dict) and config.get("hidden_size") is None else config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _reader(config: Any):
    """config.get for a dict; for a config object, getattr, where a field that differs between layers (Gemma 4's
    head_dim: its full-attention layers are wider) reads as the first layer's. The other layers' extra
    parameters are counted in extra_params."""
    if isinstance(config, dict):
        return config.get
    try:
        from transformers.integrations.heterogeneity.configuration_utils import (
            AmbiguousGlobalPerLayerAttributeError as ambiguous,
        )
    except ImportError:  # a transformers without per-layer configs
        ambiguous = AttributeError

    def get(key: str, default: Any = None) -> Any:
        try:
            return getattr(config, key, default)
        except ambiguous:
            return getattr(config.per_layer_config[0], key, default)

    return get


def _warn_uncounted_towers(config: Any, text_params: int) -> None:
    """A multimodal class that AutoModelForCausalLM loads whole also holds vision/audio towers, frozen and on the
    GPU in training; the planner counts the language model only."""
    whole = _real_param_count(config)
    if whole is not None and whole > text_params:
        warn0(
            f"{getattr(config, 'model_type', 'the model')}: its vision/audio towers ({(whole - text_params) / 1e6:.1f}M "
            "parameters, held frozen in training) are not counted in this plan; only the language model is."
        )


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


def base_param_count(shape: ModelShape) -> int:
    """Parameters of the base model (decoder blocks, embeddings, final norm, head)."""
    dims = shape.linear_dims()
    block = sum(i * o for name, (i, o) in dims.items() if name in shape.block_linears()) + 2 * shape.hidden_size
    block += sum(math.prod(shp) for shp in shape.expert_tensors().values())
    head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    embeddings = sum(rows * width for rows, width in shape.token_tables().values())
    llama = shape.num_layers * block + embeddings + shape.hidden_size + head
    return llama + shape.extra_params


def _meta_model(config: Any):
    """The config's model class built on the meta device (no memory, nothing initialised); None for an
    architecture transformers cannot build here (remote code)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError, OSError):
        return None


def _real_param_count(config: Any) -> int | None:
    """The parameters of the config's model class; None where it cannot be built here."""
    model = _meta_model(config)
    return None if model is None else sum(p.numel() for p in model.parameters())


def all_linear_layers(model: Any) -> tuple[tuple[str, int, int, int], ...]:
    """What `all-linear` wraps on `model`, as training picks it (shardtune.models.targets, by module path): one
    (pattern with layer indices as *, fan_in, fan_out, count) per distinct pattern and shape."""

    from shardtune.models.targets import plan_all_linear  # lazily: torch and peft, only when a model is built

    counts: Counter = Counter()
    for path in plan_all_linear(model).paths:
        module = model.get_submodule(path)
        fan_in = getattr(module, "in_features", None) or module.weight.shape[0]  # GPT-2's Conv1D is (in, out)
        fan_out = getattr(module, "out_features", None) or module.weight.shape[1]
        counts[(re.sub(r"\.\d+(?=\.|$)", ".*", path), int(fan_in), int(fan_out))] += 1
    return tuple((p, i, o, n) for (p, i, o), n in sorted(counts.items()))


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
        return AllLinear(shape.block_linears() + params)
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
    for name, (fan_in, fan_out) in shape.linear_dims().items():
        if name not in shape.block_linears():
            continue
        has_bias = shape.attention_bias if name in ATTN_LINEARS else shape.mlp_bias
        if use_4bit and frozen:
            out.append(
                Tensor(
                    f"{name}.weight",
                    packed_4bit_shape(fan_in * fan_out, quant_storage_bytes),
                    quant_storage_bytes,
                    False,
                    "block",
                    quantized=True,
                )
            )
        elif use_8bit and frozen:
            out.append(Tensor(f"{name}.weight", (fan_out, fan_in), 1, False, "block", quantized=True))
        else:
            out.append(
                Tensor(
                    f"{name}.weight",
                    (fan_out, fan_in),
                    _bytes(frozen, base_bytes, trainable_bytes),
                    not frozen,
                    "block",
                )
            )
        if has_bias:
            out.append(
                Tensor(f"{name}.bias", (fan_out,), _bytes(frozen, base_bytes, trainable_bytes), not frozen, "block")
            )
    for name, shp in shape.expert_tensors().items():
        if use_4bit and frozen and len(shp) == 3:  # models.quant_experts: (E, packed), each expert packed alone
            packed = packed_4bit_shape(math.prod(shp[1:]), quant_storage_bytes)[0]
            out.append(Tensor(name, (shp[0], packed), quant_storage_bytes, False, "block", quantized=True))
        else:
            out.append(Tensor(name, shp, _bytes(frozen, base_bytes, trainable_bytes), not frozen, "block"))
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.append(Tensor(f"{norm}.weight", (h,), _bytes(frozen, base_bytes, trainable_bytes), not frozen, "block"))
    root = [(f"{name}.weight", shp) for name, shp in shape.token_tables().items()] + [("norm.weight", (h,))]
    if not shape.tie_word_embeddings:
        root.append(("lm_head.weight", (v, h)))
    for name, shp in root:
        out.append(Tensor(name, shp, _bytes(frozen, base_bytes, trainable_bytes), not frozen, "root"))
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
