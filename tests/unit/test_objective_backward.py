"""Every objective backpropagates the loss it logs: on one micro-batch (the whole global batch, one process), the
tensor `Objective.step` returns is grad_scale times the loss `report` gives. The TRL comparisons check the logged
numbers only, so a term that is logged but missing from the backward tensor (or the reverse) passes them."""

from __future__ import annotations

import pytest
import torch

from shardtune.commands.demo import build_model
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.heads import sequence_logps
from shardtune.objectives.loss import build_objective
from tests.tolerance import unit_roundoff

VOCAB, SEQ, PROMPT, B = 64, 12, 4, 3
KNOBS = {"beta": 0.5, "loss_type": "sigmoid", "simpo_gamma": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.5}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = build_model(tmp_path_factory.mktemp("m"), vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                     num_kv_heads=2)  # fmt: skip
    return CausalLMForTraining(hf.train(), chunk_size=16)


def _rows(n: int, seed: int) -> dict[str, torch.Tensor]:
    """n rows whose first PROMPT positions have no target (a prompt), then next-token targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((n, 1), -100)], dim=1)
    labels[:, : PROMPT - 1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ).repeat(n, 1)}


def _batch(name: str, model) -> dict[str, torch.Tensor]:
    if name == "sft":
        return _rows(B, seed=1)
    # Pairs (chosen rows, then rejected rows) or KTO examples (completions, then KL rows): 2B rows, B examples.
    batch = {**_rows(2 * B, seed=2), "pair_index": torch.arange(B)}
    if name == "kto":
        batch["desirable"] = torch.tensor([True, False, True])
    with torch.no_grad():
        logps, _ = model(**{k: batch[k] for k in ("input_ids", "position_ids", "labels")}, head=sequence_logps)
    # A reference that differs from the policy: nonzero log-ratios and KL estimate.
    batch["ref_logps"] = logps - torch.linspace(-1.0, 1.0, len(logps))
    return batch


@pytest.mark.parametrize("name", ["sft", "dpo", "simpo", "orpo", "kto"])
def test_the_backward_tensor_is_the_logged_loss(model, name):
    objective = build_objective(name, **KNOBS)
    batch = _batch(name, model)
    totals = objective.counts(batch)
    grad_scale = 2.0
    loss, sums = objective.step(model, batch, totals, grad_scale)
    logged = objective.report({k: float(v) for k, v in sums.items()}, totals)["loss"]
    # The fp32 tensor against the float64 sums of the same fp32 parts: at most 2 fp32 roundings apart (the scaling,
    # ORPO's sum of two terms); 16 unit roundoffs leave a margin of 8.
    assert float(loss.detach()) == pytest.approx(grad_scale * logged, rel=16 * unit_roundoff(torch.float32))
    assert abs(logged) > 1e-3  # a loss that is there, so that a missing term shows
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)
