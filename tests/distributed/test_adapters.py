"""Adapters on a sharded model: switching and disabling (2 ranks vs unsharded), and the helpers' user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.models import dora
from shardtune.parallel import adapters
from tests.conftest import ROOT, _free_port, run_cli
from tests.e2e.test_merge_after_training import _eval_loss, _peft_model
from tests.parity import assert_runs_match
from tests.tolerance import TINY, TINY_VOCAB, decoder_chain, tol, tol_rounding, train_parity

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
}

WORKER = Path(__file__).with_name("adapters_worker.py")


def _make_adapters(base: Path, out: Path) -> Path:
    """Adapter `a`: LoRA on every linear plus a trained lm_head (modules_to_save); `b`: DoRA. Non-zero weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for seed, (name, use_dora, mts) in enumerate([("a", False, ["lm_head"]), ("b", True, None)]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        cfg = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules="all-linear",
            use_dora=use_dora,
            modules_to_save=mts,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, cfg)
        if mts:
            with torch.no_grad():
                peft_model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
        peft_model.save_pretrained(out / name)
    return out


@pytest.fixture(scope="module")
def two_adapters(tiny_assets, tmp_path_factory) -> Path:
    return _make_adapters(tiny_assets["model"], tmp_path_factory.mktemp("adapters"))


def test_switching_and_disabling_on_two_ranks_match_unsharded(tiny_assets, two_adapters, tmp_path):
    out = tmp_path / "result"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(tiny_assets["model"]), str(two_adapters), str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    # Sharded vs unsharded fp32: the same sums in another order. Logits of 2×12 tokens: the forward chain; b's
    # gradients: two forward+backward passes over 24 targets, accumulated. The bound is the typical (8σ, sqrt K)
    # rounding difference of those chains (tests/tolerance.py), relative to the largest value compared; measured
    # on AMD EPYC AVX-512: logits 6e-7 (24x inside), gradients 1.5e-6 (16x inside), both well above 0 only for
    # adapter b, whose sharded DoRA forward is shardtune's own.
    logit_chain = decoder_chain(**TINY, seq=12)
    grad_chain = decoder_chain(**TINY, seq=12, vocab=TINY_VOCAB, tokens=24, backward=True) + 1
    logit_tol, grad_tol = tol_rounding(torch.float32, logit_chain), tol_rounding(torch.float32, grad_chain)
    for rank in (0, 1):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert r["world_size"] == 2 and r["fast_dora_layers"] == 2 * 7
        assert r["flags_at_start_match_ref"]
        assert r["mts_rows"] == [600, 300]
        # The three settings give clearly different outputs...
        assert r["gap_a_base"] > 1e-2 and r["gap_a_b"] > 1e-2
        # ...and the sharded model matches the unsharded one in each of them.
        for key in ("a", "disabled", "a_after_disabled", "using_b", "a_after_using"):
            assert r[key] <= logit_tol * r["logit_scale"], (rank, key, r[key])
        assert r["flags_after_disabled_unchanged"] and r["flags_after_using_unchanged"]
        assert r["active_inside"] == "b" and r["active_after_using"] == "a"
        # Switching to `b` for training after an eval forward: exactly b's weights train, on every block.
        assert r["trainable_after_switch"] == ["b"]
        assert r["flags_match_ref_after_switch"]
        assert r["n_b_params"] == 2 * 7 * 3  # lora_A, lora_B and the DoRA magnitude of 7 linears in 2 blocks
        assert r["b_grads_missing"] == [] and r["frozen_with_grads"] == []
        assert r["b_grad_min_norm"] > 0
        assert r["b_grad_diff"] <= grad_tol * r["b_grad_scale"], (rank, r["b_grad_diff"])
        assert r["b_grad_norm_rel"] <= grad_tol, (rank, r["b_grad_norm_rel"])
        # --adapter_path with meta loading on rank 1: the loaded adapter, trainable, and the base when disabled.
        bound = logit_tol * r["continued_scale"]
        assert r["continued"] <= bound and r["continued_disabled"] <= bound
        assert r["continued_trainable"] == 2 * 7 * 2 + 1  # lora_A/lora_B of 14 linears + lm_head


@pytest.fixture(scope="module")
def unsharded(tiny_assets, two_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.models.training_module import CausalLMForTraining

    base = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, two_adapters / "a", adapter_name="a", is_trainable=True)
    pm.load_adapter(two_adapters / "b", adapter_name="b")
    return CausalLMForTraining(pm)


def test_helpers_name_the_problem(tiny_assets, unsharded):
    from transformers import AutoModelForCausalLM

    assert list(adapters.peft_model_of(unsharded).peft_config) == ["a", "b"]
    with pytest.raises(ValueError, match=r"no adapter named 'c'.*loaded: a, b"):
        adapters.set_active_adapter(unsharded, "c")
    plain = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32)
    with pytest.raises(ValueError, match="holds no PEFT adapter.*--use_peft_lora True"):
        adapters.active_adapter(plain)
    layer = unsharded.model.base_model.model.model.layers[0].self_attn.q_proj
    layer.merge(adapter_names=["a"])
    try:
        with (
            pytest.raises(ValueError, match="merged into .*q_proj.*unmerge them first"),
            adapters.disabled_adapter(unsharded),
        ):
            pass
    finally:
        layer.unmerge()


def test_disabled_adapter_restores_frozen_flags(unsharded):
    """peft's own context manager would leave the active adapter trainable on exit, even if it was frozen."""
    unsharded.model.set_adapter("a", inference_mode=True)
    try:
        before = {n: p.requires_grad for n, p in unsharded.named_parameters()}
        assert not any(before.values())
        with adapters.disabled_adapter(unsharded):
            pass
        assert {n: p.requires_grad for n, p in unsharded.named_parameters()} == before
    finally:
        unsharded.model.set_adapter("a")


def _dora_args(assets, out: Path, batch: int, extra: tuple[str, ...] = ()) -> list[str]:
    args = ["train", "--model_name_or_path", str(assets["model"]), "--dataset_name", str(assets["data"])]
    args += ["--chat_template_format", "chatml", "--max_seq_len", "96", "--packing", "True", "--seed", "7"]
    args += ["--max_steps", "4", "--logging_steps", "1", "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine"]
    args += ["--warmup_steps", "0", "--save_strategy", "no", "--gradient_accumulation_steps", "2"]
    args += ["--gradient_checkpointing", "True", "--eval_strategy", "epoch", "--per_device_eval_batch_size", "4"]
    args += ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0"]
    args += ["--lora_target_modules", "all-linear", "--use_dora", "True"]
    return [*args, "--per_device_train_batch_size", str(batch), "--output_dir", str(out), *extra]


def test_dora_two_ranks_match_one_process_and_reload(tiny_assets, tmp_path):
    from transformers import AutoModelForCausalLM

    one, two = tmp_path / "one", tmp_path / "two"
    # The reference also names its adapter: the saved files do not depend on the name.
    run_cli(_dora_args(tiny_assets, one, 4, ("--adapter_name", "dora_one")), nproc=1, env=FSDP_ENV)
    run_cli(_dora_args(tiny_assets, two, 2, ("--merge_adapter", "True")), nproc=2, env=FSDP_ENV)
    a1 = load_file(one / "adapter_model.safetensors")
    magnitudes = [k for k in a1 if "lora_magnitude_vector" in k]
    assert len(magnitudes) == 2 * 7
    # A magnitude starts as the norm of its base weight's rows; with lora_B (from zero) it must have moved.
    base = load_file(tiny_assets["model"] / "model.safetensors")
    linear = {k: k.removeprefix("base_model.model.").split(".lora_magnitude_vector")[0] for k in magnitudes}
    start = {k: base[f"{name}.weight"].norm(dim=1) for k, name in linear.items()}
    # 4 steps of 2 micro-batches × 4 packed rows of 96 tokens, lr 3e-3 (_dora_args): loss, grad_norm, tensors.
    assert_runs_match(one, two, train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3), start=start)
    # Reloaded with PeftModel, each adapter reproduces the eval loss its run reported.
    for out in (one, two):
        summary = json.loads((out / "train_summary.json").read_text())
        peft_model = _peft_model(tiny_assets["model"], out)
        # The same weights through peft's modules instead of shardtune's: the eval chain over 24 rows of 96.
        rel = tol(torch.float32, decoder_chain(**TINY, seq=96, vocab=TINY_VOCAB, tokens=24 * 96))
        assert _eval_loss(tiny_assets, out, peft_model) == pytest.approx(summary["final_eval_loss"], rel=rel)
    # The merged DoRA model gives the PeftModel's logits.
    ids = torch.randint(3, 600, (2, 24), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(two / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    # Merged weights (one more sum per weight: W + s·B·A over r = 4) through the forward chain of 24 tokens.
    bound = tol(torch.float32, decoder_chain(**TINY, seq=24) + 4, float(want.abs().max()))
    assert float((got - want).abs().max()) < bound


def _dora_tol(dtype: torch.dtype) -> float:
    """Relative bound for test_fast_dora_matches_peft's two-layer net (48 → 80 → 32, r = 4): fp32, the chain of
    sums (each layer: the norm of W + s·B·A over its 48 or 80 inputs, x·W over them, the rank-4 path, and back
    again for the gradients, plus the loss over 3·7·32 outputs); bf16, the roundings of each stage's output
    (per layer: B·A, W + s·B·A, the norm, x·W, the rank-4 path, the scaling and the sum: 7; twice with
    backward), one each side, with peft's and shardtune's stages rounding different intermediate values."""
    if dtype == torch.float32:
        return tol(dtype, 2 * (2 * (48 + 48 + 4) + 2 * (80 + 80 + 4)) + 3 * 7 * 32)
    return tol_rounding(dtype, 2 * 2 * 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fast_dora_matches_peft(dtype, dropout):
    """Output and every gradient (input, lora_A, lora_B, magnitude) against peft's DoRA, with and without dropout,
    on layers with and without bias."""
    import copy

    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(48, 80, bias=True), nn.SiLU(), nn.Linear(80, 32, bias=False)).to(dtype)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0", "2"], use_dora=True)
    ref = get_peft_model(base, cfg)
    with torch.no_grad():  # train the adapter away from its init, so that every term of the forward matters
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.add_(0.3 * torch.randn_like(p))
    fast = copy.deepcopy(ref)
    assert dora.use_fast_dora(fast, peft_dropout=True) == 2 and dora.use_fast_dora(fast) == 0
    x = torch.randn(3, 7, 48, dtype=dtype)
    results = []
    for model in (ref, fast):
        xx = x.clone().requires_grad_(True)
        torch.manual_seed(1)  # the same dropout masks
        y = model(xx)
        y.float().square().sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((y.detach(), xx.grad, grads))
    (y_ref, gx_ref, g_ref), (y, gx, g) = results
    assert len(g_ref) == 6 and g.keys() == g_ref.keys()

    bound = _dora_tol(dtype)

    def close(got, want):
        err = float((got.float() - want.float()).abs().max())
        assert err <= bound * float(want.float().abs().max()), err

    close(y, y_ref)
    close(gx, gx_ref)
    for k in g_ref:
        close(g[k], g_ref[k])
    # Eval mode (no dropout): the same too.
    ref.eval()
    fast.eval()
    with torch.no_grad():
        close(fast(x), ref(x))


def test_fast_dora_lora_path_dropout_follows_its_formula():
    """--dora_dropout lora_path: y = g·(W·x) + b + g·s·B·A·dropout(x), g = m/‖W + s·B·A‖ (rows), one dropout draw;
    checked against that formula written out, output and gradients."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(48, 80, bias=True))
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["0"], use_dora=True)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.3 * torch.randn_like(p))
    assert dora.use_fast_dora(model) == 1
    layer = model.base_model.model[0]
    w, b = layer.base_layer.weight, layer.base_layer.bias
    a, bb = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    m, s = layer.lora_magnitude_vector["default"].weight, layer.scaling["default"]
    x = torch.randn(3, 7, 48)
    torch.manual_seed(1)
    y = model(x)
    torch.manual_seed(1)
    xd = torch.nn.functional.dropout(x, 0.3)
    g = m / torch.linalg.vector_norm(w + s * bb @ a, dim=1).detach()
    want = g * (x @ w.T) + b + g * s * (xd @ a.T @ bb.T)
    # One layer, 48 inputs, rank 4, in another order of sums; the gradients also sum over 3·7 rows and 80 outputs.
    forward = 48 + 48 + 4 + 4
    assert float((y - want).abs().max()) <= tol(torch.float32, forward, float(want.abs().max()))
    grads = torch.autograd.grad(y.square().sum(), [a, bb, m])
    want_grads = torch.autograd.grad(want.square().sum(), [a, bb, m])
    for got, exp in zip(grads, want_grads, strict=True):
        bound = tol(torch.float32, 2 * forward + 3 * 7 + 80, float(exp.abs().max()))
        assert float((got - exp).abs().max()) <= bound


def test_fast_dora_matches_peft_on_a_4bit_base():
    """QDoRA: the norm is taken over the dequantized weight, as peft does."""
    import copy

    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 96, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(96, 64) * 0.05, requires_grad=False, quant_type="nf4")
    model = nn.Sequential(layer).to("cpu")  # bitsandbytes quantizes when the weight is moved
    assert layer.weight.dtype == torch.uint8
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["0"], use_dora=True, init_lora_weights=False)
    ref = get_peft_model(model, cfg)
    fast = copy.deepcopy(ref)
    assert dora.use_fast_dora(fast) == 1
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want, got = ref(x), fast(x)
    # One layer of 64 inputs, rank 4: the norm of the dequantized W + s·B·A, x·W and the rank-4 path.
    assert float((got - want).abs().max()) <= tol(torch.float32, 64 + 64 + 4 + 4, float(want.abs().max()))
