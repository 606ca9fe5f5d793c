"""The collectives of context parallelism (shardtune.parallel.split holds the split and the attention): the cp
process groups, the all-gather of a row's keys and values and the sum of per-row values over the cp ranks, each
with its exact backward, and a rank's part of a micro-batch."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from shardtune.models.fastpath import packed_documents
from shardtune.parallel import split
from shardtune.parallel.split import CPShard


def groups(world_size: int, size: int, tp: int = 1):
    """This rank's cp process group: every rank creates every group (torch.distributed requires it), in the same
    order. The mesh's axes are (data, cp, tp), tp innermost (shardtune.parallel.dims): the cp ranks of a
    data-parallel batch that hold the same tp slice are `size` ranks `tp` apart, from block·size·tp + t (one group
    per batch and slice; without tp, ranks r·size .. r·size + size - 1)."""
    mine = None
    rank = dist.get_rank()
    for start in range(0, world_size, size * tp):
        for t in range(tp):
            ranks = list(range(start + t, start + size * tp, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


class _GatherPositions(torch.autograd.Function):
    """All-gather along the position dimension (2) within the cp group; backward: the gradient of every gathered
    position summed over the group, this rank's part kept (a reduce-scatter; on gloo, which has none, an
    all-reduce and a slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank = group, size, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        chunks = list(grad.contiguous().chunk(ctx.size, dim=2))
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(chunks[ctx.rank])
            dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=ctx.group)
            return out, None, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None, None, None


class _SumOverRanks(torch.autograd.Function):
    """The sum of a tensor over the cp group (all-reduce). Backward: every rank's loss may read the sum, so the
    gradient of its own term is the sum of the ranks' gradients of the sum (all-reduce again): the adjoint of an
    all-reduce, so the ranks' losses add up to the objective of one process."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# The token id of the positions context parallelism pads rows with: a document of its own without targets, so the
# id never reaches a loss (any id of the vocabulary would do).
PAD_FOR_CP = 0


def local_part(batch: dict, info, model) -> tuple[dict, CPShard | None]:
    """This rank's part of a micro-batch and its CPShard: all of it and None, or with context parallelism its
    share of every row's positions (shardtune.parallel.split), its attention as the training module `model`
    runs it (`cp_varlen`). The module reads the shard for the micro-batch's forward and its recomputation in
    backward: the caller sets `model.cp_shard` before each micro-batch's forward (shardtune.training.trainer)."""
    if info.dims.cp == 1:
        return batch, None
    return shard_batch(batch, group=info.cp_group, size=info.dims.cp, rank=info.dims.cp_rank, pad_id=PAD_FOR_CP,
                       varlen=model.cp_varlen)  # fmt: skip


def shard_batch(batch: dict, *, group, size: int, rank: int, pad_id: int, varlen: bool = False) -> tuple[dict, CPShard]:
    """This rank's part of a micro-batch and the CPShard its attention reads; `varlen`: as one flash-attention
    varlen call (CUDA) rather than SDPA per part."""
    local, rows, order = split.split(batch, size=size, rank=rank, pad_id=pad_id)

    def gather(x: torch.Tensor) -> torch.Tensor:
        return _GatherPositions.apply(x, group, size, rank).index_select(2, order.to(x.device))

    def sum_rows(x: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(x, group)

    shard = local_shard(rows, local["position_ids"], gather, size=size, varlen=varlen, sum_rows=sum_rows)
    index = split.zigzag(split.padded_length(batch["input_ids"].shape[1], size), size, rank)
    tokens = functools.partial(_gather_tokens, group=group, size=size, rank=rank)
    return local, replace(shard, row_index=index.to(local["position_ids"].device),
                          length=batch["input_ids"].shape[1], gather_tokens=tokens)  # fmt: skip


def _gather_tokens(router_logits: tuple, mask: torch.Tensor, *, group, size: int, rank: int):
    """(every layer's router logits, their mask) of the cp group's tokens, rank after rank: one all-gather of
    the layers stacked (its backward sums each rank's gradient of every copy, _GatherPositions), one of the mask."""
    stacked = torch.stack([t.reshape(-1, t.shape[-1]) for t in router_logits])[None]  # [1, layers, tokens, E]
    gathered = _GatherPositions.apply(stacked, group, size, rank)[0]
    masks = [torch.empty_like(mask) for _ in range(size)]
    dist.all_gather(masks, mask.contiguous(), group=group)
    return tuple(gathered.unbind(0)), torch.cat(masks)


def local_shard(rows, positions: torch.Tensor, gather, *, size: int, varlen: bool = False, sum_rows=None) -> CPShard:
    """The CPShard of a rank's parts (split.split's `rows`) and its local position ids: each local
    part's per-document spans (read from its own position ids), and with `varlen` the whole attention's varlen
    layout, both built on the host once per micro-batch and moved to the positions' device."""
    rows = tuple(
        tuple(p if p.key_start is not None
              else replace(p, spans=packed_documents(positions[b : b + 1, p.start : p.end])[0]) for p in parts)
        for b, parts in enumerate(rows)
    )  # fmt: skip
    layout = None
    host = positions.detach().cpu()
    if varlen:
        # every rank holds L / size of a row
        layout = split.varlen(rows, host, host.shape[1] * size).to(positions.device)
    return CPShard(rows, gather, layout, sum_rows, host, size)
