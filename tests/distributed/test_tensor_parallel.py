"""Tensor parallelism equals one process: tp=2 on 2 ranks (LoRA, DoRA and full fine-tuning), dp=2 × tp=2 and
cp=2 × tp=2 on 4 ranks (LoRA), each three SGD steps of the run's own sharded model (`build_sharded_model` with one
reader per node, `train_step`, the trainer's `clip_grad_norm`) against one process training the same global batch;
the adapter a tp=2 run saves loads as a PEFT adapter equal to the one-process run's. Planted bugs of the class must
fail the same check: a row-parallel output left unreduced, a LoRA factor sharded on the wrong dimension, LoRA
initialised after sharding, DoRA's row-parallel norms taken over one rank's columns, cp groups laid out as without
tp (tests/distributed/tp_worker.py plants them).

Then whole runs (`shardtune train` under torchrun): DoRA with cp=2 × tp=2 on 4 processes, a tp=2 run and its exports (the adapter merged with
--merge_adapter, a full fine-tune's model folder) equal a tp=1 run's; DCP checkpoints resume across tp sizes
(tp=2 → 1 process, tp=1 → tp=2; a FULL_STATE_DICT full fine-tune tp=2 → 2 data-parallel ranks and 1 process →
tp=2) and continue the uninterrupted tp=1 run (tests/parity.py); a resume that gives every tp rank the first
slice of the saved tensor fails that comparison."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from shardtune.models.builder import build_training_module
from shardtune.objectives.heads import token_loss
from tests.conftest import run_cli, train_args
from tests.distributed import tp_worker
from tests.distributed.test_parity import FSDP_ENV, LORA
from tests.distributed.tp_worker import LR, SEQ, STEPS, batch, spec_for
from tests.mutation import Edit, plant
from tests.parity import assert_runs_match, assert_same_tensors, assert_same_training, load_weights, train_steps
from tests.tolerance import train_parity

DORA = {"dora": True}

# Each planted bug (tests/distributed/tp_worker.py) and the adapter it is planted in: LoRA, or DoRA.
BUGS = {
    "unreduced_rowwise": {},
    "lora_b_on_rank_dim": {},
    "init_after_sharding": {},
    "dora_norm_unreduced": {"dora": True},
}


def _spawn(world: int, path: str, runs: list) -> dict[str, dict[int, dict]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=tp_worker.worker, args=(r, world, port, path, runs, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, dict]] = {key: {} for key, *_ in runs}
    try:
        for _ in range(world * len(runs)):
            key, rank, numbers = queue.get(timeout=240)
            got[key][rank] = numbers
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got


@pytest.fixture(scope="module")
def tp2(tiny_assets, tmp_path_factory):
    """key → rank → numbers, for the 2-rank tp=2 runs (and the planted bugs); the tp=2 adapter's folder."""
    out = tmp_path_factory.mktemp("tp2_adapter")
    runs = [("lora", True, 2, None, str(out)), ("full", False, 2, None, None), ("dora", True, 2, None, None, DORA)]
    runs += [(bug, True, 2, bug, None, options) for bug, options in BUGS.items()]
    return _spawn(2, str(tiny_assets["model"]), runs), out


def _reference(path: str, lora: bool, dp_ranks: int, dora: bool = False) -> dict:
    """One process, no ranks: the same model and seed, every data-parallel rank's rows in one batch."""
    torch.manual_seed(0)
    module, _ = build_training_module(spec_for(path, lora, dora=dora), on_meta=False, quantize_device=None)
    both = {k: torch.cat([batch(r)[k] for r in range(dp_ranks)]) for k in ("input_ids", "position_ids", "labels")}
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        loss_sum, n = module(**both, head=token_loss)
        (loss_sum / n).backward()
        losses.append(float(loss_sum / n))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = {name: p.detach().clone() for name, p in module.model.named_parameters() if p.requires_grad}
    return {"losses": losses, "norms": norms, "trained": trained, "n": int(n), "module": module}


def _bounds(tokens: int) -> dict[str, float]:
    """How close the runs must be. fp32 on both sides; the tp ranks' sums run in another order (a row-parallel
    layer adds its slices' partial products after each slice's own sum; FSDP's reductions and the token counts
    over ranks too). tests/tolerance.py's `train_parity` bounds two such runs of the tiny model by 8σ of the
    rounding random walk over the chain of sums of every step so far: the loss (a mean over the step's tokens)
    to 7.8e-6 and the grad norm to 4.3e-5 for 3 steps of 30 targets. An SGD update is lr · g: a trained element
    differs by at most steps · lr · |g| · (the gradient's relative bound), so rtol is the grad norm's and atol
    that times steps · lr for elements of |g| ≤ 1 (lora_B starts at 0 and holds its updates only)."""
    b = train_parity(steps=STEPS, seq=SEQ, tokens_per_step=tokens, lr=LR)
    return {"loss": b.loss, "norm": b.grad_norm, "rtol": b.grad_norm, "atol": STEPS * LR * b.grad_norm}


def _mismatch(got: dict, ref: dict) -> str | None:
    """The first difference beyond `_bounds`, or None."""
    if "error" in got:
        return got["error"]
    bound = _bounds(ref["n"])
    for what, rtol in (("losses", bound["loss"]), ("norms", bound["norm"])):
        for step, (a, b) in enumerate(zip(got[what], ref[what], strict=True)):
            if abs(a - b) > rtol * abs(b):
                return f"{what} of step {step + 1}: {a} vs {b}"
    if not got["trained"]:  # gathered on rank 0 only
        return None
    if got["trained"].keys() != ref["trained"].keys():
        return f"trained tensors differ in names: {sorted(got['trained'])[:2]} vs {sorted(ref['trained'])[:2]}"
    for name, want in ref["trained"].items():
        if not torch.allclose(torch.from_numpy(got["trained"][name]), want, rtol=bound["rtol"], atol=bound["atol"]):
            return f"trained {name}"
    return None


def _max_diffs(got: dict, ref: dict) -> dict[str, float]:
    rel = {w: max(abs(a - b) / abs(b) for a, b in zip(got[w], ref[w], strict=True)) for w in ("losses", "norms")}
    rel["tensors"] = (
        0.0
        if not got["trained"]
        else max(float((torch.from_numpy(got["trained"][k]) - v).abs().max()) for k, v in ref["trained"].items())
    )
    return rel


@pytest.mark.parametrize("case", ["lora", "full", "dora"])
def test_tp2_equals_one_process(tp2, tiny_assets, case):
    """Bugs caught: a slice of a layer filled from the wrong block of the checkpoint, gradients of the whole
    (unsliced) parameters not agreeing on the tp ranks, token counts or losses summed once per tp rank (a
    gradient 1/tp too small), a grad norm that counts a whole parameter once per tp rank or misses a slice;
    DoRA's magnitude sliced with the wrong rows, or its weight norms taken over one rank's columns."""
    got, _ = tp2
    ref = _reference(str(tiny_assets["model"]), case != "full", dp_ranks=1, dora=case == "dora")
    assert {r["dims"] for r in got[case].values()} == {(0, 0, 2), (0, 1, 2)}
    assert got[case][0]["trained"]
    for rank, numbers in got[case].items():
        assert _mismatch(numbers, ref) is None, (rank, _mismatch(numbers, ref))
    print(case, "tp=2 vs 1 process, largest differences:", _max_diffs(got[case][0], ref))
    # Each step moves the loss by far more than the tolerance: a step that did not reach a slice is caught.
    bound = _bounds(ref["n"])["loss"]
    assert min(abs(a - b) for a, b in zip(ref["losses"], ref["losses"][1:])) > 20 * bound * ref["losses"][0]


def test_tp2_adapter_loads_as_peft_and_equals_one_process(tp2, tiny_assets):
    """The adapter written by a tp=2 run (gathered from the slices) is a plain PEFT adapter of the full shapes,
    equal to the one process's trained factors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out = tp2
    ref = _reference(str(tiny_assets["model"]), True, dp_ranks=1)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_assets["model"]), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out))
    bound = _bounds(ref["n"])
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(lora) == len(ref["trained"]) > 0
    for name, want in ref["trained"].items():
        torch.testing.assert_close(lora[name], want, rtol=bound["rtol"], atol=bound["atol"], msg=name)


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_fails_the_parity_check(tp2, tiny_assets, bug):
    """Negative controls: each planted bug makes the same comparison fail (by its numbers, not by crashing)."""
    got, _ = tp2
    ref = _reference(str(tiny_assets["model"]), True, dp_ranks=1, **BUGS[bug])
    for numbers in got[bug].values():
        assert "error" not in numbers, numbers["error"]
    assert _mismatch(got[bug][0], ref) is not None
    print(bug, "largest differences:", _max_diffs(got[bug][0], ref))


def _checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors of a DCP checkpoint read whole by this one process, without ranks (the tp=1
    one-process side of a resume), by their names in the PEFT model."""
    import torch.distributed.checkpoint as dcp

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items() if k.startswith("model.")
    }
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {k.removeprefix("model.model."): v for k, v in state.items()}


def test_dp2_tp2_on_four_ranks_equals_one_process(tiny_assets, tmp_path):
    """Four ranks: two data-parallel batches, each over a tp pair (ranks 0-1 and 2-3); FSDP shards each slice over
    the two dp ranks. Bugs caught: the tp pair given different batches or the dp ranks the same one, FSDP
    averaging over the tp ranks too, a slice sharded over the wrong ranks. Its checkpoint (each slice sharded
    again over dp: DTensors on the 2-D mesh, _StridedShard on dp) read whole by one process is the trained
    adapter: every shard written at its offset in the whole tensor."""
    got = _spawn(4, str(tiny_assets["model"]), [("lora", True, 2, None, str(tmp_path))])["lora"]
    ref = _reference(str(tiny_assets["model"]), True, dp_ranks=2)
    assert sorted(r["dims"] for r in got.values()) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert got[0]["trained"]
    for rank, numbers in got.items():
        assert _mismatch(numbers, ref) is None, (rank, _mismatch(numbers, ref))
    print("dp=2 x tp=2 vs 1 process, largest differences:", _max_diffs(got[0], ref))
    assert np.isfinite(got[0]["norms"]).all()
    saved = _checkpoint_tensors(tmp_path / "checkpoints" / f"checkpoint-{STEPS}" / "sharded")
    assert saved.keys() == ref["trained"].keys()
    for name, tensor in saved.items():  # the gathered adapter, bit for bit
        assert torch.equal(tensor, torch.from_numpy(got[0]["trained"][name])), name


def test_cp2_tp2_on_four_ranks_equals_one_process(tiny_assets):
    """Context parallelism inside tensor parallelism, 4 ranks: one batch, each row split over a cp pair, each
    half's heads over a tp pair (cp groups {0, 2} and {1, 3}: the ranks holding the same slice). Against one
    process on the whole rows. Negative control: cp groups laid out as without tp ({0, 1}, {2, 3}), which gathers
    the other slice's keys and values as the other half of the row (same shapes), fails the same comparison."""
    runs = [("cp_tp", True, 2, None, None, {"cp": 2}), ("bug", True, 2, "cp_groups_without_tp", None, {"cp": 2})]
    got = _spawn(4, str(tiny_assets["model"]), runs)
    ref = _reference(str(tiny_assets["model"]), True, dp_ranks=1)
    assert sorted(r["dims"] for r in got["cp_tp"].values()) == [(0, 0, 2, 0), (0, 0, 2, 1), (0, 1, 2, 0), (0, 1, 2, 1)]
    assert got["cp_tp"][0]["trained"]
    for rank, numbers in got["cp_tp"].items():
        assert _mismatch(numbers, ref) is None, (rank, _mismatch(numbers, ref))
    print("cp=2 x tp=2 vs 1 process, largest differences:", _max_diffs(got["cp_tp"][0], ref))
    assert "error" not in got["bug"][0], got["bug"][0]["error"]
    assert _mismatch(got["bug"][0], ref) is not None
    print("cp groups without tp, largest differences:", _max_diffs(got["bug"][0], ref))


# ---------------------------------------------------------------- whole runs: exports and checkpoints across tp sizes

FULL = ["--use_peft_lora", "False"]  # FSDP_ENV and LORA: tests/distributed/test_parity.py's
# 4 AdamW steps of 2 micro-batches of 4 packed rows of 96 tokens, lr 3e-3, no warmup: the bounds of
# tests/distributed/test_parity.py's 1-process vs 2-rank runs; a tp run's sums differ from one process's in order
# only (the row-parallel layers' partial products, the norms over two meshes), measured below those bounds.
RUN_CLOSE = train_parity(steps=4, seq=96, tokens_per_step=8 * 96, lr=3e-3)
# The planted resume: every tp rank keeps tp rank 0's slice of each sliced tensor, as a loader that reads the
# rank's shard from the start of the saved tensor (the slice taken for the whole) would.
FIRST_SLICE = Edit(
    "parallel/checkpoint.py",
    "    _apply(model, optimizer, state)\n",
    "    for t in state['model'].values():\n"
    "        if isinstance(t, DTensor) and 'tp' in (t.device_mesh.mesh_dim_names or ()):\n"
    "            dist.broadcast(t.to_local(), group=t.device_mesh.get_group('tp'), group_src=0)\n"
    "    _apply(model, optimizer, state)\n",
)


def _train(assets, out: Path, *, tp: int, nproc: int, kind: list[str], cp: int = 1, extra=(), env=None) -> Path:
    """A 4-step run (test_parity.py's), a checkpoint every 2 steps, on `nproc` processes with tp `tp` (and cp
    `cp`): 4 rows per micro-batch shared by the nproc / (cp·tp) data-parallel ranks, so every layout trains on
    the same 8 rows a step."""
    run = {"max_seq_len": 96, "seed": 7, "max_steps": 4, "gradient_accumulation_steps": 2}
    optim = {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.01}
    rows = {"per_device_train_batch_size": 4 // (nproc // (cp * tp)), "tensor_parallel_size": tp}
    rows |= {"context_parallel_size": cp} if cp > 1 else {}
    flags = train_args(assets, out, **run, **optim, **rows, save_strategy="steps", save_steps=2)
    run_cli([*flags, *kind, *extra], nproc=nproc, env={**FSDP_ENV, **(env or {})})
    return out


def _resume(assets, ckpt: Path, out: Path, **how) -> Path:
    """Continue from `ckpt` (a copy of it in a fresh output folder) with another layout."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, out / "checkpoints" / ckpt.name)
    _train(assets, out, extra=("--resume_from_checkpoint", "latest", *how.pop("extra", ())), **how)
    assert sorted(train_steps(out)) == [3, 4]
    return out


@pytest.fixture(scope="module")
def lora_runs(tiny_assets, tmp_path_factory):
    """LoRA, SHARDED_STATE_DICT, the adapter merged at the end: one process, and tp=2 on 2 ranks."""
    root = tmp_path_factory.mktemp("tp_lora")
    merge = ("--merge_adapter", "True")
    one = _train(tiny_assets, root / "one", tp=1, nproc=1, kind=LORA, extra=merge)
    tp2 = _train(tiny_assets, root / "tp2", tp=2, nproc=2, kind=LORA, extra=merge)
    return one, tp2


@pytest.fixture(scope="module")
def full_runs(tiny_assets, tmp_path_factory):
    """Full fine-tuning, FULL_STATE_DICT checkpoints (rank 0's consolidated file): one process, and tp=2."""
    root = tmp_path_factory.mktemp("tp_full")
    env = {"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}
    one = _train(tiny_assets, root / "one", tp=1, nproc=1, kind=FULL, env=env)
    tp2 = _train(tiny_assets, root / "tp2", tp=2, nproc=2, kind=FULL, env=env)
    return one, tp2


def test_tp2_run_its_adapter_and_merged_model_equal_tp1(lora_runs, tiny_assets):
    """The tp=2 run's logged steps, saved adapter and merged model (--merge_adapter, the merge `shardtune merge`
    runs) against the tp=1 run's. Bugs caught: slices written in the wrong order or only rank 0's slice saved
    (the merged q/k/v/gate/up rows or o/down columns of the other slice would differ by a whole update)."""
    one, tp2 = lora_runs
    assert_runs_match(one, tp2, RUN_CLOSE)
    a, b = load_weights(one / "merged"), load_weights(tp2 / "merged")
    base = load_weights(tiny_assets["model"] / "model.safetensors")
    assert a.keys() == b.keys()
    moved = []
    for k in sorted(a):
        torch.testing.assert_close(b[k], a[k], rtol=RUN_CLOSE.rtol, atol=RUN_CLOSE.atol, msg=k)
        if k in base and base[k].shape == a[k].shape and float((a[k] - base[k]).abs().max()) > 100 * RUN_CLOSE.atol:
            moved.append(k)
    assert len([k for k in moved if k.endswith("proj.weight")]) == 2 * 7  # every adapted linear changed


def test_dora_with_cp2_tp2_from_the_command_line_equals_one_process(tiny_assets, tmp_path):
    """`shardtune train --use_dora True --context_parallel_size 2 --tensor_parallel_size 2` on 4 processes (one
    batch: packed rows split over a cp pair, heads and widths over a tp pair) against one process: logged steps,
    the saved DoRA adapter (magnitudes gathered from the column-parallel slices) and the merged model."""
    dora = [*LORA, "--use_dora", "True", "--merge_adapter", "True"]
    one = _train(tiny_assets, tmp_path / "one", tp=1, nproc=1, kind=dora)
    both = _train(tiny_assets, tmp_path / "cp_tp", tp=2, cp=2, nproc=4, kind=dora)
    saved = json.loads((both / "checkpoints" / "checkpoint-2" / "config.json").read_text())["train"]
    assert (saved["context_parallel_size"], saved["tensor_parallel_size"]) == (2, 2)
    assert_runs_match(one, both, RUN_CLOSE)
    a, b = load_weights(one / "merged"), load_weights(both / "merged")
    assert a.keys() == b.keys()
    for k in sorted(a):
        torch.testing.assert_close(b[k], a[k], rtol=RUN_CLOSE.rtol, atol=RUN_CLOSE.atol, msg=k)
    magnitudes = [k for k in load_weights(both / "adapter_model.safetensors") if "lora_magnitude_vector" in k]
    assert len(magnitudes) == 2 * 7  # every adapted linear layer of the 2 blocks


def test_tp2_full_finetune_saves_the_same_model_folder(full_runs, tiny_assets):
    """The model folder a tp=2 full fine-tune writes (every weight gathered over the tp and data-parallel ranks)
    equals the tp=1 run's; every weight moved from the base's by far more than the tolerance."""
    one, tp2 = full_runs
    assert_runs_match(one, tp2, RUN_CLOSE, start=tiny_assets["model"] / "model.safetensors")
    assert json.loads((tp2 / "config.json").read_text())["intermediate_size"] == 160  # the whole model's shapes


def test_lora_checkpoint_resumes_across_tp_sizes(lora_runs, tiny_assets, tmp_path):
    """tp=2's checkpoint-2 (DCP shards of the slices) on one process without tp, and the one process's on tp=2:
    each continues the uninterrupted tp=1 run. The checkpoint holds whole shapes, whatever the tp size."""
    one, tp2 = lora_runs
    ck2 = tp2 / "checkpoints" / "checkpoint-2"
    saved = FileSystemReader(str(ck2 / "sharded")).read_metadata().state_dict_metadata
    layer = "model.model.base_model.model.model.layers.0"
    assert tuple(saved[f"{layer}.self_attn.q_proj.lora_B.default.weight"].size) == (64, 4)  # sliced on 64
    assert tuple(saved[f"{layer}.mlp.down_proj.lora_A.default.weight"].size) == (4, 160)  # sliced on 160
    assert json.loads((ck2 / "config.json").read_text())["train"]["tensor_parallel_size"] == 2
    down = tmp_path / "tp2_to_1"
    _resume(tiny_assets, ck2, down, tp=1, nproc=1, kind=LORA)
    up = tmp_path / "tp1_to_2"
    _resume(tiny_assets, one / "checkpoints" / "checkpoint-2", up, tp=2, nproc=2, kind=LORA)
    for resumed in (down, up):
        assert_runs_match(one, resumed, RUN_CLOSE)


@pytest.mark.bench  # ~35 s: the LoRA checkpoints' resume across tp sizes stays in the default suite
def test_full_state_checkpoint_resumes_across_tp_sizes(full_runs, tiny_assets, tmp_path):
    """FULL_STATE_DICT (rank 0 reads one file, every rank receives its block): tp=2's checkpoint on 2
    data-parallel ranks, the one process's on tp=2. Bug caught: a whole tensor on a tp rank whose mesh lacks
    rank 0 scattered from that rank's own empty buffer (NaN losses before it was fixed)."""
    one, tp2 = full_runs
    base = tiny_assets["model"] / "model.safetensors"
    ck_tp2, ck_one = (run / "checkpoints" / "checkpoint-2" for run in (tp2, one))
    assert (ck_tp2 / "full_state.pt").exists()
    two_dp = _resume(tiny_assets, ck_tp2, tmp_path / "tp2_to_dp2", tp=1, nproc=2, kind=FULL)
    up = _resume(tiny_assets, ck_one, tmp_path / "tp1_to_2", tp=2, nproc=2, kind=FULL)
    for resumed in (two_dp, up):
        assert_runs_match(one, resumed, RUN_CLOSE, start=base)


def test_resume_giving_each_tp_rank_the_first_slice_fails_the_comparison(lora_runs, tiny_assets, tmp_path):
    """Negative control: the tp=1 checkpoint resumed on tp=2 with every tp rank holding tp rank 0's slice of each
    sliced factor (FIRST_SLICE) trains on, and differs from the uninterrupted run in its losses and tensors."""
    one, _ = lora_runs
    env = plant(FIRST_SLICE, tmp_path / "planted")
    ck = one / "checkpoints" / "checkpoint-2"
    out = _resume(tiny_assets, ck, tmp_path / "run", tp=2, nproc=2, kind=LORA, env=env)
    with pytest.raises(AssertionError, match="training differs"):
        assert_same_training(one, out, RUN_CLOSE)
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_tensors(one, out, RUN_CLOSE)
