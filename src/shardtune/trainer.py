"""The training loop, readable top to bottom: accumulate, clip, step, schedule, evaluate, log, save."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from shardtune.data import PreparedSplit, iterate_batches, num_batches
from shardtune.distributed.mesh import DistInfo, all_gather_objects, all_reduce_sum
from shardtune.log import print0


@dataclass
class LoopState:
    """Where the run stands; saved in checkpoints so that a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    nonfinite_steps: int = 0
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoopSettings:
    batch_size: int
    eval_batch_size: int
    grad_accum: int
    max_grad_norm: float
    total_steps: int
    steps_per_epoch: int
    seed: int
    pad_id: int
    logging_steps: int
    logging_strategy: str
    eval_strategy: str
    eval_steps: int
    save_strategy: str
    save_steps: int
    max_nonfinite_steps: int


class NonFiniteError(RuntimeError):
    pass


def steps_per_epoch(split: PreparedSplit, *, batch_size: int, world_size: int, grad_accum: int) -> int:
    return num_batches(split, batch_size=batch_size, world_size=world_size) // grad_accum


def _micro_batches(split: PreparedSplit, s: LoopSettings, info: DistInfo, state: LoopState) -> Iterator[dict]:
    """This rank's micro-batches from the current data position onwards, across epochs."""
    epoch, start = state.epoch, state.batch_in_epoch
    while True:
        it = iterate_batches(
            split,
            batch_size=s.batch_size,
            rank=info.rank,
            world_size=info.world_size,
            epoch=epoch,
            seed=s.seed,
            shuffle=True,
            start_batch=start,
            pad_id=s.pad_id,
        )
        for i, batch in enumerate(it):
            if start + i >= s.steps_per_epoch * s.grad_accum:
                break
            yield batch
        epoch, start = epoch + 1, 0


def train_step(model: nn.Module, batches: list[dict], info: DistInfo) -> tuple[float, int, int]:
    """Forward and backward over the micro-batches of one optimizer step.

    The loss is normalised by the number of target tokens in the whole global batch (all micro-batches, all
    ranks), so N ranks with batch B compute the same gradient as one process with batch N·B. FSDP averages
    gradients over ranks, hence the factor world_size.
    """
    local_targets = sum(int((b["labels"] != -100).sum()) for b in batches)
    local_tokens = sum(int(b["input_ids"].numel()) for b in batches)
    n_targets, n_tokens = (int(x) for x in all_reduce_sum([local_targets, local_tokens], info.device))
    scale = info.world_size / max(n_targets, 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    for b in batches:
        b = {k: v.to(info.device, non_blocking=True) for k, v in b.items()}
        loss, _ = model(**b)
        (loss * scale).backward()
        loss_sum += loss.detach().double()
    total = all_reduce_sum([loss_sum.item()], info.device)[0]
    return total / max(n_targets, 1), n_targets, n_tokens


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global gradient norm across all shards (DTensor grads reduce over the mesh); clip when max_norm > 0."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


@torch.no_grad()
def evaluate(model: nn.Module, split: PreparedSplit, *, batch_size: int, info: DistInfo, pad_id: int) -> dict:
    """Eval loss over every row of the split; every rank runs the same number of forwards (FSDP gathers)."""
    model.eval()
    n_rows = len(split.input_ids)
    global_batch = batch_size * info.world_size
    loss_sum, n_targets = 0.0, 0
    for start in range(0, n_rows, global_batch):
        rows = list(range(start, min(start + global_batch, n_rows)))[info.rank :: info.world_size]
        batch = _pad_rows(split, rows, pad_id) if rows else _dummy_batch(pad_id)
        batch = {k: v.to(info.device) for k, v in batch.items()}
        loss, n = model(**batch)
        loss_sum += float(loss)
        n_targets += int(n)
    total, count = all_reduce_sum([loss_sum, n_targets], info.device)
    model.train()
    eval_loss = total / max(count, 1)
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0)), "eval_tokens": int(count)}


def _pad_rows(split: PreparedSplit, rows: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(split.input_ids[r]) for r in rows)
    out = {
        "input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
        "labels": torch.full((len(rows), length), -100, dtype=torch.long),
        "position_ids": torch.arange(length).repeat(len(rows), 1),
    }
    for i, r in enumerate(rows):
        n = len(split.input_ids[r])
        out["input_ids"][i, :n] = torch.as_tensor(split.input_ids[r])
        out["labels"][i, :n] = torch.as_tensor(split.labels[r])
        out["position_ids"][i, :n] = torch.as_tensor(split.position_ids[r])
        out["position_ids"][i, n:] = torch.arange(length - n)
    return out


def _dummy_batch(pad_id: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.full((1, 8), pad_id, dtype=torch.long),
        "labels": torch.full((1, 8), -100, dtype=torch.long),
        "position_ids": torch.arange(8)[None],
    }


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _due(step: int, every: int, strategy: str, end_of_epoch: bool) -> bool:
    if strategy == "steps":
        return every > 0 and step % every == 0
    return strategy == "epoch" and end_of_epoch


def train(
    model: nn.Module,
    optimizer,
    scheduler,
    *,
    train_split: PreparedSplit,
    eval_split: PreparedSplit | None,
    info: DistInfo,
    s: LoopSettings,
    state: LoopState,
    logger,
    save_fn: Callable[[LoopState], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> LoopState:
    """Run optimizer steps until s.total_steps; returns the final state."""
    params = [p for p in model.parameters() if p.requires_grad]
    batches = _micro_batches(train_split, s, info, state)
    model.train()
    t0, tokens0 = time.perf_counter(), state.tokens
    while state.step < s.total_steps:
        step_batches = [next(batches) for _ in range(s.grad_accum)]
        loss, _, n_tokens = train_step(model, step_batches, info)
        grad_norm = clip_grad_norm(params, s.max_grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            optimizer.zero_grad(set_to_none=True)
            state.nonfinite_steps += 1
            print0(
                f"step {state.step + 1}: non-finite loss ({loss}) or grad norm ({grad_norm}); step skipped "
                f"({state.nonfinite_steps}/{s.max_nonfinite_steps})."
            )
            if state.nonfinite_steps >= s.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{state.nonfinite_steps} steps had a non-finite loss or gradient norm "
                    "(--max_nonfinite_steps); the last checkpoint is intact. Lower the learning rate "
                    "or check the data."
                )
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        _advance(state, s, n_tokens, loss)
        end_of_epoch = state.batch_in_epoch == 0
        if _due(state.step, s.logging_steps, s.logging_strategy, end_of_epoch) or state.step == s.total_steps:
            elapsed = time.perf_counter() - t0
            mem = all_gather_objects(round(peak_memory_gb(info.device), 3))
            record = {
                "loss": loss,
                "learning_rate": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm,
                "epoch": state.epoch + state.batch_in_epoch / max(s.steps_per_epoch * s.grad_accum, 1),
                "tokens": state.tokens,
                "tokens_per_s": (state.tokens - tokens0) / max(elapsed, 1e-9),
                "memory_gb": max(mem),
                "memory_per_rank_gb": mem,
            }
            logger.log_train(state.step, record)
        logger.progress(state.step, {"loss": loss, "lr": scheduler.get_last_lr()[0]})
        if eval_split is not None and _due(state.step, s.eval_steps, s.eval_strategy, end_of_epoch):
            logger.log_eval(
                state.step, evaluate(model, eval_split, batch_size=s.eval_batch_size, info=info, pad_id=s.pad_id)
            )
        if save_fn and (_due(state.step, s.save_steps, s.save_strategy, end_of_epoch) or stop_requested()):
            save_fn(state)
        if stop_requested():
            break
    return state


def _advance(state: LoopState, s: LoopSettings, n_tokens: int, loss: float) -> None:
    state.step += 1
    state.tokens += n_tokens
    state.losses.append(loss)
    state.batch_in_epoch += s.grad_accum
    if state.batch_in_epoch >= s.steps_per_epoch * s.grad_accum:
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
