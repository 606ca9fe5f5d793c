"""The training loop, readable top to bottom: accumulate, clip, step, schedule, evaluate, log, save."""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu

from shardtune.data import PreparedSplit, StreamingSplit, iterate_batches
from shardtune.objectives.heads import token_loss
from shardtune.objectives.loss import Objective
from shardtune.parallel.context_parallel import local_part
from shardtune.parallel.mesh import DistInfo, all_gather_objects, all_reduce_sum
from shardtune.parallel.tensor import clip_grad_norm_by_mesh, mixed_meshes
from shardtune.runtime.log import print0, warn0
from shardtune.runtime.signals import SAME_STOP_WITHIN_S

# A streamed epoch's length is unknown: its steps never end an epoch in _advance; the stream position does.
STREAMING_STEPS_PER_EPOCH = 2**62
# Steps in a row with a zero gradient norm after which a run has collapsed: no update can change its weights any
# more (a too-large learning rate that killed every activation, or a loss that no longer depends on them).
COLLAPSE_STEPS = 5


@dataclass
class LoopState:
    """Where the run stands; saved in checkpoints so that a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    nonfinite_steps: int = 0
    zero_grad_steps: int = 0  # steps in a row whose gradient norm was 0
    collapsed_at: int | None = None  # the step at which training was found collapsed (see _watch_collapse)
    losses: list[float] = field(default_factory=list)
    stream: list[int] | None = None  # --streaming: [epoch, window, rows of the window consumed] (data/stream.py)
    rollout: str | None = None  # online RL: the generation batch being trained on (rl.rollout.Generation's record)

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
    # --enable_activation_offloading: what the training forward saves for backward is kept in host memory.
    activation_offloading: bool = False


class NonFiniteError(RuntimeError):
    pass


class StopFlag:
    """SIGTERM/SIGINT: finish the current step, save, exit. The ranks agree on the step to stop at.

    torchrun forwards the signal it receives to every worker, so a worker may see one Ctrl-C twice within
    milliseconds; a signal repeated later than SAME_STOP_WITHIN_S seconds ends the process at once.
    """

    def __init__(self, device):
        self.device, self.signal, self.first, self.announced = device, None, None, False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        now = time.monotonic()
        if self.first is not None and now - self.first > SAME_STOP_WITHIN_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.first is None:
            self.first, self.signal = now, signal.Signals(signum).name

    def __call__(self) -> bool:
        """Whether any rank received a signal (a collective: every rank calls it once per step)."""
        stop = all_reduce_sum([float(self.signal is not None)], self.device)[0] > 0
        if stop and not self.announced:
            self.announced = True
            print0(f"Stop requested ({self.signal or 'a signal on another rank'}): saving a checkpoint, then stopping.")
        return stop


def steps_per_epoch(split: PreparedSplit, *, batch_size: int, world_size: int, grad_accum: int) -> int:
    return split.num_batches(batch_size=batch_size, world_size=world_size) // grad_accum


def _micro_batches(split: PreparedSplit, settings: LoopSettings, info: DistInfo, state: LoopState) -> Iterator[dict]:
    """This rank's micro-batches from the current data position onwards, across epochs."""
    if hasattr(split, "micro_batches"):  # generated as the run goes (online RL: shardtune.rl.rollout)
        yield from split.micro_batches(state, settings.steps_per_epoch * settings.grad_accum)
        return
    if isinstance(split, StreamingSplit):
        stream = split.batches(
            batch_size=settings.batch_size,
            rank=info.dims.dp_rank,
            world_size=info.dims.dp_size,
            seed=settings.seed,
            position=state.stream,
        )
        for batch, position in stream:
            state.stream = position  # set before the batch is used: a checkpoint after it resumes past it
            yield batch
        return
    epoch, start = state.epoch, state.batch_in_epoch
    while True:
        it = split.iterate(
            batch_size=settings.batch_size,
            rank=info.dims.dp_rank,
            world_size=info.dims.dp_size,
            epoch=epoch,
            seed=settings.seed,
            shuffle=True,
            start_batch=start,
            pad_id=settings.pad_id,
        )
        for i, batch in enumerate(it):
            if start + i >= settings.steps_per_epoch * settings.grad_accum:
                break
            yield batch
        epoch, start = epoch + 1, 0


def train_step(
    model: nn.Module,
    batches: list[dict],
    info: DistInfo,
    objective: Objective | None = None,
    *,
    activation_offloading: bool = False,
):
    """Forward and backward over the micro-batches of one optimizer step; returns (metrics, totals, tokens).

    The objective normalises by its counts over the whole global batch (all micro-batches, all ranks: target
    tokens for SFT, pairs for preference objectives), so N ranks with batch B compute the same gradient as one
    process with batch N·B. FSDP averages gradients over the data-parallel ranks, hence the factor dp_size.
    activation_offloading: the forward's saved tensors go to host memory (saved_on_host).
    """
    objective = objective or Objective()
    return _run_objective(model, batches, info, objective, backward=True, offload=activation_offloading)


def saved_on_host(offload: bool, device: torch.device):
    """Where the training forward runs: with `offload` (--enable_activation_offloading), every tensor autograd
    saves for backward is copied to host memory (pinned, from a GPU) and back when backward needs it: torch's own
    save_on_cpu, no hooks of ours. With checkpointing what the forward saves is each block's input (what happens
    inside a checkpointed block goes to the checkpoint's own hooks), the final norm's and the loss's inputs
    (planning.activations.offloaded_tensor_bytes): the GPU then holds only the input of the block being recomputed.
    On CPU the "copy" is the tensor itself."""
    if not offload:
        return contextlib.nullcontext()
    return save_on_cpu(pin_memory=device.type == "cuda")


def _run_objective(
    model: nn.Module,
    batches: list[dict],
    info: DistInfo,
    objective: Objective,
    *,
    backward: bool,
    offload: bool = False,
):
    parts_of = [local_part(b, info, model) for b in batches]
    # Counted over what each rank computes: its positions' targets (SFT), and with context parallelism the whole
    # rows of a paired objective, whose per-row log-probs every cp rank holds summed (each rank's loss is then
    # its 1/cp share: counts and sums over all ranks stay those of one process).
    local = [objective.counts(b if objective.paired else part) for b, (part, _) in zip(batches, parts_of, strict=True)]
    keys = sorted(local[0])
    local_tokens = sum(int(part["input_ids"].numel()) for part, _ in parts_of)
    reduced = all_reduce_sum([sum(c[k] for c in local) for k in keys] + [local_tokens], info.device, info.dims)
    totals = {k: int(v) for k, v in zip(keys, reduced, strict=False)}
    sums: dict[str, torch.Tensor] = {}
    for part, shard in parts_of:
        b = {k: v.to(info.device, non_blocking=True) for k, v in part.items()}
        model.cp_shard = shard  # this micro-batch's, for its forward and the recomputation in its backward
        with saved_on_host(offload, info.device):
            loss, parts = objective.step(model, b, totals, info.dims.gradient_divisor)
        if backward:
            loss.backward()
        for k, v in parts.items():
            sums[k] = sums[k] + v if k in sums else v
    names = sorted(sums)
    reduced_sums = all_reduce_sum([sums[k].item() for k in names], info.device, info.dims)
    return objective.report(dict(zip(names, reduced_sums, strict=True)), totals), totals, int(reduced[-1])


@torch.no_grad()
def evaluate_objective(model: nn.Module, split, objective: Objective, *, batch_size: int, info: DistInfo, pad_id: int):
    """An objective's metrics over every pair of a preference split (filler pairs count nowhere), prefixed eval_.

    All pairs form one global batch, cut into micro-batches: the metrics are means over the whole split."""
    model.eval()
    dims = info.dims
    kw = {"batch_size": batch_size, "rank": dims.dp_rank, "world_size": dims.dp_size, "epoch": 0, "seed": 0}
    batches = list(split.iterate(**kw, shuffle=False, pad_id=pad_id, drop_last=False))
    metrics, _, _ = _run_objective(model, batches, info, objective, backward=False)
    model.train()
    return {f"eval_{k}": v for k, v in metrics.items()}


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global gradient norm across all shards (DTensor grads reduce over the mesh); clip when max_norm > 0."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if mixed_meshes(grads):  # tensor parallelism: sliced and whole gradients on two meshes
        return clip_grad_norm_by_mesh(grads, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


@torch.no_grad()
def evaluate(model: nn.Module, split: PreparedSplit, *, batch_size: int, info: DistInfo, pad_id: int) -> dict:
    """Eval loss over every row of the split, batched as training batches them (data.collate) without shuffling;
    the last global batch is filled with rows without targets, so every rank runs the same number of forwards
    (FSDP gathers) and the loss, a sum over targets, is unchanged."""
    model.eval()
    dims = info.dims
    batches = iterate_batches(
        split,
        batch_size=batch_size,
        rank=dims.dp_rank,
        world_size=dims.dp_size,
        epoch=0,
        seed=0,
        shuffle=False,
        pad_id=pad_id,
        drop_last=False,
    )
    loss_sum, n_targets = 0.0, 0
    for batch in batches:
        batch, model.cp_shard = local_part(batch, info, model)
        loss, n = model(**{k: v.to(info.device) for k, v in batch.items()}, head=token_loss)
        loss_sum += float(loss)
        n_targets += int(n)
    total, count = all_reduce_sum([loss_sum, n_targets], info.device, info.dims)
    model.train()
    eval_loss = total / max(count, 1)
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0)), "eval_tokens": int(count)}


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30

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
    settings: LoopSettings,
    state: LoopState,
    logger,
    save_fn: Callable[[LoopState], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
    objective: Objective | None = None,
    callbacks: Sequence[Callable[[LoopState, int], None]] = (),
) -> LoopState:
    """Run optimizer steps until settings.total_steps, minimising `objective` (default: SFT); returns the final state.

    `callbacks` run after each step's logging and evaluation, before the stop decision: fn(state, rank)
    (shardtune.runtime.hooks.step_callbacks for tests' fault injection)."""
    objective = objective or Objective()
    if settings.activation_offloading and info.device.type != "cuda":  # said once per run
        warn0("--enable_activation_offloading: no CUDA device, so the saved activations already live in host "
              "memory and nothing is offloaded (the flag changes nothing on this run).")  # fmt: skip
    offload = settings.activation_offloading
    params = [p for p in model.parameters() if p.requires_grad]
    batches = _micro_batches(train_split, settings, info, state)
    model.train()
    t0, tokens0 = time.perf_counter(), state.tokens
    while state.step < settings.total_steps:
        step_batches = [next(batches) for _ in range(settings.grad_accum)]
        metrics, _, n_tokens = train_step(model, step_batches, info, objective, activation_offloading=offload)
        loss = metrics["loss"]
        grad_norm = clip_grad_norm(params, settings.max_grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        else:
            _skip_nonfinite(state, settings, loss, grad_norm)
        # The model's gradients, not the optimizer's: a bitsandbytes optimizer steps aliases (LocalShards).
        model.zero_grad(set_to_none=True)
        scheduler.step()
        _advance(state, settings, n_tokens, loss)
        _watch_collapse(state, settings, loss, grad_norm, scheduler.get_last_lr()[0], _vocab_size(model), logger)
        end_of_epoch = state.batch_in_epoch == 0
        if (
            _due(state.step, settings.logging_steps, settings.logging_strategy, end_of_epoch)
            or state.step == settings.total_steps
        ):
            record = _train_record(state, settings, info, loss, grad_norm, scheduler, t0, tokens0)
            generated = train_split.metrics() if hasattr(train_split, "metrics") else {}  # online RL's rollouts
            logger.log_train(state.step, {**record, **generated, **metrics})
        logger.progress(state.step, {"loss": loss, "lr": scheduler.get_last_lr()[0]})
        if eval_split is not None and _due(state.step, settings.eval_steps, settings.eval_strategy, end_of_epoch):
            logger.log_eval(state.step, evaluate_split(model, eval_split, objective, settings, info))
        for callback in callbacks:
            callback(state, info.rank)
        # One collective per step, so that every rank takes the same decision.
        stop = stop_requested()
        # A scheduled save waits for a finite step: the weights that just gave a non-finite loss are not a
        # state worth keeping over the previous checkpoint. A stop request saves regardless.
        if save_fn and (
            stop or (finite and _due(state.step, settings.save_steps, settings.save_strategy, end_of_epoch))
        ):
            save_fn(state)
        if stop:
            break
    return state


def evaluate_split(model: nn.Module, split, objective: Objective, settings: LoopSettings, info: DistInfo) -> dict:
    """The eval metrics of `objective` on `split` (SFT: eval_loss and perplexity over every target token)."""
    if objective.paired:
        return evaluate_objective(
            model, split, objective, batch_size=settings.eval_batch_size, info=info, pad_id=settings.pad_id
        )
    return evaluate(model, split, batch_size=settings.eval_batch_size, info=info, pad_id=settings.pad_id)


def _skip_nonfinite(state: LoopState, settings: LoopSettings, loss: float, grad_norm: float) -> None:
    """Count a step whose loss or gradient norm is not finite (its update is dropped); stop after too many."""
    state.nonfinite_steps += 1
    print0(
        f"step {state.step + 1}: non-finite loss ({loss}) or grad norm ({grad_norm}); step skipped "
        f"({state.nonfinite_steps}/{settings.max_nonfinite_steps})."
    )
    if state.nonfinite_steps >= settings.max_nonfinite_steps:
        raise NonFiniteError(
            f"{state.nonfinite_steps} steps had a non-finite loss or gradient norm (--max_nonfinite_steps "
            f"{settings.max_nonfinite_steps}); stopped at step {state.step + 1} without saving, so the last checkpoint is "
            "the last good state. Lower the learning rate, check the data, or resume from that checkpoint."
        )


def _watch_collapse(state, settings, loss: float, grad_norm: float, lr: float, vocab: int | None, logger) -> None:
    """Report a run whose gradient norm has been 0 for COLLAPSE_STEPS steps in a row (or all of a shorter run's): a
    warning line, an event in metrics.jsonl and a summary that says so (shardtune.training.metrics); it trains on."""
    state.zero_grad_steps = state.zero_grad_steps + 1 if grad_norm == 0.0 else 0
    if state.collapsed_at is not None or state.zero_grad_steps < min(COLLAPSE_STEPS, settings.total_steps):
        return
    state.collapsed_at = state.step
    uniform = ""
    if vocab and math.isfinite(loss) and abs(loss - math.log(vocab)) <= 0.01 * math.log(vocab):
        uniform = f" = ln({vocab}), the loss of uniform predictions over the vocabulary"
    msg = (
        f"step {state.step}: training has collapsed: the gradient norm has been 0 for {state.zero_grad_steps} steps "
        f"in a row and the loss stays at {loss:.4f}{uniform}, so no step changes the weights. This usually follows "
        f"a too-large learning rate (now {lr:.2e}): lower --learning_rate and restart (or resume from a checkpoint "
        "saved before the collapse)."
    )
    warn0(msg)
    logger.log_event(state.step, "collapse", msg)


def _vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size of the model under the training module (for the collapse message), if it has one."""
    inner = getattr(model, "model", model)
    config = getattr(inner, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(config, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _train_record(state, settings, info, loss, grad_norm, scheduler, t0, tokens0) -> dict:
    elapsed = time.perf_counter() - t0
    mem = all_gather_objects(round(peak_memory_gb(info.device), 3))
    return {
        "loss": loss,
        "learning_rate": scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        # A streamed epoch's length is unknown until it ends: its whole epochs only.
        "epoch": state.epoch
        + (0 if state.stream else state.batch_in_epoch / max(settings.steps_per_epoch * settings.grad_accum, 1)),
        "tokens": state.tokens,
        "tokens_per_s": (state.tokens - tokens0) / max(elapsed, 1e-9),
        "memory_gb": max(mem),
        "memory_per_rank_gb": mem,
        "nonfinite_steps": state.nonfinite_steps,
    }


def _advance(state: LoopState, settings: LoopSettings, n_tokens: int, loss: float) -> None:
    state.step += 1
    state.tokens += n_tokens
    state.losses.append(loss)
    state.batch_in_epoch += settings.grad_accum
    if state.stream is not None:
        state.epoch = state.stream[0]
    if state.batch_in_epoch >= settings.steps_per_epoch * settings.grad_accum:
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
