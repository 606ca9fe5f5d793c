"""Tensor parallelism equals one process: tp=2 on 2 ranks (LoRA and full fine-tuning) and dp=2 × tp=2 on 4 ranks
(LoRA), each three SGD steps of the run's own sharded model (`build_sharded_model` with one reader per node,
`train_step`, the trainer's `clip_grad_norm`) against one process training the same global batch; the adapter a
tp=2 run saves loads as a PEFT adapter equal to the one-process run's. Three planted bugs of the class must fail
the same check: a row-parallel output left unreduced, a LoRA factor sharded on the wrong dimension, LoRA
initialised after sharding (tests/distributed/tp_worker.py plants them)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from shardtune.models.builder import build_training_module
from shardtune.objectives.heads import token_loss
from tests.distributed import tp_worker
from tests.distributed.tp_worker import LR, SEQ, STEPS, batch, spec_for
from tests.tolerance import train_parity

BUGS = ("unreduced_rowwise", "lora_b_on_rank_dim", "init_after_sharding")


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
    runs = [("lora", True, 2, None, str(out)), ("full", False, 2, None, None)]
    runs += [(bug, True, 2, bug, None) for bug in BUGS]
    return _spawn(2, str(tiny_assets["model"]), runs), out


def _reference(path: str, lora: bool, dp_ranks: int) -> dict:
    """One process, no ranks: the same model and seed, every data-parallel rank's rows in one batch."""
    torch.manual_seed(0)
    module, _ = build_training_module(spec_for(path, lora), on_meta=False, quantize_device=None)
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


@pytest.mark.parametrize("case", ["lora", "full"])
def test_tp2_equals_one_process(tp2, tiny_assets, case):
    """Bugs caught: a slice of a layer filled from the wrong block of the checkpoint, gradients of the whole
    (unsliced) parameters not agreeing on the tp ranks, token counts or losses summed once per tp rank (a
    gradient 1/tp too small), a grad norm that counts a whole parameter once per tp rank or misses a slice."""
    got, _ = tp2
    ref = _reference(str(tiny_assets["model"]), case == "lora", dp_ranks=1)
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
    ref = _reference(str(tiny_assets["model"]), True, dp_ranks=1)
    for numbers in got[bug].values():
        assert "error" not in numbers, numbers["error"]
    assert _mismatch(got[bug][0], ref) is not None
    print(bug, "largest differences:", _max_diffs(got[bug][0], ref))


def test_dp2_tp2_on_four_ranks_equals_one_process(tiny_assets):
    """Four ranks: two data-parallel batches, each over a tp pair (ranks 0-1 and 2-3); FSDP shards each slice over
    the two dp ranks. Bugs caught: the tp pair given different batches or the dp ranks the same one, FSDP
    averaging over the tp ranks too, a slice sharded over the wrong ranks."""
    got = _spawn(4, str(tiny_assets["model"]), [("lora", True, 2, None, None)])["lora"]
    ref = _reference(str(tiny_assets["model"]), True, dp_ranks=2)
    assert sorted(r["dims"] for r in got.values()) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert got[0]["trained"]
    for rank, numbers in got.items():
        assert _mismatch(numbers, ref) is None, (rank, _mismatch(numbers, ref))
    print("dp=2 x tp=2 vs 1 process, largest differences:", _max_diffs(got[0], ref))
    assert np.isfinite(got[0]["norms"]).all()
