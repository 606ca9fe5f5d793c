"""`fsdp_offload_params` with `fsdp_cpu_ram_efficient_loading` (the guide's QLoRA YAML), on 2 gloo ranks.

Under FSDP2's CPUOffloadPolicy the sharded parameters live in host RAM (pinned on CUDA), while the node's rank 0
sends each rank its rows over the communication device (the GPU under NCCL, which cannot write into host memory).
On CPU both are the host, so the test stands in for NCCL's rule: every tensor a collective receives into during
loading must not be one of FSDP's offloaded shards; the shards are filled by a copy, in place, so FSDP still owns
the very tensors that were written. Then the loaded weights (bf16 LoRA and 4-bit packed bytes with their states)
equal a plain load in which every rank reads the checkpoint, and three training steps give the same losses.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from shardtune.objectives.heads import token_loss

SEQ = 16


def _spec(model_dir: str, *, quantized: bool):
    from shardtune.models.builder import ModelSpec
    from shardtune.models.loading import bnb_config

    qconfig = None
    if quantized:
        qconfig = bnb_config(
            use_4bit=True, use_8bit=False, quant_type="nf4", compute_dtype_name="bfloat16", nested=True,
            storage_dtype_name="bfloat16",
        )  # fmt: skip
    return ModelSpec(
        model_name_or_path=model_dir, dtype=torch.bfloat16, n_tokens=256, param_dtype=torch.bfloat16, lora_r=4,
        lora_alpha=8, quantization_config=qconfig,
    )  # fmt: skip


def _fsdp_params(model):
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            yield from group.fsdp_params if group else []


def _build(spec, info, received: list, *, offload: bool):
    """Build the model (with `offload`, from each node's rank 0 into host RAM), recording the storage of every
    tensor a scatter or broadcast receives into."""
    import torch.distributed as dist

    from shardtune.parallel.parallelize import ShardingSettings
    from shardtune.parallel.setup import build_sharded_model

    scatter, broadcast = dist.scatter, dist.broadcast

    def spy_scatter(out, pieces=None, src=0, group=None, **kw):
        received.append(out.untyped_storage().data_ptr())
        return scatter(out, pieces, src=src, group=group, **kw)

    def spy_broadcast(t, src=0, group=None, **kw):
        received.append(t.untyped_storage().data_ptr())
        return broadcast(t, src=src, group=group, **kw)

    dist.scatter, dist.broadcast = spy_scatter, spy_broadcast
    try:
        torch.manual_seed(0)
        return build_sharded_model(spec, info, ShardingSettings(offload=offload, cpu_ram_efficient_loading=offload))
    finally:
        dist.scatter, dist.broadcast = scatter, broadcast


def _losses(model) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(3):
        total, n = model(ids, torch.arange(SEQ).repeat(2, 1), ids, head=token_loss)
        (total / n).backward()
        opt.step()
        opt.zero_grad()
        out.append(float(total.detach() / n))
    return out


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    from shardtune.models import quant
    from shardtune.parallel.mesh import init_distributed, shutdown

    info = init_distributed("FULL_SHARD")
    out = {}
    for quantized in (False, True):
        runs = {}
        for offload in (True, False):
            received: list[int] = []
            model = _build(_spec(model_dir, quantized=quantized), info, received, offload=offload)
            fsdp_params = list(_fsdp_params(model))
            shards = {fp.sharded_param.to_local().untyped_storage().data_ptr() for fp in fsdp_params}
            runs[offload] = {
                "offloaded": [fp.offload_to_cpu for fp in fsdp_params],
                "on_cpu": [fp.sharded_param.device.type == "cpu" for fp in fsdp_params],
                # FSDP's own flat shard is the tensor the parameter shows: the copy wrote into FSDP's storage.
                "owned": [
                    fp._sharded_param_data.untyped_storage().data_ptr()
                    == fp.sharded_param.to_local().untyped_storage().data_ptr()
                    for fp in fsdp_params
                ],
                "received_into_shard": sum(ptr in shards for ptr in received),
                "receives": len(received),
                "full": {n: p.full_tensor() for n, p in model.named_parameters()},
                "states": [
                    getattr(h, a).clone()
                    for _, layer in quant.linear4bit_modules(model)
                    for h, a in quant.quant_state_tensors(layer.quant_state)
                ],
                "losses": _losses(model),
            }
            del model
        out["4bit" if quantized else "bf16"] = runs
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    from shardtune.commands.demo import build_model

    model_dir, out_dir = tmp_path_factory.mktemp("model"), tmp_path_factory.mktemp("out")
    build_model(model_dir, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128)  # fmt: skip
    mp.spawn(_worker, args=(2, _free_port(), str(model_dir), str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("kind", ["bf16", "4bit"])
def test_offloaded_shards_are_filled_by_copy_not_by_the_collective(results, kind):
    for rank in results:
        off, plain = rank[kind][True], rank[kind][False]
        assert off["offloaded"] and all(off["offloaded"]) and all(off["on_cpu"]) and all(off["owned"])
        assert not any(plain["offloaded"])
        # Rank 1 receives one scatter per parameter, and rank 0 sends from a buffer too: neither ever lets the
        # collective write into an offloaded shard (what NCCL could not do with pinned host memory).
        assert off["receives"] >= len(off["full"]) and off["received_into_shard"] == 0


@pytest.mark.parametrize("kind", ["bf16", "4bit"])
def test_offload_with_efficient_loading_equals_a_plain_load(results, kind):
    for rank in results:
        off, plain = rank[kind][True], rank[kind][False]
        # The same bytes from the same checkpoint (4-bit: the same packed weights, compared as bytes since their
        # bf16 view holds NaN patterns, and the same quantization states).
        assert off["full"].keys() == plain["full"].keys()
        as_bytes = lambda t: t.contiguous().view(torch.uint8)
        for name, t in off["full"].items():
            assert torch.equal(as_bytes(t), as_bytes(plain["full"][name])), name
        assert len(off["states"]) == len(plain["states"]) == (70 if kind == "4bit" else 0)
        assert all(torch.equal(a, b) for a, b in zip(off["states"], plain["states"], strict=True))
        # Offload moves where the step runs, not what it computes: the same losses, bit for bit (same CPU kernels
        # on the same values; only the tensors' home differs).
        assert off["losses"] == plain["losses"] and off["losses"][-1] < off["losses"][0]
    assert results[0][kind][True]["losses"] == results[1][kind][True]["losses"]
