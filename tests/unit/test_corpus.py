"""Corpora larger than memory: the memory-mapped cache gives the in-memory packing's rows exactly (any number of
tokenizing processes), old caches are rebuilt, and --streaming packs per window, splits over ranks and resumes."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

import shardtune.data.prepare as prepare_mod
from shardtune.commands.demo import build_tokenizer, write_chat_dataset
from shardtune.config.errors import ConfigError
from shardtune.data import build_datasets, iterate_batches, setup_tokenizer
from shardtune.data.packing import best_fit_decreasing, build_rows, fit_documents
from shardtune.recipe.run_config import load_run_config
from tests.conftest import build_data


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    build_tokenizer(root / "tok", vocab_size=400)
    write_chat_dataset(root / "chat", n_train=60, n_test=8, seed=5)
    return root


def tokenizer(root, fmt="chatml"):
    tok = AutoTokenizer.from_pretrained(root / "tok")
    setup_tokenizer(tok, fmt)
    return tok


def build(tok, root, **kw):
    args = {
        "tokenizer": tok,
        "dataset_name": str(root / "chat"),
        "splits": "train,test",
        "dataset_text_field": "text",
        "max_length": 96,
        "packing": True,
        "append_concat_token": True,
        "add_special_tokens": False,
        "assistant_only_loss": False,
        "drop_long_samples": False,
        "cache_dir": None,
        "seed": 3,
    }
    return build_data(build_datasets, **{**args, **kw})


def in_memory_rows(tok, root, *, max_length, packing, drop_long, assistant_only, seed=3):
    """Today's in-memory path, written out: every document tokenized into memory, packed best-fit over all lengths."""
    rows = [json.loads(line)["messages"] for line in (root / "chat" / "train.jsonl").read_text().splitlines()]
    opts = {"assistant_only_loss": assistant_only, "append_concat_token": True, "add_special_tokens": False}
    docs = prepare_mod.documents(tok, rows, "train", "messages", opts)
    docs, truncated, dropped = fit_documents(docs, max_length, drop_long)
    if packing:
        groups = best_fit_decreasing([len(d.ids) for d in docs], max_length, seed)
        out = build_rows(docs, groups, row_length=max_length, pad_id=tok.pad_token_id)
    else:
        out = build_rows(docs, [[i] for i in range(len(docs))], row_length=None, pad_id=tok.pad_token_id)
    return out, (len(docs), truncated, dropped)


@pytest.mark.parametrize(
    "max_length,packing,drop_long,assistant_only",
    [(96, True, False, False), (40, True, True, True), (40, False, False, False)],
)
def test_cached_rows_equal_the_in_memory_packing(assets, tmp_path, max_length, packing, drop_long, assistant_only):
    tok = tokenizer(assets)
    flags = {"max_length": max_length, "packing": packing, "assistant_only_loss": assistant_only}
    got, _ = build(tok, assets, drop_long_samples=drop_long, cache_dir=str(tmp_path), **flags)
    want, counts = in_memory_rows(
        tok, assets, max_length=max_length, packing=packing, drop_long=drop_long, assistant_only=assistant_only
    )
    del want["padding_tokens"]
    for field in ("input_ids", "labels", "position_ids"):
        assert list(getattr(got, field)) == list(want[field]), field
    assert np.array_equal(got.input_ids.lengths(), want["input_ids"].lengths())
    s = got.stats
    assert (s["documents"], s["truncated"], s["dropped"]) == counts
    assert s["target_tokens"] == int((want["labels"].flat != -100).sum())
    assert s["tokens"] + s["padding_tokens"] == len(want["input_ids"].flat)
    assert (counts[1] > 0 or counts[2] > 0) == (max_length == 40)  # the short rows do cut documents


def test_parallel_tokenizing_gives_the_same_cache(assets, tmp_path, monkeypatch):
    tok = tokenizer(assets)
    one, _ = build(tok, assets, cache_dir=str(tmp_path / "one"), num_proc=1)
    monkeypatch.setattr(prepare_mod, "_TASK_ROWS", 7)  # 9 tasks over 2 spawned processes
    two, _ = build(tok, assets, cache_dir=str(tmp_path / "two"), num_proc=2)
    assert not two.from_cache and two.digest == one.digest
    assert list(two.input_ids) == list(one.input_ids) and list(two.labels) == list(one.labels)
    assert two.stats == one.stats


def test_a_cache_of_the_old_format_is_rebuilt_not_read(assets, tmp_path, monkeypatch):
    tok = tokenizer(assets)
    first, _ = build(tok, assets, cache_dir=str(tmp_path))
    folder, rows = tmp_path / first.cache_path.split("/")[-1], list(first.input_ids)
    del first  # its maps read the files that are overwritten in place below
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    np.save(folder / "ids.npy", np.zeros(3, np.int32))  # what a misread would read
    calls = []
    real = prepare_mod.documents
    monkeypatch.setattr(prepare_mod, "documents", lambda *a, **k: calls.append(1) or real(*a, **k))
    again, _ = build(tok, assets, cache_dir=str(tmp_path))
    assert calls and not again.from_cache and list(again.input_ids) == rows
    assert json.loads((folder / "meta.json").read_text())["format"] == 2


def test_streaming_with_a_window_over_the_whole_split_gives_the_cached_batches(assets):
    tok = tokenizer(assets)
    cached, _ = build(tok, assets)
    stream, _ = build(tok, assets, streaming=True, packing_window=1000)
    n = 60 // 1  # enough batches to exhaust the epoch
    for rank in (0, 1):
        want = list(
            iterate_batches(
                cached, batch_size=2, rank=rank, world_size=2, epoch=0, seed=3, shuffle=True, pad_id=tok.pad_token_id
            )
        )
        got = list(itertools.islice(stream.batches(batch_size=2, rank=rank, world_size=2, seed=3, position=None), n))
        assert len(want) >= 3 and [p for _, p in got[: len(want)]][-1] == [0, 0, 4 * len(want)]
        for a, (b, _) in zip(want, got):
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert got[len(want)][1][0] == 1  # then epoch 1, the remainder of epoch 0 dropped as the cached path does


def test_streaming_resumes_from_any_saved_position(assets):
    """Small windows, so that batches span windows and the epoch ends; each position restarts the same sequence."""
    tok = tokenizer(assets)
    stream, _ = build(tok, assets, streaming=True, packing_window=7, max_train_samples=40)
    run = list(itertools.islice(stream.batches(batch_size=3, rank=0, world_size=1, seed=3, position=None), 16))
    positions = [p for _, p in run]
    assert len({p[1] for p in positions}) > 3 and positions[-1][0] >= 1  # several windows, into epoch 1
    for i in (0, 4, 9, len(run) - 4):
        again = stream.batches(batch_size=3, rank=0, world_size=1, seed=3, position=positions[i])
        for (a, pa), (b, pb) in zip(run[i + 1 :], itertools.islice(again, 3)):
            assert pa == pb and all(torch.equal(a[k], b[k]) for k in a)
    # Every row of the epoch once: the documents of epoch 0's rows are the split's first 40 documents.
    ids = [b["input_ids"] for b, p in run if p[0] == 0]
    assert sum(int((x != tok.pad_token_id).sum()) for x in ids) > 0


def test_streaming_flags_are_checked(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_run_config(
            ["--model_name_or_path", "m", "--dataset_name", "d", "--streaming", "True", "--save_strategy", "epoch"],
            env={},
        )
    problems = str(e.value)
    assert "--streaming True needs --max_steps > 0" in problems
    assert "--save_strategy epoch cannot be used with --streaming True" in problems
    with pytest.raises(ConfigError, match=r"--packing_window must be >= 1 \(got 0\)"):
        load_run_config(["--model_name_or_path", "m", "--dataset_name", "d", "--packing_window", "0"], env={})


def test_streaming_names_a_missing_column(assets, tmp_path):
    Dataset.from_list([{"body": "a b c"}] * 3).to_json(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match=r"--dataset_text_field 'text': no such column .*columns: body"):
        build(tokenizer(assets, "none"), assets, dataset_name=str(tmp_path / "d.jsonl"), splits="train", streaming=True)


def test_a_node_that_prepared_other_rows_stops_the_run(assets, monkeypatch):
    """Nodes without a shared file system each prepare their cache; train.py compares the digests over all ranks
    (the gather is replaced here by what a 4-rank run whose second node read an edited file would gather)."""
    from shardtune.parallel import mesh
    from shardtune.recipe.data import _check_same_rows

    tok = tokenizer(assets)
    train, test = build(tok, assets)
    mine = [train.digest, test.digest]
    monkeypatch.setattr(mesh, "all_gather_objects", lambda obj: [obj, obj, ["other", obj[1]], ["other", obj[1]]])
    with pytest.raises(ValueError, match=r"rank\(s\) \[2, 3\] prepared other training or evaluation rows than rank 0"):
        _check_same_rows(train, test, "chat")
    monkeypatch.setattr(mesh, "all_gather_objects", lambda obj: [mine] * 4)
    _check_same_rows(train, test, "chat")  # the same rows everywhere: no error
