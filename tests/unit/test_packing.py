"""Packing, shifted labels, per-rank batches, and packed rows computing the same logits as documents run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardtune.data import PreparedSplit, iterate_batches, num_batches
from shardtune.data.packing import (
    IGNORE_INDEX,
    Document,
    RaggedRows,
    best_fit_decreasing,
    build_rows,
    fit_documents,
    shifted_labels,
)
from tests.tolerance import decoder_chain, tol


def make_docs(lengths, seed=0, vocab=50, target_prob=1.0):
    rng = np.random.default_rng(seed)
    return [Document(rng.integers(3, vocab, n).astype(np.int32), rng.random(n) < target_prob) for n in lengths]


def test_shifted_labels_predict_next_target_and_never_past_the_end():
    doc = Document(np.array([10, 11, 12, 13, 14], np.int32), np.array([True, False, True, True, False]))
    assert shifted_labels(doc).tolist() == [IGNORE_INDEX, 12, 13, IGNORE_INDEX, IGNORE_INDEX]


def test_fit_documents_truncates_or_drops_and_counts():
    docs = make_docs([3, 9, 5, 12])
    kept, truncated, dropped = fit_documents(docs, 8, drop_long=False)
    assert [len(d.ids) for d in kept] == [3, 8, 5, 8] and (truncated, dropped) == (2, 0)
    assert kept[1].ids.tolist() == docs[1].ids[:8].tolist()
    kept, truncated, dropped = fit_documents(docs, 8, drop_long=True)
    assert [len(d.ids) for d in kept] == [3, 5] and (truncated, dropped) == (0, 2)


def test_best_fit_decreasing_fills_rows_without_splitting():
    assert sorted(sorted(r) for r in best_fit_decreasing([6, 5, 4, 3, 2], 10, seed=0)) == [[0, 2], [1, 3, 4]]
    lengths = np.random.default_rng(1).integers(1, 64, 500)
    rows = best_fit_decreasing(lengths, 64, seed=3)
    flat = sorted(i for r in rows for i in r)
    assert flat == list(range(500))  # every document exactly once
    assert max(sum(lengths[i] for i in r) for r in rows) <= 64
    assert len(rows) <= int(np.ceil(lengths.sum() / 64 * 1.1))  # BFD is within a few % of the bound here
    assert rows == best_fit_decreasing(lengths, 64, seed=3)


def test_build_rows_pads_with_its_own_positions():
    docs = make_docs([3, 2])
    rows = build_rows(docs, [[0, 1]], row_length=8, pad_id=0)
    assert rows["position_ids"][0] == [0, 1, 2, 0, 1, 0, 1, 2]
    assert rows["input_ids"][0] == docs[0].ids.tolist() + docs[1].ids.tolist() + [0, 0, 0]
    labels = rows["labels"][0]
    assert labels == [*docs[0].ids[1:].tolist(), IGNORE_INDEX, docs[1].ids[1], IGNORE_INDEX, *[IGNORE_INDEX] * 3]
    assert rows["padding_tokens"] == 3


def test_ragged_rows_behave_like_lists():
    rows = RaggedRows.from_rows([[1, 2, 3], [4], [5, 6]])
    assert len(rows) == 3 and rows[1] == [4] and rows[-1] == [5, 6] and list(rows) == [[1, 2, 3], [4], [5, 6]]
    assert rows[0:2] == [[1, 2, 3], [4]] and rows.lengths().tolist() == [3, 1, 2]
    with pytest.raises(IndexError):
        rows[3]


def unpacked_split(n_rows=23, seed=0):
    lengths = np.random.default_rng(seed).integers(2, 12, n_rows)
    docs = make_docs(lengths, seed=seed)
    rows = build_rows(docs, [[i] for i in range(n_rows)], row_length=None, pad_id=0)
    return PreparedSplit(rows["input_ids"], rows["labels"], rows["position_ids"], stats={})


@pytest.mark.parametrize("drop_last", [True, False])
def test_n_ranks_see_the_rows_of_one_process_with_n_times_the_batch(drop_last):
    split = unpacked_split()
    b, n = 2, 3
    kw = {"epoch": 1, "seed": 7, "shuffle": True, "pad_id": 0, "drop_last": drop_last}
    single = list(iterate_batches(split, batch_size=b * n, rank=0, world_size=1, **kw))
    ranks = [list(iterate_batches(split, batch_size=b, rank=r, world_size=n, **kw)) for r in range(n)]
    steps = num_batches(split, batch_size=b, world_size=n, drop_last=drop_last)
    assert steps == (23 // 6 if drop_last else 4) == len(single)
    assert all(len(r) == steps for r in ranks)
    for step in range(steps):
        for key in ("input_ids", "labels", "position_ids"):
            joined = torch.cat([ranks[r][step][key] for r in range(n)])
            assert torch.equal(joined, single[step][key]), (step, key)
            assert joined.dtype == torch.long and joined.shape[0] == b * n


def test_epoch_covers_every_row_once_and_fills_the_last_batch_without_targets():
    split = unpacked_split()
    seen = []
    for batch in iterate_batches(
        split, batch_size=6, rank=0, world_size=1, epoch=0, seed=7, shuffle=True, pad_id=0, drop_last=False
    ):
        seen += [[t for t in row if t != 0] for row in batch["input_ids"].tolist()]  # make_docs never draws id 0
    assert len(seen) == 24 and seen.count([]) == 1  # 23 rows, then one filler row
    assert sorted(r for r in seen if r) == sorted(split.input_ids)
    last = batch
    assert (last["labels"][-1] == IGNORE_INDEX).all() and (last["input_ids"][-1] == 0).all()


def test_shuffle_is_per_epoch_deterministic_and_resume_skips_exactly():
    split = unpacked_split()
    kw = {"batch_size": 2, "rank": 1, "world_size": 2, "seed": 7, "shuffle": True, "pad_id": 0}
    a = [b["input_ids"] for b in iterate_batches(split, epoch=0, **kw)]
    again = [b["input_ids"] for b in iterate_batches(split, epoch=0, **kw)]
    other = [b["input_ids"] for b in iterate_batches(split, epoch=1, **kw)]
    resumed = [b["input_ids"] for b in iterate_batches(split, epoch=0, start_batch=3, **kw)]
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, other))
    assert len(resumed) == len(a) - 3 and all(torch.equal(x, y) for x, y in zip(a[3:], resumed))


def test_unshuffled_batches_pad_to_the_longest_row():
    split = unpacked_split(n_rows=4)
    (batch,) = list(
        iterate_batches(split, batch_size=4, rank=0, world_size=1, epoch=0, seed=0, shuffle=False, pad_id=0)
    )
    lengths = split.input_ids.lengths()
    assert batch["input_ids"].shape == (4, lengths.max())
    for i, n in enumerate(lengths):
        assert batch["input_ids"][i, :n].tolist() == split.input_ids[i]
        assert (batch["labels"][i, n:] == IGNORE_INDEX).all()
        assert batch["position_ids"][i].tolist() == list(range(n)) + list(range(lengths.max() - n))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from shardtune.commands.demo import build_model

    return build_model(
        tmp_path_factory.mktemp("m"), vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2
    ).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_logits_equal_each_document_alone(tiny_model, attn):
    tiny_model.config._attn_implementation = attn
    docs = make_docs([7, 5, 9], seed=4, vocab=64)
    rows = build_rows(docs, [[0, 1, 2]], row_length=26, pad_id=0)
    # Two rows in one batch (the second is the reversed document order) to exercise batch > 1.
    rows2 = build_rows(docs, [[2, 1, 0]], row_length=26, pad_id=0)
    ids = torch.tensor([rows["input_ids"][0], rows2["input_ids"][0]])
    pos = torch.tensor([rows["position_ids"][0], rows2["position_ids"][0]])
    # use_cache=False matters: with a cache, transformers does not derive the packed mask from position_ids.
    with torch.no_grad():
        packed = tiny_model(input_ids=ids, position_ids=pos, use_cache=False).logits
        naive = tiny_model(input_ids=ids, use_cache=False).logits  # one causal sequence: documents see earlier ones
        alone = [tiny_model(input_ids=torch.tensor(d.ids[None], dtype=torch.long)).logits[0] for d in docs]
    scale = max(float(a.abs().max()) for a in alone)
    for b, order in enumerate([[0, 1, 2], [2, 1, 0]]):
        start = 0
        for i in order:
            n = len(docs[i].ids)
            # The same sums in another order (a masked row vs a short one): tiny_model's forward chain (hidden 32,
            # MLP 80, 2 layers) over the 26 positions of a row, relative to the logits' size (tests/tolerance.py).
            bound = tol(torch.float32, decoder_chain(hidden=32, intermediate=80, layers=2, seq=26), scale)
            torch.testing.assert_close(packed[b, start : start + n], alone[i], atol=bound, rtol=0)
            start += n
    assert (naive[0, 7:12] - alone[1]).abs().max() > 1e-3  # the test would catch leaking attention
