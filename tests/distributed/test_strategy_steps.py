"""The sharding strategies the suite's CLI parity runs leave to `-m bench` (SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD
over two machines, reading the weights once per machine), each in two optimizer steps of the model the training
run builds (`build_sharded_model`, `train_step`) against one process with the same global batch.

Four spawned processes over gloo play two machines of two (LOCAL_WORLD_SIZE 2: ranks 0-1 and 2-3, what torchrun
sets on two nodes), all with fsdp_cpu_ram_efficient_loading. One spawn runs the three strategies in turn (one
process start, three models): step 1's loss and every parameter's full gradient on every rank, an SGD update,
step 2's loss, and which ranks read the weight files (`SHARDTUNE_LOAD_LOG`). The bench tests
(tests/distributed/test_parity.py's strategy matrix, test_multinode.py, test_node_loading.py) run the same
behaviours through the CLI and the launcher; the launcher's two-machine rendezvous is tests/unit/test_launcher.py's."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from shardtune.models import loading, training_module
from shardtune.objectives.heads import token_loss
from tests.tolerance import TINY, decoder_chain, parity, tol

SEQ, ROWS, WORLD, PER_NODE = 16, 2, 4, 2
LR = 0.5  # SGD: step 2's loss moves by far more than its tolerance (asserted below)
STRATEGIES = ("SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def _batch(dp_rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(3, 600, (ROWS, SEQ), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).repeat(ROWS, 1), "labels": labels}


def _worker(rank: int, path: str, port: int, log: str, queue) -> None:
    from shardtune.models.builder import ModelSpec
    from shardtune.parallel.mesh import init_distributed, shutdown
    from shardtune.parallel.parallelize import ShardingSettings
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.training.trainer import train_step

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    for strategy in STRATEGIES:
        os.environ["SHARDTUNE_LOAD_LOG"] = os.path.join(log, strategy)
        info = init_distributed(strategy)  # the process group once; a mesh for each strategy
        torch.manual_seed(0)
        spec = ModelSpec(model_name_or_path=path, dtype=torch.float32, n_tokens=600, use_peft_lora=False)
        model = build_sharded_model(
            spec, info, ShardingSettings(sharding_strategy=strategy, cpu_ram_efficient_loading=True)
        )
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        batch = _batch(info.dims.dp_rank)
        m1, _, _ = train_step(model, [batch], info)
        grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        m2, _, _ = train_step(model, [batch], info)
        dims = (info.dims.dp_rank, info.dims.dp_replicate, info.dims.shard_size)
        # numpy, not tensors: a queue passes tensors as shared memory, gone once this process exits.
        queue.put((strategy, rank, {"loss1": m1["loss"], "loss2": m2["loss"], "grads": grads, "dims": dims}))
        del model, opt
    shutdown()


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory):
    """strategy → rank → its numbers, and the load log's folder; the one-process reference's numbers."""
    import torch.multiprocessing as mp

    log = tmp_path_factory.mktemp("load_log")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, str(tiny_assets["model"]), port, str(log), queue)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got: dict[str, dict[int, dict]] = {s: {} for s in STRATEGIES}
    for _ in range(WORLD * len(STRATEGIES)):
        strategy, rank, numbers = queue.get(timeout=300)
        got[strategy][rank] = numbers
    for p in procs:
        p.join(timeout=60)
    return got, log, _reference(tiny_assets["model"])


def _reference(path) -> dict:
    """One process, every rank's rows in one batch: two SGD steps on the token-mean loss."""
    torch.manual_seed(0)
    base = loading.load_base_model(
        str(path), dtype=torch.float32, attn_impl=loading.attn_implementation(False, "cpu"), trust_remote_code=False
    )
    model = training_module.CausalLMForTraining(base)
    both = {k: torch.cat([_batch(r)[k] for r in range(WORLD)]) for k in ("input_ids", "position_ids", "labels")}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_sum, n = model(**both, head=token_loss)
    (loss_sum / n).backward()
    loss_sum = loss_sum.detach()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss2_sum, _ = model(**both, head=token_loss)
    return {"loss1": float(loss_sum / n), "loss2": float(loss2_sum / n), "n": int(n), "grads": grads}


@pytest.mark.parametrize(
    ("strategy", "layout"),
    [
        ("SHARD_GRAD_OP", (1, 4)),  # sharded over all 4, parameters kept gathered between forward and backward
        ("NO_SHARD", (4, 1)),  # 4 full replicas, gradients all-reduced
        ("HYBRID_SHARD", (2, 2)),  # sharded within each machine of 2, replicated across the 2 machines
    ],
)
def test_strategy_trains_like_one_process_and_reads_once_per_machine(runs, strategy, layout):
    """Bugs caught: a strategy's mesh built wrong (replicas whose gradients are not all-reduced, or shards that
    span the wrong ranks), FSDP's averaging over the replicate axis not undone (a gradient scaled by 1/replicas),
    a shard or replica left unfilled when a machine's rank 0 hands out the weights, a step 2 that runs on weights
    the update did not reach (SHARD_GRAD_OP keeps them gathered after forward), and a rank other than a machine's
    first reading the checkpoint (or a machine whose first rank does not)."""
    got, log, ref = runs
    ranks = got[strategy]
    assert sorted(ranks) == list(range(WORLD))
    assert sorted(r["dims"][0] for r in ranks.values()) == list(range(WORLD))  # 4 distinct batches
    assert {r["dims"][1:] for r in ranks.values()} == {layout}
    assert sorted(p.name for p in (log / strategy).iterdir()) == ["loaded-rank0", "loaded-rank2"]
    # One forward and backward over 8 rows of 16 positions, in another order of sums; step 2 after an update whose
    # gradients agree to that: the chains of two steps (tests/tolerance.py's `parity`).
    chain = decoder_chain(**TINY, seq=SEQ, vocab=600, tokens=ref["n"], backward=True)
    rtol2 = parity(steps=2, seq=SEQ, tokens_per_step=ref["n"], lr=LR)["rtol"]
    # The update moved the loss (by 6%) far beyond that tolerance (0.1%): step 2 on un-updated weights is caught.
    assert ref["loss1"] - ref["loss2"] > 20 * rtol2 * ref["loss1"]
    for rank, r in ranks.items():
        assert abs(r["loss1"] - ref["loss1"]) <= tol(torch.float32, chain, ref["loss1"]), (rank, r["loss1"], ref)
        assert abs(r["loss2"] - ref["loss2"]) <= rtol2 * ref["loss2"], (rank, r["loss2"], ref)
        assert r["grads"].keys() == ref["grads"].keys()
        for name, g in r["grads"].items():
            want = ref["grads"][name]
            atol = tol(torch.float32, chain, float(want.abs().max()))
            torch.testing.assert_close(torch.from_numpy(g), want, rtol=0, atol=atol, msg=f"rank {rank}: {name}")
