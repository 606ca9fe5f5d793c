"""Context parallelism's attention as one flash-attention varlen call (shardtune.parallel.split.Varlen, the CUDA
path): every rank's output equals per-document causal attention of the whole row, and its gradients equal the SDPA
path's, with flash's kernel stood in for by its documented semantics (`reference_varlen`: per segment, causal
aligned at the bottom right); a planted wrong key range fails. On CUDA with flash_attn installed the device check
(bench/gpu_numerics.py's context_parallel) runs the real kernel."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from shardtune.models import fastpath, loading
from shardtune.parallel import split
from shardtune.parallel.context_parallel import local_shard


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_varlen_func's contract: q [Tq, H, d], k and v [Tk, Hkv, d]; segment i's queries
    cu_q[i]:cu_q[i+1] attend its keys cu_k[i]:cu_k[i+1]; causal aligned at the bottom right (flash-attention
    2.1 and later); fewer key heads shared by groups of query heads."""
    assert causal and dropout_p == 0.0
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, (a, b) in
                      ((q, cu_q[i : i + 2].tolist()), (k, cu_k[i : i + 2].tolist()), (v, cu_k[i : i + 2].tolist())))  # fmt: skip
        assert qs.shape[2] <= max_q and ks.shape[2] <= max_k
        bias = causal_lower_right(qs.shape[2], ks.shape[2])
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=softmax_scale,
                                                  enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
    return torch.cat(out)


# Two rows: documents crossing chunk and rank edges (one longer than a chunk), and single-position documents.
ROWS = [(5, 7, 10, 3, 5), (1, 1, 13, 2, 6, 7)]


def _row_batch():
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ROWS])
    return {"input_ids": torch.zeros_like(pos), "position_ids": pos, "labels": torch.zeros_like(pos)}


def _whole_rows(q, k, v, pos):
    docs = split.document_ids(pos)
    n = pos.shape[1]
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True).transpose(1, 2)


def _rank(batch, size, rank, q, k, v, varlen: bool, leak: bool = False):
    """This rank's attention (one process holds every rank's keys: the all-gather of its k_r is the whole k)."""
    local, rows, _ = split.split(batch, size=size, rank=rank, pad_id=0)
    if leak:  # a crossing document attending the row from its start (keys of the documents before it)
        rows = tuple(tuple(replace(p, key_start=0) if p.key_start else p for p in parts) for parts in rows)
    mine = split.zigzag(q.shape[2], size, rank)
    q_r, k_r, v_r = (t[:, :, mine] for t in (q, k, v))
    shard = local_shard(rows, local["position_ids"], lambda x: k if x is k_r else v, size=size, varlen=varlen)
    return mine, fastpath._context_parallel_attention(q_r, k_r, v_r, shard, 0.0, None)


@pytest.fixture
def reference_flash(monkeypatch):
    monkeypatch.setattr(fastpath, "flash_varlen", lambda: reference_varlen)


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_equals_the_whole_rows_and_the_sdpa_path(reference_flash, size):
    """fp64 (unit roundoff 1.1e-16), softmaxes over at most 36 keys: 1e-12 is ~10^4 roundoffs of O(1) outputs and
    gradients, while a wrong key range moves them by O(0.1) (the leak below)."""
    batch = _row_batch()
    full = split.padded_length(batch["input_ids"].shape[1], size)
    pos = split.split(batch, size=1, rank=0, pad_id=0)[0]["position_ids"]
    pos = torch.cat([pos, torch.arange(full - pos.shape[1]).expand(2, -1)], dim=1)  # as split pads
    g = torch.Generator().manual_seed(size)
    q, k, v = (torch.randn(2, h, full, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    want = _whole_rows(q, k, v, pos)
    grad_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for r in range(size):
        grads = []
        for varlen in (True, False):
            mine, got = _rank(batch, size, r, q, k, v, varlen)
            torch.testing.assert_close(got, want[:, mine], rtol=0, atol=1e-12)
            grads.append(torch.autograd.grad(got, (q, k, v), grad_out[:, mine]))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_wrong_key_range_fails(reference_flash):
    batch = _row_batch()
    full = split.padded_length(batch["input_ids"].shape[1], 2)
    pos = torch.cat([batch["position_ids"], torch.arange(full - batch["position_ids"].shape[1]).expand(2, -1)], 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, full, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    want = _whole_rows(q, k, v, pos)
    errors = [float((out - want[:, mine]).abs().max()) for mine, out in
              (_rank(batch, 2, r, q, k, v, varlen=True, leak=True) for r in range(2))]  # fmt: skip
    assert max(errors) > 1e-2, errors


def test_the_layout_covers_every_query_once_and_keys_of_its_own_document():
    """The segments tile the rank's positions in order, and every key index lies in the local keys of the
    segment's document or in the gathered row's keys of the crossing document."""
    batch = _row_batch()
    size = 2
    for r in range(size):
        local, rows, _ = split.split(batch, size=size, rank=r, pad_id=0)
        lay = split.varlen(rows, local["position_ids"], local["position_ids"].shape[1] * size)
        n_local = local["position_ids"].numel()
        assert lay.cu_q[-1] == n_local and lay.cu_q.dtype == torch.int32
        assert (lay.cu_k[1:] - lay.cu_k[:-1] >= lay.cu_q[1:] - lay.cu_q[:-1]).all()
        assert lay.max_q == int((lay.cu_q[1:] - lay.cu_q[:-1]).max())
        assert lay.key_index.numel() == lay.cu_k[-1] and lay.key_index.max() < n_local * (1 + size)


def test_flash_is_chosen_only_under_context_parallelism_in_16_bits(monkeypatch):
    monkeypatch.setattr(loading, "_flash_version", lambda: (2, 7))
    attn = fastpath.ATTENTION
    assert loading.context_parallel_attention("flash_attention_2", 1, torch.bfloat16) == ("flash_attention_2", False)
    assert loading.context_parallel_attention("flash_attention_2", 2, torch.bfloat16) == (attn, True)
    assert loading.context_parallel_attention("flash_attention_2", 2, torch.float32) == (attn, False)
    assert loading.context_parallel_attention(attn, 2, torch.bfloat16) == (attn, False)
    monkeypatch.setattr(loading, "_flash_version", lambda: (2, 0))
    assert loading.context_parallel_attention("flash_attention_2", 2, torch.float16) == (attn, False)


def test_a_forward_on_some_rows_reads_their_own_layout(reference_flash):
    """KTO's KL rows run a forward of their own: the shard of those rows (CPShard.select_rows) attends them as
    the whole micro-batch's shard does."""
    batch = _row_batch()
    local, rows, _ = split.split(batch, size=2, rank=1, pad_id=0)
    full = split.padded_length(batch["input_ids"].shape[1], 2)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, full, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    mine = split.zigzag(full, 2, 1)
    q_r, k_r, v_r = (t[:, :, mine] for t in (q, k, v))
    shard = local_shard(rows, local["position_ids"], lambda x: k if x is k_r else v, size=2, varlen=True)
    both = fastpath._context_parallel_attention(q_r, k_r, v_r, shard, 0.0, None)
    second = shard.select_rows(slice(1, None))
    assert second.varlen.cu_q[-1] == mine.numel()
    k1, v1 = k[1:], v[1:]
    second = replace(second, gather=lambda x: k1 if x.data_ptr() == k_r[1:].data_ptr() else v1)
    one = fastpath._context_parallel_attention(q_r[1:], k_r[1:], v_r[1:], second, 0.0, None)
    torch.testing.assert_close(one, both[1:], rtol=0, atol=1e-12)
