"""shardtune.cuda_allocator: the CUDA allocator settings shardtune's processes run with, and the planner following
them."""

from __future__ import annotations

import json
import os

import pytest

from shardtune import cli, cuda_allocator
from shardtune.planning.estimate import ALLOCATOR_OVERHEAD, ALLOCATOR_OVERHEAD_EXPANDABLE
from shardtune.planning.known_configs import known_config


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
