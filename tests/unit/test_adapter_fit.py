"""An adapter of another model given to `shardtune chat` and `shardtune merge` (shardtune.models.adapter_fit): an
expert adapter of a mixture of experts with another number of experts, a Llama adapter of other widths, an expert
adapter given a dense base. Each is refused through the real command line (`cli.main`) with exit code 2 and one line
naming the first tensor that does not fit, before PEFT's loader would fail with a size-mismatch traceback; the
adapter given its own base passes (the negative control)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shardtune import cli
from shardtune.models import adapter_fit

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _save_moe(folder: Path, experts: int, hidden: int = 32) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    from shardtune.commands.demo import build_tokenizer

    config = MixtralConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    build_tokenizer(folder, vocab_size=128)
    return folder


def _save_adapter(base: Path, folder: Path, **lora) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, **lora))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from shardtune.commands.demo import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("fit")
    out = {"moe4": _save_moe(root / "moe4", 4), "moe8": _save_moe(root / "moe8", 8)}
    out["dense"] = root / "dense"  # a Llama as wide as the MoEs: its attention fits their adapters
    build_tokenizer(out["dense"], vocab_size=128)
    build_model(out["dense"], vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    out["wide"] = root / "wide"
    build_tokenizer(out["wide"], vocab_size=128)
    build_model(out["wide"], vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    out["experts4"] = _save_adapter(out["moe4"], root / "a_experts4", target_modules=["q_proj"],
                                    target_parameters=EXPERT_TARGETS)  # fmt: skip
    out["wide_adapter"] = _save_adapter(out["wide"], root / "a_wide", target_modules=["q_proj", "down_proj"])
    return out


def _cli(argv: list, capsys) -> tuple[int, str]:
    """(exit code, the one line that names the problem) of `shardtune <argv>` in this process; no traceback."""
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [s.strip() for s in err.splitlines() if "was trained on another base" in s]
    assert len(lines) == 1, err
    return rc, lines[0]


def _chat(base, adapter, capsys):
    return _cli(["chat", "--model_name_or_path", base, "--adapter", adapter, "--prompt", "hi", "--max_new_tokens", 1],
                capsys)  # fmt: skip


def _merge(base, adapter, out, capsys):
    return _cli(["merge", "--base", base, "--adapter", adapter, "--output_dir", out], capsys)


def test_an_expert_adapter_of_another_expert_count_is_refused_by_chat_and_merge(models, tmp_path, capsys):
    key = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"
    # The innermost wrapper (base_layer) is the first of target_parameters as PEFT saved them (from a set).
    want = re.compile(
        rf"adapter tensor {re.escape(key)} holds rank 2 for 4 experts but the base's "
        r"model\.layers\.0\.mlp\.experts\.(gate_up_proj \(8, 96, 32\)|down_proj \(8, 32, 48\)) has 8 experts "
        rf"\(and 7 more\); the adapter was trained on another model \(its base_model_name_or_path: "
        rf"{re.escape(str(models['moe4']))}\)"
    )
    rc, line = _chat(models["moe8"], models["experts4"], capsys)
    assert rc == 2 and want.search(line), line
    assert line.endswith(f"pass that base with --model_name_or_path, or an adapter trained on {models['moe8']}.")
    rc, line = _merge(models["moe8"], models["experts4"], tmp_path / "merged", capsys)
    assert rc == 2 and want.search(line) and "pass that base with --base" in line, line
    assert not (tmp_path / "merged").exists()


def test_an_expert_adapter_given_a_dense_base_is_refused(models, tmp_path, capsys):
    """The attention's LoRA fits the dense base (same widths): the expert parameters it targets do not exist."""
    rc, line = _chat(models["dense"], models["experts4"], capsys)
    # PEFT saves target_parameters from a set: their order in adapter_config.json varies from run to run.
    said = re.search(r"its target_parameters \(([^)]*)\) do not fit the base", line)
    assert rc == 2 and said and sorted(said[1].split(", ")) == sorted(EXPERT_TARGETS), line
    rc, line = _merge(models["dense"], models["experts4"], tmp_path / "merged", capsys)
    assert rc == 2 and "its target_parameters" in line and "pass that base with --base" in line, line


def test_a_llama_adapter_of_other_widths_is_refused_by_chat_and_merge(models, tmp_path, capsys):
    """lora_A [r, in] of down_proj against a base whose intermediate width differs, and q_proj's in_features."""
    want = ("adapter tensor base_model.model.model.layers.0.mlp.down_proj.lora_A.weight expects in_features 160 but "
            "the base's model.layers.0.mlp.down_proj (32 x 80) has 80")  # fmt: skip
    rc, line = _chat(models["dense"], models["wide_adapter"], capsys)
    assert rc == 2 and want in line and f"(its base_model_name_or_path: {models['wide']})" in line, line
    rc, line = _chat(models["moe8"], models["wide_adapter"], capsys)  # a MoE has no down_proj linear at all
    assert (
        rc == 2 and "down_proj.lora_A.weight belongs to model.layers.0.mlp.down_proj, which the base does not" in line
    )
    rc, line = _merge(models["dense"], models["wide_adapter"], tmp_path / "merged", capsys)
    assert rc == 2 and want in line, line


def test_the_adapter_on_its_own_base_passes(models, tmp_path, capsys):
    """Negative control: the same adapters on the bases they were trained on load and merge."""
    from transformers import AutoConfig

    for base, adapter in (("moe4", "experts4"), ("wide", "wide_adapter")):
        skeleton = adapter_fit.skeleton_of(models[base])
        problem = adapter_fit.adapter_base_problem(
            models[adapter],
            adapter_fit.model_shapes(skeleton),
            base_name=str(models[base]),
            flag="--adapter",
            vocab_size=AutoConfig.from_pretrained(models[base]).vocab_size,
            skeleton=skeleton,
        )
        assert problem is None
    assert cli.main(["merge", "--base", str(models["moe4"]), "--adapter", str(models["experts4"]),
                     "--output_dir", str(tmp_path / "merged")]) == 0  # fmt: skip
    rc = cli.main(["chat", "--model_name_or_path", str(models["moe4"]), "--adapter", str(models["experts4"]),
                   "--prompt", "hi", "--max_new_tokens", "1", "--temperature", "0"])  # fmt: skip
    assert rc == 0 and "Traceback" not in capsys.readouterr().err


def test_a_parameter_lora_mismatch_is_found_from_the_layout_not_the_names():
    """The layout check alone: a B with another out_features, and a rank block for another expert count."""
    layout = {
        "k.lora_A.weight": ((8, 32), "p", (4, 96, 32), 4, 2),
        "k.lora_B.weight": ((96, 8), "p", (4, 96, 32), 4, 2),
    }
    assert adapter_fit._parameter_mismatch("k.lora_A.weight", (8, 32), layout) is None
    assert adapter_fit._parameter_mismatch("k.lora_B.weight", (64, 8), layout).startswith("expects out_features 64")
    assert "for 8 experts" in adapter_fit._parameter_mismatch("k.lora_A.weight", (16, 32), layout)
    assert "does not have" in adapter_fit._parameter_mismatch("other.lora_A.weight", (8, 32), layout)
