"""`shardtune train --merge_adapter True` on 2 ranks, with new chat tokens and `--modules_to_save embed_tokens,lm_head`.

One run; the tests check the merged folder against base + adapter through PeftModel (fp32, and a bf16 merge of
the same adapter), and that the fully trained modules were saved with their resized rows and reload.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import packed_eval_split, run_cli
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain, tol, tol_rounding

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
}
# Largest |merged - PeftModel| logit difference allowed, relative to the largest |logit|, by merged dtype
# (tests/tolerance.py). fp32: the merged weights (W + s·B·A, one more sum over r = 4) through the forward chain
# of the tiny model over an eval row of up to 96 positions. bf16 against the fp32 PeftModel: every stage's output
# rounded once to bf16 (per layer: 2 norms, 7 linears, the attention's 2 products, the MLP's product and 2
# residual sums: 14; 2 layers and the head: 29) plus the merged weight itself, on the bf16 side only.
TOLERANCE = {
    torch.float32: tol(torch.float32, decoder_chain(**TINY, seq=96) + 4),
    torch.bfloat16: tol_rounding(torch.bfloat16, 2 * 14 + 1 + 1, one_sided=True),
}
# The eval loss of the same weights through PeftModel vs shardtune's model: the eval chain over 24 rows of 96.
EVAL_REL = tol(torch.float32, decoder_chain(**TINY, seq=96, vocab=TINY_VOCAB, tokens=24 * 96))


@pytest.fixture(scope="module")
def trained(tiny_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("merge_run") / "out"
    args = ["train", "--model_name_or_path", str(tiny_assets["model"]), "--dataset_name", str(tiny_assets["data"])]
    args += ["--chat_template_format", "chatml", "--max_seq_len", "96", "--packing", "True", "--seed", "5"]
    args += ["--max_steps", "3", "--learning_rate", "5e-3", "--per_device_train_batch_size", "2"]
    args += ["--per_device_eval_batch_size", "3", "--eval_strategy", "epoch", "--save_strategy", "no"]
    args += ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "16", "--lora_dropout", "0.0"]
    args += ["--lora_target_modules", "all-linear", "--modules_to_save", "embed_tokens,lm_head"]
    args += ["--merge_adapter", "True", "--output_dir", str(out)]
    run_cli(args, nproc=2, env=FSDP_ENV)
    return out


def _peft_model(base_dir: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(adapter)), pad_to_multiple_of=8)
    return PeftModel.from_pretrained(base, adapter).eval()


def _eval_batch(out: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "What is the capital of Peru?"}, {"role": "assistant", "content": "Lima."}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    ids = torch.tensor([ids])
    assert ids.max() >= 600  # the chat template's own tokens, in the resized rows
    return ids


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def _assert_close_for(dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, adapter_effect: float) -> None:
    err = float((got - want).abs().max())
    assert err <= TOLERANCE[dtype] * float(want.abs().max()), (dtype, err)
    # The adapter moves the logits far more than the merge error: the comparison can fail.
    assert adapter_effect > 20 * err, (adapter_effect, err)


def test_merged_model_gives_base_plus_adapter_logits(tiny_assets, trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardtune.merge.fold import merge_adapter

    merged_dir = trained / "merged"
    assert (merged_dir / "config.json").exists() and (merged_dir / "README.md").exists()
    assert json.loads((merged_dir / "config.json").read_text())["vocab_size"] == 608
    ids = _eval_batch(trained)
    peft_model = _peft_model(tiny_assets["model"], trained)
    want = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        effect = float((_logits(peft_model, ids) - want).abs().max())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    _assert_close_for(torch.float32, _logits(merged, ids), want, effect)
    # The same adapter merged to bf16 (what --bf16 True runs write), loaded in bf16.
    bf16_dir = merge_adapter(tiny_assets["model"], trained, tmp_path / "bf16", dtype="bf16")
    merged16 = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval()
    assert merged16.get_input_embeddings().weight.dtype == torch.bfloat16
    _assert_close_for(torch.bfloat16, _logits(merged16, ids), want, effect)


def test_modules_to_save_are_trained_in_full_saved_resized_and_reload(tiny_assets, trained):
    adapter = load_file(trained / "adapter_model.safetensors")
    base = load_file(tiny_assets["model"] / "model.safetensors")
    head, emb = adapter["base_model.model.lm_head.weight"], adapter["base_model.model.model.embed_tokens.weight"]
    # Saved whole, with the rows of the chat template's tokens (600 → 608, a multiple of 8).
    assert head.shape == emb.shape == (608, 64)
    assert not any("trainable_tokens" in k for k in adapter)  # the full modules already hold the new rows
    # Trained in full: every row of lm_head moved (each enters the softmax), and the embeddings moved.
    moved = (head[:600] - base["lm_head.weight"]).abs().amax(dim=1)
    assert bool((moved > 0).all())
    assert float((emb[:600] - base["model.embed_tokens.weight"]).abs().max()) > 1e-4
    # Reloaded through PeftModel, they reproduce the eval loss the run reported.
    peft_model = _peft_model(tiny_assets["model"], trained)
    loaded = peft_model.base_model.model.lm_head.modules_to_save["default"].weight
    torch.testing.assert_close(loaded, head, rtol=0, atol=0)
    summary = json.loads((trained / "train_summary.json").read_text())
    assert summary["final_eval_loss"] == pytest.approx(_eval_loss(tiny_assets, trained, peft_model), rel=EVAL_REL)


def _eval_loss(assets, out: Path, model) -> float:
    import torch.nn.functional as F

    ev = packed_eval_split(assets, out, out.parent / "cache", seed=5)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, pos in zip(ev.input_ids, ev.labels, ev.position_ids, strict=True):
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False).logits
            y = torch.tensor(labels)
            total += F.cross_entropy(logits[0].float(), y, reduction="sum", ignore_index=-100).item()
            count += int((y != -100).sum())
    return total / count
