"""Embeddings looked up by token id besides the input embedding (Gemma 4's per-layer input embedding,
embed_tokens_per_layer): when shardtune adds tokens, their rows in every such table are trained and saved with
the adapter, reload as trained, merge into a folder whose config agrees with its tables, and are planned.

The tiny Gemma 4 of tests/families.py (602 tokens, chat tokens already in) gains 4 tokens: 606, padded to 608 rows.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.families import FAMILIES, build_chat_tokenizer, build_family_model
from tests.tolerance import decoder_chain, tol

NEW_TOKENS = ["<t0>", "<t1>", "<t2>", "<t3>"]
OLD, ROWS = 602, 608
# A batch with old tokens, the 4 new ones (602-605) and both padding rows (606, 607).
IDS = torch.tensor([[1, 40, 602, 77, 603, 604, 605, 606, 607, 9]])
# fp32, one forward to the logits. The tiny Gemma 4's widest sum is its full-attention o_proj over 4 heads of 512
# (global_head_dim): taking that width for every sum of the chain bounds the rounding of each.
CHAIN = decoder_chain(hidden=2048, intermediate=128, layers=2, seq=IDS.shape[1])


def _train_and_save(model, tok, out) -> None:
    """Stand-in for training: every trainable value moves (lora_B leaves zero, token rows leave the resize's);
    then the adapter is saved with shardtune's export."""
    from shardtune.training import export

    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    export.save_adapter(model, state, tok, out)


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA adapter built as shardtune's training builds it (load, resize, attach), its trainable values moved
    as training would move them, and saved with shardtune's export."""
    from shardtune.models import adapter, loading

    root = tmp_path_factory.mktemp("gemma4-tokens")
    tok = build_chat_tokenizer(root / "base")
    assert len(tok) == OLD
    build_family_model("gemma4", root / "base", OLD)
    base = loading.load_base_model(
        str(root / "base"), dtype=torch.float32, attn_impl="sdpa", trust_remote_code=False, quantization_config=None
    )
    tok.add_special_tokens({"additional_special_tokens": NEW_TOKENS})
    rows = loading.resize_embeddings(base, len(tok))
    assert rows == ROWS
    model = adapter.attach_adapter(
        base, lora_r=4, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", use_dora=False,
        modules_to_save=None, new_token_ids=list(range(OLD, ROWS)),
    )  # fmt: skip
    _train_and_save(model, tok, root / "out")
    return {"root": root, "model": model.eval(), "tok": tok}


def _per_layer(model) -> torch.Tensor:
    """The per-layer embedding's effective rows (trained token rows copied in)."""
    module = model.get_per_layer_input_embeddings()
    if hasattr(module, "token_adapter"):
        return module.token_adapter.get_merged_weights(module.active_adapters)
    return module.weight


def test_new_rows_of_every_token_table_are_trained_and_saved(trained):
    from safetensors.torch import load_file

    model = trained["model"]
    spec = model.peft_config["default"].trainable_token_indices
    assert spec == {"embed_tokens": list(range(OLD, ROWS)), "embed_tokens_per_layer": list(range(OLD, ROWS))}
    saved = load_file(str(trained["root"] / "out" / "adapter_model.safetensors"))
    per_layer = [v for k, v in saved.items() if "embed_tokens_per_layer.token_adapter.trainable_tokens_delta" in k]
    assert len(per_layer) == 1 and per_layer[0].shape == (ROWS - OLD, 16)  # 2 layers x 8 per-layer inputs
    assert torch.equal(per_layer[0], _per_layer(model)[OLD:])


def test_reloaded_adapter_equals_the_trained_model_on_new_tokens(trained):
    """transformers + peft, as the README says: resize the base (a random start for the new rows), load the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(trained["root"] / "base", dtype=torch.float32)
    base.resize_token_embeddings(len(trained["tok"]), pad_to_multiple_of=8)
    reloaded = PeftModel.from_pretrained(base, trained["root"] / "out").eval()
    assert torch.equal(_per_layer(reloaded), _per_layer(trained["model"]))
    assert _rel_error(_logits(reloaded), _logits(trained["model"])) <= tol(torch.float32, CHAIN)


def test_merged_folder_grows_every_token_table_and_equals_the_trained_model(trained):
    from transformers import AutoModelForCausalLM

    from shardtune.merge.fold import merge_adapter

    out = merge_adapter(trained["root"] / "base", trained["root"] / "out", trained["root"] / "merged", dtype="fp32")
    config = json.loads((out / "config.json").read_text())["text_config"]
    assert config["vocab_size"] == config["vocab_size_per_layer_input"] == ROWS
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert merged.get_per_layer_input_embeddings().weight.shape == (ROWS, 16)
    # W + s·BA summed before (merged) or after (adapter) each product: two summation orders of one forward.
    assert _rel_error(_logits(merged), _logits(trained["model"])) <= tol(torch.float32, CHAIN)


def test_merge_of_an_adapter_without_per_layer_rows_grows_the_table_with_the_mean_row(trained, tmp_path, caplog):
    """An adapter that trained embed_tokens' new rows only (as shardtune did before): the merged model still has
    a per-layer row for every token id (the base's mean row, as the merge starts untrained rows), and says so."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardtune.merge.fold import merge_adapter

    base_dir = trained["root"] / "base"
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    mean_row = base.get_per_layer_input_embeddings().weight.mean(0)
    base.resize_token_embeddings(ROWS, mean_resizing=False)
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [602, 607]})
    get_peft_model(base, config).save_pretrained(str(tmp_path / "old"))
    with caplog.at_level(logging.WARNING):
        out = merge_adapter(base_dir, tmp_path / "old", tmp_path / "merged", dtype="fp32")
    assert "no trained rows for the new tokens in model.language_model.embed_tokens_per_layer.weight" in caplog.text
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    table = merged.get_per_layer_input_embeddings().weight
    assert table.shape == (ROWS, 16) and torch.equal(table[OLD:], mean_row.expand(ROWS - OLD, -1))
    assert torch.isfinite(_logits(merged)).all()


def test_plan_counts_the_grown_tables_and_their_trainable_rows(trained):
    """After chatml's resize (602 -> 608 rows): the planner's base count is the resized model's numel, and its
    trainable token rows are the tensors peft trains in each token table."""
    from transformers import AutoModelForCausalLM

    from shardtune.commands.plan import plan_shape
    from shardtune.planning import base_param_count
    from shardtune.planning.model import model_tensors

    config = FAMILIES["gemma4"].config(OLD)
    shape = plan_shape(config, "chatml")
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(FAMILIES["gemma4"].config(OLD))
    real.resize_token_embeddings(ROWS, mean_resizing=False)
    assert shape.vocab_size == shape.per_layer_vocab_size == ROWS
    assert base_param_count(shape) == sum(p.numel() for p in real.parameters())
    planned = {
        t.name.split(".")[0]: t.shape
        for t in model_tensors(shape, base_bytes=4, lora_targets=())
        if "trainable_tokens_delta" in t.name
    }
    peft = {
        n.split(".token_adapter")[0].rsplit(".", 1)[-1]: tuple(p.shape)
        for n, p in trained["model"].named_parameters()
        if "trainable_tokens_delta" in n
    }
    assert planned == peft == {"embed_tokens": (6, 64), "embed_tokens_per_layer": (6, 16)}


def test_plan_says_the_vision_tower_is_not_counted(caplog):
    import transformers
    from transformers import AutoModelForCausalLM

    from shardtune.commands.plan import plan_shape
    from shardtune.planning import base_param_count

    text = FAMILIES["gemma4"].config(OLD).text_config.to_dict()
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16,
    )  # fmt: skip
    config = transformers.Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=None)
    with torch.device("meta"):
        whole = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    with caplog.at_level(logging.WARNING):
        counted = base_param_count(plan_shape(config, "none"))
    tower = whole - counted
    assert tower > 0 and f"vision/audio towers ({tower / 1e6:.1f}M parameters" in caplog.text


def test_gemma3n_trains_the_per_layer_rows_of_old_ids_past_its_table(tmp_path):
    """Gemma 3n's per-layer table is shorter than the vocabulary (vocab_size_per_layer_input 600 of 604 tokens:
    ids 600-603 read row 0). transformers' resize grows it to the new vocabulary, so rows 600-607 are all new there:
    shardtune trains and saves them, and the reloaded adapter and the merged folder equal the trained model."""
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.commands.demo import build_tokenizer
    from shardtune.merge.fold import merge_adapter
    from shardtune.models import adapter, loading

    config = transformers.Gemma3nTextConfig(
        vocab_size=604, vocab_size_per_layer_input=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size_per_layer_input=8, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, laurel_rank=4,
        altup_num_inputs=2, activation_sparsity_pattern=[0.0, 0.0], pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "base")
    base = loading.load_base_model(
        str(tmp_path / "base"), dtype=torch.float32, attn_impl="sdpa", trust_remote_code=False, quantization_config=None
    )
    assert loading.resize_embeddings(base, 606) == ROWS
    model = adapter.attach_adapter(
        base, lora_r=4, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", use_dora=False,
        modules_to_save=None, new_token_ids=list(range(604, ROWS)),  # as the builder: every row the base lacks
    )  # fmt: skip
    spec = model.peft_config["default"].trainable_token_indices
    assert spec == {"embed_tokens": list(range(604, ROWS)), "embed_tokens_per_layer": list(range(600, ROWS))}
    _train_and_save(model, build_tokenizer(tmp_path / "tok", vocab_size=600), tmp_path / "out")
    ids = torch.tensor([[1, 40, 599, 600, 603, 604, 607, 9]])
    trained = _logits(model.eval(), ids)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    reloaded.resize_token_embeddings(ROWS)
    reloaded = PeftModel.from_pretrained(reloaded, tmp_path / "out").eval()
    assert torch.equal(_per_layer(reloaded), _per_layer(model))  # every row the resize drew, as trained
    out = merge_adapter(tmp_path / "base", tmp_path / "out", tmp_path / "merged", dtype="fp32")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert json.loads((out / "config.json").read_text())["vocab_size_per_layer_input"] == ROWS
    chain = decoder_chain(hidden=64, intermediate=128, layers=2, seq=ids.shape[1])  # fp32, the widest sum is 128
    assert _rel_error(_logits(reloaded, ids), trained) <= tol(torch.float32, chain)
    assert _rel_error(_logits(merged, ids), trained) <= tol(torch.float32, chain)
