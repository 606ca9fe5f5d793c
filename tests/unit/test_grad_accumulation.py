"""One optimizer step's gradient does not depend on how its global batch is cut into micro-batches: train_step over
2 micro-batches of unequal target counts gives the gradient (and the loss) of the token-mean loss over all their
rows. 2-rank parity runs use the same accumulation on both sides, so they cannot see a wrong per-micro-batch scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardtune.objectives.heads import token_loss
from shardtune.training.trainer import train_step
from tests.tolerance import tol

VOCAB, HIDDEN, SEQ = 32, 8, 6


class _TinyLM(nn.Module):
    """The training module's interface: (summed token cross-entropy, number of targets)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, position_ids, labels, head=None):  # computes the SFT head itself
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
        return loss, (labels != -100).sum()


def _batch(seed: int, targets_per_row: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(targets_per_row), SEQ), generator=g)
    labels = torch.randint(0, VOCAB, ids.shape, generator=g)
    for row, n in enumerate(targets_per_row):
        labels[row, n:] = -100
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).repeat(len(targets_per_row), 1), "labels": labels}


def test_two_micro_batches_give_the_gradient_of_the_token_mean(info):
    # 3 targets in the first micro-batch, 10 in the second: a mean per micro-batch would weigh them apart.
    micro = [_batch(1, [1, 2]), _batch(2, [5, 5])]
    model = _TinyLM()
    metrics, totals, _ = train_step(model, micro, info)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = _TinyLM()
    both = {k: torch.cat([b[k] for b in micro]) for k in micro[0]}
    loss_sum, n = ref(**both, head=token_loss)
    (loss_sum / n).backward()
    assert totals["targets"] == int(n) == 13
    # The same sums in another order: the head over HIDDEN, the softmax over VOCAB, the loss over 13 targets.
    chain = HIDDEN + VOCAB + 13
    mean = float(loss_sum.detach() / n)
    assert abs(metrics["loss"] - mean) <= tol(torch.float32, chain, mean)
    for name, p in ref.named_parameters():
        scale = float(p.grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=tol(torch.float32, chain, scale))
