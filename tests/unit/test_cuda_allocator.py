"""config.cuda_allocator: the CUDA allocator settings shardtune's processes run with, and the planner following
them."""

from __future__ import annotations

import ast
import json
import os
import sys

import pytest
import tomllib
import torch

from shardtune import cli
from shardtune.config import cuda_allocator
from shardtune.planning.estimate import ALLOCATOR_OVERHEAD, ALLOCATOR_OVERHEAD_EXPANDABLE
from shardtune.planning.known_configs import known_config
from tests.conftest import ROOT


def test_default_applies_only_when_the_user_set_nothing():
    env: dict[str, str] = {}
    assert cuda_allocator.apply_default(env) is True
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:512"}
        assert cuda_allocator.apply_default(mine) is False
        assert mine == {name: "max_split_size_mb:512"}


@pytest.mark.parametrize(
    ("conf", "expandable"),
    [
        (None, True),
        ("", True),
        ("expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("max_split_size_mb:512", False),  # the user's own settings: torch's default (off)
        ("max_split_size_mb:512, expandable_segments:true", True),
        ("expandable_segments:True,expandable_segments:False", False),  # the last one wins, as torch parses it
    ],
)
def test_reading_the_setting(conf, expandable):
    env = {} if conf is None else {"PYTORCH_CUDA_ALLOC_CONF": conf}
    assert cuda_allocator.expandable_segments(env) is expandable
    if conf:  # torch reads PYTORCH_ALLOC_CONF first
        assert cuda_allocator.expandable_segments({**env, "PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is False


def test_every_command_starts_with_the_setting(monkeypatch, tmp_path, capsys):
    """`shardtune <command>` sets the variable before the command runs (workers inherit it); `shardtune plan`
    estimates for it: the calibrated fragmentation of expandable segments by default, the default allocator's when
    the user turns them off."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(known_config("meta-llama/Llama-2-7b-hf")))
    argv = ["plan", "--model_name_or_path", str(config), "--use_peft_lora", "True", "--bf16", "True", "--json", "True"]

    def plan_terms(conf: str | None) -> dict:
        for name in cuda_allocator.VARIABLES:
            monkeypatch.delenv(name, raising=False)
        if conf is not None:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        assert cli.main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        return out

    default = plan_terms(None)
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    off = plan_terms("expandable_segments:False")
    assert default["allocator"]["expandable_segments"] is True and off["allocator"]["expandable_segments"] is False
    for out, frag in ((default, ALLOCATOR_OVERHEAD_EXPANDABLE), (off, ALLOCATOR_OVERHEAD)):
        terms = out["allocator"]
        dynamic = terms["other streams"] - terms["resident"]
        assert terms["fragmentation"] == int(frag * dynamic)
    assert off["reserved_bytes"] > default["reserved_bytes"]


def _unset(monkeypatch):
    for name in cuda_allocator.VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("user", [None, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")])
def test_train_called_in_process_starts_with_the_setting(monkeypatch, user):
    """`commands.train.main` in another program's process (bench/speed.py, the device check) goes through the same
    entry as the script: the variable is set before the command runs, and a user's own configuration is kept."""
    from shardtune.commands import train

    _unset(monkeypatch)
    if user:
        monkeypatch.setenv(*user)
    seen = {}
    monkeypatch.setattr(train, "command", lambda argv: seen.update(argv=argv, env=dict(os.environ)) or 0)
    assert train.main(["--output_dir", "x"]) == 0
    assert seen["argv"] == ["--output_dir", "x"]
    got = {k: seen["env"].get(k) for k in cuda_allocator.VARIABLES if seen["env"].get(k)}
    assert got == ({user[0]: user[1]} if user else {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})


def test_every_entry_point_goes_through_run_command(monkeypatch):
    """The `shardtune` script and `python -m shardtune` are cli.main, which runs each command by run_command."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"shardtune": "shardtune.cli:main"}
    tree = ast.parse((ROOT / "src" / "shardtune" / "__main__.py").read_text())
    assert "from shardtune.cli import main" in ast.unparse(tree) and "SystemExit(main())" in ast.unparse(tree)
    calls = []
    monkeypatch.setattr(cli, "run_command", lambda name, argv, program: calls.append((name, argv, program)) or 0)
    assert cli.main(["plan", "--json", "True"]) == 0
    assert calls == [("plan", ["--json", "True"], False)]  # argv given: a caller in its own process
    monkeypatch.setattr(sys, "argv", ["shardtune", "plan", "--json", "True"])
    assert cli.main() == 0
    assert calls[-1] == ("plan", ["--json", "True"], True)  # the script: the process ends with the command


def test_a_setting_that_comes_too_late_is_reported(monkeypatch, caplog):
    """A program that started CUDA before calling a command in its process is told that the setting cannot apply."""
    _unset(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cli.prepare_process()
    assert "CUDA started before shardtune set PYTORCH_ALLOC_CONF=expandable_segments:True" in caplog.text
    caplog.clear()
    cli.prepare_process()  # set now: nothing to say
    assert caplog.text == ""
