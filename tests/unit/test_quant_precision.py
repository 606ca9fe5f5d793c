"""The 4-bit checks take the run's precision as decided once (`RunConfig.precision`), like the other components:
what they ask for and how they name it come from that decision, not from the flags read again."""

from __future__ import annotations

import pytest
import torch

from shardtune.config.arguments import RunConfig
from shardtune.config.errors import ConfigError
from shardtune.config.precision import Precision
from shardtune.models.quant import quantization_problems
from shardtune.recipe.run_config import load_run_config

pytest.importorskip("bitsandbytes")  # without it the 4-bit checks only say that it is missing

FP16_FROM_YAML = Precision(compute=torch.float16, storage=torch.float16, flags="mixed_precision: fp16")
BF16_STORAGE_UNDER_FP16 = (
    "--bnb_4bit_quant_storage_dtype bfloat16 differs from FSDP's parameter dtype float16 (mixed_precision: fp16): "
    "FSDP would cast the packed 4-bit bytes as if they were numbers. Set --bnb_4bit_quant_storage_dtype float16, "
    "or match the precision to the storage (--bf16 True)."
)


def _problems(storage: str, precision: Precision = FP16_FROM_YAML, fsdp: bool = True) -> list[str]:
    return quantization_problems(
        use_4bit=True, use_8bit=False, quant_storage_dtype=storage, precision=precision, fsdp_enabled=fsdp
    )


def test_the_checks_ask_for_the_precision_they_are_given():
    assert _problems("float16") == [] and _problems("fp16") == []
    assert _problems("bfloat16") == [BF16_STORAGE_UNDER_FP16]
    (uint8,) = _problems("uint8")
    assert uint8.endswith("Set --bnb_4bit_quant_storage_dtype float16 (with mixed_precision: fp16).")
    fp32 = Precision(compute=torch.float32, storage=torch.float32, flags="neither --bf16 nor --fp16")
    assert _problems("uint8", fp32, fsdp=False) == [] and _problems("float32", fp32) == []


def test_validation_passes_the_runs_precision(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    argv = ["--model_name_or_path", "org/model", "--dataset_name", str(data), "--use_peft_lora", "True"]
    argv += ["--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16"]

    def env(mixed_precision: str) -> dict[str, str]:
        return {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": mixed_precision}

    with pytest.raises(ConfigError) as e:
        load_run_config(argv, env=env("fp16"))
    assert e.value.problems == [BF16_STORAGE_UNDER_FP16]
    assert load_run_config(argv, env=env("bf16")).precision.compute == torch.bfloat16  # bfloat16 storage fits
    # The decision is RunConfig.precision's alone: the same flags, and the check follows what it decides.
    monkeypatch.setattr(RunConfig, "precision", property(lambda self: FP16_FROM_YAML))
    with pytest.raises(ConfigError) as e:
        load_run_config(argv, env=env("bf16"))
    assert e.value.problems == [BF16_STORAGE_UNDER_FP16]
