"""The ranks of tests/distributed/test_tensor_parallel.py: build the run's sharded model (`build_sharded_model`)
with a tensor-parallel axis, train it a few SGD steps (`train_step`, the trainer's `clip_grad_norm`) and report
the losses, gradient norms and trained tensors; optionally with a planted bug of the class the parity check must
catch (PLANTS). Imported by spawned processes only."""

from __future__ import annotations

import math
import os
import traceback

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from shardtune.parallel import context_parallel, setup, tensor
from shardtune.parallel.parallelize import ShardingSettings

SEQ, ROWS, STEPS = 16, 2, 3
LR = 0.5  # SGD: each step moves the loss by far more than the tolerance


def batch(dp_rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(3, 600, (ROWS, SEQ), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "position_ids": torch.arange(SEQ).repeat(ROWS, 1), "labels": labels}


def spec_for(path: str, lora: bool, *, dora: bool = False, cp: int = 1):
    """The tiny model's spec: LoRA (or DoRA) on every linear layer, or full fine-tuning; with `cp`, the
    attention context parallelism runs (SDPA per part of the split rows, as a CPU run chooses)."""
    from shardtune.models.builder import ModelSpec
    from shardtune.models.loading import context_parallel_attention

    return ModelSpec(
        model_name_or_path=path, dtype=torch.float32, n_tokens=600, use_peft_lora=lora, lora_r=8, lora_alpha=16,
        lora_dropout=0.0, lora_target_modules="all-linear", use_dora=dora, context_parallel=cp,
        attn_impl=context_parallel_attention("sdpa", cp, torch.float32)[0],
    )  # fmt: skip


# ---------------------------------------------------------------- planted bugs


class _UnreducedRowwise(RowwiseParallel):
    """Row-parallel layer whose partial products are returned without their all-reduce (each rank keeps its own
    slice's share of the sum)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()


class _LoraBOnRankDim(ParallelStyle):
    """lora_B (out × r) of a column-parallel layer sharded on its rank dimension r instead of its output
    dimension, with the local forward a column-parallel layer would run (no reduction): each rank multiplies its
    r-slice of the adapter's hidden vector and keeps its output slice, so the other r-slices' terms are lost."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        w = module.weight
        module.weight = nn.Parameter(distribute_tensor(w.data, mesh, [Shard(1)]), requires_grad=w.requires_grad)
        r, n = mesh.get_local_rank(), mesh.size()

        def forward(h: torch.Tensor) -> torch.Tensor:
            part = h.chunk(n, -1)[r] @ module.weight.to_local().t()
            return part.chunk(n, -1)[r]

        module.forward = forward
        return module


def _init_after_sharding(fill):
    """LoRA's lora_A initialised on each rank's slice once the model is sharded and filled (as a layer built on
    local shapes would be): kaiming-uniform with the slice's fan-in, the same draw on every rank."""

    def fill_then_init(train_module, *args, **kwargs):
        fill(train_module, *args, **kwargs)
        with torch.no_grad():
            for name, m in train_module.named_modules():
                if name.endswith("lora_A.default") and "tp" in (m.weight.device_mesh.mesh_dim_names or ()):
                    torch.manual_seed(1)
                    nn.init.kaiming_uniform_(m.weight.to_local(), a=math.sqrt(5))

    return fill_then_init


def _row_parallel_norm_unreduced(self, sq: torch.Tensor) -> torch.Tensor:
    """DoRA's row-parallel layers' squared norms left unsummed: each rank's over its own columns only."""
    return sq


def _cp_groups_without_tp():
    """The cp groups laid out as if there were no tp axis: consecutive ranks, so a tp pair exchanges keys and
    values as if it held two parts of one row (the same shapes, other heads)."""
    real = context_parallel.groups
    return lambda world_size, size, tp=1: real(world_size, size)


def plant(bug: str | None) -> None:
    if bug == "unreduced_rowwise":
        tensor.STYLES["rowwise"] = _UnreducedRowwise
    elif bug == "lora_b_on_rank_dim":
        real = tensor.factor_style
        tensor.factor_style = lambda kind: _LoraBOnRankDim() if kind == "colwise" else real(kind)
    elif bug == "init_after_sharding":
        setup._fill = _init_after_sharding(setup._fill)
    elif bug == "dora_norm_unreduced":
        tensor.SlicedDora.sum_squares = _row_parallel_norm_unreduced
    elif bug == "cp_groups_without_tp":
        context_parallel.groups = _cp_groups_without_tp()


# ---------------------------------------------------------------- one run


def train(path: str, lora: bool, tp: int, out: str | None, dora: bool = False, cp: int = 1) -> dict:
    """Build the sharded model with `tp` (and `cp`), train STEPS SGD steps; this rank's numbers (numpy: a queue
    passes tensors as shared memory, gone once the process exits). With `out`, save the adapter and a checkpoint
    there."""
    from shardtune.parallel.gather import gather_trainable
    from shardtune.parallel.mesh import init_distributed
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.training.trainer import clip_grad_norm, train_step

    info = init_distributed("FULL_SHARD", tp=tp, cp=cp)
    torch.manual_seed(0)
    # FULL_SHARD, one reader per node (its rank 0 fills the other ranks' slices and shards).
    spec = spec_for(path, lora, dora=dora, cp=cp)
    model = build_sharded_model(spec, info, ShardingSettings(cpu_ram_efficient_loading=True))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        metrics, _, _ = train_step(model, [batch(info.dims.dp_rank)], info)
        losses.append(metrics["loss"])
        norms.append(clip_grad_norm(params, 0.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = {n: t.numpy() for n, t in gather_trainable(model.model).items()}
    if out and lora:
        _save(model, opt, info, path, out)
    dims = (info.dims.dp_rank, info.dims.tp_rank, info.dims.tp) + ((info.dims.cp_rank,) if cp > 1 else ())
    return {"losses": losses, "norms": norms, "trained": trained, "dims": dims}


def _save(model, opt, info, path: str, out: str) -> None:
    """What the run writes, into `out`: the adapter (gathered from the slices) and a DCP checkpoint of step STEPS
    (shardtune's own save: each rank's shards of the slices, at their offsets in the whole tensors)."""
    from transformers import AutoTokenizer

    from shardtune.parallel import checkpoint
    from shardtune.parallel.gather import gather_trainable
    from shardtune.training.export import save_adapter

    trained = gather_trainable(model.model)
    if info.is_main:
        save_adapter(model.model, trained, AutoTokenizer.from_pretrained(path), out)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    checkpoint.save(out, model=model, optimizer=opt, scheduler=scheduler, loop_state={"step": STEPS}, config={})


def worker(rank: int, world: int, port: int, path: str, runs: list, queue) -> None:
    """`runs`: (key, lora, tp, bug, out[, options of `train`: dora, cp]) in order; each puts (key, rank,
    numbers) on the queue."""
    from shardtune.parallel.mesh import shutdown

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    styles, factor, fill = dict(tensor.STYLES), tensor.factor_style, setup._fill
    sum_squares, cp_groups = tensor.SlicedDora.sum_squares, context_parallel.groups
    for key, lora, tp, bug, out, *options in runs:
        plant(bug)
        try:
            numbers = train(path, lora, tp, out, **(options[0] if options else {}))
        except Exception as e:  # a planted bug may also crash: the parity check fails either way  # noqa: BLE001
            numbers = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        queue.put((key, rank, numbers))
        tensor.STYLES.update(styles)
        tensor.factor_style, setup._fill = factor, fill
        tensor.SlicedDora.sum_squares, context_parallel.groups = sum_squares, cp_groups
    shutdown()
