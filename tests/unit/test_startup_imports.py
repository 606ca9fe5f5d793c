"""What `shardtune train` imports on its way to the first step (docs/speed.md, start-up): a run without a 4-bit base
never imports bitsandbytes (peft would, at its import and whenever it wraps a layer: models.quant.bitsandbytes_for_peft),
a 4-bit run still does, and the command's module does not import torch._dynamo (torch's lower-right causal bias
module does, for context parallelism's attention alone: models.fastpath.causal_lower_right imports it when used).
Each case runs in a fresh process: this one has imported everything already."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import train_args

# One optimizer step of the tiny model on the tiny data.
STEP = {"use_peft_lora": True, "max_seq_len": 64, "per_device_train_batch_size": 2, "max_steps": 1}
# Imported only for a 4-bit base: bitsandbytes, and peft's LoRA layers for its 4-bit and 8-bit linear layers.
BITSANDBYTES = ("bitsandbytes", "peft.tuners.lora.bnb")
WATCHED = (*BITSANDBYTES, "peft", "torch._dynamo")


def _printed(code: str):
    """Run `code` in a fresh interpreter; the JSON of its last line of output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _modules_after(code: str) -> dict[str, bool]:
    """Run `code` in a fresh interpreter, then say which WATCHED modules it imported."""
    return _printed(code + f"\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {WATCHED!r}}}))")


def _train(argv: list[str]) -> str:
    return f"from shardtune.cli import main\nassert main({argv[:]!r}) == 0"


def test_the_command_module_imports_no_dynamo():
    found = _modules_after("import shardtune.commands.train")
    assert not found["torch._dynamo"] and not found["bitsandbytes"]


def test_a_run_without_4bit_imports_no_bitsandbytes(tiny_assets, tmp_path):
    found = _modules_after(_train(train_args(tiny_assets, tmp_path / "out", **STEP)))
    assert found["peft"]  # the adapter was made by peft
    assert {m: found[m] for m in BITSANDBYTES} == dict.fromkeys(BITSANDBYTES, False)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes (the qlora extra)")
def test_a_4bit_run_imports_bitsandbytes(tiny_assets, tmp_path):
    argv = train_args(
        tiny_assets,
        tmp_path / "out",
        **STEP,
        use_4bit_quantization=True,
        bnb_4bit_quant_storage_dtype="bfloat16",
        bf16=True,
    )
    found = _modules_after(_train(argv))
    assert {m: found[m] for m in BITSANDBYTES} == dict.fromkeys(BITSANDBYTES, True)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes (the qlora extra)")
def test_peft_is_answered_afresh_after_a_run_without_4bit():
    """In one process: inside a run without a 4-bit base peft says bitsandbytes is absent, and nothing is left
    hiding it; after it, and for a 4-bit run, peft says it is installed."""
    code = (
        "import json, sys\nfrom shardtune.models.quant import bitsandbytes_for_peft\n"
        "with bitsandbytes_for_peft(False):\n"
        "    from peft import import_utils\n"
        "    seen = [import_utils.is_bnb_available(), import_utils.is_bnb_4bit_available(), 'bitsandbytes' in sys.modules]\n"
        "seen.append(import_utils.is_bnb_available())\n"
        "with bitsandbytes_for_peft(True):\n"
        "    seen.append(import_utils.is_bnb_4bit_available())\n"
        "print(json.dumps(seen))"
    )
    assert _printed(code) == [False, False, False, True, True]
