"""--streaming end to end: a streamed run SIGKILLed after a checkpoint and resumed gives the uninterrupted run's
losses, the windows crossed on the way."""

from __future__ import annotations

import json

from tests.conftest import run_cli, train_args, train_records


def _args(assets, out, **extra):
    flags = {
        "streaming": True,
        "packing_window": 16,  # about 6 packed rows a window: 6 steps of 2 rows cross windows
        "max_seq_len": 96,
        "seed": 5,
        "per_device_train_batch_size": 2,
        "max_steps": 6,
        "learning_rate": 3e-3,
        "save_strategy": "steps",
        "save_steps": 2,
        "use_peft_lora": True,
        "lora_r": 4,
        "lora_dropout": 0.0,
        "lora_target_modules": "all-linear",
        **extra,
    }
    return train_args(assets, out, **flags)


def test_streaming_run_killed_and_resumed_gives_the_uninterrupted_losses(tiny_assets, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_cli(_args(tiny_assets, whole))
    killed = run_cli(_args(tiny_assets, cut), env={"SHARDTUNE_FAULT": "step:3:0"}, check=False)
    assert killed.returncode != 0 and [r["step"] for r in train_records(cut)] == [1, 2, 3]
    meta = json.loads((cut / "checkpoints" / "checkpoint-2" / "meta.json").read_text())
    epoch, window, row = meta["loop"]["stream"]
    assert epoch == 0 and window >= 0 and row > 0  # the position after 2 steps of 2 rows: inside a window
    run_cli(_args(tiny_assets, cut, resume_from_checkpoint="latest"))
    want = {r["step"]: r["loss"] for r in train_records(whole)}
    got = {r["step"]: r["loss"] for r in train_records(cut)}  # steps 3.. from the resumed run (the last record)
    assert len(want) == 6 and sorted(got) == list(range(1, 7))
    # One process on the same machine, the same rows in the same order: the same floating-point operations, so
    # the losses are bitwise equal.
    assert got == want
    last = json.loads((whole / "checkpoints" / "checkpoint-6" / "meta.json").read_text())["loop"]["stream"]
    assert last[1] >= 1  # the 12 rows of the six steps came from more than one window
