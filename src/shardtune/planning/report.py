"""What `shardtune plan` reports: the plan of a run (its launch, shapes, estimate, recommendation and trace),
the table and JSON it prints, and the traced step set beside the estimate, by phase and by category.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from shardtune.config.arguments import RunConfig
from shardtune.planning.activations import tensor_parallel_buffer_bytes
from shardtune.planning.estimate import MemoryEstimate, estimate_memory, loss_chunk
from shardtune.planning.generation import VLLM, kv_bytes_per_position
from shardtune.planning.inputs import RUN_FIELDS, PlanInputs, as_json
from shardtune.planning.model import EXPERT_LORA, ROUTER_LORA, lora_param_count, resolve_lora_targets
from shardtune.planning.phases import (
    BLOCK_FORWARD,
    BLOCK_SCATTER,
    FORWARD,
    GENERATION,
    LATER_FORWARD,
    LAYER,
    LOSS,
    LOSS_FORWARD,
)
from shardtune.planning.recommend import NEAR_LIMIT, Recommendation
from shardtune.planning.shape import ModelShape, base_param_count
from shardtune.planning.state import GiB, compute_dtype_bytes


@dataclass
class Launch:
    """Where and how the run is sharded: from the accelerate YAML, the launcher's environment, or defaults."""

    world_size: int = 1
    num_nodes: int = 1
    sharding_strategy: str = "FULL_SHARD"
    offload: bool = False
    mixed_precision: str = "no"
    activation_checkpointing: bool = False
    # The CUDA allocator's setting the processes run with (shardtune.config.cuda_allocator).
    expandable_segments: bool = True
    single_process: str = "auto"  # SHARDTUNE_FSDP_SINGLE_PROCESS: whether one process keeps FSDP


@dataclass
class Plan:
    """Everything `shardtune plan` reports."""

    name: str
    shape: ModelShape
    inputs: PlanInputs  # the run's (planning.fit.plan_inputs)
    estimate: MemoryEstimate
    launch: Launch
    gpu_bytes: int | None = None
    host_bytes: int | None = None
    recommendation: Recommendation | None = None
    as_json: bool = False
    run: RunConfig | None = None  # the flags as `shardtune train` would run them (for --trace)
    config: Any = None  # the model's transformers config
    trace: Any = None  # a planning.trace.TraceResult, with --trace
    longest: dict[int, int] | None = None  # --longest_seq_len: {cp degree: longest max_seq_len that fits}
    # A run that fits near the limit: the smallest tensor-parallel size that restores the planner's margin
    # (planning.recommend.near_limit_tensor_parallel), if any.
    headroom: Recommendation | None = None

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        targets = (
            resolve_lora_targets(self.shape, i.lora_target_modules, i.lora_target_parameters) if i.use_peft_lora else ()
        )
        out = {
            "model": {
                "name": self.name,
                **asdict(self.shape),
                "parameters": base_param_count(self.shape),
                "lora_parameters": lora_param_count(self.shape, i.lora_r, targets, i.use_dora),
            },
            # the loss's chunk as the run resolves it (None in the inputs: the rule on the vocabulary)
            "run": {**as_json(i, RUN_FIELDS), "loss_chunk_tokens": loss_chunk(self.shape, i)},
            **self.estimate.to_dict(),
            "gpu_memory_bytes": self.gpu_bytes,
            "fits": None if self.gpu_bytes is None else self.estimate.fits(self.gpu_bytes),
            "host_memory_bytes": self.host_bytes,
            "host_fits": None if self.host_bytes is None else self.estimate.host_total <= self.host_bytes,
            "recommendation": self.recommendation.to_dict() if self.recommendation else None,
            "near_limit_recommendation": self.headroom.to_dict() if self.headroom else None,
            "longest_seq_len": {str(k): v for k, v in self.longest.items()} if self.longest else None,
        }
        return out


def traced_run_inputs(inputs: PlanInputs, device: str) -> PlanInputs:
    """The estimate's settings for what the trace runs: transformers' SDPA over whole rows with the 4-D packed-row
    mask, not shardtune's per-document attention (fake tensors give no positions to cut rows by: the trace turns
    per_document_attention off), no offload on CPU (shardtune offloads only from a GPU) and no activation
    offloading (the traced step is the trainer's forward and backward without save_on_cpu). LoRA dropout
    keeps a one-byte mask on either device (CUDA's bool mask; on CPU shardtune's FastDropout keeps uint8), but on
    CPU FastDropout draws it through int64 random bits (2 bytes per element) and an int32 copy (4 bytes), which
    CUDA's dropout kernel does not make (shardtune.models.fastpath._BitsDropout). One process is traced under FSDP. With
    context parallelism the trace splits real host rows (planning.trace): one document per row, per document."""
    # The traced model is built without weights, which one process traces under FSDP2's memory tracker.
    out = replace(inputs, attn_implementation="sdpa", packing=True, per_document_attention=False, fsdp=True)
    out = replace(out, rollout_engine=None, activation_offloading=False)  # the training step, not a rollout
    if inputs.context_parallel > 1:  # the split does read positions: rows of one document each, no mask
        out = replace(out, packing=False, per_document_attention=True)
    if device == "cpu":
        out = replace(out, offload=False, dropout_scratch_bytes=CPU_DROPOUT_SCRATCH_BYTES)
    return out


CPU_DROPOUT_SCRATCH_BYTES = 2 + 4


# The traced peaks and the estimate's phases that correspond: the root module's forward (first block's
# all-gather, loss forward), the blocks' backward (compute, reduce-scatter), the root's backward (with the loss's
# backward), and the whole step (every phase, the root's reduce-scatter included).
TRACE_PHASES = {
    "forward": (FORWARD, LATER_FORWARD, BLOCK_FORWARD, LOSS_FORWARD),
    "decoder-layer backward": (LAYER, BLOCK_SCATTER),
    "backward": (LOSS, LAYER, BLOCK_SCATTER),
    "step": None,
}


def traced_estimate(p: Plan, **overrides: Any) -> MemoryEstimate:
    """The estimate for the settings the trace ran (traced_run_inputs), which the trace is compared with."""
    return estimate_memory(p.shape, replace(traced_run_inputs(p.inputs, p.trace.device), **overrides))


def trace_comparison(p: Plan) -> dict[str, tuple[int, int]]:
    """{traced peak: (traced bytes, estimated bytes)}, for rank 0 and the settings the trace ran."""
    est = traced_estimate(p)
    out = {}
    for name, keys in TRACE_PHASES.items():
        estimated = est.allocated if keys is None else max(est.phase_bytes.get(k, 0) for k in keys)
        out[name] = (p.trace.peaks[name].get("Total", 0), estimated)
    return out


# The estimate's rows that make each category of the traced step peak (storages filed by what they are,
# shardtune.parallel.fake). Activations and temporaries follow the tracker's split, by when a tensor is made:
# forward (and the inputs) or backward (a block's recomputation included); the estimate's rows of activations
# and logits hold both, and MemoryEstimate.temporaries says how much of them its peak phase's backward makes.
ESTIMATE_CATEGORIES = {
    "parameters": ("frozen base weights", "quantization constants", "trainable weights", "FSDP all-gather buffers"),
    "gradients": ("gradients", "FSDP reduce-scatter buffers"),
    "optimizer states": ("optimizer state",),
    "activations": ("activations", "logits and loss"),
}


def category_comparison(p: Plan) -> dict[str, tuple[int, int]]:
    """{category: (traced bytes, estimated bytes)} at the step's peak, rank 0. The traced optimizer states leave
    out AdamW's step counters (4 bytes per trainable tensor): the trace holds them on CPU, a GPU run on the host.
    Not compared: the traced buffers (the rotary inv_freq table, a few KiB), which the estimate leaves out."""
    est = traced_estimate(p)
    got = dict(p.trace.step_by_identity)
    got["optimizer states"] -= 4 * p.trace.state["trainable_tensors"]
    out = {c: (got[c], sum(est.device.get(r, 0) for r in rows)) for c, rows in ESTIMATE_CATEGORIES.items()}
    out["activations"] = (got["activations"], out["activations"][1] - est.temporaries)
    out["temporaries"] = (got["temporaries"], est.temporaries)
    return out


def format_trace(p: Plan) -> str:
    t = p.trace
    lines = [
        "",
        "",  # a blank line after the plan's table, which ends without one
        (f"Traced step (rank 0 of {p.launch.world_size}, fake tensors on {t.device}; SDPA with the packed-row mask)"),
        "Peak allocated, rank 0             traced GiB   estimate GiB",
    ]
    for name, (traced, est) in trace_comparison(p).items():
        lines.append(f"  {name:<32}{_gib(traced)}     {_gib(est)}")
    lines += ["", "Step peak by category              traced GiB   estimate GiB"]
    lines += [f"  {name:<32}{_gib(a)}     {_gib(b)}" for name, (a, b) in category_comparison(p).items()]
    lines += _replay_lines(p)
    if p.inputs.activation_offloading:
        lines.append("note: activation offloading is not traced: the trace and its estimate keep the activations.")
    lines += [f"note: {n}" for n in t.notes]
    return "\n".join(lines)


def _allocator_line(e: MemoryEstimate) -> str:
    """What the allocator overhead row is made of, and the allocator setting it assumes."""
    t = e.allocator_terms
    setting = "expandable segments" if e.inputs.expandable_segments else "default segments"
    parts = [f"fragmentation {t.get('fragmentation', 0) / GiB:.2f}"]
    if t.get("forward all-gather cache"):
        parts.insert(0, f"all-gather stream cache {t['forward all-gather cache'] / GiB:.2f}")
    root = t.get("root gradients' segments", 0)
    if root:
        parts.append(f"root gradients' own segments {root / GiB:.2f}")
    return f"  allocator ({setting}, PYTORCH_ALLOC_CONF): " + ", ".join(parts) + " GiB"


def _replay_lines(p: Plan) -> list[str]:
    """The caching allocator replayed over the traced history, beside the estimate's allocator terms."""
    t = p.trace
    if t.replay is None:
        return []
    est = traced_estimate(p)
    terms = est.allocator_terms
    gather = t.gather_stream
    replayed = t.replay_expandable if est.inputs.expandable_segments else t.replay
    rows = [
        ("max_memory_allocated", replayed.allocated, est.allocated),
        ("max_memory_reserved", replayed.reserved, est.reserved),
        ("  forward all-gather cache", replayed.by_stream.get(gather, 0), terms.get("forward all-gather cache", 0)),
        ("  reserved, default allocator", t.replay.reserved, None),
        ("  reserved, expandable segments", t.replay_expandable.reserved, None),
    ]
    lines = ["", "CUDA caching allocator, replayed  traced GiB   estimate GiB"]
    for name, traced, estimate in rows:
        lines.append(f"  {name:<32}{_gib(traced)}     {_gib(estimate) if estimate is not None else '':>8}")
    setting = "expandable segments" if est.inputs.expandable_segments else "the default allocator"
    dynamic = terms.get("other streams", 0) - terms.get("resident", 0)
    fraction = terms["fragmentation"] / dynamic if dynamic > 0 else 0.0
    lines.append(
        f"  (reserved over allocated: traced +{_pct(replayed.reserved, replayed.allocated)}, estimate "
        f"+{_pct(est.reserved, est.allocated)} with {setting}: fragmentation {fraction:.0%} of what the other "
        "streams allocate and free, calibrated by bench/allocator_replay.py)"
    )
    return lines


def _replay_json(p: Plan) -> dict[str, Any] | None:
    t = p.trace
    if t.replay is None:
        return None
    out = {}
    for label, r in (("default", t.replay), ("expandable_segments", t.replay_expandable)):
        out[label] = {
            "max_memory_allocated": r.allocated,
            "max_memory_reserved": r.reserved,
            "reserved_by_stream": {t.streams.get(k, str(k)): v for k, v in r.by_stream.items()},
        }
    est = traced_estimate(p)
    out["estimate"] = {"max_memory_reserved": est.reserved, **est.allocator_terms}
    return out


def _pct(a: int, b: int) -> str:
    return f"{(a - b) / b:.1%}" if b else "0%"


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f}"


def _describe_run(p: Plan) -> list[str]:
    k, s = p.inputs, p.shape
    if k.use_peft_lora:
        targets = resolve_lora_targets(s, k.lora_target_modules, k.lora_target_parameters)
        n = lora_param_count(s, k.lora_r, targets, k.use_dora)
        base = "4-bit" if k.use_4bit else "8-bit" if k.use_8bit else "frozen"
        params = [t for t in targets if t in (*EXPERT_LORA, ROUTER_LORA)]
        on = f"{len(targets) - len(params)} linears" + (f" and {' and '.join(params)}" if params else "")
        method = (
            f"{'DoRA' if k.use_dora else 'LoRA'} r={k.lora_r} on {on} per block ({n / 1e6:.1f}M trainable), {base} base"
        )
    else:
        method = "full fine-tuning"
    dtype = "bf16" if k.bf16 else "fp16" if k.fp16 else "fp32"
    return [
        (
            f"shardtune plan: {p.name} ({s.model_type}, {base_param_count(s) / 1e9:.2f}B parameters, "
            f"{s.num_layers} blocks)"
        ),
        f"  {method}",
        (
            f"  {k.world_size} GPU(s) on {k.num_nodes} machine(s), {_sharding(k)}"
            f"{', CPU offload' if k.offload else ''}, {dtype}, batch {k.batch_size} x {k.seq_len} tokens, "
            f"{'gradient checkpointing' if k.gradient_checkpointing else 'no checkpointing'}"
            f"{' (activations offloaded to host memory)' if k.activation_offloading else ''}, "
            f"{k.attn_implementation}" + _context_parallel_text(k)
        ),
        *_tensor_parallel_lines(p),
    ]


def _tensor_parallel_lines(p: Plan) -> list[str]:
    """The tensor-parallel degree and what one rank holds of the model (planning.state.tensor_parallel_slices, the
    block it computes: ModelShape.tensor_parallel_rank)."""
    k, s, tp = p.inputs, p.shape, p.inputs.tensor_parallel
    if tp == 1:
        return []
    dp = k.world_size // (tp * k.context_parallel)
    tokens = k.batch_size * k.rows_per_example * k.seq_len // k.context_parallel
    reduced = tensor_parallel_buffer_bytes(s, tokens, compute_dtype_bytes(k.bf16, k.fp16), tp)
    return [
        (
            f"  tensor parallel {tp} within each machine ({dp} data-parallel ranks x {k.context_parallel} cp x {tp} "
            f"tp): a rank holds 1/{tp} of every block's linear layers ({s.num_heads // tp} of {s.num_heads} heads, "
            f"{s.num_kv_heads // tp} of {s.num_kv_heads} KV heads, {s.intermediate_size // tp} of "
            f"{s.intermediate_size} MLP width), FSDP-sharded over the {k.world_size // tp} ranks of its slice"
        ),
        (
            f"  embeddings, norms and head whole on the tp ranks (sharded over the same {k.world_size // tp}); two "
            f"all-reduces of [tokens x hidden] per block each way, {reduced / GiB:.2f} GiB of buffers in activations"
        ),
    ]


def _context_parallel_text(k: PlanInputs) -> str:
    cp = k.context_parallel
    if cp == 1:
        return ""
    return f", context parallel {cp} (each row over {cp} GPUs, {k.world_size // cp} batches per step)"


def _sharding(k: PlanInputs) -> str:
    if not k.fsdp:
        return "no FSDP (one process: the adapters' bf16 copies fill the all-gather row)"
    return k.sharding_strategy + (", frozen base replicated" if k.replicate_base else "")


def format_plan(p: Plan) -> str:
    """The table `shardtune plan` prints."""
    e = p.estimate
    lines = _describe_run(p) + ["", "Per GPU (estimate)                   GiB"]
    lines += [f"  {name:<32}{_gib(b)}" for name, b in e.device.items()]
    lines += [
        f"  {'total (as nvidia-smi shows)':<32}{_gib(e.total)}",
        f"  {'  PyTorch allocated / reserved':<32}{_gib(e.allocated)} / {e.reserved / GiB:.2f}",
        f"  peak during {_phase(e.peak_phase)}; logits + loss alone peak at {e.logits_peak / GiB:.2f} GiB",
        _allocator_line(e),
        *generation_lines(p),
        "",
        "Activations + logits (estimate GiB) checkpointing  no checkpointing",
    ]
    for impl, row in e.activations_by_attention.items():
        lines.append(f"  {impl:<32}{_gib(row['checkpointing'])}        {_gib(row['no checkpointing'])}")
    lines += ["", "Host RAM per machine (estimate)      GiB"]
    lines += [f"  {name:<32}{_gib(b)}" for name, b in e.host.items()]
    lines.append(f"  {'peak':<32}{_gib(e.host_total)}")
    verdict = _verdict(p)
    lines += ["", *verdict] if verdict else []
    return "\n".join(lines + ([""] + [f"note: {n}" for n in e.notes] if e.notes else []))


def generation_lines(p: Plan) -> list[str]:
    """The rollout of an online-RL run (planning.generation), estimated per GPU: the weights it gathers and its KV
    cache apart, and whether it is the run's peak."""
    g, k, e = p.estimate.generation, p.inputs, p.estimate
    if g is None:
        return []
    if g.engine == VLLM:
        return [
            "",
            (
                "Generation on a vLLM server (--rollout_engine vllm): nothing on the training GPUs but the adapter's "
                f"sync, one tensor gathered at a time (largest {g.weights / 2**20:.1f} MiB; estimate)."
            ),
        ]
    whole = "whole model" if k.gather_for_generation else "root + one block"
    rows = [
        (f"gathered weights ({whole})", g.weights, f"--gather_for_generation {k.gather_for_generation}"),
        (f"KV cache at the {g.moment}", g.kv_cache, ""),
        ("KV cache at its longest", g.kv_cache_longest, _kv_text(p.shape, g.prompt_len + g.completion_len - 1)),
        ("activations", g.activations, ""),
        ("logits and sampling", g.logits + g.sampling, ""),
        ("all-gather in flight, KV cache copy", g.gather_alive + g.kv_growth, ""),
        ("phase allocated (with resident state)", e.phase_bytes[GENERATION], f"peaks at the {g.moment}"),
    ]
    lines = [
        "",
        "Generation, per GPU (estimate)           GiB",
        f"  transformers engine: {g.rows} completions at once (batch {k.batch_size} x steps_per_generation "
        f"{k.steps_per_generation}), prompt {g.prompt_len} + completion {g.completion_len} tokens" + _prompt_source(k),
    ]
    lines += [f"  {name:<38}{_gib(b)}" + (f"  {why}" if why else "") for name, b, why in rows]
    if e.peak_phase != GENERATION:
        lines.append(f"  the step peaks higher, during {_phase(e.peak_phase)}")
    return lines


def _kv_text(shape: ModelShape, positions: int) -> str:
    keys, values = kv_bytes_per_position(shape, 1)
    if shape.latent_attention:
        per = f"latent {keys} + rotary key {values}"
    else:
        per = f"2 x {shape.num_kv_heads} KV heads x {shape.head_dim}"
    return f"{positions} positions x {shape.num_layers} layers x {per}"


def _prompt_source(k: PlanInputs) -> str:
    return "" if k.max_prompt_length is not None else " (--max_prompt_length unset: prompts planned at --max_length)"


def _phase(name: str) -> str:
    return name if name.startswith("a ") else f"the {name}"


def _flags_text(flags: dict[str, Any]) -> str:
    parts = []
    for k, v in flags.items():
        if k in ("fsdp_offload_params", "num_processes"):
            parts.append(f"{k}: {str(v).lower()} in the accelerate YAML")
        else:
            parts.append(f"--{k} {v}")
    return ", ".join(parts)


def _verdict(p: Plan) -> list[str]:
    e, out = p.estimate, []
    if p.gpu_bytes is not None:
        if e.fits(p.gpu_bytes):
            out.append(
                f"Fits (estimate): {e.total / GiB:.2f} GiB of {p.gpu_bytes / GiB:.2f} GiB per GPU "
                f"({(1 - e.total / p.gpu_bytes) * 100:.0f}% left)."
            )
        else:
            out.append(
                f"Does not fit (estimate): {e.total / GiB:.2f} GiB needed per GPU, "
                f"{p.gpu_bytes / GiB:.2f} GiB available."
            )
            out += recommendation_lines(p.recommendation)
    if p.headroom is not None:
        h = p.headroom
        out += [
            (
                f"Near the limit (less than {NEAR_LIMIT:.0%} left, the planner's largest error): {h.description} -> "
                f"estimate {h.estimate.total / GiB:.2f} GiB per GPU."
            ),
            f"  set {_flags_text(h.flags)}",
        ]
    if p.longest:
        cp = p.inputs.context_parallel
        parts = [f"cp {d}: {n:,}" + (" (this run)" if d == cp else "") for d, n in sorted(p.longest.items())]
        gpus = f"{p.launch.world_size} GPU(s)"
        out.append(f"Longest --max_seq_len that fits on {gpus} (estimate): " + "; ".join(parts) + ".")
    if p.host_bytes is not None:
        word = "fits in" if e.host_total <= p.host_bytes else "exceeds"
        host = f"{e.host_total / GiB:.2f} GiB {word} {p.host_bytes / GiB:.2f} GiB per machine"
        out.append(f"Host RAM (estimate): {host}.")
    return out


def recommendation_lines(rec: Recommendation | None) -> list[str]:
    if rec is None:
        return []
    need = rec.estimate.total / GiB
    if rec.fits:
        return [
            f"Smallest change that fits: {rec.description} -> estimate {need:.2f} GiB per GPU.",
            f"  set {_flags_text(rec.flags)}",
        ]
    return [
        (
            f"Nothing tried fits ({rec.tried} changes: smaller batches, gradient checkpointing, context or tensor "
            f"parallelism, CPU offload, 4-bit, more GPUs). Closest: {rec.description} at an estimated {need:.2f} GiB "
            "per GPU."
        ),
        "  Shorten --max_length or use GPUs with more memory.",
    ]


def trace_json(p: Plan) -> dict[str, Any]:
    """The trace's part of `shardtune plan --trace --json`."""
    return {
        "peaks": {k: {"traced": a, "estimate": b} for k, (a, b) in trace_comparison(p).items()},
        "step_by_category": {k: {"traced": a, "estimate": b} for k, (a, b) in category_comparison(p).items()},
        "step_by_tracker_tag": p.trace.by_category("step"),
        "allocator_replay": _replay_json(p),
        "state": p.trace.state,
        "device": p.trace.device,
    }
