"""`shardtune merge`: the merged folder must compute what PeftModel(base, adapter) computes, shard by shard."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from shardtune.commands import merge
from shardtune.commands.demo import build_model, build_tokenizer
from shardtune.merge import fold
from shardtune.merge import plan as merge_plan
from shardtune.models import weights
from tests.tolerance import decoder_chain, tol, tol_rounding

VOCAB = 300
SHARD = "16KB"  # the tiny Llama is ~150 KB in fp32: about ten base shards
INPUT_IDS = torch.tensor([[1, 5, 17, 42, 250, 299, 3, 8], [1, 301, 302, 7, 9, 300, 11, 12]])
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save_sharded(model_dir: Path, tie: bool) -> Path:
    build_model(model_dir, vocab_size=VOCAB, hidden_size=32, num_layers=2, tie_word_embeddings=tie, seed=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for f in model_dir.glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(model_dir, max_shard_size=SHARD)
    return model_dir


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out = {"untied": _save_sharded(root / "untied", False), "tied": _save_sharded(root / "tied", True)}
    tok = build_tokenizer(root / "tok", vocab_size=VOCAB)
    for d in out.values():
        tok.save_pretrained(d)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=2)
    )
    gpt2.save_pretrained(root / "gpt2", max_shard_size=SHARD)
    out["gpt2"] = root / "gpt2"
    return out


def make_adapter(base_dir: Path, out: Path, config, resize: int | None = None, seed: int = 0) -> Path:
    """A PEFT adapter whose every trainable tensor (LoRA A/B, DoRA magnitude, tokens, saved modules) is perturbed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if resize:
        model.resize_token_embeddings(resize, mean_resizing=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for _, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    peft_model.save_pretrained(out)
    return out


def peft_logits(base_dir: Path, adapter_dir: Path, resize: int | None = None) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if resize:
        model.resize_token_embeddings(resize, mean_resizing=False)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = INPUT_IDS.clamp(max=model.get_input_embeddings().weight.shape[0] - 1)
    with torch.no_grad():
        return model(ids).logits


def merged_logits(out: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = INPUT_IDS.clamp(max=model.get_input_embeddings().weight.shape[0] - 1)
    with torch.no_grad():
        return model(ids).logits


def assert_merged_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Merged weights (W + s·B·A: one more sum, over r ≤ 8) through the forward of the test bases (hidden up to 64,
    MLP up to 128 wide, up to 3 layers) over INPUT_IDS' positions, vs the adapter applied on the fly: the same sums
    in another order (tests/tolerance.py), relative to the logits' size."""
    chain = decoder_chain(hidden=64, intermediate=128, layers=3, seq=INPUT_IDS.shape[-1]) + 8
    torch.testing.assert_close(got, want, rtol=0, atol=tol(torch.float32, chain, float(want.abs().max())))


def shard_names(folder: Path) -> dict[str, str]:
    names = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names.update(dict.fromkeys(sf.keys(), f.name))
    return names


LORA = {"r": 4, "lora_alpha": 8}
CASES = {  # LoraConfig arguments, and the vocabulary the embedding is resized to before training
    "lora": ({**LORA, "target_modules": ALL_LINEAR}, None),
    "dora": ({**LORA, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True}, None),
    "rslora": ({"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "up_proj"], "use_rslora": True}, None),
    "patterns": (
        {
            **LORA,
            "target_modules": ["q_proj", "v_proj"],
            "rank_pattern": {"q_proj": 2},
            "alpha_pattern": {"layers.1.self_attn.v_proj": 32},
        },
        None,
    ),
    "modules_to_save": ({**LORA, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, None),
    "embedding_lora": ({**LORA, "target_modules": ["embed_tokens", "lm_head", "o_proj"]}, None),
    "trainable_tokens": ({**LORA, "target_modules": ["q_proj"], "trainable_token_indices": [3, 5, 300, 302]}, 304),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_model_matches_peft_model_untied(bases, tmp_path, case):
    kwargs, resize = CASES[case]
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(**kwargs), resize=resize)
    out = fold.merge_adapter(bases["untied"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    expected = peft_logits(bases["untied"], adapter, resize)
    got = merged_logits(out)
    assert got.shape == expected.shape
    assert_merged_close(got, expected)
    # The adapter really changed the model, so the comparison above means something.
    base_logits = merged_logits(bases["untied"]) if not resize else None
    if base_logits is not None:
        assert (base_logits - expected).abs().max() > 1e-2
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == (resize or VOCAB)
    assert config["dtype"] == "float32"


@pytest.mark.parametrize("case", ["trainable_tokens", "embedding_lora", "modules_to_save", "lora"])
def test_merged_model_matches_peft_model_tied(bases, tmp_path, case):
    kwargs, resize = CASES[case]
    adapter = make_adapter(bases["tied"], tmp_path / "adapter", LoraConfig(**kwargs), resize=resize)
    out = fold.merge_adapter(bases["tied"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    assert_merged_close(merged_logits(out), peft_logits(bases["tied"], adapter, resize))
    config = json.loads((out / "config.json").read_text())
    names = shard_names(out)
    # Tied token edits leave both ends equal, so the merged model stays tied; a LoRA on the embedding alone, or
    # a trained lm_head copy, leaves the output head different from the embedding, which must then be untied.
    stays_tied = case in ("trainable_tokens", "lora")
    assert config["tie_word_embeddings"] is stays_tied
    assert ("lm_head.weight" in names) is (not stays_tied)


def test_gpt2_conv1d_fan_in_fan_out_and_lora_bias(bases, tmp_path):
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_bias=True)
    adapter = make_adapter(bases["gpt2"], tmp_path / "adapter", cfg)
    out = fold.merge_adapter(bases["gpt2"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    assert_merged_close(merged_logits(out), peft_logits(bases["gpt2"], adapter))


def test_gpt2_dora_fan_in_fan_out(bases, tmp_path):
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=True)
    adapter = make_adapter(bases["gpt2"], tmp_path / "adapter", cfg)
    out = fold.merge_adapter(bases["gpt2"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    assert_merged_close(merged_logits(out), peft_logits(bases["gpt2"], adapter))


def test_bf16_output_and_tokenizer_from_adapter(bases, tmp_path):
    kwargs, resize = CASES["trainable_tokens"]
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(**kwargs), resize=resize)
    tok = AutoTokenizer.from_pretrained(bases["untied"])
    tok.add_special_tokens({"additional_special_tokens": ["<|a|>", "<|b|>", "<|c|>", "<|d|>"]})
    tok.save_pretrained(adapter)
    out = fold.merge_adapter(bases["untied"], adapter, tmp_path / "merged", dtype="bf16", max_shard_size=SHARD)
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # bf16 keeps 8 bits of significand: each merged weight is rounded once (u = 2^-8), the forward itself runs in
    # fp32. One rounding per weight matrix along the chain (the embedding, 7 per layer, the head: 16), on the
    # merged side only (tests/tolerance.py), relative to the logits' size.
    want = peft_logits(bases["untied"], adapter, resize)
    diff = (merged_logits(out) - want).abs().max().item()
    assert 0 < diff <= tol_rounding(torch.bfloat16, 16, one_sided=True, scale=float(want.abs().max()))
    assert len(AutoTokenizer.from_pretrained(out)) == VOCAB + 4
    assert (out / "generation_config.json").exists()


def test_index_lists_every_tensor_and_shards_respect_the_size(bases, tmp_path):
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(r=4, target_modules=ALL_LINEAR))
    out = fold.merge_adapter(bases["untied"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    on_disk = shard_names(out)
    assert index["weight_map"] == on_disk
    assert len(set(on_disk.values())) >= 2
    model_keys = set(AutoModelForCausalLM.from_pretrained(bases["untied"]).state_dict())
    assert set(on_disk) == model_keys
    sizes = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            sizes[f.name] = sum(sf.get_tensor(k).nbytes for k in sf.keys())  # noqa: SIM118
    assert index["metadata"]["total_size"] == sum(sizes.values())
    biggest_tensor = VOCAB * 32 * 4
    assert all(s <= max(16_000, biggest_tensor) for s in sizes.values())


def test_streams_one_base_shard_at_a_time(bases, tmp_path, monkeypatch):
    """Evidence for the memory bound: one base shard open at a time, each output written before the next opens."""
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(r=4, target_modules=ALL_LINEAR))
    events: list[tuple[str, str]] = []
    open_now = []
    real_open, real_save = weights.open_shard, weights.write_safetensors

    class CountingOpen:
        def __init__(self, path):
            self.path, self.inner = path, real_open(path)

        def __enter__(self):
            open_now.append(self.path)
            assert len(open_now) == 1, f"two base shards open at once: {open_now}"
            events.append(("open", self.path.name))
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now.remove(self.path)
            return self.inner.__exit__(*exc)

    def counting_save(tensors, path):
        assert len(open_now) == 1
        events.append(("save", open_now[0].name))
        real_save(tensors, path)

    monkeypatch.setattr(weights, "open_shard", CountingOpen)
    monkeypatch.setattr(weights, "write_safetensors", counting_save)
    fold.merge_adapter(bases["untied"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    base_shards = sorted(p.name for p in bases["untied"].glob("model-*.safetensors"))
    opened = [name for kind, name in events if kind == "open"]
    assert opened == base_shards  # each base shard read exactly once, in order
    # Every base shard's output is saved while that shard is open, before the next one is opened.
    for name in base_shards:
        assert ("save", name) in events
        assert events.index(("save", name)) < (
            events.index(("open", base_shards[base_shards.index(name) + 1])) if name != base_shards[-1] else len(events)
        )


def _tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        h.update(f.name.encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def test_failure_mid_merge_leaves_existing_output_untouched(bases, tmp_path, monkeypatch):
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(r=4, target_modules=ALL_LINEAR))
    out = fold.merge_adapter(bases["untied"], adapter, tmp_path / "merged", max_shard_size=SHARD)
    before = _tree_digest(out)
    other = make_adapter(bases["untied"], tmp_path / "other", LoraConfig(r=4, target_modules=ALL_LINEAR), seed=5)
    calls = {"n": 0}
    real_apply = fold.apply_edit

    def failing_apply(*args):
        calls["n"] += 1
        if calls["n"] == 15:  # after several output shards were written
            raise RuntimeError("disk full")
        return real_apply(*args)

    monkeypatch.setattr(fold, "apply_edit", failing_apply)
    with pytest.raises(RuntimeError, match="disk full"):
        fold.merge_adapter(bases["untied"], other, out, max_shard_size=SHARD)
    assert _tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged", "other"]
    monkeypatch.setattr(fold, "apply_edit", real_apply)
    fold.merge_adapter(bases["untied"], other, out, max_shard_size=SHARD)  # a good run replaces it
    assert _tree_digest(out) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged", "other"]
    assert_merged_close(merged_logits(out), peft_logits(bases["untied"], other))


def test_refuses_to_replace_a_folder_that_is_not_a_model(bases, tmp_path):
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(r=4, target_modules=["q_proj"]))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"holds files a merge does not write \(todo\.txt\)"):
        fold.merge_adapter(bases["untied"], adapter, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_errors_name_the_problem(bases, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        fold.merge_adapter(bases["untied"], tmp_path, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(bases["untied"])
    get_peft_model(
        model, IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    ).save_pretrained(tmp_path / "ia3")
    with pytest.raises(ValueError, match="is a IA3 adapter; shardtune merge supports LoRA"):
        fold.merge_adapter(bases["untied"], tmp_path / "ia3", tmp_path / "out")
    # An adapter for a 3-layer model has keys for layers.2, which the 2-layer base does not have.
    build_model(tmp_path / "deeper", vocab_size=VOCAB, hidden_size=32, num_layers=3)
    make_adapter(tmp_path / "deeper", tmp_path / "deep_adapter", LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(
        ValueError, match=r"another base .*belongs to model\.layers\.2\.self_attn\.q_proj, which the base does not have"
    ):
        fold.merge_adapter(bases["untied"], tmp_path / "deep_adapter", tmp_path / "out")
    # A wider model: same names, wrong shapes.
    build_model(tmp_path / "wider", vocab_size=VOCAB, hidden_size=64, num_layers=2)
    make_adapter(tmp_path / "wider", tmp_path / "wide_adapter", LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(
        ValueError,
        match=r"another base .*expects in_features 64 but the base's model\.layers\.0\.self_attn\.q_proj \(32 x 32\) has 32",
    ):
        fold.merge_adapter(bases["untied"], tmp_path / "wide_adapter", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_lora_variants_that_do_not_merge_linearly_are_refused(bases, tmp_path):
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(r=4, target_modules=["q_proj"]))
    config_path = adapter / "adapter_config.json"
    plain = json.loads(config_path.read_text())
    for option, value in (("alora_invocation_tokens", [5, 6]), ("use_qalora", True), ("init_lora_weights", "mica")):
        config_path.write_text(json.dumps({**plain, option: value}))
        with pytest.raises(ValueError, match=f"uses {option}.*does not support"):
            fold.merge_adapter(bases["untied"], adapter, tmp_path / "out")


def test_live_state_dict_keys_with_adapter_names_group_like_saved_ones(bases):
    model = AutoModelForCausalLM.from_pretrained(bases["untied"])
    cfg = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, modules_to_save=["lm_head"])
    live = {k: v for k, v in get_peft_model(model, cfg).state_dict().items() if "lora_" in k or "modules_to_" in k}
    assert any(".default." in k for k in live)
    groups = merge_plan.parse_keys(live)
    assert set(groups["model.layers.0.self_attn.q_proj"]) == {"A", "B", "magnitude"}
    assert set(groups["lm_head.weight"]) == {"replace"}
    assert len(groups) == 3


def test_cli(bases, tmp_path, capsys):
    adapter = make_adapter(bases["untied"], tmp_path / "adapter", LoraConfig(r=4, target_modules=["q_proj"]))
    rc = merge.main(
        [
            "--base",
            str(bases["untied"]),
            "--adapter",
            str(adapter),
            "--output_dir",
            str(tmp_path / "m"),
            "--dtype",
            "fp16",
            "--max_shard_size",
            "1MB",
        ]
    )
    assert rc == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float16"
    # Output shards never span two base shards (that would hold two in memory), so a large limit keeps the base's.
    n_base = len(list(bases["untied"].glob("*.safetensors")))
    assert len(list((tmp_path / "m").glob("model-*-of-*.safetensors"))) == n_base
    assert merge.main(["--help"]) == 0
    assert "--max_shard_size" in capsys.readouterr().out
    assert merge.main(["--base", str(bases["untied"]), "--adaptr", "x"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --adapter?" in err and "--output_dir is required" in err
    assert (
        merge.main(["--base", str(bases["untied"]), "--adapter", str(tmp_path), "--output_dir", "o"]) == 2
    )  # bad input
    assert "no adapter_config.json" in capsys.readouterr().err


def test_qlora_adapter_merges_into_original_precision_base(bases, tmp_path):
    """A QLoRA adapter merged into the original weights differs from the 4-bit model it was trained on by about
    the base's own quantization error; merged into dequantized weights it matches that model but keeps the error."""
    from transformers import BitsAndBytesConfig

    # bitsandbytes' CPU kernels want every in_features to be a multiple of its 64-wide blocks.
    base = tmp_path / "base"
    build_model(base, vocab_size=VOCAB, hidden_size=64, num_layers=2, intermediate_size=128, seed=3)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)

    def load_4bit():
        return AutoModelForCausalLM.from_pretrained(base, quantization_config=bnb, device_map="cpu")

    torch.manual_seed(0)
    qmodel = get_peft_model(load_4bit(), LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR))
    with torch.no_grad():
        for _, p in qmodel.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    qmodel.save_pretrained(tmp_path / "qlora")
    with torch.no_grad():
        trained_on = qmodel.eval()(INPUT_IDS[:1]).logits  # what the adapter saw in training
        quant_error = (load_4bit()(INPUT_IDS[:1]).logits - merged_logits(base)[:1]).abs().mean().item()
    dequantized = load_4bit().dequantize()
    dequantized.save_pretrained(tmp_path / "deq", max_shard_size=SHARD)

    to_original = fold.merge_adapter(base, tmp_path / "qlora", tmp_path / "m_orig")
    to_dequant = fold.merge_adapter(tmp_path / "deq", tmp_path / "qlora", tmp_path / "m_deq")
    gap_original = (merged_logits(to_original)[:1] - trained_on).abs().mean().item()
    gap_dequant = (merged_logits(to_dequant)[:1] - trained_on).abs().mean().item()
    print(
        f"mean |logit| {trained_on.abs().mean():.4f}; mean |logit gap|: base fp32 vs nf4 {quant_error:.4f}; "
        f"merged into original {gap_original:.4f}; "
        f"merged into dequantized {gap_dequant:.2e}"
    )
    assert gap_dequant < 0.05 * quant_error
    assert 0.3 * quant_error < gap_original < 3 * quant_error
    with pytest.raises(ValueError, match="is quantized"):
        qdir = tmp_path / "q4"
        load_4bit().save_pretrained(qdir)
        fold.merge_adapter(qdir, tmp_path / "qlora", tmp_path / "m_q4")
