"""4-bit experts: the fused expert tensors of a mixture of experts quantized expert by expert (QLoRA on MoE).

transformers' bitsandbytes integration quantizes linear layers only. The experts of transformers 5's MoE families
are 3-D parameters, (E, out, in) or (E, in, out), which it leaves in 16 bits: about 95% of Qwen3-30B-A3B's weights.
Here, while the checkpoint is read:

- each expert's matrix is quantized on its own, by bitsandbytes' `quantize_4bit` in the (out, in) orientation its
  `matmul_4bit` expects, so expert e's bytes and its quantization state are bitsandbytes' own;
- the E packed matrices are one (E, packed) parameter of the storage dtype (`Experts4bit.weight`): FSDP2 shards it
  over experts and all-gathers it with its decoder block like a Linear4bit's packed weight;
- the E quantization states are stacked into one `QuantState` (absmax (E, blocks), ...) that every rank holds,
  replicated like a Linear4bit's, so shardtune.models.quant and shardtune.parallel.loading treat both alike
  (`shardtune.models.quant.packed_modules`).

The experts' forward (`forward_4bit`) is transformers' eager loop over the experts a micro-batch routes tokens to,
with `matmul_4bit` in place of each linear: expert e is dequantized when its tokens are multiplied, and again in
backward (bitsandbytes' MatMul4Bit keeps the packed bytes, not the 16-bit matrix), so no 16-bit copy of a block's
experts is held, one expert's matrix at a time. The gating (`_apply_gate`: GPT-OSS's clamped, interleaved one too),
biases, transposed layouts and post-expert norms are read off the flags transformers' `use_experts_implementation`
sets on every experts module, as its own batched implementation does.

Checkpoints store experts per expert (`experts.3.gate_proj.weight`), which transformers stacks and concatenates
while loading; `ExpertReader` inverts that conversion (models.weights.expert_slices) and quantizes each expert as
soon as all its rows have been read, so at most the experts in flight are held in 16 bits.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from shardtune.models.targets import expert_parameters
from shardtune.models.weights import checkpoint_files, expert_slices, read_headers

# The flags transformers' use_experts_implementation sets on an experts module; without them the module's forward
# is its own code, which forward_4bit cannot stand in for.
_EXPERT_FLAGS = ("has_gate", "has_bias", "is_transposed")


class Experts4bit(nn.Module):
    """One fused expert tensor in 4 bits: `weight` (E, packed) of the storage dtype, `quant_state` the E experts'
    states stacked (its `shape` is (E, out, in)); `transposed`: the model holds the tensor as (E, in, out)."""

    def __init__(self, weight: torch.Tensor, quant_state, *, transposed: bool):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.quant_state = quant_state
        self.transposed = transposed

    @property
    def num_experts(self) -> int:
        return self.quant_state.shape[0]

    @property
    def model_shape(self) -> tuple[int, int, int]:
        """The fused tensor's shape as the model holds it."""
        e, out, inp = self.quant_state.shape
        return (e, inp, out) if self.transposed else (e, out, inp)

    def expert_state(self, e: int):
        """Expert e's own QuantState (views of the stacked tensors)."""
        from bitsandbytes.functional import QuantState

        s = self.quant_state
        state2 = None
        if s.nested:
            state2 = QuantState(absmax=s.state2.absmax[e], code=s.state2.code, blocksize=s.state2.blocksize,
                                dtype=s.state2.dtype)  # fmt: skip
        return QuantState(
            absmax=s.absmax[e], shape=torch.Size(s.shape[1:]), code=s.code, blocksize=s.blocksize,
            quant_type=s.quant_type, dtype=s.dtype, offset=None if s.offset is None else s.offset[e], state2=state2,
        )  # fmt: skip

    def linear(self, x: torch.Tensor, e: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W_e^T (+ bias) with W_e dequantized in forward and again in backward."""
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, self.weight[e], self.expert_state(e), bias=bias)

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The whole tensor as the model holds it, (E, out, in) or (E, in, out), in the state's dtype."""
        from bitsandbytes.functional import dequantize_4bit

        mats = [dequantize_4bit(self.weight[e].reshape(-1, 1), self.expert_state(e)) for e in range(self.num_experts)]
        full = torch.stack(mats)
        return full.transpose(1, 2) if self.transposed else full


def expert_parameters_4bit(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(experts module, parameter name) of every fused expert tensor to quantize; raises ValueError for an experts
    module whose forward forward_4bit cannot stand in for."""

    out = []
    for path in expert_parameters(model):
        owner, _, name = path.rpartition(".")
        module = model.get_submodule(owner)
        missing = [f for f in _EXPERT_FLAGS if not hasattr(module, f)]
        if missing:
            raise ValueError(
                f"--use_4bit_quantization: {type(module).__name__} ({owner}) computes its experts in its own code, "
                "not through transformers' experts interface (use_experts_implementation), so shardtune cannot "
                "run its experts in 4 bits. Train this model without --use_4bit_quantization (LoRA in bf16)."
            )
        out.append((module, name))
    return out


def quantize_skeleton(model: nn.Module, *, dtype: torch.dtype, settings: dict) -> list[str]:
    """Replace every fused expert parameter of a meta skeleton by an Experts4bit on meta (shapes as quantize_4bit
    makes them) and give its experts module forward_4bit; returns the parameter paths. settings: bitsandbytes'
    blocksize, quant_type, compress_statistics and quant_storage (those of the model's Linear4bit layers)."""
    paths = []
    for module, name in expert_parameters_4bit(model):
        param = module._parameters.pop(name)
        transposed = bool(module.is_transposed)
        e, *mat = param.shape
        shape = (e, mat[1], mat[0]) if transposed else (e, *mat)
        module.add_module(name, _on_meta(shape, dtype, settings, transposed))
        module.forward = forward_4bit.__get__(module)
        paths.append(f"{_path_of(model, module)}.{name}")
    return paths


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _on_meta(shape: tuple[int, int, int], dtype: torch.dtype, settings: dict, transposed: bool) -> Experts4bit:
    """An Experts4bit on meta with the shapes and dtypes bitsandbytes' quantize_4bit gives each expert."""
    from bitsandbytes.functional import QuantState

    experts, n = shape[0], shape[1] * shape[2]
    storage, blocksize = settings["quant_storage"], settings["blocksize"]
    blocks = -(-n // blocksize)
    meta = torch.device("meta")
    absmax_dtype, offset, state2 = torch.float32, None, None
    if settings["compress_statistics"]:
        absmax_dtype = torch.uint8
        offset = torch.empty(experts, dtype=torch.float32, device=meta)
        state2 = QuantState(absmax=torch.empty(experts, -(-blocks // 256), dtype=torch.float32, device=meta),
                            code=torch.empty(256, dtype=torch.float32, device=meta), blocksize=256,
                            dtype=torch.float32)  # fmt: skip
    state = QuantState(
        absmax=torch.empty(experts, blocks, dtype=absmax_dtype, device=meta), shape=torch.Size(shape),
        code=torch.empty(16, dtype=torch.float32, device=meta), blocksize=blocksize,
        quant_type=settings["quant_type"], dtype=dtype, offset=offset, state2=state2,
    )  # fmt: skip
    packed = torch.empty(experts, (n + 1) // (storage.itemsize * 2), dtype=storage, device=meta)
    return Experts4bit(packed, state, transposed=transposed)


def forward_4bit(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' eager experts loop with 4-bit experts (`self`: the experts module): each expert multiplies
    the tokens routed to it, and its outputs, scaled by their routing weights, are added to the tokens' rows in
    expert order, as the eager loop adds them. The routed copies are sorted by expert once (as grouped_mm does),
    so the loop needs only how many each expert has (`_expert_counts`)."""
    n_experts = (self.gate_up_proj if self.has_gate else self.up_proj).num_experts
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens, weights = order // k, top_k_weights.reshape(-1)[order]
    up = "gate_up_proj" if self.has_gate else "up_proj"
    out = torch.zeros_like(hidden_states)
    start = 0
    for e, n in enumerate(_expert_counts(flat, n_experts)):  # copies routed to transformers' sentinel E sort last
        rows, w = tokens[start : start + n], weights[start : start + n]
        start += n
        if n == 0:
            continue
        h = _expert_linear(self, up, hidden_states[rows], e)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _expert_linear(self, "down_proj", h, e)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        out.index_add_(0, rows, (h * w[:, None]).to(out.dtype))
    return out


def _expert_counts(flat: torch.Tensor, n_experts: int) -> list[int]:
    """How many routed copies each expert has. Under fake tensors (`shardtune plan --trace`) the routing has no
    values: the copies are spread evenly, the balance the planner's estimate assumes."""
    if is_fake(flat):
        copies = flat.numel()
        return [copies // n_experts + (e < copies % n_experts) for e in range(n_experts)]
    return torch.bincount(flat, minlength=n_experts + 1)[:n_experts].tolist()


def _expert_linear(experts: nn.Module, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
    bias = getattr(experts, f"{name}_bias")[e].to(x.dtype) if experts.has_bias else None
    y = getattr(experts, name).linear(x, e, bias)
    wrapper = getattr(experts, LORA_ATTR, {}).get(name)
    lora = None if wrapper is None else _expert_lora(wrapper, x, e)
    return y if lora is None else y + lora.to(y.dtype)


# ---------------------------------------------------------------- expert LoRA on 4-bit experts

# On an experts module with 4-bit experts: {parameter name: the PEFT ParamWrapper adapting it}.
LORA_ATTR = "shardtune_expert_lora"


@contextlib.contextmanager
def shaped_as_parameters(model: nn.Module) -> Iterator[None]:
    """While PEFT finds and wraps the expert tensors (target_parameters): each Experts4bit stands aside for a
    parameter of the fused tensor's shape holding no memory, so PEFT's ParamWrapper takes the shapes, names and layout of
    transformers' own experts, and the adapter it saves loads on a 16-bit base in plain PEFT."""
    swapped = []
    for owner in model.modules():
        for name, child in list(owner._modules.items()):
            if isinstance(child, Experts4bit):
                del owner._modules[name]
                # One element broadcast to the shape: on the packed weight's device, where PEFT puts the LoRA.
                one = torch.zeros((), dtype=child.quant_state.dtype, device=child.weight.device)
                owner._parameters[name] = nn.Parameter(one.expand(child.model_shape), requires_grad=False)
                swapped.append((owner, name, child))
    try:
        yield
    finally:
        for owner, name, child in swapped:
            del owner._parameters[name]
            owner._modules[name] = child


def expert_stand_ins(attach):
    """Decorates a function attaching a PEFT adapter to `model` (its first argument): while it runs, 4-bit experts
    stand in as the 3-D parameters they are (shaped_as_parameters); after it, their LoRA is bound to the 4-bit
    forward (bind_expert_lora)."""

    @functools.wraps(attach)
    def attached(model: nn.Module, *args, **kwargs) -> nn.Module:
        with shaped_as_parameters(model):
            model = attach(model, *args, **kwargs)
        bind_expert_lora(model)
        return model

    return attached


def bind_expert_lora(model: nn.Module) -> None:
    """After PEFT wrapped 4-bit experts: each wrapper's LoRA is applied inside forward_4bit, expert by expert
    (x·A_eᵀ·B_eᵀ beside the 4-bit matmul), so the wrapper's own forward, which would add its delta to the
    parameter, only passes through."""
    from peft.tuners.lora import ParamWrapper

    for module in model.modules():
        if not isinstance(module, ParamWrapper):
            continue
        base = module.get_base_layer()
        if isinstance(getattr(base, module.parameter_name, None), Experts4bit):
            base.__dict__.setdefault(LORA_ATTR, {})[module.parameter_name] = module
            module.forward = types.MethodType(_pass_through, module)


def _pass_through(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self.base_layer(x, *args, **kwargs)


def _expert_lora(wrapper, x: torch.Tensor, e: int) -> torch.Tensor | None:
    """Expert e's LoRA output, scale · x A_eᵀ B_eᵀ, in PEFT's layout: A (r·E, in) holds A_e in rows e·r..(e+1)·r,
    B (out, r·E) holds B_e in columns e, e+E, ... (ParamWrapper.get_delta_weight); None when adapters are off."""
    if wrapper.disable_adapters:  # PEFT's disable_adapter(): a preference objective's reference forward
        return None
    terms = []
    for name in [a for a in wrapper.active_adapters if a in wrapper.lora_A]:
        A, B = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
        r = A.shape[0] // wrapper.num_experts
        a_e = A.view(wrapper.num_experts, r, A.shape[1])[e]
        b_e = B.view(B.shape[0], r, wrapper.num_experts)[:, :, e]
        terms.append(wrapper.scaling[name] * nn.functional.linear(nn.functional.linear(x.to(A.dtype), a_e), b_e))
    return sum(terms) if terms else None


class ExpertReader:
    """Fills the Experts4bit of a skeleton from a checkpoint read tensor by tensor (shardtune.models.weights'
    `load_checkpoint_into(take=...)`): a stored per-expert tensor gives its rows of one expert's matrix, a fused
    stored tensor all experts; each expert is quantized once complete."""

    def __init__(self, model: nn.Module, model_name_or_path: str, paths: list[str], *, rename, device):
        shapes, _ = read_headers(checkpoint_files(model_name_or_path))
        shapes = {rename(k): v for k, v in shapes.items()}
        self.device = device
        self.holders = {p: model.get_submodule(p) for p in paths}
        self.rows: dict[str, tuple[str, int, slice]] = {}  # stored (renamed) name -> (holder path, expert, rows)
        for path in paths:
            slices = expert_slices(model.config, path, shapes, lambda n: n if n in shapes else None) or []
            for stored, e, rows in slices:
                self.rows[stored] = (path, e, rows)
        self.pending: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}
        self.done: dict[str, torch.Tensor] = {}  # holder path -> its packed (E, packed) being filled
        self.filled: dict[str, int] = {p: 0 for p in paths}

    def take(self, key: str, tensor: torch.Tensor) -> bool:
        """Place a checkpoint tensor that belongs to an expert tensor (True); anything else: False."""
        if key in self.holders:
            for e in range(tensor.shape[0]):
                self._quantize(key, e, tensor[e])
            return True
        if key not in self.rows:
            return False
        path, e, rows = self.rows[key]
        holder = self.holders[path]
        shape = holder.quant_state.shape[1:]
        mat_shape = (shape[1], shape[0]) if holder.transposed else tuple(shape)
        buf, count = self.pending.get((path, e), (None, 0))
        if buf is None:
            buf = torch.empty(mat_shape, dtype=tensor.dtype)
        buf[rows] = tensor
        count += rows.stop - rows.start
        if count < mat_shape[0]:
            self.pending[(path, e)] = (buf, count)
            return True
        self.pending.pop((path, e), None)
        self._quantize(path, e, buf)
        return True

    def _quantize(self, path: str, e: int, matrix: torch.Tensor) -> None:
        """Quantize expert e's matrix (as the model holds it) into its holder; the holder becomes real when its
        last expert is in."""
        from bitsandbytes.functional import quantize_4bit

        holder = self.holders[path]
        s = holder.quant_state
        w = (matrix.T if holder.transposed else matrix).contiguous().to(self.device)
        packed, state = quantize_4bit(w, blocksize=s.blocksize, compress_statistics=s.nested,
                                      quant_type=s.quant_type, quant_storage=holder.weight.dtype)  # fmt: skip
        if path not in self.done:
            self.done[path] = torch.empty(holder.weight.shape, dtype=holder.weight.dtype)
            _materialize_state(s)
        self.done[path][e] = packed.reshape(-1).cpu()
        _store_expert_state(s, e, state)
        self.filled[path] += 1
        if self.filled[path] == holder.num_experts:
            holder.weight = nn.Parameter(self.done.pop(path), requires_grad=False)

    def check_complete(self, model_name_or_path: str) -> None:
        short = [p for p, n in self.filled.items() if n != self.holders[p].num_experts]
        if short:
            p = short[0]
            raise ValueError(
                f"{model_name_or_path}: the checkpoint holds {self.filled[p]} of the "
                f"{self.holders[p].num_experts} experts of {p} ({len(short)} expert tensors incomplete); save the "
                "model again with transformers' save_pretrained."
            )


def _materialize_state(state) -> None:
    """The stacked state's tensors on CPU, to be filled expert by expert."""
    state.absmax = torch.empty_like(state.absmax, device="cpu")
    state.code = torch.empty_like(state.code, device="cpu")
    if state.nested:
        state.offset = torch.empty_like(state.offset, device="cpu")
        state.state2.absmax = torch.empty_like(state.state2.absmax, device="cpu")
        state.state2.code = torch.empty_like(state.state2.code, device="cpu")


def _store_expert_state(stacked, e: int, state) -> None:
    stacked.absmax[e] = state.absmax.cpu()
    stacked.code.copy_(state.code.cpu())  # the same table (NF4 or FP4) for every expert
    if stacked.nested:
        stacked.offset[e] = state.offset.cpu()
        stacked.state2.absmax[e] = state.state2.absmax.cpu()
        stacked.state2.code.copy_(state.state2.code.cpu())
