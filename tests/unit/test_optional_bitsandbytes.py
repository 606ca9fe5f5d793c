"""bitsandbytes is the optional extra `qlora`: without it, 4-bit and the 8-bit optimizers are refused at start with
one line that names the extra, and everything else still runs."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.conftest import train_args

NO_BNB = "import sys; sys.modules['bitsandbytes'] = None; sys.argv[0] = 'shardtune'; "


def test_problems_name_the_extra(monkeypatch):
    from shardtune.config.precision import resolve_precision
    from shardtune.models.quant import quantization_problems
    from shardtune.training.optimizers import optimizer_problems

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    bf16 = resolve_precision(bf16=True, fp16=False, mixed_precision="bf16")
    flags = {"use_8bit": False, "quant_storage_dtype": "bfloat16", "precision": bf16, "fsdp_enabled": True}
    (problem,) = quantization_problems(use_4bit=True, **flags)
    assert problem.startswith("--use_4bit_quantization True needs bitsandbytes") and "shardtune[qlora]" in problem
    assert quantization_problems(use_4bit=False, **flags) == []
    for optim in ("adamw_8bit", "paged_adamw_8bit"):
        (problem,) = optimizer_problems(optim, torch.device("cpu"))
        assert problem.startswith(f"--optim {optim} needs bitsandbytes") and "shardtune[qlora]" in problem
        assert problem.endswith("or use --optim adamw_torch.")
    assert optimizer_problems("adamw_torch", torch.device("cpu")) == []


def test_cli_without_bitsandbytes_exits_2_before_loading(tiny_assets, tmp_path):
    argv = train_args(
        tiny_assets, tmp_path / "out", use_4bit_quantization=True, bnb_4bit_quant_storage_dtype="bfloat16"
    )
    code = NO_BNB + f"sys.argv[1:] = {argv!r}; from shardtune.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "bitsandbytes" in ln]
    assert len(lines) == 1 and "pip install 'shardtune[qlora]'" in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
