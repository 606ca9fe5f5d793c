"""A run whose training collapses (a too-large learning rate kills every activation: the loss sticks at ln(vocab) and
the gradient norm is 0 from then on) is reported, not called finished: one warning line during training, an event
and the summary's collapsed_at_step in metrics.jsonl, a summary table that says COLLAPSED, trackers not marked
finished. A healthy run of the same loop reports nothing (the control)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardtune.training import trainer
from shardtune.training.metrics import RunLogger, read_metrics, summary_table
from shardtune.training.trainer import COLLAPSE_STEPS, LoopSettings, LoopState, train

VOCAB = 7


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group (the loop gathers memory figures), torn down after the module."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardtune.parallel.dims import ParallelDims
    from shardtune.parallel.mesh import DistInfo

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    yield DistInfo(0, 1, 0, 1, torch.device("cpu"), mesh, ParallelDims(dp_replicate=1, dp_shard=1))
    dist.destroy_process_group()


class _DeadReLU(nn.Module):
    """logits = relu(a · token) · u with the training module's interface. Every target is token 0, whose logit
    falls as the activation grows (u[0] < 0), so the first gradient pushes `a` down; a large enough learning rate
    takes it below 0, where the ReLU is dead: logits 0, loss ln(VOCAB), gradient 0 for good."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(()))
        self.u = nn.Parameter(torch.tensor([-1.0] + [1.0] * (VOCAB - 1)))
        self.config = SimpleNamespace(vocab_size=VOCAB)

    def forward(self, input_ids, position_ids, labels, head=None):  # computes the SFT head itself
        h = torch.relu(self.a * input_ids.float())
        logits = h[..., None] * self.u
        mask = labels != -100
        loss = nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum")
        return loss, mask.sum()


def _run(group, tmp_path, lr: float, tracker) -> tuple[LoopState, RunLogger]:
    from shardtune.data import PreparedSplit

    rows = [[1 + i % 3] * 6 for i in range(32)]
    labels = [[0] * 5 + [-100] for _ in range(32)]
    split = PreparedSplit(rows, labels, [list(range(6))] * 32, stats={})
    model = _DeadReLU()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    total = 8
    s = LoopSettings(
        batch_size=2, eval_batch_size=2, grad_accum=1, max_grad_norm=0.0, total_steps=total, steps_per_epoch=16,
        seed=0, pad_id=0, logging_steps=1, logging_strategy="steps", eval_strategy="no", eval_steps=1,
        save_strategy="no", save_steps=1, max_nonfinite_steps=3,
    )  # fmt: skip
    logger = RunLogger(str(tmp_path), is_main=True, total_steps=total, disable_progress=True, trackers=[tracker])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    state = train(model, opt, sched, train_split=split, eval_split=None, info=group, settings=s, state=LoopState(),
                  logger=logger)  # fmt: skip
    logger.finish({"output_path": str(tmp_path / "out")})
    logger.close(finished=True)
    return state, logger


class _Tracker:
    raw_keys = True

    def __init__(self):
        self.closed = None

    def log_config(self, config):
        pass

    def log(self, kind, step, scalars):
        pass

    def finish(self, summary):
        pass

    def close(self, finished):
        self.closed = finished


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(trainer, "warn0", seen.append)
    return seen


def test_a_collapse_is_reported_and_not_called_finished(group, tmp_path, warnings):
    tracker = _Tracker()
    state, _ = _run(group, tmp_path, lr=100.0, tracker=tracker)
    records = read_metrics(tmp_path)
    train_records = [r for r in records if r["type"] == "train"]
    # Step 1 has a gradient; from step 2 on the ReLU is dead: ln(VOCAB) and a zero norm, so step 1 + COLLAPSE_STEPS.
    assert train_records[0]["grad_norm"] > 0
    assert all(r["grad_norm"] == 0.0 and r["loss"] == pytest.approx(math.log(VOCAB), abs=1e-6)
               for r in train_records[1:])  # fmt: skip
    at = 1 + COLLAPSE_STEPS
    assert state.collapsed_at == at and len(warnings) == 1
    assert warnings[0].startswith(
        f"step {at}: training has collapsed: the gradient norm has been 0 for {COLLAPSE_STEPS} steps in a row and "
        f"the loss stays at {math.log(VOCAB):.4f} = ln({VOCAB}), the loss of uniform predictions"
    )
    assert "lower --learning_rate" in warnings[0] and "(now 1.00e+02)" in warnings[0]
    events = [r for r in records if r["type"] == "event"]
    assert [(e["step"], e["kind"], e["message"]) for e in events] == [(at, "collapse", warnings[0])]
    (summary,) = [r for r in records if r["type"] == "summary"]
    assert summary["collapsed_at_step"] == at
    status = next(line for line in summary_table(records).splitlines() if line.strip().startswith("status"))
    assert f"COLLAPSED at step {at}" in status and "finished" not in status
    assert tracker.closed is False


def test_a_healthy_run_reports_nothing(group, tmp_path, warnings):
    """The control: the same loop at a learning rate that keeps the ReLU alive."""
    tracker = _Tracker()
    state, _ = _run(group, tmp_path, lr=1e-3, tracker=tracker)
    records = read_metrics(tmp_path)
    assert state.collapsed_at is None and warnings == []
    assert all(r["grad_norm"] > 0 for r in records if r["type"] == "train")
    assert not [r for r in records if r["type"] == "event"]
    assert "collapsed_at_step" not in next(r for r in records if r["type"] == "summary")
    assert "status                 finished" in summary_table(records) and tracker.closed is True


def test_an_interrupted_run_that_collapsed_says_so(tmp_path):
    """`shardtune report` on a metrics.jsonl without a summary record (a killed run) still shows the collapse."""
    lines = [{"type": "start", "total_steps": 9}, {"type": "train", "step": 6, "loss": 1.9, "grad_norm": 0.0},
             {"type": "event", "step": 6, "kind": "collapse", "message": "m"}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert "COLLAPSED at step 6" in summary_table(read_metrics(tmp_path))
