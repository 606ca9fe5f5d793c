"""One process without FSDP (the plain module, FSDP2's mixed-precision numerics) against one process under FSDP2
(the old path): losses, grad_norm, adapter and model tensors. Against 2 FSDP ranks, the default one-process path
is tests/distributed/test_parity.py's and test_checkpoint.py's (resume across world sizes) reference.

Tolerances. At world size 1 FSDP2's all-gather and reduce-scatter copy values without changing them (a cast to
bf16, a sum over one rank, a cast to fp32), and the plain module runs the same casts and the same kernels on the
same tensors in the same order: the two runs are bitwise equal (measured so on every case below), so they are
compared exactly; any reordering would be a change of the computation, which these tests are there to catch.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardtune.config.errors import ConfigError
from shardtune.config.fsdp import SINGLE_PROCESS_ENV, fsdp_settings_from_env
from tests.conftest import run_cli, train_args, train_records
from tests.mutation import Edit, plant

LORA = ["--use_peft_lora", "True", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear"]
FULL = ["--use_peft_lora", "False"]
# QLoRA: LoRA on a 4-bit base whose packed weights are bf16 parameters (bitsandbytes' CPU kernels).
QLORA = [
    *LORA,
    *("--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_quant_type", "nf4"),
    *("--bnb_4bit_quant_storage_dtype", "bfloat16", "--bnb_4bit_compute_dtype", "bfloat16"),
]
NO_FSDP_LINE = "No FSDP at world size 1"


def _args(assets, out, rows: int, extra) -> list[str]:
    run = {"max_seq_len": 96, "seed": 7, "max_steps": 3, "gradient_accumulation_steps": 2, "learning_rate": 3e-3}
    return [
        *train_args(assets, out, **run, per_device_train_batch_size=rows, gradient_checkpointing=True),
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        *extra,
    ]


def _run(assets, out, extra, *, mode: str = "auto", env=None) -> str:
    proc = run_cli(_args(assets, out, 4, extra), env={SINGLE_PROCESS_ENV: mode, **(env or {})})
    return proc.stdout + proc.stderr


def _curve(out) -> tuple[list[float], list[float]]:
    records = train_records(out)
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _tensors(out) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(out / name)


def _assert_equal_runs(a, b) -> None:
    (la, ga), (lb, gb) = _curve(a), _curve(b)
    assert len(la) == 3 and la == lb and ga == gb, (la, lb, ga, gb)
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    # The checkpoints (DCP: plain tensors without FSDP, DTensors under it) hold the same weights and AdamW state.
    sa, sb = _checkpoint(a), _checkpoint(b)
    assert sa.keys() == sb.keys() and any("exp_avg" in k for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], k


def _checkpoint(out) -> dict:
    """checkpoint-3's DCP state as one flat dict (torch's own converter)."""
    flat = out / "checkpoint-3.pt"
    dcp_to_torch_save(out / "checkpoints" / "checkpoint-3" / "sharded", flat)
    state = torch.load(flat, weights_only=False)
    return {f"{part}/{k}": v for part in ("model", "optim") for k, v in _flatten(state[part]).items()}


def _flatten(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


@pytest.fixture(scope="module")
def qlora_fsdp(tiny_assets, tmp_path_factory):
    """The old path: one process under FSDP2, QLoRA in bf16 (shared by the comparison and its control)."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path_factory.mktemp("qlora") / "fsdp"
    log = _run(tiny_assets, out, [*QLORA, "--bf16", "True"], mode="fsdp")
    assert "FSDP at world size 1: kept by SHARDTUNE_FSDP_SINGLE_PROCESS=fsdp" in log and NO_FSDP_LINE not in log
    return out


def _without_fsdp(assets, out, extra, env=None):
    log = _run(assets, out, [*extra, "--bf16", "True"], env=env)
    assert NO_FSDP_LINE in log and "blocks on one process without FSDP" in log
    return out


def test_qlora_bf16_without_fsdp_equals_fsdp(tiny_assets, tmp_path, qlora_fsdp):
    """bf16 compute over fp32 adapter masters and a 4-bit base, lora dropout, checkpointed blocks and 2
    accumulated micro-batches: the plain module gives FSDP2's numbers bit for bit."""
    _assert_equal_runs(_without_fsdp(tiny_assets, tmp_path / "plain", QLORA), qlora_fsdp)


def test_full_finetune_bf16_without_fsdp_equals_fsdp(tiny_assets, tmp_path):
    """Every weight an fp32 master computed in bf16 (the embeddings and the head too)."""
    plain = tmp_path / "plain"
    log = _run(tiny_assets, plain, [*FULL, "--bf16", "True"], mode="no_fsdp")
    assert NO_FSDP_LINE in log and "blocks on one process without FSDP" in log
    # auto keeps FSDP here (one block's bf16 copy at a time rather than the whole model's), and says why.
    fsdp = tmp_path / "fsdp"
    log = _run(tiny_assets, fsdp, [*FULL, "--bf16", "True"])
    assert "FSDP at world size 1: full fine-tuning computes every fp32 weight in bfloat16" in log
    _assert_equal_runs(plain, fsdp)
    losses, _ = _curve(plain)
    assert abs(losses[-1] - losses[0]) > 1e-3  # it trained


# Planted bugs of the no-FSDP path: the bf16 copy cut off from its fp32 master (no gradient reaches the adapter),
# and no bf16 copy at all (the adapters computed in fp32, as FSDP2's mixed precision would not).
DROPPED_GRADIENT = Edit(
    "parallel/fsdp.py",
    "copies.setdefault(id(p), p.to(self.dtype))",
    "copies.setdefault(id(p), p.detach().to(self.dtype))",
)
NO_CAST = Edit("parallel/fsdp.py", "    if mp.param_dtype is not None:\n", "    if False:\n")


@pytest.mark.parametrize("bug", [DROPPED_GRADIENT, NO_CAST], ids=["dropped_gradient", "no_cast"])
def test_planted_bug_fails(tiny_assets, tmp_path, qlora_fsdp, bug):
    """Control: each planted bug makes the comparison with FSDP fail."""
    mutant = _without_fsdp(tiny_assets, tmp_path / "planted", QLORA, env=plant(bug, tmp_path / "mutant"))
    with pytest.raises(AssertionError):
        _assert_equal_runs(mutant, qlora_fsdp)
    grad_norms = _curve(mutant)[1]
    if bug is DROPPED_GRADIENT:
        assert all(g == 0 for g in grad_norms)  # no gradient reaches the adapters
    else:
        assert grad_norms != _curve(qlora_fsdp)[1]


def test_single_process_setting_refuses_other_values():
    assert fsdp_settings_from_env({}).single_process == "auto"
    assert fsdp_settings_from_env({SINGLE_PROCESS_ENV: " FSDP "}).single_process == "fsdp"
    assert fsdp_settings_from_env({SINGLE_PROCESS_ENV: "no_fsdp"}).single_process == "no_fsdp"
    with pytest.raises(ConfigError, match=f"{SINGLE_PROCESS_ENV}='none' is not a choice; set it to auto"):
        fsdp_settings_from_env({SINGLE_PROCESS_ENV: "none"})
