"""shardtune.models.fastpath: the fast dropout and the per-document attention give what the library versions give."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.models import fastpath
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.heads import token_loss
from tests.tolerance import tol

# --- dropout -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_fast_dropout_keep_rate_scale_and_gradient(p):
    torch.manual_seed(0)
    x = torch.randn(1000, 1000, requires_grad=True)
    drop = fastpath.FastDropout(p)
    y = drop(x)
    kept = y != 0
    # 1e6 draws: the kept fraction's standard deviation is below 5e-4.
    assert abs(float(kept.float().mean()) - (1 - p)) < 3e-3
    # x · fl32(1/(1-p)) vs x / fl32(1-p): two roundings to fp32 on each side (the scalar, the product or
    # quotient), so within 4u of each other = tol over a "reduction" of 2 (tests/tolerance.py).
    once = tol(torch.float32, 2)
    torch.testing.assert_close(y[kept], x.detach()[kept] / (1 - p), rtol=once, atol=0)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, kept.float() / (1 - p), rtol=once, atol=0)
    # Masks differ from draw to draw, and eval mode is the identity.
    assert not torch.equal(drop(x) != 0, kept)
    drop.eval()
    assert torch.equal(drop(x), x)


def test_fast_dropout_draws_the_same_mask_when_checkpointing_recomputes():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), fastpath.FastDropout(0.3), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    grads = []
    for checkpointed in (False, True):
        net.zero_grad()
        torch.manual_seed(1)
        y = torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False) if checkpointed else net(x)
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_use_fast_dropout_replaces_every_lora_dropout():
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model = get_peft_model(base, LoraConfig(r=2, lora_dropout=0.2, target_modules=["0", "2"]))
    assert fastpath.use_fast_dropout(model) == 2
    drops = [d for m in model.modules() for d in getattr(m, "lora_dropout", {}).values()]
    assert len(drops) == 2 and all(type(d) is fastpath.FastDropout and d.p == 0.2 for d in drops)
    assert fastpath.use_fast_dropout(model) == 0  # already replaced
    # Without dropout peft uses nn.Identity, which stays.
    plain = get_peft_model(nn.Sequential(nn.Linear(16, 4)), LoraConfig(r=2, lora_dropout=0.0, target_modules=["0"]))
    assert fastpath.use_fast_dropout(plain) == 0


# --- packed documents ---------------------------------------------------------------------------------------------


def _positions(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def test_packed_documents_groups_short_documents_into_spans():
    pos = torch.stack([_positions(30, 40, 100, 200, 10, 20), _positions(400)])
    rows = fastpath.packed_documents(pos, span_tokens=128)
    assert [sp.size for sp in rows[0]] == [70, 100, 200, 30]
    assert [sp.mask is None for sp in rows[0]] == [False, True, True, False]
    assert [(sp.size, sp.mask) for sp in rows[1]] == [(400, None)]
    # A span's mask is causal inside each document and blocks attention across documents.
    doc = torch.tensor([0] * 30 + [1] * 40)
    want = (doc[:, None] == doc[None, :]) & torch.ones(70, 70, dtype=torch.bool).tril()
    assert torch.equal(rows[0][0].mask[0, 0], want)


def _tiny_llama(attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_per_document_attention_matches_the_masked_attention(dtype, tol):
    """Loss and every gradient equal transformers' SDPA with its block-diagonal mask, on rows mixing short
    documents (grouped spans), a document longer than a span, and a row with one document."""
    ref = _tiny_llama("sdpa", dtype)
    fast = _tiny_llama(fastpath.register_attention(), dtype)
    fast.load_state_dict(ref.state_dict())
    pos = torch.stack([_positions(150, 20, 30, 100), _positions(300)])
    ids = torch.randint(0, 97, pos.shape, generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    results = []
    for model, per_doc in ((ref, False), (fast, True)):
        module = CausalLMForTraining(model, chunk_size=256, per_document_attention=per_doc)
        loss, n = module(ids, pos, labels, head=token_loss)
        loss.backward()
        results.append((loss.detach() / n, {k: p.grad for k, p in model.named_parameters()}))
    (want, want_g), (got, got_g) = results
    assert float((got - want).abs()) <= tol * float(want.abs())
    for k, g in want_g.items():
        err = float((got_g[k].float() - g.float()).abs().max())
        assert err <= tol * float(g.float().abs().max()), (k, err)


def test_per_document_attention_keeps_a_mask_it_does_not_know(monkeypatch):
    """A family's mask that is not plain causal within documents (attention chunks of 8 positions, as Llama 4's)
    is applied on each span's diagonal block, read once per forward however many layers share it; planted bug: the
    spans' own causal masks instead, which attend across chunks."""
    import torch.nn.functional as F

    pos = _positions(20, 12, 30, 150)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate((20, 12, 30, 150))])
    p = pos.flatten()
    chunk = (p[:, None] // 8) == (p[None, :] // 8)
    mask = ((doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril() & chunk)[
        None, None
    ]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(doc), 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    documents = fastpath.packed_documents(pos)
    reads = []
    family_mask = fastpath._family_mask
    monkeypatch.setattr(fastpath, "_family_mask", lambda *a: reads.append(a[2]) or family_mask(*a))
    for _ in range(3):  # three layers sharing the mask
        got, _ = fastpath.packed_sdpa_attention(nn.Module(), q, k, v, mask, shardtune_documents=documents)
        # fp32, the same softmax sums over at most 150 keys of 16-wide products in another grouping.
        torch.testing.assert_close(got, want, rtol=0, atol=tol(torch.float32, 150 + 16))
    assert len(reads) == len(documents[0])  # once per span, not per layer
    monkeypatch.setattr(fastpath, "_family_mask", lambda *a: None)
    bug, _ = fastpath.packed_sdpa_attention(
        nn.Module(), q, k, v, mask, shardtune_documents=fastpath.packed_documents(pos)
    )
    assert float((bug - want).abs().max()) > 100 * tol(torch.float32, 150 + 16)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_row_mask_is_built_only_for_a_family_that_masks_more(monkeypatch, chunked):
    """The training forward of a plain causal family (Llama) has transformers build no row-wide mask (a packed row
    of L positions would cost L² bytes, 3·L² while building), and trains the same (the loss above); a family
    with attention chunks (Llama 4's attention_chunk_size) still gets its mask, which the spans read."""
    from transformers import masking_utils

    model = _tiny_llama(fastpath.register_attention(), torch.float32)
    if chunked:
        model.config.attention_chunk_size = 8
    built = []
    sdpa_mask = masking_utils.sdpa_mask
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: built.append(1) or sdpa_mask(*a, **k))
    pos = torch.stack([_positions(150, 20, 30, 100)])
    ids = torch.randint(0, 97, pos.shape, generator=torch.Generator().manual_seed(1))
    CausalLMForTraining(model, chunk_size=256)(ids, pos, ids.roll(-1, 1), head=token_loss)
    assert bool(built) == chunked
    from shardtune.models import families

    assert families.plain_causal(model.config) == (not chunked)


def test_attention_without_spans_is_transformers_sdpa():
    """Generation and any caller that passes no spans get transformers' SDPA, mask included."""
    ref = _tiny_llama("sdpa", torch.float32)
    fast = _tiny_llama(fastpath.register_attention(), torch.float32)
    fast.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0  # left padding, as in batched generation
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=padding).logits
        got = fast(input_ids=ids, attention_mask=padding).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        out = fast.generate(ids[:1], max_new_tokens=4, do_sample=False)
        assert torch.equal(out, ref.generate(ids[:1], max_new_tokens=4, do_sample=False))


# --- a document begun before its queries (context parallelism's crossing parts) -------------------------------


@pytest.mark.parametrize(("queries", "before", "key_heads"), [(16, 24, 4), (16, 24, 2), (7, 1, 2), (33, 70, 1)])
def test_queries_over_keys_from_the_document_start_equal_masked_attention(queries, before, key_heads):
    """On CPU, the last `queries` positions of a document over its keys from the start are two kernel calls merged
    by log-sum-exp (fastpath._PrefixThenCausal, no mask tensor): forward and every gradient equal the masked
    attention of the whole rectangle. fp64, where the merge and the kernel's blocked softmax round at ~1e-16
    (measured 6.7e-16 to 1.6e-15): 1e-12 is 500x that, and a block's share left out or mis-weighted is O(1)."""
    torch.manual_seed(0)
    d, n = 8, before + queries
    q = torch.randn(1, 4, queries, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, key_heads, n, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = fastpath._lower_right(q, k, v, 0.0, None)
    assert out.grad_fn.next_functions[0][0].name().endswith("_PrefixThenCausalBackward")
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[before:]  # query i sees the keys up to its own position
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    ref = ref.transpose(1, 2)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# --- LoRA forward -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fast_lora_forward_matches_peft(dtype, tol, dropout):
    """Output and every gradient against peft's own LoRA forward (the same dropout masks); merge and unmerge give
    peft's weights; a layer with lora_bias keeps peft's path."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(48, 80), nn.SiLU(), nn.Linear(80, 32, bias=False)).to(dtype)
    ref = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0", "2"]))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.add_(0.3 * torch.randn_like(p))
    fastpath.use_fast_dropout(ref)
    fast = copy.deepcopy(ref)
    assert fastpath.use_fast_lora(fast) == 2 and fastpath.use_fast_lora(fast) == 0
    x = torch.randn(3, 7, 48, dtype=dtype)
    results = []
    for model in (ref, fast):
        xx = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        y = model(xx)
        y.float().square().sum().backward()
        results.append((y.detach(), xx.grad, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (y_ref, gx_ref, g_ref), (y, gx, g) = results

    def close(got, want):
        err = float((got.float() - want.float()).abs().max())
        assert err <= tol * float(want.float().abs().max()), err

    close(y, y_ref)
    close(gx, gx_ref)
    assert len(g_ref) == 4
    for k in g_ref:
        close(g[k], g_ref[k])
    for model in (ref, fast):
        model.base_model.merge_adapter()
    for (n, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
    fast.base_model.unmerge_adapter()
    ref.base_model.unmerge_adapter()
    for (n, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


def test_fast_lora_skips_variants_and_keeps_lora_bias_exact():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    dora = get_peft_model(nn.Sequential(nn.Linear(16, 8)), LoraConfig(r=2, target_modules=["0"], use_dora=True))
    assert fastpath.use_fast_lora(dora) == 0
    model = get_peft_model(nn.Sequential(nn.Linear(16, 8)), LoraConfig(r=2, target_modules=["0"], lora_bias=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p))
    x = torch.randn(5, 16)
    want = model(x)
    assert fastpath.use_fast_lora(model) == 1
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
