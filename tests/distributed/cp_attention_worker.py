"""One rank of tests/distributed/test_context_parallel.py's attention check (run under torchrun, gloo): this rank's
context-parallel attention of a crafted packed row, forward and backward, against autograd over the whole row in
one process; writes its errors as JSON to argv[1] (rank 0)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.models.fastpath import _context_parallel_attention
from shardtune.parallel import split
from shardtune.parallel.context_parallel import groups, shard_batch


def main(out: str, lengths: list[int]) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = groups(size, size)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    length = pos.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, length, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    grad_out = torch.randn(1, length, 4, 8, generator=g, dtype=torch.float64)
    # one process: per-document causal attention of the whole row
    docs = split.document_ids(pos)[0]
    allowed = (docs[:, None] == docs[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(full[0], full[1], full[2], attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    ref.backward(grad_out)
    # this rank
    batch = {"input_ids": torch.zeros_like(pos), "position_ids": pos, "labels": torch.zeros_like(pos)}
    _, shard = shard_batch(batch, group=group, size=size, rank=rank, pad_id=0)
    mine = split.zigzag(length, size, rank)
    local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
    got = _context_parallel_attention(*local, shard, 0.0, None)
    got.backward(grad_out[:, mine])
    errors = {"out": float((got - ref[:, mine]).abs().max())}
    for name, mine_t, whole in zip("qkv", local, full, strict=True):
        errors[f"grad_{name}"] = float((mine_t.grad - whole.grad[:, :, mine]).abs().max())
    crossing = sum(p.key_start is not None for p in shard.rows[0])
    gathered = [None] * size
    dist.all_gather_object(gathered, {"errors": errors, "crossing_parts": crossing})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
