"""Smallest changes that make a run fit a GPU memory budget, tried in order of how much they change the run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from shardtune.planning.estimate import MemoryEstimate, estimate_memory
from shardtune.planning.generation import TRANSFORMERS, whole_groups
from shardtune.planning.inputs import PlanInputs
from shardtune.planning.phases import GENERATION
from shardtune.planning.shape import ModelShape
from shardtune.planning.state import as_shape, tensor_parallel_problems

MAX_GPUS = 4096
# Tensor-parallel sizes tried: within one machine (its ranks exchange activations in every block), 8 GPUs at most.
TP_DEGREES = (2, 4, 8)
# A run that fits with less than this share of the GPU left is near the limit: the planner's largest leave-one-out
# error on the published runs (the margin of planning.fit.AUTO_REPLICATE_MARGIN, docs/plan.md).
NEAR_LIMIT = 0.13


@dataclass
class Recommendation:
    """A change to the run (flags to set) and the estimate with it; `fits` is False for the closest miss."""

    description: str
    flags: dict[str, Any]
    estimate: MemoryEstimate
    fits: bool
    tried: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "flags": dict(self.flags),
            "fits": self.fits,
            "device_total_bytes": self.estimate.total,
            "candidates_tried": self.tried,
        }


# Each candidate: (what it changes, the flags that make the change, the PlanInputs fields it changes).
Candidate = tuple[str, dict[str, Any], dict[str, Any]]


def _halvings(batch: int, accumulation: int) -> Iterator[Candidate]:
    """Halve the per-device batch and double gradient accumulation, keeping the global batch."""
    b, g = batch, accumulation
    while b > 1:
        b, g = b // 2, g * 2
        yield (
            f"per-device batch {b} with gradient accumulation {g} (same global batch)",
            {"per_device_train_batch_size": b, "gradient_accumulation_steps": g},
            {"batch_size": b, "grad_accum": g},
        )


def _stage(label: str, flags: dict[str, Any], change: dict[str, Any], batch: int, accumulation: int):
    """One change, alone and then with each batch halving on top."""
    yield label, dict(flags), dict(change)
    for desc, bflags, bchange in _halvings(batch, accumulation):
        yield f"{label}, {desc}", {**flags, **bflags}, {**change, **bchange}


def candidates(inputs: PlanInputs, accumulation: int) -> Iterator[Candidate]:
    """Changes in order of size: a replicated frozen base sharded, smaller batches, gradient checkpointing, context
    then tensor parallelism on the same GPUs, CPU offload, 4-bit, then more GPUs."""
    batch = inputs.batch_size
    if inputs.replicate_base:  # --frozen_base replicated only saves all-gathers: the same training, sharded
        yield "the frozen base sharded", {"frozen_base": "sharded"}, {"replicate_base": False}
    yield from _halvings(batch, accumulation)
    change: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    if not inputs.gradient_checkpointing:
        change, flags = {"gradient_checkpointing": True}, {"gradient_checkpointing": True}
        yield from _stage("gradient checkpointing", flags, change, batch, accumulation)
    yield from _context_parallel(inputs, change, flags, accumulation)
    yield from _tensor_parallel(inputs, change, flags, accumulation)
    if not inputs.offload:
        change, flags = {**change, "offload": True}, {**flags, "fsdp_offload_params": True}
        if inputs.replicate_base:  # offload keeps the frozen base's shards in host RAM: it cannot stay replicated
            change, flags = {**change, "replicate_base": False}, {**flags, "frozen_base": "sharded"}
        yield from _stage(_describe(flags), flags, change, batch, accumulation)
    if not inputs.use_4bit:
        quant = {"use_4bit": True, "use_peft_lora": True, "use_8bit": False}
        qflags = {"use_4bit_quantization": True, "bnb_4bit_quant_storage_dtype": "bfloat16"}
        if not inputs.use_peft_lora:
            qflags["use_peft_lora"] = True
        no_offload = {k: v for k, v in change.items() if k not in ("offload", "replicate_base")}
        no_offload_flags = {k: v for k, v in flags.items() if k not in ("fsdp_offload_params", "frozen_base")}
        for c, f in (
            ({**no_offload, **quant}, {**no_offload_flags, **qflags}),
            ({**change, **quant}, {**flags, **qflags}),
        ):
            yield from _stage(_describe(f), f, c, batch, accumulation)
    world = inputs.world_size
    nodes = inputs.num_nodes
    more = 1 << world.bit_length() if world & (world - 1) == 0 else 1 << (world - 1).bit_length()
    while more <= MAX_GPUS:
        if more % nodes == 0:
            yield f"{more} GPUs", {"num_processes": more}, {"world_size": more}
        more *= 2


def generation_candidates(inputs: PlanInputs, accumulation: int) -> Iterator[Candidate]:
    """When the rollout on the training ranks is what does not fit (planning.generation): each block gathered per
    forward instead of the whole model for the whole rollout; fewer rows generated at once, by a smaller
    --steps_per_generation or a smaller per-device batch (the same global batch, --steps_per_generation kept), with
    the whole model gathered and then per block; then generation on a vLLM server (LoRA: vLLM serves neither DoRA
    nor modules saved in full)."""
    if inputs.rollout_engine != TRANSFORMERS:
        return
    stages: list[Candidate] = [("", {}, {})]
    if inputs.gather_for_generation:
        off = {"gather_for_generation": False}
        yield "each block gathered per forward in generation", dict(off), dict(off)
        stages.append(("each block gathered per forward in generation", off, off))
    keep = {"steps_per_generation": inputs.steps_per_generation}
    for label, flags, change in stages:
        steps = inputs.steps_per_generation
        while steps > 1:
            steps //= 2
            desc = _joined(label, f"{steps} micro-batches per generation batch")
            yield desc, {**flags, "steps_per_generation": steps}, {**change, "steps_per_generation": steps}
        for desc, bflags, bchange in _halvings(inputs.batch_size, accumulation):
            yield _joined(label, desc), {**flags, **bflags, **keep}, {**change, **bchange}
    if inputs.use_peft_lora and not inputs.use_dora and not inputs.modules_to_save:
        yield "generation on a vLLM server", {"rollout_engine": "vllm"}, {"rollout_engine": "vllm"}


def _joined(*parts: str) -> str:
    return ", ".join(p for p in parts if p)


def _ordered(inputs: PlanInputs, accumulation: int, rollout_first: bool) -> Iterator[Candidate]:
    """The candidates in the order tried: the rollout's first when the rollout is what does not fit. An online-RL
    run's batch halvings keep --steps_per_generation as it was (its default follows the accumulation, which would
    keep the rows generated at once)."""
    if rollout_first:
        yield from generation_candidates(inputs, accumulation)
    keep = {"steps_per_generation": inputs.steps_per_generation} if inputs.rollout_engine else {}
    for desc, flags, change in candidates(inputs, accumulation):
        yield desc, ({**flags, **keep} if keep and "gradient_accumulation_steps" in flags else flags), change


def _context_parallel(inputs: PlanInputs, change: dict, flags: dict, accumulation: int):
    """Each row split over more of the same GPUs (shardtune.parallel.split), the global batch kept by
    accumulating as many more micro-batches: the step computes the same gradient, a rank holds 1/cp of each row."""
    world, cp = inputs.world_size // inputs.tensor_parallel, inputs.context_parallel  # cp divides the dp ranks
    more = cp * 2
    while more <= world:
        if world % more == 0 and inputs.rows_per_example == 1:  # SFT only
            g = accumulation * more // cp
            c = {**change, "context_parallel": more, "grad_accum": g}
            f = {**flags, "context_parallel_size": more, "gradient_accumulation_steps": g}
            yield f"context parallel size {more} (each row over {more} GPUs, same global batch)", f, c
        more *= 2


def _tensor_parallel(inputs: PlanInputs, change: dict, flags: dict, accumulation: int) -> Iterator[Candidate]:
    """Each block's linear layers sliced over 2, 4 or 8 GPUs of a machine (shardtune.parallel.tensor), smallest
    first, the global batch kept by accumulating tp times as many micro-batches (the tp ranks share one batch): a
    rank gathers 1/tp of each block and keeps 1/tp of its attention and MLP activations, and holds the embeddings,
    norms and head sharded over world / tp ranks instead of world. Never with context parallelism or a quantized
    base (refused under tp), nor where the run's settings are refused under tp (state.tensor_parallel_problems);
    recommend skips those the model refuses (the family's plan, the heads and widths tp must divide)."""
    if inputs.tensor_parallel > 1 or inputs.context_parallel > 1 or inputs.use_4bit or inputs.use_8bit:
        return
    for tp in TP_DEGREES:
        g = accumulation * tp
        c = {**change, "tensor_parallel": tp, "grad_accum": g}
        f = {**flags, "tensor_parallel_size": tp, "gradient_accumulation_steps": g}
        if inputs.replicate_base:  # parallel.setup shards the frozen slices
            c, f = {**c, "replicate_base": False}, {**f, "frozen_base": "sharded"}
        if tensor_parallel_problems(None, replace(inputs, **c)):  # a machine's GPUs, sft, no offload, ...
            continue
        label = f"tensor parallel size {tp} (each block's layers over {tp} GPUs of a machine, same global batch)"
        yield from _stage(label, f, c, inputs.batch_size, g)


def _refused(shape: ModelShape | None, candidate: PlanInputs) -> bool:
    """A candidate that training would refuse under its tensor-parallel size (state.tensor_parallel_problems: the
    run's own tp with offload or 4-bit, a tp the family cannot take); without a model, any tp but 1."""
    if candidate.tensor_parallel == 1:
        return False
    return shape is None or bool(tensor_parallel_problems(shape, candidate))


def near_limit_tensor_parallel(
    inputs: PlanInputs, gpu_bytes: int, accumulation: int = 1, model: Any = None,
    estimator: Callable[..., MemoryEstimate] = estimate_memory,
) -> Recommendation | None:  # fmt: skip
    """For a run that fits with less than NEAR_LIMIT of the GPU left (within the planner's error): the smallest
    tensor-parallel size, alone on the same GPUs and global batch, that leaves at least that margin; None where the
    run is not near the limit or no tp does it (or the family, the run's settings or cp refuse it)."""
    total = estimator(model, inputs).total
    if total > gpu_bytes or total <= (1 - NEAR_LIMIT) * gpu_bytes:
        return None
    shape = None if model is None else as_shape(model)
    for description, flags, change in _tensor_parallel(inputs, {}, {}, accumulation):
        candidate = replace(inputs, **change)
        if "per_device_train_batch_size" in flags or _refused(shape, candidate):
            continue  # tp alone: the run as it is, sliced
        est = estimator(model, candidate)
        if est.total <= (1 - NEAR_LIMIT) * gpu_bytes:
            return Recommendation(description, flags, est, True)
    return None


def longest_sequences(inputs: PlanInputs, gpu_bytes: int, world_size: int, model: Any, *,
                      estimator: Callable[..., MemoryEstimate] = estimate_memory) -> dict[int, int]:  # fmt: skip
    """{cp degree: the longest max_seq_len (a multiple of 2·cp·64) whose estimate fits gpu_bytes}, for the run's
    cp and every power-of-two degree dividing world_size (SFT); 0 where not even the shortest fits."""
    degrees = sorted({inputs.context_parallel, *(d for d in _powers(world_size) if world_size % d == 0)})
    if inputs.rows_per_example != 1:
        degrees = [inputs.context_parallel]
    return {cp: _longest(inputs, gpu_bytes, model, cp, estimator) for cp in degrees}


def _longest(inputs: PlanInputs, gpu_bytes: int, model: Any, cp: int, estimator) -> int:
    """Doubling, then bisection, over multiples of 2·cp·64 positions (up to 2^16 of them)."""
    step = 2 * cp * 64

    def fits(n: int) -> bool:
        return estimator(model, replace(inputs, seq_len=n * step, context_parallel=cp)).total <= gpu_bytes

    lo, hi = 0, 1
    while fits(hi) and hi < 1 << 16:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def _powers(n: int) -> list[int]:
    out, d = [], 1
    while d <= n:
        out.append(d)
        d *= 2
    return out


def _describe(flags: dict[str, Any]) -> str:
    names = {
        "gradient_checkpointing": "gradient checkpointing",
        "fsdp_offload_params": "CPU offload",
        "frozen_base": "the frozen base sharded",
        "use_4bit_quantization": "4-bit base (QLoRA)",
        "use_peft_lora": "LoRA",
    }
    return " + ".join(names[k] for k in names if k in flags)


def recommend(
    inputs: PlanInputs,
    gpu_bytes: int,
    accumulation: int = 1,
    estimator: Callable[..., MemoryEstimate] = estimate_memory,
    model: Any = None,
) -> Recommendation:
    """The first candidate change whose estimate fits `gpu_bytes`, or the closest one (fits=False) if none does;
    the rollout's changes first when the rollout is the phase that does not fit (generation_candidates)."""
    best: Recommendation | None = None
    tried = 0
    first = inputs.rollout_engine is not None and estimator(model, inputs).peak_phase == GENERATION
    shape = None if model is None else as_shape(model)
    for description, flags, change in _ordered(inputs, accumulation, first):
        candidate = replace(inputs, **change)
        # a generation batch must be whole groups of num_generations; nothing that training refuses under tp
        if not whole_groups(candidate) or _refused(shape, candidate):
            continue
        tried += 1
        est = estimator(model, candidate)
        if est.total <= gpu_bytes:
            return Recommendation(description, flags, est, True, tried)
        if best is None or est.total < best.estimate.total:
            best = Recommendation(description, flags, est, False, tried)
    if best is None:  # nothing to change (e.g. batch 1, everything on): report the run as it is
        est = estimator(model, inputs)
        return Recommendation("no change left to try", {}, est, est.total <= gpu_bytes, tried)
    best.tried = tried
    return best
