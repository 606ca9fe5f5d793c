"""`shardtune plan --trace`: run shardtune's own training step for a real config.json under fake tensors.

Nothing is allocated and no weights are read: the model is built and sharded on meta by `build_sharded_model`
(the same builder, adapter wrapping, 4-bit preparation, activation checkpointing and FSDP2 sharding as
`shardtune train`, with `read_weights=False`) over a fake process group of the run's world size
(shardtune.parallel.fake); its shards are then allocated under torch's FakeTensorMode, one step creates the
optimizer states, and a second step's forward (through the chunked loss), backward and gradient clipping run under
FSDP2's memory tracker (torch.distributed._tools.fsdp2_mem_tracker, as in torchtitan's memory estimation), which
records, storage by storage, rank 0's peaks by category. docs/plan.md ("Tracing the real step") lists what differs
from a real run.

What the trace cannot run exactly, and what it runs instead:
- data-dependent host logic has no values under fake tensors: the packed rows' per-document attention spans
  (shardtune.models.fastpath reads position_ids on the host) and transformers' packed-sequence check. The trace
  runs SDPA with the 4-D packed-row mask, as transformers does when it cannot read the positions.
- with context parallelism, rows of one document each are split as `shardtune train` splits them (on the host
  batch's real values); rank 0's part then runs through the fake process group's cp group.
- the loss keeps every position (`h[labels != -100]` is taken as all rows: the guide's packed rows train on
  every token), see `_AllTargetsFakeMode`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from shardtune.config.errors import ConfigError
from shardtune.models import fastpath, quant
from shardtune.models.builder import model_spec
from shardtune.objectives.heads import token_loss
from shardtune.parallel.context_parallel import local_part
from shardtune.parallel.fake import fake_process_group, track_peak, untracked_root
from shardtune.parallel.fsdp import local_state_bytes
from shardtune.parallel.loading import allocate_unread
from shardtune.parallel.parallelize import sharding_settings
from shardtune.parallel.setup import build_sharded_model
from shardtune.planning.allocator import Replay, replay
from shardtune.planning.recorder import AllocationRecorder
from shardtune.training.optimizers import build_optimizer

# The tracker's categories, grouped. The tracker splits by when a tensor was made (forward and recomputation:
# activations; backward: temporaries), not by what it is, and has no row for frozen weights.
CATEGORIES = {
    "parameters": ("Sharded Param", "Unsharded Param", "Buffer", "All Gather", "Quantization constants"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer states": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
}


@dataclass
class TraceResult:
    """Rank 0's traced peaks by the tracker's categories, and the model state it holds after the step."""

    peaks: dict[str, dict[str, int]]  # {"step", "forward", "backward", "decoder-layer backward": {category: bytes}}
    state: dict[str, int]  # frozen / trainable parameter bytes, optimizer-state bytes, trainable tensors
    device: str
    # The storages alive at the step's peak filed by what they are (shardtune.parallel.fake): an FSDP
    # parameter's gathered copy is a parameter and its unsharded .grad a gradient whichever phase made them;
    # the quantization constants are parameters.
    step_by_identity: dict[str, int] = field(default_factory=dict)
    # The CUDA caching allocator replayed over the history of the whole trace (planning.allocator): by default,
    # and with expandable segments; reserved bytes by stream are filed under FSDP2's stream names.
    replay: Replay | None = None
    replay_expandable: Replay | None = None
    streams: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def gather_stream(self) -> int | None:
        """The replay's number of FSDP2's all-gather copy-in stream (where forward all-gathers allocate)."""
        return next((n for n, name in self.streams.items() if name == "all-gather-copy-in"), None)

    @property
    def peak_total(self) -> int:
        return self.peaks["step"]["Total"]

    @property
    def peak_by_type(self) -> dict[str, int]:
        return {k: v for k, v in self.peaks["step"].items() if k != "Total"}

    def by_category(self, phase: str = "step") -> dict[str, int]:
        snap = self.peaks[phase]
        return {c: sum(snap.get(k, 0) for k in kinds) for c, kinds in CATEGORIES.items()}

    @property
    def peak_by_category(self) -> dict[str, int]:
        return self.by_category("step")


class _AllTargetsFakeMode:
    """Builds a FakeTensorMode whose boolean-mask indexing keeps every row (there are no values to count)."""

    @staticmethod
    def make():
        from torch._subclasses.fake_tensor import FakeTensorMode

        aten = torch.ops.aten

        class Mode(FakeTensorMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is aten._local_scalar_dense.default and args[0].dtype == torch.bool:
                    return True  # `if keep.any()`: there are targets (every position is one)
                if func is aten.index.Tensor and _bool_index(args[1]):
                    x, idx = args
                    mask = next(i for i in idx if i is not None)
                    # Every position is a target: the output has all the mask's rows.
                    return super().__torch_dispatch__(
                        aten.empty.memory_format,
                        types,
                        ((mask.numel(), *x.shape[mask.dim() :]),),
                        {"dtype": x.dtype, "device": x.device},
                    )
                if func in (aten.index_put.default, aten.index_put_.default) and _bool_index(args[1]):
                    x = args[0]
                    if func is aten.index_put_.default:
                        return x
                    return super().__torch_dispatch__(aten.clone.default, types, (x,), {})
                return super().__torch_dispatch__(func, types, args, kwargs)

        return Mode(allow_non_fake_inputs=True)  # the rotary buffers are real (built with the skeleton)


def _bool_index(indices: Any) -> bool:
    return any(i is not None and i.dtype == torch.bool for i in indices)


def _config_folder(config: Any, tmp: str) -> str:
    """The config as a folder with config.json, which the product's builder reads like a model folder."""
    config.save_pretrained(tmp)
    return tmp


def trace_step(
    cfg,
    config: Any,
    *,
    n_tokens: int,
    new_ids: list[int],
    world_size: int,
    num_nodes: int,
    device: str = "cpu",
    loss_chunk_tokens: int | None = None,
    replicate_base: bool = False,
) -> TraceResult:
    """Trace the run `cfg` (a RunConfig) for the model `config` on rank 0 of `world_size` ranks, with the frozen
    base replicated where `replicate_base` (the estimate's setting, `--frozen_base`)."""

    with (
        tempfile.TemporaryDirectory() as tmp,
        fake_process_group(
            world_size, num_nodes, cfg.fsdp.sharding_strategy, device, cfg.train.context_parallel_size
        ) as info,
    ):
        model_args = dataclasses.replace(cfg.model, model_name_or_path=_config_folder(config, tmp))
        cfg = dataclasses.replace(cfg, model=model_args)
        spec = model_spec(cfg, info.device.type, n_tokens, new_ids)
        spec.read_weights = False
        spec.loss_chunk_size = loss_chunk_tokens
        # The frozen base placed as the estimate plans it.
        sharding = sharding_settings(cfg.fsdp, "replicated" if replicate_base else "sharded")
        # Built and sharded on meta (nothing allocated); fake tensors only from allocation on, since
        # bitsandbytes' Params4bit cannot wrap a FakeTensor while the 4-bit layers are being built.
        model = build_sharded_model(spec, info, sharding)
        if untracked_root(model):
            why = (
                "--trace with --frozen_base replicated: the root module (embeddings, final norm, head) trains "
                "nothing, so FSDP2's memory tracker cannot follow it. Trace with --frozen_base sharded (the "
                "estimate plans replicated either way), or train a root module too (--chat_template_format "
                "chatml, --modules_to_save lm_head)."
            )
            raise ConfigError([why])
        with _AllTargetsFakeMode.make(), _fake_4bit_weights(), _real_causal_bias():
            return _trace_built(model, cfg, info, n_tokens)


@contextlib.contextmanager
def _fake_4bit_weights():
    """bitsandbytes re-wraps a 4-bit layer's plain (FSDP2-gathered) weight as Params4bit at every forward,
    which cannot wrap a FakeTensor; the wrapper only re-attaches the layer's quantization state (same storage,
    no bytes), so under the trace the state is attached to the plain weight instead."""
    try:
        from bitsandbytes.nn import modules as bnb_modules
    except ImportError:
        yield
        return

    def attach_state(module) -> None:
        module.weight.quant_state = module.quant_state

    original = bnb_modules.fix_4bit_weight_quant_state_from_module
    bnb_modules.fix_4bit_weight_quant_state_from_module = attach_state
    try:
        yield
    finally:
        bnb_modules.fix_4bit_weight_quant_state_from_module = original


@contextlib.contextmanager
def _real_causal_bias():
    """torch's lower-right causal bias (context parallelism's attention of a document begun in an earlier chunk)
    is a tensor subclass, which cannot be made under the trace's dispatch modes: it is made outside them (it
    holds no data: SDPA reads its shape and variant, and builds any mask it needs on the queries' device)."""

    original = fastpath.causal_lower_right

    def real(*args):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # the fake mode and the trace's recording modes
            return original(*args)

    fastpath.causal_lower_right = real
    try:
        yield
    finally:
        fastpath.causal_lower_right = original


def _trace_built(model, cfg, info, n_tokens: int) -> TraceResult:
    """Record the allocation history of two steps and replay it, then trace a third step under FSDP2's tracker.

    The history is recorded untracked: FSDP2's tracker keeps a micro-batch's leaf inputs alive after its backward
    (see _tracked_step), which a real run frees. Two steps: the first creates the optimizer states (one
    micro-batch), the second repeats a steady step (two micro-batches when the run accumulates: the second holds
    every gradient from its start, and later ones repeat it); both shape what the allocator keeps cached."""

    t = cfg.train
    micro_batches = min(t.gradient_accumulation_steps, 2)
    recorder = AllocationRecorder(info.device.type)
    with recorder.recording():
        allocate_unread(model, info.device)
        optimizer = _optimizer(model, t)
        batch = _batch(t.per_device_train_batch_size, cfg.data.max_length, info)
        model.per_document_attention = False  # see the module docstring
        if info.dims.cp > 1:
            batch = _context_parallel_part(model, batch, info)
        model.train()
        for n in (1, micro_batches):
            for _ in range(n):
                _forward_backward(model, batch)
            _clip(model, t.max_grad_norm)
            _optimizer_step(model, optimizer)
    result = _tracked_step(model, optimizer, batch, t.max_grad_norm, micro_batches)
    result.device = info.device.type
    result.replay = replay(recorder.events)
    result.replay_expandable = replay(recorder.events, expandable=True)
    result.streams = _stream_names(model, recorder.stream_numbers())
    return result


def _optimizer(model, t):
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return build_optimizer(
        params,
        optim=t.optim,
        lr=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
    )


def _stream_names(model, numbers: dict[object, int]) -> dict[int, str]:
    """{stream number: name} for the default stream and FSDP2's communication streams (its FSDPCommContext)."""
    state = getattr(model, "_get_fsdp_state", None)
    ctx = getattr(state(), "_comm_ctx", None) if state is not None else None
    names = {0: "default"}
    for attr in ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream"):
        stream = getattr(ctx, attr, None)
        if stream is not None and stream in numbers:
            names[numbers[stream]] = attr.removesuffix("_stream").replace("_", "-")
    return names


def _tracked_step(model, optimizer, batch, max_grad_norm: float, micro_batches: int) -> TraceResult:
    """One step's micro-batches under FSDP2's memory tracker: its peaks by category, and the state it leaves."""

    micro = [lambda: _forward_backward(model, batch)] * (micro_batches - 1)
    micro.append(lambda: (_forward_backward(model, batch), _clip(model, max_grad_norm)))
    # One tracker per micro-batch: FSDP2's tracker (its ModTracker's register_multi_grad_hook on each module's
    # inputs) keeps a micro-batch's leaf inputs alive after its backward, here the embeddings' output, which
    # transformers makes a leaf requiring grad under checkpointing (enable_input_require_grads), with its .grad.
    # A real run frees both when the backward ends; a second micro-batch under the same tracker would count them
    # (two T·h tensors). A fresh tracker counts what exists at its start by what it is: parameters, gradients,
    # optimizer states, inputs.
    peaks = _worst(track_peak(model, optimizer, tuple(batch.values()), [run]) for run in micro)
    by_identity = peaks.pop("step by identity")
    # Not traced: under fake tensors, foreach AdamW on DTensor parameters leaves its intermediates alive
    # (7x the trainable shard, against 2x states + 1x temporary in a real run).
    _optimizer_step(model, optimizer)
    state = _state_bytes(model, optimizer)
    # bitsandbytes' quantization states are plain attributes of the layers, which the tracker does not see;
    # they live through the whole step on every rank.
    constants = quant.quantized_bytes(model)["quant_state"]
    for snap in peaks.values():
        snap["Quantization constants"] = constants
        snap["Total"] = snap.get("Total", 0) + constants
    by_identity["parameters"] += constants
    return TraceResult(peaks, state, "", by_identity)


def _worst(runs) -> dict:
    """The largest of each peak over several tracked runs; the step's identity filing and sizes come with the
    step's peak."""
    out: dict = {}
    for run in runs:
        for name, snap in run.items():
            if name == "step by identity":
                continue
            if snap.get("Total", 0) >= out.get(name, {}).get("Total", -1):
                out[name] = snap
                if name == "step":
                    out["step by identity"] = run["step by identity"]
    return out


def _batch(batch_size: int, seq_len: int, info) -> dict[str, torch.Tensor]:
    """One micro-batch of whole rows, each one document. Under context parallelism its real host copy: the split
    reads the positions."""
    with _real_tensors() if info.dims.cp > 1 else contextlib.nullcontext():
        ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
        pos = torch.arange(seq_len).expand(batch_size, seq_len).contiguous()
        batch = {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}
    return batch if info.dims.cp > 1 else {k: v.to(info.device) for k, v in batch.items()}


def _context_parallel_part(model, batch: dict, info) -> dict:
    """Rank 0's part of the micro-batch (shardtune.parallel.context_parallel.local_part), and the model's CPShard:
    with rows of one document each, chunk 0 attends among its own positions and chunk 2·cp - 1 the whole row's
    gathered keys, the largest crossing part a row can have. The split runs on the host batch's real values; the
    part then enters the trace as fake tensors on the device."""

    with _real_tensors():
        local, model.cp_shard = local_part(batch, info, model)
    return {k: v.to(info.device) for k, v in local.items()}


def _real_tensors():
    """Real (not fake) tensors inside the trace's FakeTensorMode, for the host logic that reads values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _forward_backward(model, batch) -> None:
    """One micro-batch of shardtune.training.trainer's step, without its host reads (the token counts)."""
    loss, _ = model(**batch, head=token_loss)
    loss.backward()


def _clip(model, max_grad_norm: float) -> None:
    """shardtune.training.trainer's gradient clipping, without reading the norm on the host."""
    grads = [p for p in model.parameters() if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grad_norm_(grads, max_grad_norm if max_grad_norm > 0 else math.inf, foreach=True)


def _optimizer_step(model, optimizer) -> None:
    optimizer.step()
    model.zero_grad(set_to_none=True)


def _state_bytes(model, optimizer) -> dict[str, int]:
    out = dict(local_state_bytes(model))
    out["trainable_tensors"] = sum(1 for p in model.parameters() if p.requires_grad)
    out["optimizer"] = sum(
        _local(v).numel() * _local(v).element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
