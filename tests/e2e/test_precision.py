"""The run's precision is decided once (RunConfig.precision): `mixed_precision: bf16` in the accelerate YAML means
what `--bf16 True` means, for training and for what is written (the full model's weights, the merged model)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.conftest import run_cli, train_args

# What `accelerate launch --config_file` exports for a YAML with `mixed_precision: bf16` and FSDP on.
YAML_BF16 = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "ACCELERATE_MIXED_PRECISION": "bf16",
}


def _dtypes(folder) -> set[str]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    out = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            out |= {str(st.get_slice(k).get_dtype()) for k in st.keys()}  # noqa: SIM118 - safe_open has no __iter__
    return out


@pytest.mark.parametrize(
    "method, flags, folder",
    [
        ("full", {"use_peft_lora": False}, "."),
        ("lora", {"use_peft_lora": True, "lora_r": 4, "merge_adapter": True}, "merged"),
    ],
)
def test_yaml_bf16_writes_bf16_weights(tiny_assets, tmp_path, method, flags, folder):
    out = tmp_path / method
    args = train_args(tiny_assets, out, max_seq_len=64, per_device_train_batch_size=2, max_steps=1, **flags)
    run_cli(args, env=YAML_BF16)
    written = out / folder
    assert _dtypes(written) == {"BF16"}
    config = json.loads((written / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    card = (out / "README.md").read_text()
    assert "| bf16 | True |" in card  # the hyperparameters table says what the run trained in
