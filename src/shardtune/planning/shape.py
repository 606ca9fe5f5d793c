"""What the planner knows about a model's shape: its sizes from config.json, as a Llama-style layout (the layers
every decoder of this kind has, a mixture of experts' routed and shared experts), and the parameters the model class
holds beyond that layout, counted on the class built on meta.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

from shardtune.config.errors import ConfigError
from shardtune.runtime.log import warn0

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Multi-latent attention (DeepSeek-V2/V3 and the families built on it: their configs have kv_lora_rank): the queries
# through a low-rank factor (q_a_proj, its norm, q_b_proj; one q_proj where q_lora_rank is None), the keys and
# values from one latent (kv_a_proj_with_mqa, its norm, kv_b_proj) beside one rotary key shared by the heads.
MLA_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_BIASED = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")  # the ones attention_bias gives a bias
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# A mixture of experts' shared expert: a dense MLP beside the routed experts, under the planner's own names.
SHARED_LINEARS = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
# The module path endings of the shared expert's linears in transformers' classes (Qwen2-MoE's `shared_expert`,
# DeepSeek's `shared_experts`), to tell whether all-linear wraps them on a family.
SHARED_PATH = re.compile(r"shared_experts?\.(gate|up|down)_proj$")
ROOT_LINEARS = ("lm_head",)


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
    # Parameters the model class holds beyond the layout below (a dense first block's MLP among MoE blocks,
    # biases, the weights of q/k norms, a shared expert's gate, ...), counted on the class built
    # on meta (_unmodelled): per block, as their mean over the blocks, in linear weights (which 4-bit quantizes) and
    # in the rest; and outside the blocks. base_param_count is then exact for every family, and model_tensors holds
    # them, so that the plan's memory holds every parameter it counts. Negative where the layout counts more than
    # the class holds: the memory then keeps the layout's figure.
    block_extra_linear: int = 0
    block_extra_other: int = 0
    root_extra: int = 0
    # Mixture-of-experts blocks (Mixtral, Qwen3-MoE, ... as transformers 5 builds them): the MLP is a router
    # `mlp.gate` (E, h) and fused experts `mlp.experts.gate_up_proj` (E, 2I, h) and `down_proj` (E, h, I), with I
    # the experts' width; none of them is an nn.Linear, so LoRA's all-linear wraps the attention only.
    num_experts: int = 0
    expert_intermediate_size: int = 0
    experts_per_token: int = 0  # the router's top-k
    # The width of the shared expert (Qwen2-MoE's shared_expert_intermediate_size, DeepSeek's n_shared_experts ·
    # moe_intermediate_size): a dense MLP of nn.Linear layers run on every token beside the routed experts.
    shared_expert_intermediate_size: int = 0
    # The bytes of a routing weight where the family's router returns them in fp32 (Mixtral, DeepSeek: 4), or 0
    # where they are in the compute dtype (Qwen-MoE, OLMoE, gpt-oss): read by running the router on meta
    # (_routing_weight_bytes); fp32 (the larger) for a shape given as numbers.
    routing_weight_bytes: int = 4
    # Multi-latent attention (MLA_LINEARS; zero without it): the ranks of the query and key-value factors (no
    # query factor: q_lora_rank 0), and the heads' widths: query and key heads qk_nope_head_dim + qk_rope_head_dim
    # wide, value heads v_head_dim. head_dim is then the rotary width (the config's).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The RMSNorms a block runs beyond the layout's (block_norms): Qwen3's and OLMo2's query and key norms (per head
    # or over all heads), Gemma's norms after the attention and the MLP. Each as (input width per token, rows it
    # normalises per token), read off the class built on meta (_extra_norms): their fp32 inputs are kept.
    extra_norms: tuple[tuple[int, int], ...] = ()
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
    # Whether the family has the tensor-parallel plan shardtune verified (shardtune.parallel.tensor.family_plan:
    # transformers' Llama-style base_model_tp_plan). Set by plan_shape from the config's class; True (shardtune's
    # Llama-style default) for a shape given as numbers.
    tensor_parallel_plan: bool = True

    @property
    def extra_params(self) -> int:
        """Parameters of the model class beyond the layout (see block_extra_linear)."""
        return self.num_layers * (self.block_extra_linear + self.block_extra_other) + self.root_extra

    @property
    def latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_linears(self) -> tuple[str, ...]:
        """The attention's nn.Linear layers: Llama's four, or a latent attention's (with or without the query's
        factor)."""
        if not self.latent_attention:
            return ATTN_LINEARS
        return tuple(n for n in MLA_LINEARS if n not in (("q_proj",) if self.q_lora_rank else ("q_a_proj", "q_b_proj")))

    def block_linears(self) -> tuple[str, ...]:
        """The nn.Linear layers of one block: with a mixture of experts, the attention and the shared expert."""
        if not self.num_experts:
            return self.attention_linears() + MLP_LINEARS
        return self.attention_linears() + (SHARED_LINEARS if self.shared_expert_intermediate_size else ())

    def has_bias(self, linear: str) -> bool:
        """Whether the block's linear `linear` has a bias (attention_bias for the attention's, mlp_bias else)."""
        if linear in self.attention_linears():
            return self.attention_bias and (linear in MLA_BIASED or not self.latent_attention)
        return self.mlp_bias

    def block_norms(self) -> dict[str, int]:
        """The RMSNorm weights of one block and their widths: the two around the attention, and multi-latent
        attention's norms of its query and key-value latents."""
        norms = {"input_layernorm": self.hidden_size, "post_attention_layernorm": self.hidden_size}
        if self.q_lora_rank:
            norms["self_attn.q_a_layernorm"] = self.q_lora_rank
        if self.latent_attention:
            norms["self_attn.kv_a_layernorm"] = self.kv_lora_rank
        return norms

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
        """The queries' width over all heads (and, repeated to every head, the keys')."""
        if self.latent_attention:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """The keys' width as the attention is given them (grouped-query attention's fewer heads)."""
        return self.q_dim if self.latent_attention else self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """The values' width as the attention is given them."""
        return self.num_heads * self.v_head_dim if self.latent_attention else self.kv_dim

    @property
    def o_dim(self) -> int:
        """The attention's output width over all heads, o_proj's input (the values' heads, repeated to every one)."""
        return self.num_heads * self.v_head_dim if self.latent_attention else self.q_dim

    @property
    def v_kept(self) -> int:
        """What the attention's values keep alive per token: multi-latent attention's values are a view of
        kv_b_proj's output, which holds each head's key part too; elsewhere the values themselves."""
        if self.latent_attention:
            return self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return self.v_dim

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of one decoder block."""
        h, i, s = self.hidden_size, self.intermediate_size, self.shared_expert_intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "q_a_proj": (h, self.q_lora_rank),
            "q_b_proj": (self.q_lora_rank, self.q_dim),
            "kv_a_proj_with_mqa": (h, self.kv_lora_rank + self.qk_rope_head_dim),
            "kv_b_proj": (self.kv_lora_rank, self.v_kept),
            "o_proj": (self.o_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "shared_gate_proj": (h, s),
            "shared_up_proj": (h, s),
            "shared_down_proj": (s, h),
        }

    def tensor_parallel_rank(self, tp: int) -> ModelShape:
        """A block as one of `tp` tensor-parallel ranks computes it (shardtune.parallel.tensor): its own attention
        heads and key/value heads and its slice of the MLP's width, so that every activation term of
        planning.activations that follows them (q, k, v, the attention's output and logsumexp, the row-parallel
        layers' inputs, gate, up and act(gate), a per-head query or key norm) is the rank's; the hidden size (the
        block's input and output, the residual stream, the norms, the column-parallel layers' inputs), the
        vocabulary and the head stay whole. The caller checks that tp divides them (planning.state)."""
        if tp == 1:
            return self
        per_head = {(self.q_dim, self.num_heads), (self.kv_dim, self.num_kv_heads)}
        norms = tuple((w // tp, n // tp) if (w, n) in per_head else (w, n) for w, n in self.extra_norms)
        return replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=self.num_kv_heads // tp,
            intermediate_size=self.intermediate_size // tp,
            extra_norms=norms,
        )

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
            num_experts=_expert_count(get),
            expert_intermediate_size=int(get("moe_intermediate_size") or get("intermediate_size")),
            experts_per_token=int(get("num_experts_per_tok") or 0),
            shared_expert_intermediate_size=_shared_expert_width(get),
            **_latent_attention(get),
            router_aux_loss_coef=float(get("router_aux_loss_coef") or 0.0),
            per_layer_vocab_size=int(get("vocab_size_per_layer_input") or 0) if per_layer_input else 0,
            per_layer_width=int(get("num_hidden_layers")) * per_layer_input,
        )
        meta = None if isinstance(config, dict) else _meta_model(text)
        real = None if meta is None else sum(p.numel() for p in meta.parameters())
        if real is not None and text is not config:
            _warn_uncounted_towers(config, real)
        if meta is not None:
            shape = replace(shape, all_linear_layers=all_linear_layers(meta), **_unmodelled(meta, shape))
            shape = replace(shape, routing_weight_bytes=_routing_weight_bytes(meta, shape))
            shape = replace(shape, extra_norms=_extra_norms(meta, shape))
        return shape


def _expert_count(get) -> int:
    from shardtune.models.targets import EXPERT_COUNT_KEYS  # lazily: torch, only when a model is built

    counts = [get(k) for k in EXPERT_COUNT_KEYS]
    return next((int(n) for n in counts if isinstance(n, int) and n > 1), 0)


def _routing_weight_bytes(meta: Any, shape: ModelShape) -> int:
    """ModelShape.routing_weight_bytes: the router of the first block with experts (its `gate` or `router`) run on
    meta with a bf16 input, as training runs it; its (tokens, top-k) float output is the routing weights. 4 (fp32,
    the larger) where no router is found or it cannot run here."""
    import torch  # lazily: only with a model class built on meta

    if not shape.num_experts:
        return 0
    k, tokens = shape.experts_per_token or 1, 3
    for module in meta.modules():
        router = next(
            (getattr(module, n) for n in ("gate", "router") if isinstance(getattr(module, n, None), torch.nn.Module)),
            None,
        )
        if router is None or not hasattr(module, "experts"):
            continue
        try:  # (the meta model is discarded after reading the shape: casting its router in place is harmless)
            out = router.to(torch.bfloat16)(torch.empty(tokens, shape.hidden_size, device="meta", dtype=torch.bfloat16))
        except (TypeError, RuntimeError, ValueError):  # a router of another signature: the larger assumed
            return 4
        weights = [
            t
            for t in (out if isinstance(out, tuple) else (out,))
            if torch.is_tensor(t) and t.is_floating_point() and tuple(t.shape) == (tokens, k)
        ]
        return 0 if weights and weights[0].dtype != torch.float32 else 4
    return 4


def _extra_norms(meta: Any, shape: ModelShape) -> tuple[tuple[int, int], ...]:
    """ModelShape.extra_norms, from the last decoder block of the class built on meta: its norms beyond the two of
    hidden width the layout has and a latent attention's own. A query or key norm as wide as a head normalises every
    head (its input is all of them); a wider one, the whole projection."""
    from shardtune.models.loading import decoder_block_classes  # lazily: torch, only when a model is built

    try:
        block = [m for m in meta.modules() if isinstance(m, decoder_block_classes(meta))][-1]
    except (ValueError, IndexError):  # no block class known: no norms beyond the layout's assumed
        return ()
    own = set(shape.block_norms()) - {"input_layernorm", "post_attention_layernorm"}
    hidden, out = 0, []
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        leaf = name.rpartition(".")[2]
        if "norm" not in leaf or name in own or weight is None or weight.ndim != 1:
            continue
        width = weight.numel()
        if leaf.startswith(("q_", "k_")) and width == shape.head_dim:
            out.append((shape.q_dim, shape.num_heads) if leaf[0] == "q" else (shape.kv_dim, shape.num_kv_heads))
        elif width == shape.hidden_size and (hidden := hidden + 1) <= 2:
            continue  # one of the layout's two
        else:
            out.append((width, 1))
    return tuple(out)


def _latent_attention(get) -> dict[str, int]:
    """ModelShape's multi-latent attention fields from the config's own keys; none where it has no kv_lora_rank."""
    if not get("kv_lora_rank"):
        return {}
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {k: int(get(k) or 0) for k in keys}


def _shared_expert_width(get) -> int:
    """The shared expert's width: Qwen2-MoE's own key, or DeepSeek's count of shared experts (fused into one MLP)
    times the experts' width; 0 without a mixture of experts or a shared expert."""
    if not _expert_count(get):
        return 0
    if get("shared_expert_intermediate_size"):
        return int(get("shared_expert_intermediate_size"))
    return int(get("n_shared_experts") or 0) * int(get("moe_intermediate_size") or 0)


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


def _layout_block(shape: ModelShape) -> tuple[int, int]:
    """One block of the layout, as planning.model.model_tensors holds it: (its linear weights and 3-D expert
    tensors, which 4-bit quantizes; the rest: biases, the two norms, a router)."""
    dims = {name: d for name, d in shape.linear_dims().items() if name in shape.block_linears()}
    experts = shape.expert_tensors().values()
    linear = sum(i * o for i, o in dims.values()) + sum(math.prod(t) for t in experts if len(t) == 3)
    biases = sum(dims[n][1] for n in dims if shape.has_bias(n))
    other = sum(shape.block_norms().values()) + biases + sum(math.prod(t) for t in experts if len(t) != 3)
    return linear, other


def _layout_root(shape: ModelShape) -> int:
    head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return sum(rows * width for rows, width in shape.token_tables().values()) + shape.hidden_size + head


def base_param_count(shape: ModelShape) -> int:
    """Parameters of the base model (decoder blocks, embeddings, final norm, head), exact where the shape was read
    off the model class (its parameters beyond the layout included)."""
    return shape.num_layers * sum(_layout_block(shape)) + _layout_root(shape) + shape.extra_params


def _unmodelled(meta: Any, shape: ModelShape) -> dict[str, int]:
    """ModelShape's block_extra_linear, block_extra_other and root_extra: the parameters of the class built on meta
    (`meta`) beyond `shape`'s layout, per decoder block (the mean over the blocks FSDP shards one by one) in linear
    weights and 3-D expert tensors (what 4-bit quantizes) and in the rest, and the remainder outside the blocks."""
    from shardtune.models.loading import decoder_block_classes  # lazily: torch, only when a model is built
    from shardtune.models.targets import linear_classes  # the same

    try:
        blocks = [m for m in meta.modules() if isinstance(m, decoder_block_classes(meta))]
    except ValueError:  # no block class known: everything beyond the layout is counted outside the blocks
        blocks = []
    linear = other = 0
    for module in (m for block in blocks for m in block.modules()):
        for name, p in module.named_parameters(recurse=False):
            quantized = p.ndim == 3 or (name == "weight" and isinstance(module, linear_classes()))
            linear, other = (linear + p.numel(), other) if quantized else (linear, other + p.numel())
    layout_linear, layout_other = _layout_block(shape)
    n = len(blocks) or shape.num_layers
    extra = {
        "block_extra_linear": (linear // n - layout_linear) if blocks else 0,
        "block_extra_other": (other // n - layout_other) if blocks else 0,
    }
    real = sum(p.numel() for p in meta.parameters())
    return {**extra, "root_extra": real - base_param_count(replace(shape, **extra, root_extra=0))}


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
