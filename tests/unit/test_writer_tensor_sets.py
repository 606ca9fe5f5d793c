"""Every writer holds exactly the tensors it must, by name and shape: the adapter export (training.export.save_adapter),
the full model export (save_full_model) and the merged folder (merge.fold.merge_adapter). The expected sets are
computed here, independently of shardtune: from the base's config.json (the Llama layout written out) and the LoRA
settings, and read back with safetensors' own header reader; a loss within a tolerance would not see a missing or an
extra tensor. The negative control plants an extra, a missing and a reshaped tensor and sees each fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

R, TARGETS = 4, ("q_proj", "v_proj", "down_proj")


def stored(folder: Path, pattern: str = "*.safetensors") -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in the folder's safetensors files (safetensors' reader, not shardtune's)."""
    out: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob(pattern)):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                assert key not in out, f"{key} stored twice"
                out[key] = tuple(f.get_slice(key).get_shape())
    return out


def llama_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of a Llama checkpoint, from its config.json."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (q, h),
            f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h),
            f"{p}self_attn.o_proj.weight": (h, q),
            f"{p}mlp.gate_proj.weight": (i, h),
            f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i),
        }
    return out


def lora_tensors(config: dict, r: int, targets: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """PEFT's adapter file: for each targeted linear (out, in), lora_A [r, in] and lora_B [out, r]."""
    out = {}
    for name, shape in llama_tensors(config).items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in targets:
            out[f"base_model.model.{module}.lora_A.weight"] = (r, shape[1])
            out[f"base_model.model.{module}.lora_B.weight"] = (shape[0], r)
    return out


def assert_exact(got: dict, want: dict, what: str) -> None:
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    assert not missing, f"{what} lacks {missing[:3]}"
    assert not extra, f"{what} holds extra {extra[:3]}"
    wrong = [(k, got[k], want[k]) for k in sorted(want) if tuple(got[k]) != tuple(want[k])]
    assert not wrong, f"{what}: shapes differ {wrong[:3]}"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama, its LoRA adapter and full model as shardtune exports them, and the merged folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.commands.demo import build_model, build_tokenizer
    from shardtune.merge.fold import merge_adapter
    from shardtune.training import export

    root = tmp_path_factory.mktemp("writers")
    base = root / "base"
    build_tokenizer(base, vocab_size=128)
    build_model(base, vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    tok = AutoTokenizer.from_pretrained(base)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=R, target_modules=list(TARGETS))
    )
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.05)
    state = {n: p.detach() for n, p in peft_model.named_parameters() if p.requires_grad}
    export.save_adapter(peft_model, state, tok, root / "adapter")
    full = AutoModelForCausalLM.from_pretrained(base)
    export.save_full_model(full, dict(full.state_dict()), tok, root / "full", dtype=torch.bfloat16)
    merge_adapter(base, root / "adapter", root / "merged")
    return {"base": base, "adapter": root / "adapter", "full": root / "full", "merged": root / "merged"}


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_the_expected_sets_describe_the_base_checkpoint(written):
    """The reference itself: the Llama layout from config.json is exactly what the base's own files hold."""
    assert_exact(stored(written["base"]), llama_tensors(_config(written["base"])), "the base")


def test_the_adapter_export_holds_exactly_the_lora_tensors(written):
    want = lora_tensors(_config(written["base"]), R, TARGETS)
    assert len(want) == 2 * 2 * len(TARGETS)  # 2 layers x 3 targets x (A, B)
    assert_exact(stored(written["adapter"], "adapter_model.safetensors"), want, "the adapter")


def test_the_full_model_export_holds_exactly_the_base_checkpoints_tensors(written):
    got = stored(written["full"])
    assert_exact(got, llama_tensors(_config(written["base"])), "the full model")
    assert_exact(got, stored(written["base"]), "the full model")


def test_the_merged_folder_holds_exactly_the_base_tensors(written):
    got = stored(written["merged"])
    assert_exact(got, stored(written["base"]), "the merged folder")
    assert_exact(got, llama_tensors(_config(written["base"])), "the merged folder")
    assert not any("lora" in k for k in got)


@pytest.mark.parametrize("plant", ["extra", "missing", "reshaped"])
def test_a_planted_difference_fails(written, plant):
    """Negative control: each kind of difference from the expected set is caught."""
    want = lora_tensors(_config(written["base"]), R, TARGETS)
    got = dict(stored(written["adapter"], "adapter_model.safetensors"))
    key = next(iter(sorted(got)))
    if plant == "extra":
        got["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = (R, 32)
    elif plant == "missing":
        del got[key]
    else:
        got[key] = (R + 1, *got[key][1:])
    with pytest.raises(AssertionError):
        assert_exact(got, want, "the planted adapter")
