"""`shardtune plan` in a fresh process prints its table on stdout and nothing on stderr: the notices libraries log
while they are imported (bitsandbytes' missing optional CPU kernels) are quieted for every command, before any
import (shardtune.cli.prepare_process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shardtune.planning.known_configs import known_config


def test_plan_writes_nothing_on_stderr(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(known_config("meta-llama/Llama-2-7b-hf")))
    argv = [sys.executable, "-m", "shardtune", "plan", "--model_name_or_path", str(config), "--use_peft_lora", "True"]
    argv += ["--use_4bit_quantization", "True", "--bf16", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "frozen base weights" in proc.stdout
    assert proc.stderr == ""
