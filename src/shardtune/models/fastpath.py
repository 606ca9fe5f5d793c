"""Faster drop-in pieces for the training step, where the libraries' own are slow on the paths shardtune runs
(each measured in docs/speed.md and tested against the library version).

- `FastDropout`: PEFT's `lora_dropout` is an `nn.Dropout`, and on CPU `bernoulli_` draws one random number per
  element: with LoRA on every linear layer it took a fifth of the step. FastDropout draws one 64-bit number per
  four elements; same keep probability (to 1/65536), same gradient.
- `use_fast_lora`: a PEFT LoRA variant whose forward is one addmm instead of a product, a scaling and a sum.
- `packed_sdpa_attention` ("shardtune_sdpa"): with packed rows and SDPA, transformers builds a block-diagonal causal
  mask over the whole row, and SDPA then computes every (query, key) pair of the row, masked or not. This runs
  SDPA per span of whole documents instead (short documents grouped, long ones alone and causal). Where
  flash-attention 2 is installed (CUDA), shardtune uses it instead: it does the same with cu_seqlens.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardtune.parallel import split

ATTENTION = "shardtune_sdpa"
DOCUMENTS_KWARG = "shardtune_documents"
# Short documents are grouped into spans of up to this many positions, one SDPA call per span: on CPU a call costs
# about as much for 22 positions as for 128, so grouping beats one call per document.
SPAN_TOKENS = 128


# ---------------------------------------------------------------- dropout


class _BitsDropout(torch.autograd.Function):
    """Dropout whose keep mask compares 16-bit slices of 64-bit random integers with a threshold.

    The mask is built with integer arithmetic and kept as uint8 (one byte, as nn.Dropout's bool mask): on CPU,
    comparisons producing bool and products with bool tensors run 3-5x slower than these vectorized steps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, scale: float) -> torch.Tensor:
        n = x.numel()
        bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        # A uniform int16 is >= t with probability (32768 - t) / 65536 = 1 - p; clamp(b - t + 1, 0, 1) is that test.
        t = round(p * 65536) - 32768
        keep = bits.view(torch.int16)[:n].view(x.shape).to(torch.int32).sub_(t - 1).clamp_(0, 1).to(torch.uint8)
        ctx.save_for_backward(keep)
        ctx.scale = scale
        y = x * keep.to(x.dtype)
        return y if scale == 1.0 else y.mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        g = grad * keep.to(grad.dtype)
        return (g if ctx.scale == 1.0 else g.mul_(ctx.scale)), None, None


class FastDropout(nn.Dropout):
    """nn.Dropout with the same keep probability (to 1/65536), about 3x faster on CPU.

    Under activation checkpointing the recomputed forward restores the RNG state, so it draws the same mask. On
    CUDA, and under torch.compile, the native dropout is already fast and is used as it is.
    """

    def fast(self, x: torch.Tensor) -> bool:
        """Whether this call draws its own mask (else it is nn.Dropout's)."""
        return self.training and 0.0 < self.p < 1.0 and x.device.type == "cpu" and not torch.compiler.is_compiling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fast(x):
            return super().forward(x)
        return _BitsDropout.apply(x, self.p, 1.0 / (1.0 - self.p))

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """x with the dropped elements zeroed, not rescaled: the caller applies 1/(1-p) (only when fast(x))."""
        return _BitsDropout.apply(x, self.p, 1.0)


def use_fast_dropout(model: nn.Module) -> int:
    """Replace the nn.Dropout on every LoRA layer's input (PEFT's lora_dropout) by FastDropout; return how many."""
    n = 0
    for mod in model.modules():
        drops = getattr(mod, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict):
            for name, d in list(drops.items()):
                if type(d) is nn.Dropout:
                    drops[name] = FastDropout(d.p)
                    n += 1
    return n


# ---------------------------------------------------------------- LoRA forward


def _fast_lora_forward(module, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs) -> torch.Tensor:
    """peft's vanilla LoRA forward, result + s·B·(A·dropout(x)), with the product by B, the scaling (and dropout's
    1/(1-p)) and the sum done by one addmm: two fewer passes over the (tokens, out) output per layer, forward and
    backward, and `result` is not kept for backward. Same value and gradients up to rounding."""
    lora_A, lora_B = module.lora_A[active_adapter], module.lora_B[active_adapter]
    dropout, scaling = module.lora_dropout[active_adapter], module.scaling[active_adapter]
    if isinstance(dropout, FastDropout) and dropout.fast(x):
        h, alpha = lora_A(dropout.mask(x)), scaling / (1.0 - dropout.p)
    else:
        h, alpha = lora_A(dropout(x)), scaling
    if lora_B.bias is not None or h.dtype != result.dtype or lora_B.weight.dtype != h.dtype:
        return result + lora_B(h) * alpha
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), lora_B.weight.t(), alpha=alpha)
    return out.view(result.shape)


def _delta(module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    return module.get_delta_weight(adapter).to(weight.dtype)


@functools.cache
def _fast_lora_variant() -> type:
    from peft.tuners.lora.layer import LoraVariant

    # Merging and unmerging are vanilla LoRA's, casts included (peft handles lora_bias outside the variant).
    return type(
        "FastLoraVariant",
        (LoraVariant,),
        {
            "init": staticmethod(lambda module, adapter_name, **kw: None),
            "merge_safe": staticmethod(lambda module, adapter, w: w + _delta(module, adapter, w)),
            "merge_unsafe": staticmethod(lambda module, adapter, w: w.data.add_(module.get_delta_weight(adapter))),
            "unmerge": staticmethod(lambda module, adapter, w: w - _delta(module, adapter, w)),
            "forward": staticmethod(_fast_lora_forward),
        },
    )


def use_fast_lora(model: nn.Module) -> int:
    """Give every plain LoRA adapter on a (non-quantized) linear layer the forward above; return how many.
    DoRA and other variants keep theirs; 4-bit layers keep peft's forward."""
    from peft.tuners.lora.layer import Linear

    fast, n = _fast_lora_variant(), 0
    for m in model.modules():
        if type(m) is not Linear:
            continue
        for name in m.lora_A:
            if name not in m.lora_variant:
                m.lora_variant[name] = fast()
                n += 1
    return n


# ---------------------------------------------------------------- attention over packed documents


@dataclass(frozen=True)
class Span:
    """Consecutive positions of one row: one document (mask None: causal), or several short ones (mask: causal
    within each document, [1, 1, size, size] bool)."""

    size: int
    mask: torch.Tensor | None


Documents = tuple[tuple[Span, ...], ...]  # per row


class PackedDocuments(tuple):
    """Documents of one forward, with the spans' masks read from the family's masks (_span_masks)."""

    def __new__(cls, rows):
        self = super().__new__(cls, rows)
        self.span_masks = {}
        return self


def packed_documents(position_ids: torch.Tensor, span_tokens: int = SPAN_TOKENS) -> Documents:
    """Each row cut into spans of whole documents. A document starts where the position does not follow the
    previous one (as transformers' find_packed_sequence_indices reads packed rows). Consecutive documents share a
    span while it stays within `span_tokens`; a longer document is a span of its own. One host copy of the
    position ids per forward; the masks are built here once and serve every layer."""
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.ndim == 1:
        pos = pos[None]
    breaks = torch.ones_like(pos, dtype=torch.bool)
    breaks[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    rows = []
    for row in breaks:
        bounds = [*torch.nonzero(row).flatten().tolist(), row.numel()]
        spans: list[Span] = []
        group: list[tuple[int, int]] = []
        for s, e in itertools.pairwise(bounds):
            if group and e - group[0][0] > span_tokens:
                spans.append(_span(group, position_ids.device))
                group = []
            group.append((s, e))
        spans.append(_span(group, position_ids.device))
        rows.append(tuple(spans))
    return PackedDocuments(rows)


def _span(docs: list[tuple[int, int]], device: torch.device) -> Span:
    size = docs[-1][1] - docs[0][0]
    if len(docs) == 1:
        return Span(size, None)
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor([e - s for s, e in docs]))
    mask = (doc[:, None] == doc[None, :]) & torch.ones(size, size, dtype=torch.bool).tril()
    return Span(size, mask[None, None].to(device))


def _span_attention(q, k, v, span: Span, dropout: float, scaling: float | None, mask=None) -> torch.Tensor:
    """[1, heads, L, d] -> [1, L, heads, d]. Spans up to SPAN_TOKENS run on SDPA's math kernel, which on CPU is
    2-3x faster than its flash kernel at these lengths (the whole score matrix is small); longer documents
    run on the default (flash) kernel. `mask`: the family's own mask over the span, where it is not plain causal
    within each document (chunked attention, a bias)."""
    gqa = q.shape[1] != k.shape[1]
    kw = {"dropout_p": dropout, "scale": scaling, "enable_gqa": gqa}
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    elif span.size <= SPAN_TOKENS:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, is_causal=span.mask is None, **kw)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return out.transpose(1, 2)


def _family_mask(attention_mask: torch.Tensor | None, row: int, start: int, span: Span) -> torch.Tensor | None:
    """The family's mask on a span's diagonal block, or None where it is the span's own (causal within each
    document): transformers' mask of a packed row is block-diagonal over its documents, so its diagonal blocks
    are all of it that a span needs, and they carry what shardtune would not know (chunked attention)."""
    if attention_mask is None or attention_mask.ndim != 4:
        return None
    end = start + span.size
    block = attention_mask[row : row + 1, :, start:end, start:end]
    if block.dtype != torch.bool:
        return block  # an additive mask (or bias): used as it is
    own = span.mask
    if own is None:
        own = torch.ones(span.size, span.size, dtype=torch.bool, device=block.device).tril_()
    return None if bool((block == own.to(block.device)).all()) else block


def _span_masks(attention_mask: torch.Tensor | None, documents: Documents) -> list[list[torch.Tensor | None]]:
    """_family_mask of every span of every row. transformers builds one mask per kind of layer, shared by every
    layer of that kind: the spans' masks are read (a host sync each) once per forward and kept with the forward's
    documents (PackedDocuments), not once per layer."""
    if attention_mask is None:
        return [[None] * len(spans) for spans in documents]
    cache = getattr(documents, "span_masks", {})
    hit = cache.get(id(attention_mask))
    if hit is not None and hit[0] is attention_mask:
        return hit[1]
    masks = []
    for row, spans in enumerate(documents):
        starts = itertools.accumulate([0, *[sp.size for sp in spans[:-1]]])
        masks.append([_family_mask(attention_mask, row, start, sp) for start, sp in zip(starts, spans, strict=True)])
    cache[id(attention_mask)] = (attention_mask, masks)
    return masks


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: SDPA per span of packed documents when the caller passed the spans
    (`shardtune_documents`, from CausalLMForTraining) and nothing else shapes the mask; transformers' SDPA with
    its mask otherwise (generation with a cache, sliding windows, padding masks, torch.compile)."""
    documents: Documents | None = kwargs.pop(DOCUMENTS_KWARG, None)
    if isinstance(documents, split.CPShard):
        if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None) is not None:
            raise ValueError("context parallelism does not support sliding-window attention yet")
        return _context_parallel_attention(query, key, value, documents, dropout, scaling), None
    plain = (
        documents is None
        or query.shape[2] != key.shape[2]
        or len(documents) != query.shape[0]
        or kwargs.get("sliding_window") is not None
        or getattr(module, "sliding_window", None) is not None
        or kwargs.get("softcap") is not None
        or torch.compiler.is_compiling()
    )
    if plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    # unbind and split: their backward writes each gradient once (slicing would add a zero-filled full-size
    # gradient per span).
    rows = []
    span_masks = _span_masks(attention_mask, documents)
    for spans, masks, q, k, v in zip(
        documents, span_masks, query.unbind(0), key.unbind(0), value.unbind(0), strict=True
    ):
        sizes = [sp.size for sp in spans]
        parts = [
            _span_attention(qs[None], ks[None], vs[None], sp, dropout, scaling, m)
            for sp, m, qs, ks, vs in zip(
                spans, masks, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), strict=True
            )
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))  # [1, seq, heads, head_dim]
    return torch.cat(rows, dim=0), None


def _context_parallel_attention(q, k, v, shard: split.CPShard, dropout: float, scaling: float | None):
    """This rank's queries [B, H, L_local, d] -> [B, L_local, H, d] (shardtune.parallel.split): per row, each
    local part's documents among its own positions (span attention, as without context parallelism), and a
    document that began in an earlier chunk against the gathered row's keys from its start (lower-right causal)."""
    # Every rank gathers in every layer, and every rank's output depends on the gathered keys and values, with or
    # without a part that reads them: the all-gather and its backward's reduce-scatter are collectives, and a rank
    # that skipped either (no gather, or no gradient reaching it) would leave the others waiting.
    gathered = [shard.gather(k), shard.gather(v)]
    if shard.varlen is not None:  # flash-attention (loading.context_parallel_attention chose it)
        return _varlen_attention(q, k, v, gathered, shard.varlen, dropout, scaling)
    used = any(p.key_start is not None for parts in shard.rows for p in parts)
    rows = []
    for b, parts in enumerate(shard.rows):
        sizes = [p.end - p.start for p in parts]
        out = []
        for p, qs, ks, vs in zip(parts, q[b].split(sizes, 1), k[b].split(sizes, 1), v[b].split(sizes, 1), strict=True):
            if p.key_start is None:
                spans = [sp.size for sp in p.spans]
                out += [_span_attention(qq[None], kk[None], vv[None], sp, dropout, scaling)
                        for sp, qq, kk, vv in zip(p.spans, qs.split(spans, 1), ks.split(spans, 1), vs.split(spans, 1),
                                                  strict=True)]  # fmt: skip
            else:
                keys, values = (t[b : b + 1, :, p.key_start : p.key_end] for t in gathered)
                out.append(_lower_right(qs[None], keys, values, dropout, scaling))
        rows.append(torch.cat(out, dim=1))
    out = torch.cat(rows, dim=0)
    return out if used else out + sum(t[:, :, :0].sum() for t in gathered)  # empty: adds 0, keeps them in the graph


def _varlen_attention(q, k, v, gathered, layout: split.Varlen, dropout: float, scaling: float | None):
    """_context_parallel_attention as one flash-attention varlen call: the queries flattened, each segment's keys
    picked from the local and the gathered keys (split.Varlen). Flash takes GQA's fewer key heads as
    they are and aligns a segment with more keys than queries at the bottom right, as _lower_right does."""
    b, heads, n, d = q.shape

    def segments(local: torch.Tensor, row: torch.Tensor) -> torch.Tensor:  # -> [total keys, kv heads, d]
        flat = torch.cat([local.transpose(1, 2).flatten(0, 1), row.transpose(1, 2).flatten(0, 1)])
        return flat.index_select(0, layout.key_index)

    out = flash_varlen()(
        q.transpose(1, 2).flatten(0, 1), segments(k, gathered[0]), segments(v, gathered[1]),
        layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, dropout_p=dropout, softmax_scale=scaling, causal=True,
    )  # fmt: skip
    return out.view(b, n, heads, d)


def flash_varlen():
    """flash-attention's flash_attn_varlen_func (an optional CUDA dependency, imported when first used)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def causal_lower_right(*args):
    """torch's lower-right causal bias (torch.nn.attention.bias.causal_lower_right), imported when first made: that
    module imports torch._dynamo, which importing shardtune's training stack (`train --help`, the flags' checks)
    then skips (0.8 s); a run gets it from transformers' modeling anyway. (A module attribute: planning.trace
    makes the bias outside its dispatch modes by replacing it.)"""
    from torch.nn.attention.bias import causal_lower_right as make

    return make(*args)


def _lower_right(q, k, v, dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal attention of the last q.shape[2] positions of a document over its k.shape[2] keys, without a mask
    tensor -> [1, L, heads, d]. On CPU, torch's lower-right causal bias is a mask it materializes (queries x keys:
    8K queries over 32K keys held 1.26 GiB more than their inputs, a causal 8K x 8K call 0.09 GiB), so there the
    keys before the queries and the queries' own keys are two calls merged (_PrefixThenCausal)."""
    prefix = k.shape[2] - q.shape[2]
    if q.device.type == "cpu" and dropout == 0.0 and prefix > 0 and _CPU_FLASH is not None:
        own = (slice(None), slice(None), slice(prefix, None))
        before = (slice(None), slice(None), slice(None, prefix))
        return _PrefixThenCausal.apply(q, k[before], v[before], k[own], v[own], scaling).transpose(1, 2)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scaling,
                                          enable_gqa=gqa).transpose(1, 2)  # fmt: skip


# torch's CPU flash-attention kernel, which (unlike F.scaled_dot_product_attention) returns the log-sum-exp of each
# query's scores and takes GQA's fewer key heads as they are.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class _PrefixThenCausal(torch.autograd.Function):
    """softmax(q [k_before; k_own]) [v_before; v_own] with causal attention among the queries' own keys: one
    unmasked call over the keys before the queries and one causal call over their own keys, merged by the two
    calls' log-sum-exps (as ring attention merges its blocks). The backward runs each call's kernel backward
    with the merged output and log-sum-exp, which gives each block's exact share of the gradient."""

    @staticmethod
    def forward(ctx, q, k_before, v_before, k_own, v_own, scale):
        out_a, lse_a = _CPU_FLASH(q, k_before, v_before, 0.0, False, scale=scale)
        out_b, lse_b = _CPU_FLASH(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_a, lse_b)  # fp32 (fp64 for fp64 inputs)
        wide = torch.promote_types(q.dtype, torch.float32)
        out = out_a.to(wide) * (lse_a - lse).exp().unsqueeze(-1) + out_b.to(wide) * (lse_b - lse).exp().unsqueeze(-1)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_before, v_before, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_before, v_before, k_own, v_own, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq_a, dk_a, dv_a = backward(grad, q, k_before, v_before, out, lse, 0.0, False, scale=ctx.scale)
        dq_b, dk_b, dv_b = backward(grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq_a + dq_b, dk_a, dv_a, dk_b, dv_b, None


# Set while the training module runs a forward whose attention gets its documents (or its context-parallel split)
# from shardtune and whose family masks nothing else (no sliding window, no chunks: families.plain_causal): the
# row-wide mask transformers would build is then not read, and is not built (at L positions, L² bytes and 3·L²
# while building).
_NO_ROW_MASK = contextvars.ContextVar("shardtune_no_row_mask", default=False)


@contextlib.contextmanager
def without_row_mask() -> Iterator[None]:
    token = _NO_ROW_MASK.set(True)
    try:
        yield
    finally:
        _NO_ROW_MASK.reset(token)


def _row_mask(*args, **kwargs):
    """SDPA's mask (transformers' sdpa_mask), or None inside without_row_mask."""
    from transformers.masking_utils import sdpa_mask

    return None if _NO_ROW_MASK.get() else sdpa_mask(*args, **kwargs)


@functools.cache
def register_attention() -> str:
    """Register "shardtune_sdpa" with transformers (its masks are SDPA's, unless not needed: _row_mask); return
    the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, packed_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, _row_mask)
    return ATTENTION
