"""Tensor parallelism: each decoder block's linear layers sliced over the `tp` ranks of the mesh, applied before
FSDP2 shards the rest over the data-parallel dimensions (shardtune.parallel.parallelize, step 2).

The plan is Megatron's, as transformers' `base_model_tp_plan` and torchtitan's Llama plan give it: q, k, v, gate
and up are column-parallel (weight Shard(0): each rank computes its heads and its slice of the MLP's width from the
whole input), o and down are row-parallel (weight Shard(1): each rank multiplies its slice, and one all-reduce
sums the parts). Between the two, attention runs on the rank's heads only: transformers' attention reshapes its
projections to (-1, head_dim), so the local head counts follow from the local widths, and the key/value groups
(heads per kv head) are unchanged. Embeddings, norms and the head stay whole on every tp rank (FSDP shards them
over the data-parallel ranks); their gradients agree on the tp ranks because the column-parallel layers
all-reduce their input's gradient in backward (torch's ColwiseParallel).

LoRA: the factors are placed so that the adapter's product matches its base layer's slice, and the adapter stays
the one a single process trains. A column-parallel base (W: out×in, Shard(0)) gets lora_A (r×in) whole and
lora_B (out×r) sharded on its output dimension; a row-parallel base (Shard(1)) gets lora_A sharded on its input
dimension, whose partial products are all-reduced, and lora_B whole. The factors are initialised by peft on their
full shapes before this runs (models.builder attaches the adapter first), then sliced: the initial adapter, and
so the trained and saved one, does not depend on the tp size.

peft 0.21 places the factors the same way, but only for a model that transformers loaded with its own `tp_plan`
(`from_pretrained(tp_plan=..., device_mesh=...)`, which sets `model._device_mesh` and `model.tp_plan` that peft
reads): shardtune loads its own way (one reader per node, a skeleton on meta elsewhere, FSDP's shards filled
after sharding), so the same placement is applied here with torch's parallel styles, on the base layer and the
factors peft created. The factors then compute through peft's own forward (the modules' hooks do the
communication); shardtune's one-addmm LoRA forward (models.fastpath), which reads lora_B's weight directly, is
taken off the sliced layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardtune.config.errors import ConfigError
from shardtune.runtime.log import print0

# The verified plan, by module path inside a decoder block: Llama's (transformers' base_model_tp_plan).
LLAMA_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
# torch's styles for the plan's words (the tests' planted bugs replace an entry).
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def family_plan(config) -> dict[str, str] | None:
    """The family's block plan when it is the verified one: transformers' `base_model_tp_plan` of the config,
    with the decoder layers' prefix taken off, equal to LLAMA_PLAN (Llama, Mistral, Qwen2 ... share it). None for
    a family with another plan or none."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    block = {k.removeprefix("layers.*."): v for k, v in plan.items()}
    return dict(LLAMA_PLAN) if block == LLAMA_PLAN else None


def check_model(model_name_or_path: str, tp: int, *, trust_remote_code: bool = False) -> None:
    """Refuse (ConfigError, every problem at once) a model tensor parallelism cannot slice, from its config.json,
    before any weight is read."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    problems = model_problems(config, tp)
    if problems:
        raise ConfigError(problems)


def model_problems(config, tp: int) -> list[str]:
    """What the model needs for `--tensor_parallel_size tp`, read from its config before any weight is: a verified
    plan, no experts, and attention heads, key/value heads and the MLP's width that tp divides (each rank holds
    whole heads and equal slices)."""
    flag = f"--tensor_parallel_size {tp}"
    text = config.get_text_config()
    p = []
    if family_plan(config) is None:
        p.append(f"{flag}: {config.model_type} has no tensor-parallel plan shardtune has verified (the Llama-style "
                 "plan: q/k/v/gate/up column-parallel, o/down row-parallel); use --tensor_parallel_size 1.")  # fmt: skip
    experts = [k for k in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(text, k, None)]
    if experts:
        p.append(f"{flag}: {config.model_type} has experts ({experts[0]}), which shardtune's tensor parallelism "
                 "does not slice yet; use --tensor_parallel_size 1.")  # fmt: skip
    widths = {
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None),
        "intermediate_size": getattr(text, "intermediate_size", None),
    }
    for name, value in widths.items():
        if value is not None and value % tp:
            p.append(f"{flag}: the model's {name} {value} is not divisible by {tp}; each rank must hold an equal "
                     f"share; use a tensor_parallel_size that divides it.")  # fmt: skip
    return p


def apply_tensor_parallel(blocks: list[nn.Module], mesh: DeviceMesh, plan: dict[str, str]) -> int:
    """Slice each block's layers of `plan` over the tp `mesh` (this module's docstring); returns how many."""
    n = 0
    for block in blocks:
        for path, kind in plan.items():
            _parallelize_layer(block.get_submodule(path), kind, mesh)
            n += 1
    print0(
        f"Tensor parallelism: {n} linear layers of {len(blocks)} blocks sliced over {mesh.size()} ranks "
        f"({', '.join(sorted({p.rsplit('.', 1)[-1] for p, k in plan.items() if k == 'colwise'}))} column-parallel; "
        f"{', '.join(sorted({p.rsplit('.', 1)[-1] for p, k in plan.items() if k == 'rowwise'}))} row-parallel)."
    )
    return n


def factor_style(kind: str):
    """The style of the LoRA factor on the sliced side of a `kind` base layer: the base layer's own."""
    return STYLES[kind]()


def _parallelize_layer(module: nn.Module, kind: str, mesh: DeviceMesh) -> None:
    """One linear layer, or a peft LoRA layer: its base layer, and the factor on the sliced side of it."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        parallelize_module(module, mesh, STYLES[kind]())
        return
    parallelize_module(module.get_base_layer(), mesh, STYLES[kind]())
    for name in module.lora_A:
        # Column-parallel base: lora_B's output slice is the base's; lora_A stays whole (its input is whole).
        # Row-parallel base: lora_A reads the same input slice as the base and all-reduces its r-wide product;
        # lora_B stays whole (its output is whole).
        factor = module.lora_B[name] if kind == "colwise" else module.lora_A[name]
        parallelize_module(factor, mesh, factor_style(kind))
        if name in module.lora_magnitude_vector:
            _place_magnitude(module, name, kind, mesh)
        else:
            module.lora_variant.pop(name, None)  # peft's forward through the factors' hooks (docstring)


@dataclass(frozen=True)
class SlicedDora:
    """What shardtune's DoRA forward (models.dora) needs of a layer sliced over the tp ranks, set on the layer as
    `shardtune_sliced`: each tensor's local slice, and for a row-parallel layer (a slice of every row) the sums of
    its per-slice partial results over the ranks."""

    row_parallel: bool
    mesh: DeviceMesh

    @staticmethod
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def sum_squares(self, sq: torch.Tensor) -> torch.Tensor:
        """The squared row norms, from each slice's sums over its columns (a constant for autograd)."""
        if self.row_parallel:
            dist.all_reduce(sq, group=self.mesh.get_group())
        return sq

    def sum_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """A product with the weight's slice added over the ranks, with the backward of RowwiseParallel's output
        (the replicated sum's gradient passed to every partial product unchanged)."""
        if not self.row_parallel:
            return partial
        return DTensor.from_local(partial, self.mesh, [Partial()]).redistribute(placements=[Replicate()]).to_local()


def _place_magnitude(module: nn.Module, name: str, kind: str, mesh: DeviceMesh) -> None:
    """DoRA's magnitude (one value per output row) follows its layer's output: sliced with a column-parallel
    layer's rows, whole beside a row-parallel one. shardtune's DoRA forward (models.dora) computes the norms on the
    slices, summing a row-parallel layer's over the tp ranks (SlicedDora), and scales the output it holds."""
    magnitude = module.lora_magnitude_vector[name]
    if kind == "colwise":
        w = magnitude.weight
        magnitude.weight = nn.Parameter(distribute_tensor(w.data, mesh, [Shard(0)]), requires_grad=w.requires_grad)
    module.shardtune_sliced = SlicedDora(row_parallel=kind == "rowwise", mesh=mesh)


def mixed_meshes(params: list[nn.Parameter]) -> bool:
    """Whether the gradients live on several meshes: under tensor parallelism the sliced layers' on the
    data-parallel × tp mesh, the rest (embeddings, norms, the head, lora_A of a column-parallel layer) on the
    data-parallel mesh only, which one foreach norm (torch's clip_grad_norm_) refuses to mix."""
    return len({id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None for p in params}) > 1


@torch.no_grad()
def clip_grad_norm_by_mesh(params: list[nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ (2-norm, coefficient max_norm / (norm + 1e-6) capped at 1) over gradients on
    several meshes: each mesh's norm reduced over its own ranks (a gradient whole on the tp ranks is counted
    once), then combined; clip when max_norm > 0. `params` have gradients."""
    groups: dict[int | None, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = float(torch.linalg.vector_norm(torch.stack(norms)))
    if max_norm > 0:
        coef = min(max_norm / (total + 1e-6), 1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total
