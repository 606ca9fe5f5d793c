"""Batches without a target token (--assistant_only_loss and no assistant turn in them) contribute nothing and
do not stop training, on one rank or on all; the loss stays normalised by the global number of targets."""

from __future__ import annotations

import os

import torch

from shardtune.models import loading, training_module
from shardtune.objectives.heads import token_loss
from tests.tolerance import TINY, decoder_chain, tol
from tests.unit.test_plan import _spawn_two

SEQ = 12


def _batch(seed: int, targets: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 600, (2, SEQ), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    if not targets:
        labels[:] = -100
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).repeat(2, 1), "labels": labels}


def _model(path) -> training_module.CausalLMForTraining:
    torch.manual_seed(0)
    base = loading.load_base_model(
        str(path), dtype=torch.float32, attn_impl=loading.attn_implementation(False, "cpu"), trust_remote_code=False
    )
    return training_module.CausalLMForTraining(base)


def test_a_batch_without_targets_gives_a_zero_loss_that_backpropagates(tiny_assets):
    model = _model(tiny_assets["model"])
    loss, n = model(**_batch(0, targets=False), head=token_loss)
    assert int(n) == 0 and float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()  # used to raise "element 0 of tensors does not require grad"
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    # Every parameter is reached (FSDP's reduce-scatters run on this rank too) and receives exactly zero.
    assert grads and all(g is not None and not g.any() for g in grads)


def _worker(rank: int, world: int, path: str, port: int, queue) -> None:
    """Rank 0's batch has targets, rank 1's none; then a step where no rank has any."""
    from shardtune.models.builder import ModelSpec
    from shardtune.parallel.mesh import init_distributed, shutdown
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.training.trainer import train_step

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_PORT=str(port)
    )
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    info = init_distributed()
    torch.manual_seed(0)
    spec = ModelSpec(model_name_or_path=path, dtype=torch.float32, n_tokens=600, use_peft_lora=False)
    model = build_sharded_model(spec, info)
    metrics, totals, _ = train_step(model, [_batch(rank, targets=rank == 0)], info)
    loss, n_targets = metrics["loss"], totals["targets"]
    # numpy, not tensors: a queue passes tensors as shared memory, gone once this process exits.
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    metrics0, totals0, _ = train_step(model, [_batch(rank, targets=False)], info)
    loss0, n0 = metrics0["loss"], totals0["targets"]
    all_zero = all(p.grad is not None and not p.grad.full_tensor().any() for p in model.parameters())
    queue.put((rank, {"loss": loss, "n": n_targets, "grads": grads, "loss0": loss0, "n0": n0, "zero": all_zero}))
    shutdown()


def test_two_ranks_one_without_targets_equal_one_process(tiny_assets):
    got = _spawn_two(_worker, tiny_assets["model"])
    # One process with both ranks' rows: the loss summed over its targets, divided by their number.
    ref = _model(tiny_assets["model"])
    both = {k: torch.cat([_batch(0, True)[k], _batch(1, False)[k]]) for k in ("input_ids", "position_ids", "labels")}
    loss_sum, n = ref(**both, head=token_loss)
    (loss_sum / n).backward()
    mean = float(loss_sum.detach() / n)
    # A forward and backward over 4 rows of 12 positions and 22 targets, in another order of sums.
    chain = decoder_chain(**TINY, seq=SEQ, vocab=600, tokens=22, backward=True)
    for rank in (0, 1):
        r = got[rank]
        assert r["n"] == int(n) == 22
        assert abs(r["loss"] - mean) <= tol(torch.float32, chain, mean)
        want = {name: p.grad for name, p in ref.named_parameters()}
        assert r["grads"].keys() == want.keys()
        for name, g in r["grads"].items():
            g = torch.from_numpy(g)
            torch.testing.assert_close(
                g, want[name], rtol=0, atol=tol(torch.float32, chain, float(want[name].abs().max()))
            )
        # A step without any target anywhere: a zero loss and zero gradients, not a crash.
        assert r["n0"] == 0 and r["loss0"] == 0.0 and r["zero"]
