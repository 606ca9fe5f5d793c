"""Damaged inputs (docs/errors.md, "Damaged files"): a data file that is not UTF-8, a weight, adapter or tokenizer
file cut short or with a damaged header, a merge into a folder of other files, a training checkpoint given as an
adapter. Each stops with exit code 2 and one line naming the file (and the row) and the fix, without a traceback,
and leaves the files on disk as they were. All run `shardtune.cli.main` in this process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from shardtune import cli
from shardtune.data import sources
from shardtune.parallel import checkpoint
from tests.conftest import train_args
from tests.e2e.test_bad_inputs import _main, _model_copy, _snapshot, no_dist_env  # noqa: F401 - a fixture

# In-process runs set RANK etc.; the fixture undoes it after each test.
pytestmark = pytest.mark.usefixtures("no_dist_env")
RESTORE = "restore it from the original model"


def _latin1(path: Path, bad_line: int, rows: list[str]) -> None:
    """rows written as UTF-8, with row `bad_line` (1-based) holding a latin-1 é (0xe9), as a Windows export does."""
    out = [r.encode() for r in rows]
    out[bad_line - 1] = out[bad_line - 1].replace("é".encode(), b"\xe9")
    path.write_bytes(b"\n".join(out) + b"\n")


# ---------------------------------------------------------------- data files that are not UTF-8


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".json"])
def test_a_byte_that_is_not_utf8_is_named_by_file_and_line(suffix, tmp_path, monkeypatch):
    rows = {
        ".jsonl": [json.dumps({"text": t}, ensure_ascii=False) for t in ("ok", "naïve ✓", "x", "café")],
        ".csv": ["text", "ok", "naïve ✓", "café"],
        ".json": ["[", '{"text": "naïve ✓"},', '{"text": "x"},', '{"text": "café"}', "]"],
    }[suffix]
    bad = rows.index(next(r for r in rows if "é" in r and "ï" not in r)) + 1
    path = tmp_path / f"train{suffix}"
    _latin1(path, bad, rows)
    # Blocks of 7 bytes: the line count must carry across blocks, and multi-byte characters (ï, ✓) in earlier
    # lines must not be cut by a block's end.
    monkeypatch.setattr(sources, "_UTF8_BLOCK", 7)
    with pytest.raises(ValueError) as e:
        sources.load_split(str(path), "train", is_train=True)
    col = rows[bad - 1].encode().index("é".encode()) + 1
    assert str(e.value) == (
        f"--dataset_name: {str(path)!r} is not UTF-8: line {bad}, byte {col} is 0xe9 (invalid continuation byte). "
        f"Re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > {tmp_path}/train.utf8{suffix}` (give "
        "the file's real encoding after -f)."
    )
    # The same rows in UTF-8 load (the check refuses only what is not UTF-8).
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert len(sources.load_split(str(path), "train", is_train=True)) == {".jsonl": 4, ".csv": 3, ".json": 3}[suffix]


def test_train_on_a_folder_with_a_latin1_file_exits_2_naming_it(tiny_assets, tmp_path, capsys):
    data = shutil.copytree(tiny_assets["data"], tmp_path / "data")
    rows = (data / "test.jsonl").read_text(encoding="utf-8").splitlines()
    rows[4] = rows[4].replace('"content": "', '"content": "café ', 1)
    _latin1(data / "test.jsonl", 5, rows)
    out, cache = tmp_path / "out", tmp_path / "cache"
    rc, line = _main(train_args(tiny_assets, out, dataset_name=data, dataset_cache_dir=cache), capsys)
    assert rc == 2
    assert line.startswith(f"error: --dataset_name: '{data}/test.jsonl' is not UTF-8: line 5, byte "), line
    assert "iconv -f latin1 -t utf-8" in line
    # The training split's cache is whole (it was written before the eval split was read); nothing half-written.
    assert [p.name.split("-")[0] for p in cache.iterdir()] == ["train"] and not list(out.glob("*.safetensors"))


# ---------------------------------------------------------------- weight, adapter and tokenizer files


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damage", ["cut_short", "header", "bin_cut_short"])
def test_a_damaged_weight_file_is_named_before_anything_loads(damage, tiny_assets, tmp_path, capsys):
    model = _model_copy(tiny_assets, tmp_path / "m")
    weights = model / "model.safetensors"
    if damage == "cut_short":
        _cut(weights)
        want = rf"{weights} is truncated \(\d+ of \d+ bytes\)"
    elif damage == "header":
        raw = bytearray(weights.read_bytes())
        raw[8:12] = b"\x00\xff\x00\xff"  # the JSON header's first bytes
        weights.write_bytes(bytes(raw))
        want = rf"{weights} has a damaged safetensors header \(JSONDecodeError"
    else:
        import torch
        from safetensors.torch import load_file

        torch.save(load_file(weights), model / "pytorch_model.bin")
        weights.unlink()
        _cut(model / "pytorch_model.bin", 0.9)
        want = rf"{model}/pytorch_model.bin is unreadable or truncated \(BadZipFile"
    before = _snapshot(tmp_path)
    rc, line = _main(train_args(tiny_assets, tmp_path / "out", model_name_or_path=model), capsys)
    assert rc == 2 and line.startswith(f"- --model_name_or_path {model}: "), line
    assert re.search(want, line) and line.endswith(
        f"; {RESTORE} (a download or copy was cut short, or the file was damaged)."
    )
    assert _snapshot(tmp_path) == before  # no output_dir, no cache
    if damage != "bin_cut_short":  # merge reads the same headers: the same file named, exit 2
        rc, line = _main(["merge", "--base", model, "--adapter", tmp_path, "--output_dir", tmp_path / "merged"], capsys)
        assert rc == 2 and re.search(want, line), line


def test_weights_damaged_after_the_preflight_are_named_when_read(tiny_assets, tmp_path):
    """A file cut short between the check and the read (or read without the check): safetensors' own error
    becomes a ValueError naming the file."""
    from shardtune.models import weights

    model = _model_copy(tiny_assets, tmp_path / "m")
    _cut(model / "model.safetensors", 0.3)
    with pytest.raises(ValueError, match=rf"^{model}/model.safetensors is truncated \(\d+ of \d+ bytes\); {RESTORE}"):
        list(weights.iter_checkpoint(str(model)))
    with pytest.raises(ValueError, match=f"^{model}/model.safetensors is truncated"):
        weights.read_headers([model / "model.safetensors"])


@pytest.fixture
def adapter(tiny_assets, tmp_path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets["model"])
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_a_cut_short_adapter_and_a_damaged_tokenizer_are_named(tiny_assets, adapter, tmp_path, capsys):
    model = tiny_assets["model"]
    _cut(adapter / "adapter_model.safetensors")
    rc, line = _main(["chat", "--model_name_or_path", model, "--adapter", adapter, "--prompt", "hi"], capsys)
    assert rc == 2 and line.startswith(
        f"shardtune chat: --adapter {adapter}: {adapter}/adapter_model.safetensors is truncated"
    )
    rc, line = _main(train_args(tiny_assets, tmp_path / "o", use_peft_lora=True, adapter_path=adapter), capsys)
    assert rc == 2 and line.startswith(f"- --adapter_path {adapter}: {adapter}/adapter_model.safetensors is truncated")
    copy = _model_copy(tiny_assets, tmp_path / "m")
    _cut(copy / "tokenizer.json")
    want = f"--model_name_or_path {copy}: {copy}/tokenizer.json is not valid JSON (Unterminated string"
    rc, line = _main(train_args(tiny_assets, tmp_path / "out", model_name_or_path=copy), capsys)
    assert rc == 2 and line.startswith(f"- {want}") and line.endswith("or give --tokenizer_name_or_path."), line
    # chat reads the tokenizer without the preflight's JSON check: the loader's error names the folder.
    rc, line = _main(["chat", "--model_name_or_path", copy, "--prompt", "hi"], capsys)
    assert rc == 2 and line.startswith(
        f"shardtune chat: --model_name_or_path {copy}: its tokenizer cannot be loaded (JSONDecodeError: Unterminated"
    ), line


# ---------------------------------------------------------------- merge's output folder


def test_merge_refuses_a_folder_holding_other_files(tiny_assets, adapter, tmp_path, capsys):
    run = tmp_path / "run"  # a full fine-tune's output: a model next to its checkpoints and metrics
    _model_copy(tiny_assets, run)
    (run / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint-2" / "meta.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    before = _snapshot(tmp_path)
    rc, line = _main(["merge", "--base", tiny_assets["model"], "--adapter", adapter, "--output_dir", run], capsys)
    assert rc == 2
    assert line == (
        f"shardtune merge: --output_dir {run} is not empty and holds files a merge does not write (checkpoints, "
        "metrics.jsonl); a merge replaces its --output_dir whole, so it refuses this one. Give a new or empty folder."
    )
    assert _snapshot(tmp_path) == before
    # A folder holding a model (the kinds of files a merge writes) is replaced, and an empty one is filled.
    (tmp_path / "empty").mkdir()
    for out in (_model_copy(tiny_assets, tmp_path / "merged"), tmp_path / "empty"):
        rc = cli.main(
            ["merge", "--base", str(tiny_assets["model"]), "--adapter", str(adapter), "--output_dir", str(out)]
        )
        assert rc == 0 and (out / "model.safetensors").is_file()


# ---------------------------------------------------------------- hints naming the next step


def _checkpoint(run: Path, step: int) -> Path:
    ck = run / "checkpoints" / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    (ck / "config.json").write_text("{}")
    return ck


def test_a_training_checkpoint_given_as_adapter_names_the_folder_to_pass(tiny_assets, adapter, tmp_path, capsys):
    run = tmp_path / "run"
    ck = _checkpoint(run, 4)
    model = tiny_assets["model"]
    unfinished = (
        f"--adapter {ck} is a training checkpoint (the sharded state that --resume_from_checkpoint reads), not an "
        f"adapter; the run has not finished (no adapter in {run} yet): finish it with `shardtune train ... "
        f"--output_dir {run} --resume_from_checkpoint {ck}`, which writes the adapter to {run}, then pass {run}."
    )
    rc, line = _main(["chat", "--model_name_or_path", model, "--adapter", ck, "--prompt", "hi"], capsys)
    assert rc == 2 and line == f"shardtune chat: {unfinished}"
    rc, line = _main(["merge", "--base", model, "--adapter", ck, "--output_dir", tmp_path / "m"], capsys)
    assert rc == 2 and line == f"shardtune merge: {unfinished}"
    for f in adapter.iterdir():  # the run finished: its adapter is in the run's folder
        shutil.copy(f, run / f.name)
    rc, line = _main(
        ["merge", "--base", model, "--adapter", run / "checkpoints", "--output_dir", tmp_path / "m"], capsys
    )
    assert rc == 2 and line.endswith(f"not an adapter; pass the run's final adapter, --adapter {run}.")
    assert not (tmp_path / "m").exists()


def test_resume_true_means_latest(tiny_assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    rc, line = _main(train_args(tiny_assets, out, resume_from_checkpoint="True"), capsys)
    assert rc == 2 and line == (
        f"error: --resume_from_checkpoint True (the latest checkpoint): no complete checkpoint in {out}/checkpoints; "
        "check --output_dir, or drop --resume_from_checkpoint to start afresh."
    )
    for step in (2, 10, 5):
        _checkpoint(out, step)
    monkeypatch.setattr(checkpoint, "damage", lambda path: None)
    assert checkpoint.resolve("True", out) == checkpoint.resolve("latest", out) == out / "checkpoints" / "checkpoint-10"
