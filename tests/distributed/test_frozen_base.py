"""The frozen base replicated on every rank (`--frozen_base replicated`) against the same run with it sharded: the
same per-step losses, grad_norm and adapter, checkpoints that resume under the other placement, and the 4-bit
base's packed weights and quantization states whole on every rank. A planted bug of the class (the adapters left
out of FSDP with the base, so that no rank's gradient is averaged with the other's) makes the comparison fail.

Tolerance: both sides run 2 ranks with the same micro-batches, so the frozen weights a layer computes with are the
same numbers (FSDP casts the sharded base to the compute dtype at each all-gather, the replicated one is cast once,
fsdp.frozen_parameters) and only the order of the adapters' gradient reduction may differ: the 1-vs-2-rank bounds
of tests/tolerance.train_parity, which cover a different order of every sum, hold it with room (measured: equal to
the last digit on AMD EPYC AVX-512, fp32).
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file

from tests.conftest import run_cli, train_args, train_records
from tests.distributed.test_parity import CLOSE, FSDP_ENV, LORA  # the LoRA parity test's launch and bounds
from tests.mutation import Edit, plant
from tests.parity import assert_runs_match, train_steps

# The adapters left out of FSDP too: each rank steps its own copy on its own rows, and the saved adapter is rank
# 0's alone.
TRAINABLE_IGNORED = Edit(
    "parallel/fsdp.py",
    "    frozen = {p for p in model.parameters() if not p.requires_grad}\n",
    "    frozen = set(model.parameters())\n",
)


def _run(assets, out, placement, extra=(), env=None, **flags):
    run = {"max_seq_len": 96, "seed": 7, "max_steps": 4, "gradient_accumulation_steps": 2}
    optim = {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.01}
    args = train_args(assets, out, **run, **optim, gradient_checkpointing=True, per_device_train_batch_size=2, **flags)
    proc = run_cli([*args, *LORA, *extra, "--frozen_base", placement], nproc=2, env={**FSDP_ENV, **(env or {})})
    return out, proc.stdout + proc.stderr


def _held(out):
    return train_records(out, "start")[0]["config"]["param_bytes_per_rank"]


@pytest.fixture(scope="module")
def sharded(tiny_assets, tmp_path_factory):
    """The reference: the frozen base sharded, a checkpoint after step 2."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    return _run(tiny_assets, out, "sharded", save_strategy="steps", save_steps=2)[0]


def test_replicated_base_trains_as_the_sharded_one(tiny_assets, sharded, tmp_path):
    out, log = _run(tiny_assets, tmp_path / "replicated", "replicated")
    assert "Frozen base replicated on every rank (--frozen_base replicated)" in log
    assert_runs_match(sharded, out, CLOSE)
    assert sum(k.endswith("lora_A.weight") for k in load_file(out / "adapter_model.safetensors")) == 2 * 7
    # Each rank holds the whole frozen base (both halves of the sharded run's), and half the adapters.
    rep, shd = _held(out), _held(sharded)
    assert rep[0]["frozen"] == rep[1]["frozen"] == shd[0]["frozen"] + shd[1]["frozen"]
    assert [r["trainable"] for r in rep] == [r["trainable"] for r in shd]


def test_a_sharded_checkpoint_resumes_replicated(tiny_assets, sharded, tmp_path):
    """Steps 3-4 resumed from the sharded run's step-2 checkpoint with the base replicated are the sharded run's."""
    out = tmp_path / "resumed"
    shutil.copytree(sharded, out)
    for name in ("adapter_model.safetensors", "metrics.jsonl"):
        (out / name).unlink()
    shutil.rmtree(out / "checkpoints" / "checkpoint-4")
    _, log = _run(tiny_assets, out, "replicated", ["--resume_from_checkpoint", "latest"], save_strategy="no")
    assert "checkpoint-2" in log and sorted(train_steps(out)) == [3, 4]
    assert_runs_match(sharded, out, CLOSE, min_trained_steps=2)


def test_adapters_left_out_of_fsdp_fail_the_comparison(tiny_assets, sharded, tmp_path):
    out, _ = _run(tiny_assets, tmp_path / "planted", "replicated", env=plant(TRAINABLE_IGNORED, tmp_path / "src"))
    assert sorted(train_steps(out)) == [1, 2, 3, 4]  # the run completed: the comparison is what fails
    with pytest.raises(AssertionError):
        assert_runs_match(sharded, out, CLOSE)


QLORA = ["--bf16", "True", "--use_4bit_quantization", "True", "--bnb_4bit_quant_storage_dtype", "bfloat16",
         "--bnb_4bit_compute_dtype", "bfloat16", "--use_nested_quant", "True"]  # fmt: skip


def _packed_mib(log: str) -> tuple[float, list[float]]:
    """(the packed 4-bit MiB in all, those each rank held) from the run's "4-bit base:" line."""
    line = next(x for x in log.splitlines() if x.startswith("4-bit base:"))
    total = float(line.split("4-bit base: ")[1].split(" MiB")[0])
    return total, [float(v) for v in line.split("held per rank: [")[1].split("]")[0].split(",")]


# bench: a replicated 4-bit base in emulated bf16, 45 s; the replicated base's parity, resume and control stay in this file (`python -m pytest tests -m bench`; docs/testing.md)
@pytest.mark.bench
def test_qlora_bf16_replicated_trains_as_sharded(tiny_assets, tmp_path):
    """QLoRA in bf16 (the guide's 2-GPU setting): with the base replicated, every rank holds all the packed 4-bit
    weights and their quantization states, and trains as with them sharded."""
    pytest.importorskip("bitsandbytes")
    shd, shd_log = _run(tiny_assets, tmp_path / "sharded", "sharded", QLORA)
    rep, rep_log = _run(tiny_assets, tmp_path / "replicated", "replicated", QLORA)
    total, held = _packed_mib(shd_log)
    assert sum(held) == pytest.approx(total, abs=0.02) and max(held) < 0.6 * total
    assert _packed_mib(rep_log) == (total, [total, total])
    # The same micro-batches on the same bf16 weights: the fp32 bounds hold (a wrong quantization state on one
    # rank moves the first loss by far more).
    assert_runs_match(shd, rep, CLOSE)
