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


def test_tied_family_exports_bf16_that_reloads_tied(tmp_path):
    """Qwen3 (tied embeddings, q/k norms, a chat tokenizer whose length is no multiple of 8): a full fine-tune
    with the YAML's bf16 writes bf16 weights that transformers reloads as bf16 with the head still tied."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.families import build_assets

    assets = build_assets(tmp_path / "assets", families=["qwen3"])
    out = tmp_path / "qwen3"
    model_dir = assets["root"] / "qwen3"
    args = train_args(
        {"model": model_dir, "data": assets["data"]}, out, max_seq_len=64, per_device_train_batch_size=2,
        max_steps=1, use_peft_lora=False,
    )  # fmt: skip
    run_cli(args, env=YAML_BF16)
    assert _dtypes(out) == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # the embeddings were padded past the tokenizer (len not a multiple of 8) and saved that way
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows % 8 == 0 and rows > len(assets["tokenizers"]["chat"])
