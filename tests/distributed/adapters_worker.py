"""Run under torchrun by test_adapters.py: adapter switching on a 2-rank sharded model vs the unsharded model.

argv: base model folder, folder with adapters `a` (LoRA + lm_head in modules_to_save) and `b` (DoRA), output
JSON. Every rank builds an unsharded reference next to the sharded model and records the largest differences.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardtune.models import adapter, dora, loading, training_module
from shardtune.models.builder import ModelSpec
from shardtune.objectives.heads import token_loss
from shardtune.parallel import adapters
from shardtune.parallel.fsdp import assert_sharded, shard_model
from shardtune.parallel.mesh import init_distributed, shutdown
from shardtune.parallel.parallelize import ShardingSettings
from shardtune.parallel.setup import build_sharded_model

VOCAB, SEQ = 600, 12


def _multi_adapter_model(base_dir: str, adapter_dir: str) -> training_module.CausalLMForTraining:
    """Base + adapter `a` (trainable, active) + adapter `b` (loaded frozen), unsharded."""
    base = loading.load_base_model(base_dir, dtype=torch.float32, attn_impl="sdpa", trust_remote_code=False)
    pm = adapter.attach_adapter(
        base,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules="all-linear",
        use_dora=False,
        modules_to_save=None,
        new_token_ids=[],
        adapter_name="a",
        adapter_path=f"{adapter_dir}/a",
    )
    pm.load_adapter(f"{adapter_dir}/b", adapter_name="b")
    return training_module.CausalLMForTraining(pm)


def _shard(model: training_module.CausalLMForTraining, info) -> training_module.CausalLMForTraining:
    blocks = [m for m in model.modules() if isinstance(m, loading.decoder_block_classes(model.model))]
    shard_model(model, blocks=blocks, mesh=info.mesh, param_dtype=None)
    assert_sharded(model, info.world_size)
    return model


def _logits(model, batch) -> torch.Tensor:
    # `logits` bypasses the root module's forward hooks, so gather the root's parameters first.
    if hasattr(model, "unshard"):
        model.unshard()
    with torch.no_grad():
        return model.logits(batch["input_ids"], batch["position_ids"])


def _diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max())


def _flags(model) -> dict[str, bool]:
    """requires_grad of each adapter parameter as FSDP sees it: on the sharded parameters."""
    # Resharded here with FSDP's own API rather than the helper under test.
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return {
        n.removeprefix("model."): p.requires_grad
        for n, p in model.named_parameters()
        if "lora_" in n or "modules_to_save" in n
    }


def _adapter_of(name: str) -> str:
    parts = name.split(".")
    return next(parts[i + 1] for i, p in enumerate(parts) if p.startswith("lora_") or p == "modules_to_save")


def _grads(model) -> dict[str, torch.Tensor | None]:
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n or "modules_to_save" in n:
            g = p.grad
            out[n.removeprefix("model.")] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
    return out


def _train_step(model, batch) -> None:
    model.train()
    loss, _ = model(**batch, head=token_loss)
    loss.backward()
    model.eval()


def switching(base_dir: str, adapter_dir: str, info) -> dict:
    torch.manual_seed(0)
    ref = _multi_adapter_model(base_dir, adapter_dir)
    sh = _multi_adapter_model(base_dir, adapter_dir)
    # The sharded model runs shardtune's DoRA forward for `b`; the reference keeps peft's.
    r: dict = {"world_size": info.world_size, "fast_dora_layers": dora.use_fast_dora(sh)}
    sh = _shard(sh, info)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    batch = {"input_ids": ids, "position_ids": torch.arange(SEQ).repeat(2, 1), "labels": ids.roll(-1, dims=1)}
    # lm_head is in adapter a's modules_to_save: its trained copy is sharded like any other weight.
    head = sh.model.base_model.model.lm_head.modules_to_save["a"].weight
    r["mts_rows"] = [head.shape[0], head.to_local().shape[0] if isinstance(head, DTensor) else None]
    flags_at_start = _flags(sh)
    r["flags_at_start_match_ref"] = flags_at_start == _flags(ref)
    # A training step and an eval forward, as in training: the root and the last block stay unsharded.
    _train_step(sh, batch)
    sh.zero_grad(set_to_none=True)
    ref.eval()
    ref_a = _logits(ref, batch)
    r["a"] = _diff(_logits(sh, batch), ref_a)
    with adapters.disabled_adapter(sh), ref.model.disable_adapter():
        ref_base = _logits(ref, batch)
        r["disabled"] = _diff(_logits(sh, batch), ref_base)
    r["flags_after_disabled_unchanged"] = _flags(sh) == flags_at_start
    r["a_after_disabled"] = _diff(_logits(sh, batch), ref_a)
    ref.model.set_adapter("b")
    ref_b = _logits(ref, batch)
    with adapters.using_adapter(sh, "b"):
        r["using_b"] = _diff(_logits(sh, batch), ref_b)
        r["active_inside"] = adapters.active_adapter(sh)
    r["flags_after_using_unchanged"] = _flags(sh) == flags_at_start
    r["a_after_using"] = _diff(_logits(sh, batch), ref_a)
    r["active_after_using"] = adapters.active_adapter(sh)
    # The outputs really differ between the three settings, so the comparisons above mean something.
    r["gap_a_base"], r["gap_a_b"] = _diff(ref_a, ref_base), _diff(ref_a, ref_b)
    r["logit_scale"] = max(float(x.abs().max()) for x in (ref_a, ref_base, ref_b))  # for the tolerance
    # Switch to `b` for training right after an eval forward; its gradients must reach every sharded weight.
    _logits(sh, batch)
    adapters.set_active_adapter(sh, "b")
    flags = _flags(sh)
    r["trainable_after_switch"] = sorted({_adapter_of(n) for n, f in flags.items() if f})
    r["flags_match_ref_after_switch"] = flags == _flags(ref)
    # Two steps: the second all-gathers again, so flags left only on unsharded parameters would be lost there.
    for _ in range(2):
        sh.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        _train_step(sh, batch)
        _train_step(ref, batch)
    got, want = _grads(sh), _grads(ref)
    b_keys = [k for k, f in flags.items() if f]
    r["n_b_params"] = len(b_keys)
    r["b_grads_missing"] = [k for k in b_keys if got[k] is None]
    r["b_grad_diff"] = max(_diff(got[k], want[k]) for k in b_keys if got[k] is not None)
    r["b_grad_scale"] = max(float(want[k].abs().max()) for k in b_keys if want[k] is not None)
    r["b_grad_min_norm"] = min(float(got[k].norm()) for k in b_keys if got[k] is not None)
    # The norm over all of b's gradients, as training's grad_norm: relative difference to the unsharded one.
    norms = [torch.stack([g[k].norm() for k in b_keys if g[k] is not None]).norm() for g in (got, want)]
    r["b_grad_norm_rel"] = float((norms[0] - norms[1]).abs() / norms[1])
    r["frozen_with_grads"] = [k for k, f in flags.items() if not f and got[k] is not None]
    return r


def _spec(base_dir: str, adapter_path: str) -> ModelSpec:
    return ModelSpec(
        model_name_or_path=base_dir,
        dtype=torch.float32,
        n_tokens=VOCAB,
        lora_r=4,
        lora_alpha=8,
        adapter_name="a",
        adapter_path=adapter_path,
    )


def continued(base_dir: str, adapter_dir: str, info) -> dict:
    """--adapter_path through build_sharded_model (meta loading on rank 1): the loaded adapter, then the base."""
    from peft import PeftModel

    sh = build_sharded_model(
        _spec(base_dir, f"{adapter_dir}/a"), info, ShardingSettings(cpu_ram_efficient_loading=True)
    )
    sh.eval()
    base = loading.load_base_model(base_dir, dtype=torch.float32, attn_impl="sdpa", trust_remote_code=False)
    ref = training_module.CausalLMForTraining(PeftModel.from_pretrained(base, f"{adapter_dir}/a")).eval()
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "position_ids": torch.arange(SEQ)[None]}
    want = _logits(ref, batch)
    r = {"continued": _diff(_logits(sh, batch), want), "continued_scale": float(want.abs().max())}
    r["continued_trainable"] = sum(p.requires_grad for p in sh.parameters())
    with adapters.disabled_adapter(sh), ref.model.disable_adapter():
        r["continued_disabled"] = _diff(_logits(sh, batch), _logits(ref, batch))
    return r


def main() -> None:
    base_dir, adapter_dir, out = sys.argv[1:4]
    info = init_distributed()
    result = {**switching(base_dir, adapter_dir, info), **continued(base_dir, adapter_dir, info)}
    with open(f"{out}.rank{info.rank}.json", "w") as f:
        json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main()
