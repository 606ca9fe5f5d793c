"""4-bit experts (QLoRA on a mixture of experts): every fused-expert family transformers ships, saved by
save_pretrained and read back by shardtune's 4-bit loader, computes the logits and input gradients of transformers'
own model holding the same (dequantized) weights; each expert's bytes are bitsandbytes' quantize_4bit of that
expert; a planted expert mix-up is seen. FSDP2 sharding and training are tests/distributed/test_qlora.py's."""

from __future__ import annotations

import pytest
import torch

from shardtune.models import adapter, loading, quant, targets
from shardtune.models.quant_experts import Experts4bit
from tests.unit.test_expert_lora import FUSED
from tests.unit.test_targets import _model, _one_thread  # noqa: F401 - the tiny models, one thread (autouse)

bnb = pytest.importorskip("bitsandbytes")


def _bnb(nested: bool):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=nested,
                              bnb_4bit_quant_storage=torch.float32, bnb_4bit_compute_dtype=torch.float32)  # fmt: skip


def _saved(model_type: str, tmp_path):
    model = _model(model_type)
    model.save_pretrained(tmp_path)
    return model


def _dequantized_reference(model, ours):
    """transformers' model (the tiny one as built) holding the weights shardtune's 4-bit model computes with."""
    sd = model.state_dict()
    for name, module in ours.named_modules():
        if isinstance(module, Experts4bit):
            sd[name] = module.dequantize()
        elif isinstance(module, bnb.nn.Linear4bit):
            sd[f"{name}.weight"] = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
    model.load_state_dict(sd)
    return model


def _logits_and_input_grad(model, ids):
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), embeds.grad


# Llama 4's experts compute in their own code (a bmm over all experts), not through transformers' experts interface.
OWN_FORWARD = ("llama4_text",)


@pytest.mark.parametrize("model_type", [t for t in FUSED if t not in OWN_FORWARD])
def test_4bit_experts_compute_what_transformers_computes_with_the_same_weights(model_type, tmp_path):
    ref = _saved(model_type, tmp_path)
    ours = loading.load_base_model(str(tmp_path), quantization_config=_bnb(nested=model_type != "mixtral"),
                                    dtype=torch.float32, attn_impl="eager", trust_remote_code=False)  # fmt: skip
    holders = {n: m for n, m in ours.named_modules() if isinstance(m, Experts4bit)}
    fused = targets.expert_parameters(ref)
    assert sorted(holders) == sorted(fused) and not targets.expert_parameters(ours)
    # Expert e's bytes are bitsandbytes' own quantization of the stored expert e (in the (out, in) orientation).
    name, holder = next(iter(holders.items()))
    e = holder.num_experts - 1
    w = ref.get_parameter(name)[e].detach()
    packed, state = bnb.functional.quantize_4bit((w.T if holder.transposed else w).contiguous(), blocksize=64,
                                                 compress_statistics=holder.quant_state.nested, quant_type="nf4",
                                                 quant_storage=torch.float32)  # fmt: skip
    assert torch.equal(holder.weight[e].view(torch.int32), packed.reshape(-1).view(torch.int32))  # bytes, not floats
    theirs = bnb.functional.dequantize_4bit(packed, state)  # and its stacked state is bitsandbytes' state of e
    assert torch.equal(holder.dequantize()[e], theirs.T if holder.transposed else theirs)
    ref = _dequantized_reference(ref, ours)
    ids = torch.randint(5, 120, (2, 12), generator=torch.Generator().manual_seed(0))
    want_logits, want_grad = _logits_and_input_grad(ref, ids)
    got_logits, got_grad = _logits_and_input_grad(ours, ids)
    # fp32, the same products summed in the same order per expert; 8 ulps of the largest value covers a different
    # accumulation order inside the matmul kernels (measured: equal to the bit on this CPU).
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=8 * eps * float(want_logits.abs().max()))
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=8 * eps * float(want_grad.abs().max()))
    # Negative control: expert 0 computing with expert 1's bytes moves the logits far outside that bound.
    holder.weight.data[0] = holder.weight.data[1]
    with torch.no_grad():
        planted = ours(input_ids=ids).logits
    assert (planted - want_logits).abs().max() > 1e3 * eps * float(want_logits.abs().max())


def test_the_4bit_skeleton_has_the_shapes_of_the_loaded_model(tmp_path):
    """Ranks that receive their shards build the 4-bit experts on meta: the same packed and state shapes as the
    model rank 0 reads, nested statistics included."""
    _saved("qwen3_moe", tmp_path)
    kw = {"quantization_config": _bnb(nested=True), "dtype": torch.float32, "attn_impl": "eager",
          "trust_remote_code": False}  # fmt: skip
    real = loading.load_base_model(str(tmp_path), **kw)
    meta = loading.load_base_model(str(tmp_path), on_meta=True, **kw)

    def shapes(model):
        out = {}
        for name, module in quant.packed_modules(model):
            out[name] = [tuple(module.weight.shape), module.weight.dtype]
            out[name] += [tuple(getattr(h, a).shape) for h, a in quant.quant_state_tensors(module.quant_state)]
        return out

    assert shapes(meta) == shapes(real) and any(".experts." in n for n in shapes(real))


def test_an_incomplete_expert_checkpoint_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved("qwen3_moe", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    gone = next(k for k in tensors if ".experts.1.up_proj" in k)
    del tensors[gone]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the checkpoint holds \d of the 4 experts of model\.layers\.\d+\.mlp\."
                                         r"experts\.gate_up_proj \(1 expert tensors incomplete\)"):  # fmt: skip
        loading.load_base_model(str(tmp_path), quantization_config=_bnb(nested=False), dtype=torch.float32,
                                 attn_impl="eager", trust_remote_code=False)  # fmt: skip


def test_experts_outside_transformers_experts_interface_are_refused_before_loading(tmp_path):
    model = _saved("llama4_text", tmp_path)
    with pytest.raises(ValueError, match=r"--use_4bit_quantization: Llama4TextExperts \(model\.layers\.0\.feed_forward"
                                         r"\.experts\) computes its experts in its own code"):  # fmt: skip
        loading.check_4bit_layout(model.config, model)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_on_4bit_experts_equals_peft_on_the_same_weights(model_type, tmp_path):
    """--lora_target_experts on a 4-bit base: PEFT's ParamWrappers (same names, shapes and layout as on a 16-bit
    base, so the adapter reloads there) with each expert's LoRA applied beside its 4-bit matmul; logits and every
    LoRA gradient equal PEFT's own expert LoRA on transformers' model holding the dequantized weights; with the
    adapters disabled (a preference objective's reference) the base's logits. GPT-OSS: experts stored (E, in, out)."""
    from peft.tuners.lora import ParamWrapper

    ref = _saved(model_type, tmp_path)
    ours = loading.load_base_model(str(tmp_path), quantization_config=_bnb(nested=True), dtype=torch.float32,
                                    attn_impl="eager", trust_remote_code=False)  # fmt: skip
    ref = _dequantized_reference(ref, ours)
    kw = {"lora_r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": "all-linear", "use_dora": False,
          "modules_to_save": None, "new_token_ids": [], "target_experts": True}  # fmt: skip
    ours = adapter.attach_adapter(ours, **kw)
    ref = adapter.attach_adapter(ref, **kw)
    wrappers = [n for n, m in ours.named_modules() if isinstance(m, ParamWrapper)]
    assert wrappers == [n for n, m in ref.named_modules() if isinstance(m, ParamWrapper)] and wrappers
    assert {k: v.shape for k, v in ours.state_dict().items() if "lora_" in k} == {
        k: v.shape for k, v in ref.state_dict().items() if "lora_" in k
    }
    with torch.no_grad():  # B starts at zero: the same random values on both, so every expert's LoRA counts
        gen = torch.Generator().manual_seed(1)
        for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
            if "lora_" in name:
                a.copy_(torch.randn(a.shape, generator=gen) * 0.1)
                b.copy_(a)
    ids = torch.randint(5, 120, (2, 12), generator=torch.Generator().manual_seed(0))
    got, want = ours(input_ids=ids).logits, ref(input_ids=ids).logits
    eps = torch.finfo(torch.float32).eps
    # fp32: x·(W + s·B·A)ᵀ (PEFT) against x·Wᵀ + s·(x·Aᵀ)·Bᵀ (shardtune), a few roundings apart per product
    # through two blocks: measured 3.5-4.4 ulps of the largest logit and 8.4-9.6 of the largest LoRA gradient
    # (Qwen3-MoE, GPT-OSS); 64 leaves a 6x margin, and the planted misread layout (expert_lora_4bit_layout) fails.
    torch.testing.assert_close(got, want, rtol=0, atol=64 * eps * float(want.abs().max()))
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    lora = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n and ".experts." in n}
    assert lora and all(g is not None and g.abs().max() > 0 for g in lora.values())
    for name, grad in lora.items():
        mine = ours.get_parameter(name).grad
        torch.testing.assert_close(mine, grad, rtol=0, atol=64 * eps * float(grad.abs().max()), msg=name)
    with torch.no_grad(), ours.disable_adapter(), ref.disable_adapter():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0,
                                   atol=8 * eps * float(want.abs().max()))  # fmt: skip


def test_a_conversion_the_loader_cannot_invert_is_refused(monkeypatch):
    """Stacking experts (and concatenating gate and up along dim 1) is the one conversion inverted; anything else
    a family's checkpoint needs while loading is refused before reading, naming the tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    model = _model("qwen3_moe")
    loading.check_4bit_layout(model.config, model)  # transformers' own rule for Qwen3-MoE: accepted
    other = WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                            "mlp.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=2)])  # fmt: skip
    monkeypatch.setattr(loading, "layout_conversions", lambda config: [other])
    with pytest.raises(ValueError, match=r"checkpoints store mlp\.experts\.\*\.gate_proj\.weight, mlp\.experts\.\*"
                                         r"\.up_proj\.weight that transformers converts into mlp\.experts\.gate_up_proj"
                                         r" while loading in a way shardtune's 4-bit loader cannot invert"):  # fmt: skip
        loading.check_4bit_layout(model.config)
