"""4-bit bases: flag checks, the tensor-by-tensor quantizing loader against transformers', FSDP preparation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardtune.config.errors import ConfigError
from shardtune.config.precision import resolve_precision
from shardtune.models import loading, quant
from shardtune.recipe.run_config import load_run_config

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def qmodel(tmp_path_factory):
    """A tiny Llama to quantize (2 layers, widths 64 and 128)."""
    from shardtune.commands.demo import build_model

    path = tmp_path_factory.mktemp("qmodel")
    build_model(path, vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return path


def _bnb(quant_type="nf4", nested=True, storage=torch.bfloat16, compute=torch.bfloat16):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_quant_storage=storage,
        bnb_4bit_compute_dtype=compute,
    )


def _load(path, qcfg, dtype, on_meta=False):
    return loading.load_base_model(
        str(path), quantization_config=qcfg, dtype=dtype, attn_impl="sdpa", trust_remote_code=False, on_meta=on_meta
    )


def _problems(**kw):
    args = {
        "use_4bit": True,
        "use_8bit": False,
        "quant_storage_dtype": "bfloat16",
        "bf16": True,
        "fp16": False,
        "fsdp_enabled": True,
        "mixed_precision": "no",
        **kw,
    }
    flags = {k: args.pop(k) for k in ("bf16", "fp16", "mixed_precision")}
    return quant.quantization_problems(**args, precision=resolve_precision(**flags))


def test_accepted_combinations_have_no_problems():
    assert _problems() == []
    assert _problems(quant_storage_dtype="bf16", bf16=False, mixed_precision="bf16") == []
    assert _problems(quant_storage_dtype="float32", bf16=False) == []
    assert _problems(quant_storage_dtype="float16", bf16=False, fp16=True) == []
    # Without FSDP, FSDP2's single-rank wrapper never casts integer parameters, nor anything when computing in fp32.
    assert _problems(quant_storage_dtype="uint8", fsdp_enabled=False) == []
    assert _problems(quant_storage_dtype="bfloat16", bf16=False, fsdp_enabled=False) == []
    assert _problems(use_4bit=False, quant_storage_dtype="uint8") == []


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {"quant_storage_dtype": "uint8"},
            ["uint8", "cannot be used under FSDP", "--bnb_4bit_quant_storage_dtype bfloat16"],
        ),
        (
            {"quant_storage_dtype": "float32"},
            ["float32 differs", "bfloat16", "--bf16 True", "neither --bf16 nor --fp16"],
        ),
        ({"quant_storage_dtype": "bfloat16", "bf16": False, "fp16": True}, ["--bnb_4bit_quant_storage_dtype float16"]),
        ({"quant_storage_dtype": "float32", "fsdp_enabled": False}, ["FSDP would cast the packed 4-bit bytes"]),
        ({"quant_storage_dtype": "int4"}, ["'int4' is not a dtype", "bfloat16"]),
        (
            {"use_4bit": False, "use_8bit": True},
            ["--use_8bit_quantization is not supported", "--use_4bit_quantization True"],
        ),
    ],
)
def test_wrong_combinations_name_the_flags_to_set(kw, expected):
    problems = _problems(**kw)
    assert len(problems) == 1
    for text in expected:
        assert text in problems[0]


def test_config_refuses_before_loading(tmp_path, qmodel):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    argv = ["--model_name_or_path", str(qmodel), "--dataset_name", str(data), "--use_peft_lora", "True"]
    env = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}
    with pytest.raises(ConfigError) as e:
        load_run_config([*argv, "--use_4bit_quantization", "True"], env=env)
    assert "--bnb_4bit_quant_storage_dtype uint8 (the default) cannot be used under FSDP" in str(e.value)
    assert "--bnb_4bit_quant_storage_dtype bfloat16" in str(e.value)
    with pytest.raises(ConfigError, match="--use_8bit_quantization is not supported"):
        load_run_config([*argv, "--use_8bit_quantization", "True"], env=env)
    cfg = load_run_config(
        [*argv, "--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16"], env=env
    )
    assert cfg.model.use_4bit_quantization


@pytest.mark.parametrize(
    ("quant_type", "nested", "dtype"),
    [("nf4", True, torch.bfloat16), ("fp4", False, torch.float32)],
)
def test_loader_matches_transformers_from_pretrained(qmodel, quant_type, nested, dtype):
    from transformers import AutoModelForCausalLM

    qcfg = _bnb(quant_type, nested, storage=dtype, compute=dtype)
    ours = _load(qmodel, qcfg, dtype)
    ref = AutoModelForCausalLM.from_pretrained(
        str(qmodel), quantization_config=_bnb(quant_type, nested, dtype, dtype), dtype=dtype
    )
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    n_packed = 0
    for k, v in ref_sd.items():
        assert ours_sd[k].dtype == v.dtype, k
        # Bitwise: packed weights, absmax, nested constants and the packed quant-state blob alike.
        assert torch.equal(ours_sd[k].view(torch.uint8), v.view(torch.uint8)), k
        n_packed += k.endswith("proj.weight")
    assert n_packed == 2 * 7
    layer = ours.model.layers[0].mlp.down_proj
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.quant_state.quant_type == quant_type
    assert layer.weight.numel() * layer.weight.element_size() == 64 * 128 // 2  # two 4-bit values a byte
    assert not isinstance(ours.lm_head, bnb.nn.Linear4bit)  # the output head stays unquantized, as in transformers
    assert ours.is_loaded_in_4bit and ours.config.quantization_config.bnb_4bit_quant_type == quant_type


def test_meta_skeleton_has_the_shapes_rank0_sends(qmodel):
    real = _load(qmodel, _bnb(), torch.bfloat16)
    meta = _load(qmodel, _bnb(), torch.bfloat16, on_meta=True)
    real_layers, meta_layers = dict(quant.linear4bit_modules(real)), dict(quant.linear4bit_modules(meta))
    assert real_layers.keys() == meta_layers.keys() and len(real_layers) == 14
    for name, r in real_layers.items():
        m = meta_layers[name]
        assert m.weight.is_meta and (m.weight.shape, m.weight.dtype) == (r.weight.shape, r.weight.dtype)
        rs, ms = quant.quant_state_tensors(r.quant_state), quant.quant_state_tensors(m.quant_state)
        assert [(getattr(h, a).shape, getattr(h, a).dtype) for h, a in rs] == [
            (getattr(h, a).shape, getattr(h, a).dtype) for h, a in ms
        ]
        assert (m.quant_state.shape, m.quant_state.dtype, m.quant_state.blocksize) == (
            r.quant_state.shape,
            r.quant_state.dtype,
            r.quant_state.blocksize,
        )


def test_prepared_layers_keep_their_output(qmodel):
    model = _load(qmodel, _bnb(), torch.bfloat16).eval()
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert quant.prepare_for_fsdp(model, torch.bfloat16) == 14
    layer = model.model.layers[1].self_attn.o_proj
    assert type(layer.weight) is torch.nn.Parameter and layer.quant_state is not None
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # bitsandbytes rebuilt each weight's Params4bit from the state kept on its layer: the same numbers exactly.
    assert torch.equal(before, after)
    _, total = loading.count_parameters(model)
    assert total == sum(p.numel() for p in _plain_params(qmodel))  # values, not packed bytes


def _plain_params(path):
    return load_file(str(path / "model.safetensors")).values()


def test_prepare_refuses_storage_fsdp_would_cast(qmodel):
    model = _load(qmodel, _bnb(storage=torch.float32, compute=torch.float32), torch.float32)
    with pytest.raises(ValueError, match="set --bnb_4bit_quant_storage_dtype to bfloat16"):
        quant.prepare_for_fsdp(model, torch.bfloat16)


def test_loader_ties_embeddings_and_names_missing_weights(tmp_path):
    from shardtune.commands.demo import build_model

    tied = tmp_path / "tied"
    build_model(
        tied,
        vocab_size=128,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    model = _load(tied, _bnb(), torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    sd = load_file(str(tied / "model.safetensors"))
    sd["model.layers.0.mlp.gate.weight"] = sd.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(sd, str(tied / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of the model's weights.*gate_proj.*mlp\.gate\.weight"):
        _load(tied, _bnb(), torch.bfloat16)
