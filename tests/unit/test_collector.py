"""The garbage collector over a command (shardtune.runtime.collector): no full collection while the command starts,
start-up's survivors frozen when training starts and the oldest generation collected again after it, a program's
exit left nothing to scan, and an in-process caller's collector given back as it was. A real `shardtune train` in
this process goes through the same window (the last test)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest

from shardtune import cli
from shardtune.runtime import collector
from tests.conftest import train_args


class _Cycle:
    """Cyclic garbage: freed by a collection only."""

    def __init__(self):
        self.me = self


def _cycles() -> int:
    return sum(type(o) is _Cycle for o in gc.get_objects())


@pytest.fixture
def probe_command(monkeypatch):
    """A command `probe` whose function records the collector's state at each point of its life."""
    seen: dict = {}

    def probe(argv: list[str]) -> int:
        seen["starting"] = gc.get_threshold()
        kept = _Cycle()
        gc.collect(1)  # a survivor of the young collections: now in the oldest generation
        del kept  # garbage start-up leaves behind there, which only a full collection frees
        seen["garbage"] = _cycles()
        collector.training_starts()
        seen["training"] = (gc.get_threshold(), gc.get_freeze_count() > 0, len(gc.get_objects()))
        seen["garbage_after"] = _cycles()
        return 0

    monkeypatch.setitem(cli.COMMANDS, "probe", (__name__, "_probe", "probe"))
    monkeypatch.setattr(sys.modules[__name__], "_probe", probe, raising=False)
    return seen


def test_a_command_in_process_gives_the_collector_back(probe_command):
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    assert cli.run_command("probe", []) == 0
    seen = probe_command
    assert seen["starting"] == (before[0], before[1], collector.NEVER)  # no full collection while starting
    assert seen["garbage"] == 1 and seen["garbage_after"] == 0  # training_starts collected it
    threshold, frozen, unfrozen = seen["training"]
    assert threshold == before and frozen and unfrozen < 1000  # start-up's objects out of later scans
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0  # the caller's collector as it was


def test_a_program_exits_with_everything_frozen(probe_command):
    try:
        assert cli.run_command("probe", [], program=True) == 0
        assert gc.get_freeze_count() > 0 and len(gc.get_objects()) < 1000  # the exit's scans find next to nothing
    finally:
        gc.unfreeze()
        gc.set_threshold(*probe_command["training"][0])


def test_training_starts_outside_a_command_changes_nothing():
    """A test or a program driving the recipe directly: nothing would unfreeze, so nothing is frozen."""
    before = gc.get_threshold()
    collector.training_starts()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_a_train_run_in_this_process_freezes_and_gives_back(tiny_assets, tmp_path):
    """`shardtune train` as a caller runs it: the window is entered, training_starts runs once the model is built
    (seen from the first step's callback: the start-up's objects are frozen then), and at the end the caller's
    collector is back. Negative control: the training_starts call removed from recipe/train.py, `frozen` is 0."""
    from shardtune.runtime import hooks

    frozen: list[int] = []
    hooks.register("step", lambda step, rank: frozen.append(gc.get_freeze_count()))
    try:
        argv = train_args(tiny_assets, tmp_path / "out", max_steps=1, max_seq_len=128, per_device_train_batch_size=2)
        assert cli.run_command("train", argv[1:]) == 0
    finally:
        hooks.clear()
    assert frozen and frozen[0] > 10_000  # torch's, transformers' and the model's objects
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[2] != collector.NEVER


def test_the_script_exits_cleanly_with_its_code(tmp_path):
    """The program path end to end: `python -m shardtune` with a command that fails its flags still exits with its
    code after the freeze (2, a mistake in the input), its one line printed."""
    script = textwrap.dedent(
        """
        import gc, json, sys
        from shardtune import cli
        code = cli.main()
        print(json.dumps({"code": code, "frozen": gc.get_freeze_count()}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "plan", "--lora_r", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 2 and out["frozen"] > 0
