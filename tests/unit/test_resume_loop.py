"""A run stopped mid-epoch and resumed from its saved loop state sees exactly the micro-batches, and ends in exactly
the state, of the run that was never stopped (the training loop, one gloo rank, a recording toy model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtune.data import PreparedSplit
from shardtune.parallel import checkpoint
from shardtune.training.trainer import LoopSettings, LoopState, train


class _Recorder(nn.Module):
    """The training module's interface; remembers the rows of every micro-batch it is given."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[list[list[int]]] = []

    def forward(self, input_ids, position_ids, labels, head=None):  # computes the SFT head itself
        self.seen.append(input_ids.tolist())
        return self.w.sum() * input_ids.float().sum(), (labels != -100).sum()


class _Quiet:
    def log_train(self, step, record):
        pass

    def log_eval(self, step, record):
        pass

    def progress(self, step, postfix):
        pass


# 20 distinct rows, 2 per micro-batch, 2 micro-batches per step: 5 steps per epoch; 8 steps cross into epoch 2.
ROWS = [[100 + i] * 4 for i in range(20)]
SETTINGS = {"batch_size": 2, "grad_accum": 2, "steps_per_epoch": 5, "total_steps": 8}


def _run(info, state: LoopState, total: int) -> tuple[_Recorder, LoopState]:
    split = PreparedSplit(ROWS, ROWS, [list(range(4))] * len(ROWS), stats={})
    model = _Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the losses then depend on the batches alone
    s = LoopSettings(
        batch_size=SETTINGS["batch_size"], eval_batch_size=2, grad_accum=SETTINGS["grad_accum"], max_grad_norm=0.0,
        total_steps=total, steps_per_epoch=SETTINGS["steps_per_epoch"], seed=3, pad_id=0, logging_steps=1,
        logging_strategy="steps", eval_strategy="no", eval_steps=1, save_strategy="no", save_steps=1,
        max_nonfinite_steps=1,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    state = train(model, opt, sched, train_split=split, eval_split=None, info=info, settings=s, state=state,
                  logger=_Quiet())  # fmt: skip
    return model, state


# Mid-epoch (the saved position is micro-batch 6 of 10), and at the epoch's end (position 0 of the next epoch: the
# epoch number and its shuffle carry the state).
@pytest.mark.parametrize("stop_at", [3, 5])
def test_resumed_loop_sees_the_batches_of_an_uninterrupted_run(info, stop_at):
    total, per_step = SETTINGS["total_steps"], SETTINGS["grad_accum"]
    whole, whole_state = _run(info, LoopState(), total)
    assert len(whole.seen) == total * per_step
    # The epochs are shuffled differently: a resume that replayed epoch 0's order would be told apart.
    epoch0 = sorted(r for b in whole.seen[:10] for r in b)
    assert epoch0 == sorted(ROWS) and whole.seen[10:12] != whole.seen[0:2]

    first, stopped = _run(info, LoopState(), stop_at)
    assert first.seen == whole.seen[: stop_at * per_step]
    # What a checkpoint saves and a resume reads back (meta.json's loop, the position in samples), same ranks.
    saved = {**stopped.to_dict(), "samples_in_epoch": stopped.batch_in_epoch * SETTINGS["batch_size"]}
    saved["global_batch"] = SETTINGS["batch_size"] * per_step
    loop, notes = checkpoint.resume_position({"world_size": 1, "loop": saved}, per_device=2, world=1, grad_accum=2)
    assert notes == []
    resumed, end = _run(info, LoopState(**loop), total)
    assert resumed.seen == whole.seen[stop_at * per_step :]
    assert (end.step, end.epoch, end.batch_in_epoch, end.tokens) == (
        whole_state.step,
        whole_state.epoch,
        whole_state.batch_in_epoch,
        whole_state.tokens,
    )
    assert end.losses == whole_state.losses
