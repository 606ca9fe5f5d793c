"""What shardtune's training forward is verified to compute for a family: its conformance verdict.

shardtune does not run a causal LM's own forward when it trains: it runs the decoder (with per-document
attention over packed rows, shardtune.models.fastpath) and then the output head on chunks of hidden states
(training_module.CausalLMForTraining). That is the model's function only where the decoder is the module the fast path
calls, the head's output transform (logit scaling, muP multipliers, soft-capping) is one shardtune applies, and
the attention it substitutes masks what the family's own mask does (sliding windows, chunked attention).
Packed rows are the model's function on each document alone only where every mixer keeps documents apart
(recurrent mixers carry their state across them; some masks ignore position_ids).

Rather than a hand-kept list, `verdict(config, ...)` checks it: it builds a tiny random copy of the config
(`tiny_config`: the sizes shrunk, everything else, the multipliers included, kept), and compares, logit by logit
in fp32, the candidate training forwards with the model's own forward in eager attention, on one document and
on a packed row against each document alone. The verdict (cached per shrunk config) says which layout to use:

- `fast`: the decoder and head that reproduce the model's logits, or None (then the model's own forward is
  trained, with full logits: slower, never a different function);
- `fast_packing` / `own_packing`: whether packed documents stay apart on that path;
- `reason`: why a path was not verified.

`bench/conformance.py` runs it on every causal-LM architecture transformers registers and writes the README's
table; `shardtune train` runs it on a tiny copy of the run's own config before loading any weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from shardtune.models import fastpath
from shardtune.models.targets import EXPERT_COUNT_KEYS
from shardtune.models.weights import causal_lm_class
from shardtune.runtime.log import print0

# Sizes of the tiny copy. Windows and attention chunks shrink below the probe's documents so that they cut.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 96, 128
WINDOW = 6
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 32
DOCS = (13, 9, 7)  # the packed row; the first document is also the single one
# fp32, tiny models: two correct forwards differ by summation order only, at most 5e-6 of the logits' largest
# magnitude on every family that conforms (Gemma 4's; bench/results/conformance.json records each family's); a
# wrong function differs by far more: a dropped multiplier or a leak across documents by 1e-1 and more, the
# smallest defect measured (Falcon-H1's recurrent state across packed documents) by 8e-4. 1e-4 is 20x above the
# noise and 8x below that defect.
RTOL = 1e-4


_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "n_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "decoder_ffn_dim"), FFN),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(EXPERT_COUNT_KEYS, EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k"), TOP_K),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "sliding_window_size", "window_size"), WINDOW),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "d_state", "linear_key_head_dim"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "linear_num_value_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "linear_value_head_dim"), 16),
    **dict.fromkeys(("n_groups", "mamba_n_groups", "n_group", "topk_group", "n_shared_experts"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "first_k_dense_replace": 1,  # DeepSeek-style: one dense block, then mixtures of experts
    "linear_num_key_heads": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "rotary_dim": 8,
    "vocab_size": VOCAB,
}


def tiny_config(config, *, discriminating: bool = False):
    """A copy of `config` (a transformers config) with small sizes, sub-configs included; its other settings
    (multipliers, soft-caps, layer kinds, rope) kept. discriminating: a head or logit multiplier left at 1.0 is set
    to 2.5, so that a check on the class's defaults can tell a dropped multiplier from none."""
    d = config.to_dict()
    _shrink(d, discriminating)
    tiny = type(config).from_dict(d)
    tiny._attn_implementation_internal = None
    return tiny


def _shrink(d: dict, discriminating: bool) -> None:
    before = dict(d)
    layers_before = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(d.get(k), int)), 0)
    for key, value in list(d.items()):
        if isinstance(value, dict) and key.endswith("config"):
            _shrink(value, discriminating)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            d[key] = min(value, _SIZES[key]) if key not in ("n_groups", "n_group") else 1
        elif key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            d[key] = VOCAB - 1
        elif discriminating and isinstance(value, float) and value == 1.0 and _HEAD_ATTR.search(key):
            d[key] = 2.5
    _keep_equal_sizes(d, before)
    _fit_mixers(d)
    d.pop("quantization_config", None)
    if "model_type" in d:  # a config (not a per-layer table of one)
        d["dtype"] = "float32"
    layers = d.get("num_hidden_layers", d.get("n_layer", d.get("num_layers")))
    if isinstance(layers, int) and layers_before > layers:
        _keep_layer_lists(d, layers_before, layers)


_HEAD_COUNTS = {"num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "n_heads"}
_HEAD_COUNTS |= {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"}
_WIDTHS = {"head_dim", "attention_head_dim", "kv_channels", "v_head_dim", "qk_rope_head_dim", "qk_nope_head_dim"}
_WIDTHS |= {"rotary_dim", "kv_lora_rank", "q_lora_rank", "linear_key_head_dim", "linear_value_head_dim"}


def _keep_equal_sizes(d: dict, before: dict) -> None:
    """Head counts that were equal stay equal, and so do head widths (each the smaller new value): multi-head
    attention stays multi-head (kv heads = heads), DeepSeek's head_dim stays its rotary width, and so on."""
    for kind in (_HEAD_COUNTS, _WIDTHS):
        groups: dict[int, list[str]] = {}
        for key in kind & set(d):
            if isinstance(before.get(key), int) and before[key] > 0 and isinstance(d[key], int):
                groups.setdefault(before[key], []).append(key)
        for keys in groups.values():
            low = min(d[k] for k in keys)
            for k in keys:
                d[k] = low


def _fit_mixers(d: dict) -> None:
    """Sizes that other sizes fix: a Mamba-2 mixer's heads x head width = expand x hidden; MLA's q/k width."""
    hidden = d.get("hidden_size")
    if isinstance(hidden, int) and {"num_heads", "head_dim", "expand", "state_size"} <= set(d):
        d["num_heads"] = d["expand"] * hidden // d["head_dim"]
    if isinstance(hidden, int) and {"mamba_n_heads", "mamba_d_head"} <= set(d):
        if d.get("mamba_d_ssm"):
            d["mamba_d_ssm"] = d["mamba_n_heads"] * d["mamba_d_head"]
        else:
            d["mamba_n_heads"] = int(d.get("mamba_expand", 2) * hidden) // d["mamba_d_head"]
    if {"qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim"} <= set(d):
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]


def _keep_layer_lists(d: dict, before: int, after: int) -> None:
    """Per-layer lists (layer_types, ...) cut to the new depth; the first layer of each kind in `layer_types` is
    kept too (a hybrid model keeps an attention and a recurrent layer), which may make the copy deeper."""
    kinds = d.get("layer_types") if isinstance(d.get("layer_types"), list) else []
    firsts = {json.dumps(v): i for i, v in reversed(list(enumerate(kinds)))}
    picked = sorted(set(range(after)) | set(firsts.values()))
    for key, value in list(d.items()):
        if isinstance(value, list) and len(value) == before:
            d[key] = [value[i] for i in picked]
    table = d.get("per_layer_config")
    if isinstance(table, dict):  # per-layer overrides keyed by layer index, renumbered over the kept layers
        by_index = {int(k): v for k, v in table.items()}
        d["per_layer_config"] = {
            type(next(iter(table)))(new): by_index[old] for new, old in enumerate(picked) if old in by_index
        }
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if k in d:
            d[k] = len(picked)


# ---------------------------------------------------------------- attention

_SAID: set[str] = set()


def plain_causal(config) -> bool:
    """Whether the family's attention mask is causal within each document and nothing else: no sliding window,
    no attention chunks, every layer full attention. shardtune's per-document attention then needs no mask from
    transformers (fastpath.without_row_mask); the conformance check (check) runs it so, and would catch a family
    that masks something more."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text, k, None) for k in ("sliding_window", "attention_chunk_size", "sliding_window_size")):
        return False
    return all(t == "full_attention" for t in (getattr(text, "layer_types", None) or ()))


def family_attention(config, attn_impl: str) -> str:
    """attn_impl, or eager attention where the family cannot run SDPA: its class says it does not support SDPA
    (Gemma 2), or its config soft-caps the attention scores, which SDPA cannot do. Eager attention receives
    transformers' block-diagonal causal mask over packed rows (whether the family's mask keeps packed documents
    apart is what `verdict` checks). Said once in the log."""
    impl, reason = _attention_choice(config, attn_impl)
    if reason is not None and reason not in _SAID:
        _SAID.add(reason)
        print0(f"{reason}; using eager attention.")
    return impl


def _attention_choice(config, attn_impl: str) -> tuple[str, str | None]:
    if attn_impl not in (fastpath.ATTENTION, "sdpa"):
        return attn_impl, None
    cls = causal_lm_class(config)
    if cls is not None and not getattr(cls, "_supports_sdpa", True):
        return "eager", f"{cls.__name__} does not support SDPA attention"
    if attn_impl == fastpath.ATTENTION and cls is not None and not getattr(cls, "_supports_attention_backend", True):
        # Its attention classes are chosen by name (Falcon): registered functions never reach them.
        return "sdpa", None
    if getattr(config.get_text_config(), "attn_logit_softcapping", None):
        name = getattr(cls, "__name__", config.model_type)
        return "eager", f"{name} soft-caps its attention scores, which SDPA cannot"
    return attn_impl, None


# ---------------------------------------------------------------- the head's output transforms

# Config attributes that may scale the head's logits: the check finds which one (and how) the family applies.
_HEAD_ATTR = re.compile(r"(logit|lm_head|output).*(scal|mult)|(scal|mult).*(logit|lm_head)", re.IGNORECASE)


def head_transforms(config) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Candidate logit transforms of the raw head output, by name ("x 'attr'", "/ 'attr'"), identity first; each
    followed by the family's final soft-capping (cap·tanh(z/cap)) where it sets one. Evaluated on any config
    that has the same attributes (the tiny copy in the check, the run's own config in training)."""
    cfg = config.get_text_config()
    cap = getattr(cfg, "final_logit_softcapping", None)
    out = {"identity": _with_cap(lambda z: z, cap)}
    for name in sorted(k for k, v in cfg.to_dict().items() if _HEAD_ATTR.search(k) and _number(v)):
        v = float(getattr(cfg, name))
        out[f"x {name}"] = _with_cap(lambda z, v=v: z * v, cap)
        out[f"/ {name}"] = _with_cap(lambda z, v=v: z / v, cap)
    if _number(getattr(cfg, "dim_model_base", None)):  # muP width scaling of the last hidden state (MiniCPM)
        w = float(cfg.dim_model_base) / float(cfg.hidden_size)
        out["x dim_model_base/hidden_size"] = _with_cap(lambda z, w=w: z * w, cap)
    return out


def head_transform(config, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return head_transforms(config)[name]


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v != 0 and math.isfinite(v)


def _with_cap(f, cap):
    if not cap:
        return f
    return lambda z: torch.tanh(f(z) / cap) * cap


# ---------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Layout:
    """How the training module computes logits. fast: the decoder at `decoder` (an attribute path of the base
    model; "" for get_decoder()) and the head with transform `head`; own: the model's own forward. split: each
    packed document decoded as a row of its own (shardtune.models.documents), for families whose mixers carry
    state or attention across documents."""

    path: str = "fast"
    decoder: str = ""
    head: str = "identity"
    split: bool = False


OWN = Layout(path="own")


@dataclass(frozen=True)
class Verdict:
    model_type: str
    fast: Layout | None  # None: the fast path does not reproduce the model's logits
    fast_packing: bool  # packed documents stay apart on the fast path
    own_packing: bool  # ... on the model's own forward
    attention: str  # the attention the check ran the training side with
    reason: str = ""  # why the fast path or packing was not verified
    checked: bool = True  # False: the check could not run (the fast path is then not used)
    errors: dict[str, float] = field(default_factory=dict)  # the relative errors measured, by comparison
    split_packing: bool = False  # ... on the base layout (fast, else own) with each document a row of its own

    @property
    def base(self) -> Layout:
        """The layout of one document: the fast path where it is the model's function, else its own forward."""
        return OWN if self.fast is None else self.fast

    def layout(self, packing: bool | None) -> Layout:
        """The layout to train with: on rows that may be packed, the first that keeps documents apart of the fast
        path, the model's own forward, and the base layout with each document a row of its own; else the base."""
        if packing is False:
            return self.base
        for candidate in (self.fast, OWN, dataclasses.replace(self.base, split=True)):
            if candidate is not None and self.packing_ok(candidate):
                return candidate
        return self.base

    def packing_ok(self, layout: Layout) -> bool:
        if layout.split:
            return self.split_packing and dataclasses.replace(layout, split=False) == self.base
        return self.fast_packing if layout.path == "fast" else self.own_packing


def decoder_candidates(base) -> list[str]:
    """Attribute paths where a causal LM may keep its decoder, get_decoder() ("") first."""
    names = ["", getattr(base, "base_model_prefix", "") or "model", "model", "language_model", "transformer"]
    names += ["model.language_model", "model.text_model"]
    out = []
    for n in names:
        if n not in out and (n == "" or _attr(base, n) is not None):
            out.append(n)
    return out


def resolve_decoder(base, path: str):
    return base.get_decoder() if path == "" else _attr(base, path)


def _attr(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def cache_key(config, attn_impl: str) -> str:
    tiny = tiny_config(config)
    return json.dumps([tiny.to_dict(), attn_impl], sort_keys=True, default=str)


_CACHE: dict[str, Verdict] = {}


def verdict(config, attn_impl: str, training_cls) -> Verdict:
    """The conformance verdict of `config` when trained with `attn_impl` by `training_cls`
    (training_module.CausalLMForTraining), from a check on its tiny copy; cached per shrunk config."""
    key = cache_key(config, attn_impl)
    if key not in _CACHE:
        try:
            _CACHE[key] = check(tiny_config(config), attn_impl, training_cls)
        except Exception as e:  # noqa: BLE001 - any failure to build or run the copy: trust only the own forward
            reason = f"the tiny copy could not be checked ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            _CACHE[key] = Verdict(config.model_type, None, False, False, attn_impl, reason, checked=False)
    return _CACHE[key]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level, threads = hf_logging.get_verbosity(), torch.get_num_threads()
    hf_logging.set_verbosity_error()
    # One thread: the tiny copy's products are microseconds; waking a pool for each costs more than all of them.
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), torch.device("cpu"):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        torch.set_num_threads(threads)


def build_tiny(config, attn_impl: str, seed: int = 0):
    """The tiny model of a (tiny) config, fp32 in eval mode, random weights from `seed`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_impl)
    model.config.use_cache = False
    return model.eval()


def probe_inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(packed ids [1, sum(DOCS)], their position ids, each document's ids), fixed tokens above the specials."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(min(5, vocab - 1), vocab, (1, sum(DOCS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    return ids, pos, list(ids.split(DOCS, dim=1))


def own_logits(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The model's own forward's fp32 logits [seq, vocab]."""
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want| (inf when the shapes differ or got is not finite)."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return math.inf
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return error(got, want) <= RTOL


def check(tiny, attn_impl: str, training_cls) -> Verdict:
    """Compare the training forwards with the model's own (eager attention) on the tiny config `tiny`."""
    with _quiet(), torch.no_grad():
        attention = _probe_attention(tiny, attn_impl)
        model = build_tiny(tiny, attention)
        ids, pos, docs = probe_inputs(model.get_input_embeddings().weight.shape[0])
        model.set_attn_implementation("eager")
        one = own_logits(model, docs[0], pos[:, : DOCS[0]])
        alone = torch.cat([own_logits(model, d, torch.arange(d.shape[1])[None]) for d in docs])
        own_packed = own_logits(model, ids, pos)
        model.set_attn_implementation(attention)
        fast, reason = _fast_layout(model, training_cls, docs[0], pos[:, : DOCS[0]], one)
        errors = {"own packed": error(own_packed, alone)}
        errors["own path packed"] = error(_train_logits(model, training_cls, OWN, ids, pos), alone)
        if fast is not None:
            errors["fast"] = error(_train_logits(model, training_cls, fast, docs[0], pos[:, : DOCS[0]]), one)
            errors["fast packed"] = error(_train_logits(model, training_cls, fast, ids, pos), alone)
        fast_packing = fast is not None and errors["fast packed"] <= RTOL
        own_packing = max(errors["own packed"], errors["own path packed"]) <= RTOL
        split = None
        if not (fast_packing or own_packing):  # each document a row of its own, on the base layout
            split = dataclasses.replace(OWN if fast is None else fast, split=True)
            errors["split packed"] = error(_train_logits(model, training_cls, split, ids, pos), alone)
    if fast is not None and not fast_packing:
        reason = "the fast path lets packed documents see each other"
    if not own_packing:
        reason = (reason + "; " if reason else "") + "its own forward lets packed documents affect each other"
    split_packing = split is not None and errors["split packed"] <= RTOL
    v = Verdict(tiny.model_type, fast, fast_packing, own_packing, attention, reason, errors=errors)
    return dataclasses.replace(v, split_packing=split_packing)


def _probe_attention(config, attn_impl: str) -> str:
    """The attention the check runs the training side with: the run's, or shardtune's SDPA in place of a kernel
    that needs CUDA (flash-attention: the same per-document attention, from position_ids); then, as in
    training, eager where the family cannot run SDPA."""
    shardtune_sdpa = fastpath.register_attention()
    impl = attn_impl if attn_impl in ("eager", "sdpa", shardtune_sdpa) else shardtune_sdpa
    return _attention_choice(config, impl)[0]


def _train_logits(model, training_cls, layout: Layout, ids, pos) -> torch.Tensor:
    train = training_cls(model, layout=layout)
    return train.logits(ids, pos)[0]


def _fast_layout(model, training_cls, ids, pos, want) -> tuple[Layout | None, str]:
    """The first (decoder, head transform) whose logits are the model's own on one document."""
    tried = []
    for dec in decoder_candidates(model):
        try:
            train = training_cls(model, layout=Layout(decoder=dec))
            h = train.hidden_states(ids, pos)
            raw = train._head(h)[0].float()
        except Exception as e:  # noqa: BLE001 - a candidate that does not run is not the family's decoder
            tried.append(f"{dec or 'get_decoder()'}: {type(e).__name__}")
            continue
        for name, f in head_transforms(model.config).items():
            if close(f(raw), want):
                return Layout(decoder=dec, head=name), ""
        tried.append(f"{dec or 'get_decoder()'}: logits differ")
    return None, "the decoder + chunked head do not give the model's logits (" + "; ".join(tried) + ")"


def summary(v: Verdict, layout: Layout, packing: bool) -> str:
    """One log line: which forward trains and what was verified."""
    if layout.path == "fast":
        head = "" if layout.head == "identity" else f", head logits {layout.head}"
        what = f"shardtune's fast path (decoder {layout.decoder or 'get_decoder()'}{head})"
    else:
        what = "the model's own forward (full logits)"
    if not v.checked:
        return f"{v.model_type}: training {what}; {v.reason}."
    if layout.split and v.packing_ok(layout):
        rows = "packed documents stay apart, each decoded as a row of its own"
    elif v.packing_ok(layout):
        rows = "packed documents stay apart"
    else:
        rows = "packed documents would not stay apart" + ("" if packing else " (rows are not packed)")
    shown = v.reason and (packing or layout.path != "fast") and not (layout.split and v.packing_ok(layout))
    why = f"; {v.reason}" if shown else ""
    return f"{v.model_type}: training {what}, checked against its own forward on a tiny copy; {rows}{why}."


@functools.cache
def causal_lm_types() -> tuple[str, ...]:
    """Every model_type transformers registers a causal LM for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
