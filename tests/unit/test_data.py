"""build_datasets end to end: every source kind, every user error, labels, assistant-only loss, limits, caching."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

import shardtune.data.prepare as prepare_mod
from shardtune.commands.demo import build_tokenizer, write_chat_dataset
from shardtune.data import IGNORE_INDEX, build_datasets, setup_tokenizer
from shardtune.data.sources import load_split
from tests.conftest import build_data
from tests.tolerance import decoder_chain, tol

TEXTS = [
    "The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "hot cold",
    "What is the opposite of big? The opposite of big is small.",
    "apple, river, stone, cloud, tiger, lemon, piano, train, candle, forest, window, garden",
    "Reverse this list: honey, ocean",
    "The capital of Japan is Tokyo. The capital of Peru is Lima. The capital of Chile is Santiago.",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, vocab_size=400)
    return d


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return write_chat_dataset(tmp_path_factory.mktemp("chat"), n_train=40, n_test=8, seed=3)


def tokenizer(tok_dir, fmt="chatml"):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    setup_tokenizer(tok, fmt)
    return tok


def build(tok, name, **kw):
    args = {
        "tokenizer": tok,
        "dataset_name": str(name),
        "splits": "train,test",
        "dataset_text_field": "text",
        "max_length": 64,
        "packing": False,
        "append_concat_token": False,
        "add_special_tokens": False,
        "assistant_only_loss": False,
        "drop_long_samples": False,
        "cache_dir": None,
        "seed": 0,
    }
    return build_data(build_datasets, **{**args, **kw})


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def documents_of(row_ids, row_pos, row_labels):
    """Split a row into (ids, labels) per document using the restarting position ids."""
    starts = [i for i, p in enumerate(row_pos) if p == 0] + [len(row_pos)]
    return [(row_ids[a:b], row_labels[a:b]) for a, b in itertools.pairwise(starts)]


# ---------------------------------------------------------------- sources


def test_every_source_kind_gives_the_same_rows(tok_dir, chat_dir, tmp_path):
    train, test = read_jsonl(chat_dir / "train.jsonl"), read_jsonl(chat_dir / "test.jsonl")
    dd = DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)})
    dd.save_to_disk(tmp_path / "dict")
    dd["train"].save_to_disk(tmp_path / "per_split" / "train")
    dd["test"].save_to_disk(tmp_path / "per_split" / "test")
    Dataset.from_list(train).to_parquet(tmp_path / "files" / "train.parquet")
    write_jsonl(tmp_path / "files" / "test.jsonl", test)
    tok = tokenizer(tok_dir)
    ref_train, ref_test = build(tok, chat_dir)
    assert len(ref_train) == 40 and len(ref_test) == 8
    for source in ("dict", "per_split", "files"):
        got_train, got_test = build(tok, tmp_path / source)
        assert list(got_train.input_ids) == list(ref_train.input_ids), source
        assert list(got_test.labels) == list(ref_test.labels), source
    single, none = build(tok, chat_dir / "train.jsonl", splits="train")
    assert none is None and list(single.input_ids) == list(ref_train.input_ids)
    assert load_split(str(tmp_path / "dict"), "test", is_train=False)["messages"] == [r["messages"] for r in test]


@pytest.mark.parametrize("suffix", ["parquet", "csv", "json"])
def test_single_text_file_of_each_type(tok_dir, tmp_path, suffix):
    ds = Dataset.from_list([{"text": t} for t in TEXTS])
    path = tmp_path / f"data.{suffix}"
    {"parquet": ds.to_parquet, "csv": ds.to_csv, "json": ds.to_json}[suffix](str(path))
    tok = tokenizer(tok_dir, "none")
    train, _ = build(tok, path, splits="train", max_length=512)
    assert list(train.input_ids) == [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


# ---------------------------------------------------------------- errors


def test_missing_path(tok_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--dataset_name '.*nowhere\.jsonl': no such file or folder"):
        build(tokenizer(tok_dir), tmp_path / "nowhere.jsonl")


def test_missing_split_lists_the_available_ones(tok_dir, chat_dir):
    with pytest.raises(ValueError, match=r"split 'validation' not found .*available splits: 'test', 'train'"):
        build(tokenizer(tok_dir), chat_dir, splits="train,validation")


def test_missing_split_in_a_saved_dataset_dict(tok_dir, tmp_path):
    DatasetDict({"train": Dataset.from_list([{"text": "a b"}])}).save_to_disk(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"split 'test' not found .*available splits: 'train'"):
        build(tokenizer(tok_dir, "none"), tmp_path / "dd")


def test_eval_split_from_a_single_file(tok_dir, chat_dir):
    with pytest.raises(ValueError, match=r"--splits asks for an evaluation split 'test'.*--splits train"):
        build(tokenizer(tok_dir), chat_dir / "train.jsonl", splits="train,test")


def test_bad_splits_flag(tok_dir, chat_dir):
    with pytest.raises(ValueError, match=r"--splits 'a,b,c' must name one or two splits"):
        build(tokenizer(tok_dir), chat_dir, splits="a,b,c")


@pytest.mark.parametrize("content", ["", "text\n"])
def test_empty_split(tok_dir, tmp_path, content):
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": "a b"}])
    (tmp_path / "d" / "test.csv").write_text(content)
    with pytest.raises(ValueError, match=r"test.csv': split 'test' is empty"):
        build(tokenizer(tok_dir, "none"), tmp_path / "d")


def test_empty_save_to_disk_split(tok_dir, tmp_path):
    dd = DatasetDict({"train": Dataset.from_list([{"text": "a"}]), "test": Dataset.from_dict({"text": []})})
    dd.save_to_disk(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"'.*dd' for split 'train'.*check that every split saved there has rows"):
        build(tokenizer(tok_dir, "none"), tmp_path / "dd")


def test_missing_text_column_names_it_and_lists_columns(tok_dir, tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"body": t, "id": i} for i, t in enumerate(TEXTS)])
    with pytest.raises(ValueError, match=r"--dataset_text_field 'text': no such column .*\(columns: body, id\)"):
        build(tokenizer(tok_dir, "none"), tmp_path / "d", splits="train")


def test_messages_with_format_none_point_to_the_fix(tok_dir, chat_dir):
    with pytest.raises(ValueError, match=r"columns: messages\).*--chat_template_format chatml, zephyr or auto"):
        build(tokenizer(tok_dir, "none"), chat_dir, chat_template_format="none")
    with pytest.raises(ValueError, match=r"has a `messages` column but the tokenizer has no chat template"):
        build(tokenizer(tok_dir, "auto"), chat_dir)


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"role": "robot", "content": "hi"}, "message 0: unknown role 'robot'; allowed roles are system, user"),
        ({"role": "user"}, "message 0 (user) has no content"),
        ({"role": "user", "content": ""}, "message 0 (user) has empty content"),
        ({"role": "user", "content": 7}, "message 0 (user) has non-string content 7"),
    ],
)
def test_bad_message_names_split_and_row(tok_dir, chat_dir, tmp_path, bad, needle):
    rows = read_jsonl(chat_dir / "test.jsonl")
    rows[5] = {"messages": [bad, {"role": "assistant", "content": "ok"}]}
    write_jsonl(tmp_path / "d" / "train.jsonl", read_jsonl(chat_dir / "train.jsonl"))
    write_jsonl(tmp_path / "d" / "test.jsonl", rows)
    with pytest.raises(ValueError) as e:
        build(tokenizer(tok_dir), tmp_path / "d")
    assert "split 'test', row 5, " + needle in str(e.value)


def test_bad_text_row_is_named(tok_dir, tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": t} for t in TEXTS[:3]] + [{"text": ""}])
    with pytest.raises(ValueError, match=r"split 'train', row 3: column 'text' must hold a non-empty string"):
        build(tokenizer(tok_dir, "none"), tmp_path / "d", splits="train")


def test_assistant_only_loss_needs_messages(tok_dir, tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": t} for t in TEXTS])
    with pytest.raises(ValueError, match=r"--assistant_only_loss needs rows with a `messages` column"):
        build(tokenizer(tok_dir, "none"), tmp_path / "d", splits="train", assistant_only_loss=True)


# ---------------------------------------------------------------- tokens and labels


@pytest.mark.parametrize("bos", [False, True])
def test_packed_rows_hold_whole_documents_with_shifted_labels(tok_dir, tmp_path, bos):
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": t} for t in TEXTS * 3])
    tok = tokenizer(tok_dir, "none")
    train, _ = build(
        tok,
        tmp_path / "d",
        splits="train",
        packing=True,
        append_concat_token=True,
        add_special_tokens=bos,
        max_length=80,
        seed=5,
    )
    expected = [tok(t, add_special_tokens=bos)["input_ids"] + [tok.eos_token_id] for t in TEXTS * 3]
    assert all(e[0] == tok.bos_token_id for e in expected) == bos
    found, padding, targets = [], 0, 0
    for ids, pos, labels in zip(train.input_ids, train.position_ids, train.labels):
        assert len(ids) == len(pos) == len(labels) == 80
        for doc_ids, doc_labels in documents_of(ids, pos, labels):
            if all(t == tok.pad_token_id for t in doc_ids):  # documents hold text, not only EOS/pad ids
                assert all(lab == IGNORE_INDEX for lab in doc_labels)  # padding: its own document, no targets
                padding += len(doc_ids)
                continue
            assert doc_labels == doc_ids[1:] + [IGNORE_INDEX]  # never predicts the next document's first token
            found.append(doc_ids)
            targets += len(doc_ids) - 1
    assert sorted(found) == sorted(expected)
    s = train.stats
    assert (s["documents"], s["rows"], s["padding_tokens"], s["target_tokens"]) == (21, len(train), padding, targets)
    assert s["tokens"] == sum(map(len, expected)) == 80 * len(train) - padding
    again, _ = build(
        tok,
        tmp_path / "d",
        splits="train",
        packing=True,
        append_concat_token=True,
        add_special_tokens=bos,
        max_length=80,
        seed=5,
    )
    assert list(again.input_ids) == list(train.input_ids)  # deterministic given the seed


def assistant_targets_by_scan(tok, ids):
    """Positions of assistant tokens found on token ids: after `<|im_start|>assistant` and its newline, through
    the next `<|im_end|>`."""
    header, end = tok.convert_tokens_to_ids(["<|im_start|>assistant", "<|im_end|>"])
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    out, i = set(), 0
    while i < len(ids):
        if ids[i] == header:
            assert ids[i + 1 : i + 1 + len(newline)] == newline
            j = i + 1 + len(newline)
            while ids[j] != end:
                out.add(j)
                j += 1
            out.add(j)
            i = j
        i += 1
    return out


def test_assistant_only_loss_masks_exactly_the_non_assistant_targets(tok_dir, chat_dir):
    tok = tokenizer(tok_dir, "chatml")
    train, _ = build(tok, chat_dir, packing=True, assistant_only_loss=True, append_concat_token=True, max_length=96)
    full, _ = build(tok, chat_dir, packing=True, append_concat_token=True, max_length=96)
    chats = [r["messages"] for r in read_jsonl(chat_dir / "train.jsonl")]
    replies = sorted("".join(m["content"] + "<|im_end|>" for m in c if m["role"] == "assistant") for c in chats)
    decoded, n_docs = [], 0
    for ids, pos, labels in zip(train.input_ids, train.position_ids, train.labels):
        for doc_ids, doc_labels in documents_of(ids, pos, labels):
            got = {i + 1 for i, lab in enumerate(doc_labels) if lab != IGNORE_INDEX}
            assert got == assistant_targets_by_scan(tok, doc_ids)
            assert all(doc_labels[i - 1] == doc_ids[i] for i in got)
            if got:
                n_docs += 1
                decoded.append(tok.decode([doc_ids[i] for i in sorted(got)], skip_special_tokens=False))
    assert n_docs == 40 and sorted(decoded) == replies
    assert list(full.input_ids) == list(train.input_ids)  # the mask changes labels only
    assert 0 < train.stats["target_tokens"] < full.stats["target_tokens"]


def test_assistant_only_loss_with_zephyr_unpacked(tok_dir, chat_dir):
    tok = tokenizer(tok_dir, "zephyr")
    train, _ = build(tok, chat_dir, assistant_only_loss=True)
    chats = [r["messages"] for r in read_jsonl(chat_dir / "train.jsonl")]
    for ids, labels, chat in zip(train.input_ids, train.labels, chats):
        targets = [lab for lab in labels if lab != IGNORE_INDEX]
        want = "".join(m["content"] + "</s>" for m in chat if m["role"] == "assistant")
        assert tok.decode(targets, skip_special_tokens=False) == want


def test_truncation_and_dropping_are_counted(tok_dir, tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": t} for t in TEXTS])
    tok = tokenizer(tok_dir, "none")
    lengths = [len(tok(t, add_special_tokens=True)["input_ids"]) for t in TEXTS]
    limit = 12
    n_long = sum(n > limit for n in lengths)
    assert 0 < n_long < len(TEXTS)
    cut, _ = build(tok, tmp_path / "d", splits="train", max_length=limit, add_special_tokens=True)
    assert (cut.stats["truncated"], cut.stats["dropped"], cut.stats["documents"]) == (n_long, 0, len(TEXTS))
    assert [len(r) for r in cut.input_ids] == [min(n, limit) for n in lengths]
    assert cut.input_ids[1] == tok(TEXTS[1], add_special_tokens=True)["input_ids"][:limit]
    drop, _ = build(
        tok,
        tmp_path / "d",
        splits="train",
        max_length=limit,
        add_special_tokens=True,
        drop_long_samples=True,
        packing=True,
    )
    assert (drop.stats["truncated"], drop.stats["dropped"]) == (0, n_long)
    assert drop.stats["tokens"] == sum(n for n in lengths if n <= limit)


def test_sample_limits(tok_dir, chat_dir):
    train, test = build(tokenizer(tok_dir), chat_dir, max_train_samples=7, max_eval_samples=3)
    assert (len(train), len(test)) == (7, 3)
    full, _ = build(tokenizer(tok_dir), chat_dir)
    assert list(train.input_ids) == list(full.input_ids)[:7]


# ---------------------------------------------------------------- cache


def test_cache_is_reused_without_tokenizing_and_keyed_by_inputs(tok_dir, chat_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    tok = tokenizer(tok_dir)
    first, first_eval = build(tok, chat_dir, packing=True, cache_dir=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert not first.from_cache and len(files) == 2 and not any(n.endswith(".tmp") for n in files)
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again although the cache should have been used")

    monkeypatch.setattr(prepare_mod, "documents", no_tokenizing)
    second, second_eval = build(tokenizer(tok_dir), chat_dir, packing=True, cache_dir=str(cache))
    assert second.from_cache and second_eval.from_cache
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == mtimes
    for a, b in ((first, second), (first_eval, second_eval)):
        assert list(a.input_ids) == list(b.input_ids) and list(a.labels) == list(b.labels)
        assert list(a.position_ids) == list(b.position_ids) and a.stats == b.stats
    with pytest.raises(AssertionError, match="tokenized again"):  # a changed flag is a new key
        build(tok, chat_dir, packing=True, cache_dir=str(cache), max_length=65)
    with pytest.raises(AssertionError, match="tokenized again"):  # so is a changed template
        build(tokenizer(tok_dir, "zephyr"), chat_dir, packing=True, cache_dir=str(cache))


def test_changed_data_file_is_a_new_cache_key(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": t} for t in TEXTS])
    cache = tmp_path / "cache"
    tok = tokenizer(tok_dir, "none")
    a, _ = build(tok, path, splits="train", cache_dir=str(cache))
    write_jsonl(path, [{"text": t} for t in reversed(TEXTS)])
    b, _ = build(tok, path, splits="train", cache_dir=str(cache))
    assert not b.from_cache and b.cache_path != a.cache_path
    assert list(b.input_ids) == list(reversed(list(a.input_ids)))


def test_concurrent_cache_writes_leave_one_complete_folder(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "d" / "train.jsonl", [{"text": t} for t in TEXTS])
    split, _ = build(tokenizer(tok_dir, "none"), path, splits="train", packing=True)
    cache, results = tmp_path / "cache", []

    def prepare():  # a tokenizer per thread: a Rust tokenizer is not shared across threads
        results.append(build(tokenizer(tok_dir, "none"), path, splits="train", packing=True, cache_dir=str(cache))[0])

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    (folder,) = cache.iterdir()  # one complete cache, no temporary folder left
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["ids.npy", "labels.npy", "doc_offsets.npy", "row_docs.npy", "row_offsets.npy", "meta.json"]
    )
    loaded, _ = build(tokenizer(tok_dir, "none"), path, splits="train", packing=True, cache_dir=str(cache))
    assert loaded.from_cache and list(loaded.input_ids) == list(split.input_ids)
    assert list(loaded.labels) == list(split.labels) and loaded.digest == split.digest


def test_packed_batches_from_the_pipeline_match_documents_run_alone(tok_dir, chat_dir, tmp_path):
    import torch

    from shardtune.commands.demo import build_model
    from shardtune.data import iterate_batches, padded_vocab_size

    tok = tokenizer(tok_dir, "chatml")
    train, _ = build(tok, chat_dir, packing=True, append_concat_token=True, max_length=96, max_train_samples=12)
    model = build_model(tmp_path / "m", vocab_size=padded_vocab_size(tok), hidden_size=32, num_layers=2).eval()
    batch = next(
        iterate_batches(
            train, batch_size=2, rank=0, world_size=1, epoch=0, seed=0, shuffle=True, pad_id=tok.pad_token_id
        )
    )
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        for b in range(2):
            ids, pos = batch["input_ids"][b].tolist(), batch["position_ids"][b].tolist()
            docs = documents_of(ids, pos, ids)
            assert len(docs) >= 2
            start = 0
            for doc_ids, _ in docs:
                alone = model(input_ids=torch.tensor([doc_ids])).logits[0]
                # Another order of the same sums: the forward chain of this model (hidden 32, MLP 80, 2 layers)
                # over a packed row of 96 positions, relative to the logits' size (tests/tolerance.py).
                chain = decoder_chain(hidden=32, intermediate=80, layers=2, seq=96)
                bound = tol(torch.float32, chain, float(alone.abs().max()))
                torch.testing.assert_close(logits[b, start : start + len(doc_ids)], alone, atol=bound, rtol=0)
                start += len(doc_ids)
