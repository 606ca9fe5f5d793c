"""A new training objective added through the public part (shardtune.objectives.loss.register_objective) trains from the
command line: the trainer minimises what the objective's `step` returns, logs what its `report` returns, and
evaluates like SFT since it trains on token rows. The toy objective is SFT's cross-entropy times a scale (taken from
--beta, a knob every objective receives)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from tests.conftest import run_cli, train_args, train_records
from tests.tolerance import tol, train_chain

PLUGIN = textwrap.dedent(
    """
    import sys

    from shardtune.objectives.loss import Objective, ObjectiveSpec, register_objective


    class ScaledSFT(Objective):
        name = "scaled_sft"

        def __init__(self, scale):
            self.scale = scale

        def step(self, model, batch, totals, grad_scale):
            loss, parts = super().step(model, batch, totals, grad_scale)
            return loss * self.scale, {"loss": parts["loss"] * self.scale}

        def report(self, sums, totals):
            return {**super().report(sums, totals), "scale": self.scale}


    register_objective(ObjectiveSpec("scaled_sft", lambda *, beta, **_: ScaledSFT(beta), data="rows"))

    from shardtune.cli import main

    raise SystemExit(main(sys.argv[1:]))
    """
)
STEPS, SEQ, BATCH = 4, 96, 2


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    """SFT, the toy objective at scale 2 and at scale 0, each 4 steps, evaluated every 2 steps."""
    root = tmp_path_factory.mktemp("objective")
    (root / "plugin.py").write_text(PLUGIN)
    out = {}
    for name, flags in {
        "sft": {},
        "x2": {"objective": "scaled_sft", "beta": 2.0},
        "x0": {"objective": "scaled_sft", "beta": 0.0},
    }.items():
        args = train_args(
            tiny_assets,
            root / name,
            max_seq_len=SEQ,
            per_device_train_batch_size=BATCH,
            max_steps=STEPS,
            eval_strategy="steps",
            eval_steps=2,
            learning_rate=1e-3,
            # Clipping rescales each step's gradient by a factor that depends on the objective's scale.
            max_grad_norm=0,
            **flags,
        )
        run_cli(args, cwd=root, plugin=root / "plugin.py")
        out[name] = root / name
    return out


def _losses(out, kind, key):
    return [r[key] for r in train_records(out, kind)]


def test_the_objective_is_what_is_minimised_and_logged(runs):
    sft, x2 = _losses(runs["sft"], "train", "loss"), _losses(runs["x2"], "train", "loss")
    # Step 1 runs on the same weights and rows: the logged loss is the objective's, exactly twice SFT's (a scaling
    # by 2 is exact in floating point; the sums are the same ones, so at most their order could differ: the bound
    # of one step's forward chain of the tiny model, tests/tolerance.py).
    rtol = tol(torch.float32, train_chain(steps=1, seq=SEQ, tokens_per_step=SEQ * BATCH))
    assert x2[0] == pytest.approx(2 * sft[0], rel=rtol)
    assert [r["scale"] for r in train_records(runs["x2"], "train")] == [2.0] * STEPS
    assert sft[-1] < sft[0]  # training lowers SFT's loss on these rows


def test_the_trainer_follows_the_objectives_gradient(runs):
    """Scale 0 gives zero gradients: the adapter's B stays 0 and every evaluation equals the untrained model's,
    while SFT's evaluations move (so the comparison can fail)."""
    frozen = _losses(runs["x0"], "eval", "eval_loss")
    moving = _losses(runs["sft"], "eval", "eval_loss")
    assert len(frozen) == len(moving) >= 2
    assert frozen[0] == frozen[-1] and all(math.isfinite(v) for v in frozen)
    assert moving[-1] < moving[0]
    assert all(v == 0.0 for v in _losses(runs["x0"], "train", "loss"))


def test_an_unknown_objective_names_the_registered_ones(tiny_assets, tmp_path):
    proc = run_cli(train_args(tiny_assets, tmp_path / "o", objective="nope"), check=False)
    assert proc.returncode == 2
    assert "--objective 'nope' is not one of sft, dpo, simpo, orpo, kto" in proc.stderr
