"""What an adapter does to each tensor of its base, for `shardtune merge`: reading the adapter (config and
weights), mapping every adapter key to the base tensor it changes and checking shapes before any base weight is
read (`plan_merge`), and computing one merged tensor in fp32 (`apply_edit`).

Reads only headers and the adapter; the base's shards are streamed by shardtune.merge.fold.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shardtune.config import dtypes
from shardtune.merge.experts import ExpertLora, parameter_wrappers, wrapper_edits
from shardtune.models.weights import PEFT_PREFIX, checkpoint_renaming
from shardtune.runtime.log import warn0
from shardtune.training.run_dir import checkpoint_given_as_adapter

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# Fields of LoraConfig that do not mark a variant yet change what merging means.
UNMERGEABLE_OPTIONS = ("use_qalora", "layer_replication")
# Adapter keys after the `base_model.model.` prefix; the optional `.<name>` is an adapter name that peft drops
# when saving but that state dicts taken from a live model still carry. The first pattern that matches wins.
KEY_PATTERNS = (
    (re.compile(r"^(?P<m>.+)\.lora_A(?:\.[^.]+)?\.weight$"), "A"),
    (re.compile(r"^(?P<m>.+)\.lora_B(?:\.[^.]+)?\.weight$"), "B"),
    (re.compile(r"^(?P<m>.+)\.lora_B(?:\.[^.]+)?\.bias$"), "B_bias"),
    (re.compile(r"^(?P<m>.+)\.lora_embedding_A(?:\.[^.]+)?$"), "emb_A"),
    (re.compile(r"^(?P<m>.+)\.lora_embedding_B(?:\.[^.]+)?$"), "emb_B"),
    (re.compile(r"^(?P<m>.+)\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?$"), "magnitude"),
    (re.compile(r"^(?P<m>.+)\.token_adapter\.trainable_tokens_delta(?:\.[^.]+)?$"), "tokens"),
    (re.compile(r"^(?P<m>.+?)(?:\.token_adapter)?\.base_layer\.(?P<p>weight|bias)$"), "replace"),
    (re.compile(r"^(?P<m>.+)\.modules_to_save\.[^.]+\.(?P<p>weight|bias)$"), "replace"),
    (re.compile(r"^(?P<m>.+)\.(?P<p>weight|bias)$"), "replace"),
)


@dataclass
class LoraUpdate:
    """One adapted layer: delta = scale · B @ A in (out, in) layout; DoRA adds a per-output magnitude."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    transposed: bool  # the stored weight is (in, out): fan_in_fan_out (Conv1D) or an embedding
    magnitude: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        out, inp = self.B.shape[0], self.A.shape[1]
        return (inp, out) if self.transposed else (out, inp)


@dataclass
class TensorEdit:
    """Everything the adapter does to one tensor, applied in this order."""

    replacement: torch.Tensor | None = None  # modules_to_save or saved (resized) embedding layer
    grow_to: int | None = None  # rows, when trained tokens lie past the base embedding's end
    lora: LoraUpdate | None = None
    add: torch.Tensor | None = None  # scale · lora_B.bias
    tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # (indices, rows) copied in
    experts: ExpertLora | None = None  # a fused expert tensor stored whole (shardtune.merge.experts)

    def final_shape(self, base_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = tuple(self.replacement.shape) if self.replacement is not None else tuple(base_shape)
        return (self.grow_to, *shape[1:]) if self.grow_to else shape


@dataclass
class BaseCheckpoint:
    folder: Path
    shards: list[Path]  # in order
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    config: dict[str, Any]


@dataclass
class MergePlan:
    edits: dict[str, TensorEdit]
    aliases: dict[str, str]  # tied output-embedding name -> the base tensor it is tied to
    input_embedding: str | None
    dtype: torch.dtype
    # Config fields that follow the vocabulary when it grows (vocab_size; Gemma 4's vocab_size_per_layer_input).
    config_updates: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- reading the adapter


def read_adapter_config(adapter: Path) -> Any:
    """The adapter's LoraConfig; refuse other adapter types and LoRA variants that do not merge as W + s·BA."""
    from peft import LoraConfig

    path = adapter / "adapter_config.json"
    if not path.exists():
        if hint := checkpoint_given_as_adapter(adapter, "--adapter"):
            raise ValueError(hint)
        raise ValueError(
            f"--adapter {adapter}: no adapter_config.json there; give the folder that PEFT's "
            "save_pretrained (or shardtune train) wrote."
        )
    raw = json.loads(path.read_text())
    peft_type = str(raw.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise ValueError(
            f"--adapter {adapter} is a {peft_type or 'unknown'} adapter; shardtune merge supports LoRA "
            "adapters (with or without DoRA) only."
        )
    fields = {f.name: f.metadata for f in dataclasses.fields(LoraConfig)}
    variants = [k for k, meta in fields.items() if meta.get("is_lora_variant") and k != "use_dora"]
    used = [k for k in (*variants, *UNMERGEABLE_OPTIONS) if raw.get(k)]
    if raw.get("init_lora_weights") in fields["init_lora_weights"].get("lora_variants", ()):
        used.append(f"init_lora_weights={raw['init_lora_weights']}")
    if used:
        raise ValueError(
            f"--adapter {adapter} uses {', '.join(used)}, which shardtune merge does not support; "
            "merge it with peft's merge_and_unload instead."
        )
    if str(raw.get("init_lora_weights")).lower().startswith(("pissa", "olora", "corda")):
        warn0(
            f"--adapter {adapter} was initialised with {raw['init_lora_weights']}, which changed the base weights "
            "during training; the merge is right only if the adapter was converted to plain LoRA when saved."
        )
    return LoraConfig.from_pretrained(str(adapter))


def load_adapter_weights(adapter: Path) -> dict[str, torch.Tensor]:
    for name in ADAPTER_WEIGHTS:
        path = adapter / name
        if path.exists():
            if name.endswith(".safetensors"):
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"--adapter {adapter}: no {' or '.join(ADAPTER_WEIGHTS)} there.")


def parse_keys(weights: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Group adapter tensors by the module (or, for replacements, the tensor) they belong to."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in weights.items():
        rel = key.removeprefix(PEFT_PREFIX)
        for pattern, kind in KEY_PATTERNS:
            m = pattern.match(rel)
            if m:
                break
        else:
            raise ValueError(f"adapter key {key!r} is not a LoRA, DoRA, modules_to_save or trainable-token tensor.")
        target = f"{m['m']}.{m['p']}" if kind == "replace" else m["m"]
        group = groups.setdefault(target, {})
        if kind in group:
            raise ValueError(f"adapter keys {group[kind][0]!r} and {key!r} both set the same {kind} of {target}.")
        group[kind] = (key, value)
    return groups


# ---------------------------------------------------------------- planning


def plan_merge(
    base: BaseCheckpoint,
    peft_config: Any,
    weights: dict[str, torch.Tensor],
    dtype: str | None,
    trust_remote_code: bool = False,
) -> MergePlan:
    """Map every adapter tensor to the base tensor it changes and check shapes, before any weight is read."""
    in_name, aliases, skeleton = _embedding_layout(base, trust_remote_code)
    plan = MergePlan({}, aliases, in_name, _output_dtype(base, dtype))
    names = {n: n for n in [*base.shapes, *aliases]} | _renamed_tensors(base, trust_remote_code)
    groups = parse_keys(weights)
    _plan_parameter_loras(plan, groups, skeleton, peft_config, names, base)
    # Replacements first: they fix the shape (e.g. a resized embedding) that LoRA and token edits must match.
    for target, parts in sorted(groups.items(), key=lambda kv: "replace" not in kv[1]):
        if "replace" in parts:
            key, value = parts.pop("replace")
            plan.edits.setdefault(_resolve(target, names, key), TensorEdit()).replacement = value
        if parts.keys() & {"A", "B", "emb_A", "emb_B", "magnitude", "B_bias"}:
            _plan_lora(plan, target, parts, names, peft_config)
        if "tokens" in parts:
            _plan_tokens(plan, target, parts["tokens"], names, peft_config)
    for name, edit in plan.edits.items():
        _fit_edit(name, edit, base.shapes[aliases.get(name, name)])
    if skeleton is not None:
        _grow_token_tables(plan, base, skeleton)
    return plan


def _embedding_layout(
    base: BaseCheckpoint, trust_remote_code: bool
) -> tuple[str | None, dict[str, str], torch.nn.Module | None]:
    """Find the input embedding and, when the output embedding is tied to it, map the output name to it; also
    return the model's skeleton (None when it cannot be built).

    The model is built on the meta device (no memory) so that any architecture transformers knows answers for
    itself; a tied output embedding is usually absent from the checkpoint, yet the adapter may still change it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(base.folder), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - unknown architecture without --trust_remote_code, and the like
        warn0(f"could not build the base model's skeleton ({e}); assuming Llama-style embedding names.")
        in_name = next((n for n in base.shapes if n.endswith(("embed_tokens.weight", "wte.weight"))), None)
        tied = bool(base.config.get("tie_word_embeddings", False))
        return in_name, ({"lm_head.weight": in_name} if tied and in_name else {}), None
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    ie, oe = model.get_input_embeddings(), model.get_output_embeddings()
    in_name = _match_checkpoint_name(f"{modules[id(ie)]}.weight", base.shapes)
    tied = oe is not None and oe.weight is ie.weight
    return in_name, ({f"{modules[id(oe)]}.weight": in_name} if tied and in_name else {}), model


def _grow_token_tables(plan: MergePlan, base: BaseCheckpoint, skeleton: torch.nn.Module) -> None:
    """When the merged input embedding has more rows than the base's, grow every other table transformers'
    resize_token_embeddings grows with it (Gemma 4's and Gemma 3n's per-layer input embeddings,
    embed_tokens_per_layer), and note the config fields the resize changes (vocab_size_per_layer_input).

    The skeleton (on meta) is resized by transformers itself, so that the merged folder is what
    resize_token_embeddings makes of the base: its config and every token-indexed table agree, and a new token id
    indexes each of them. Rows that the adapter trained are copied in by the token edit; others get the mean row.
    """
    name = plan.input_embedding
    if name is None or name not in plan.edits:
        return
    rows = plan.edits[name].final_shape(base.shapes[name])[0]
    if rows <= base.shapes[name][0]:
        return
    text = skeleton.config.get_text_config()
    before = text.to_dict()
    tables = {n: m.num_embeddings for n, m in skeleton.named_modules() if isinstance(m, torch.nn.Embedding)}
    try:
        skeleton.resize_token_embeddings(rows, mean_resizing=False)
    except (NotImplementedError, AttributeError, ValueError) as e:  # remote code that does not resize
        warn0(f"could not resize the base model's skeleton ({e}); only {name} grows with the vocabulary.")
        return
    plan.config_updates = {k: v for k, v in text.to_dict().items() if before.get(k) != v}
    for module, m in skeleton.named_modules():
        if not isinstance(m, torch.nn.Embedding) or tables.get(module) in (None, rows) or m.num_embeddings != rows:
            continue
        stored = _match_checkpoint_name(f"{module}.weight", base.shapes)
        if stored is None or stored == name or stored in plan.aliases:
            continue
        edit = plan.edits.setdefault(stored, TensorEdit())
        if edit.final_shape(base.shapes[stored])[0] < rows:
            edit.grow_to = rows
            trained = set() if edit.tokens is None else set(edit.tokens[0].tolist())
            if not set(range(base.shapes[stored][0], rows)) <= trained:
                warn0(
                    f"the adapter carries no trained rows for the new tokens in {stored}; they are set to its mean "
                    "row, so the merged model may differ from the trained one on those tokens."
                )


def _match_checkpoint_name(model_name: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    if model_name in shapes:
        return model_name
    found = [n for n in shapes if n.endswith("." + model_name) or model_name.endswith("." + n)]
    return found[0] if len(found) == 1 else None


def _output_dtype(base: BaseCheckpoint, dtype: str | None) -> torch.dtype:
    """--dtype, else the dtype the base's config names, else its first floating tensor's."""
    if dtype is not None:
        if dtypes.canonical(dtype) not in dtypes.FLOATING:
            raise ValueError(f"--dtype {dtype!r}: use bf16, fp16 or fp32.")
        return dtypes.parse(dtype)
    text = base.config.get("text_config") if isinstance(base.config.get("text_config"), dict) else {}
    for value in (base.config.get("dtype"), base.config.get("torch_dtype"), text.get("dtype")):
        if isinstance(value, str) and dtypes.canonical(value) in dtypes.FLOATING:
            return dtypes.parse(value)
    floats = [d for d in base.dtypes.values() if d.is_floating_point]
    return floats[0] if floats else torch.float32


def _resolve(target: str, names: dict[str, str], key: str) -> str:
    """The base tensor an adapter key means, tolerating a differing leading prefix (e.g. `model.`). names maps the
    model's tensor names to the names stored in the checkpoint."""
    if target in names:
        return names[target]
    found = sorted(n for n in names if n.endswith("." + target) or target.endswith("." + n))
    if len(found) == 1:
        return names[found[0]]
    if found:
        raise ValueError(f"adapter key {key!r} matches several base tensors ({', '.join(found)}).")
    close = difflib.get_close_matches(target, sorted(names), n=1, cutoff=0.5)
    hint = f" (closest: {close[0]})" if close else ""
    raise ValueError(
        f"adapter key {key!r} matches no tensor of the base model{hint}; is --base the model the "
        "adapter was trained on?"
    )


def _renamed_tensors(base: BaseCheckpoint, trust_remote_code: bool) -> dict[str, str]:
    """{model name: stored name} for tensors the family stores under another name than its module's (GPT-NeoX
    stores lm_head as embed_out); the adapter's keys use the module names."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(base.folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return {}
    rename = checkpoint_renaming(config)
    return {rename(n): n for n in base.shapes if rename(n) != n}


def _plan_lora(plan: MergePlan, module: str, parts: dict[str, Any], names: dict[str, str], cfg: Any) -> None:
    from peft.utils.other import get_pattern_key

    embedding = "emb_A" in parts or "emb_B" in parts
    a_kind, b_kind = ("emb_A", "emb_B") if embedding else ("A", "B")
    if a_kind not in parts or b_kind not in parts:
        some_key = next(iter(parts.values()))[0]
        raise ValueError(f"adapter has {some_key!r} without its LoRA {'A' if a_kind not in parts else 'B'} matrix.")
    key, A = parts[a_kind]
    B = parts[b_kind][1]
    rank = A.shape[0]
    alpha = cfg.alpha_pattern.get(get_pattern_key(cfg.alpha_pattern.keys(), module), cfg.lora_alpha)
    scale = alpha / math.sqrt(rank) if cfg.use_rslora else alpha / rank
    magnitude = parts["magnitude"][1] if "magnitude" in parts else None
    update = LoraUpdate(A, B, scale, transposed=embedding or bool(cfg.fan_in_fan_out), magnitude=magnitude)
    edit = plan.edits.setdefault(_resolve(f"{module}.weight", names, key), TensorEdit())
    edit.lora = update
    if "B_bias" in parts:
        bias_key, bias = parts["B_bias"]
        plan.edits.setdefault(_resolve(f"{module}.bias", names, bias_key), TensorEdit()).add = bias * scale


def _plan_parameter_loras(plan: MergePlan, groups: dict, skeleton, cfg: Any, names: dict[str, str], base) -> None:
    """Take the LoRAs of targeted parameters (experts, routers) out of `groups` into the plan's edits."""
    if not getattr(cfg, "target_parameters", None):
        return
    if skeleton is None:
        raise ValueError("the adapter adapts parameters (target_parameters), whose place in the base's tensors "
                         "needs the base model's skeleton, which could not be built (see the warning above).")  # fmt: skip
    for module, wrapper in parameter_wrappers(skeleton, cfg).items():
        parts = groups.pop(module, None)
        if parts is None:
            continue
        if set(parts) != {"A", "B"}:
            raise ValueError(f"adapter keys for {module}: a parameter's LoRA has lora_A and lora_B only, not "
                             f"{', '.join(sorted(set(parts) - {'A', 'B'}))}.")  # fmt: skip
        for we in wrapper_edits(
            module, parts["A"][1], parts["B"][1], wrapper, cfg, skeleton.config, names, base.shapes
        ):
            edit = plan.edits.setdefault(we.stored, TensorEdit())
            if we.experts is not None:
                edit.experts = we.experts
            else:
                edit.lora = LoraUpdate(we.A, we.B, we.scale, transposed=we.transposed)


def _plan_tokens(plan: MergePlan, module: str, part: tuple[str, torch.Tensor], names: dict[str, str], cfg: Any) -> None:
    key, rows = part
    spec = cfg.trainable_token_indices
    if isinstance(spec, dict):
        found = [v for k, v in spec.items() if module == k or module.endswith("." + k)]
        if not found:
            raise ValueError(f"adapter key {key!r}: no trainable_token_indices entry for {module} in its config.")
        spec = found[0]
    if not spec or len(spec) != rows.shape[0]:
        raise ValueError(
            f"adapter key {key!r} has {rows.shape[0]} rows but trainable_token_indices lists {len(spec or [])} tokens."
        )
    edit = plan.edits.setdefault(_resolve(f"{module}.weight", names, key), TensorEdit())
    edit.tokens = (torch.tensor(spec, dtype=torch.long), rows)


def _fit_edit(name: str, edit: TensorEdit, base_shape: tuple[int, ...]) -> None:
    """Check an edit's shapes against its tensor; grow the rows when trained tokens lie past its end."""
    if edit.replacement is not None and tuple(edit.replacement.shape[1:]) != tuple(base_shape[1:]):
        raise ValueError(
            f"the adapter's {name} has shape {tuple(edit.replacement.shape)}, the base's "
            f"{tuple(base_shape)}; only the number of rows (vocabulary) may differ."
        )
    if edit.tokens is not None:
        rows = edit.final_shape(base_shape)[0]
        needed = int(edit.tokens[0].max()) + 1
        if needed > rows:
            edit.grow_to = needed  # peft copies trained rows in whole, so rows past the end are fully known
    shape = edit.final_shape(base_shape)
    if edit.experts is not None and edit.experts.shape != shape:
        raise ValueError(f"the adapter's expert LoRA for {name} makes a {edit.experts.shape} update but the tensor "
                         f"is {shape}.")  # fmt: skip
    if edit.lora is not None:
        if len(shape) != 2:
            raise ValueError(f"{name} has shape {shape}: LoRA merges are supported for linear and embedding layers.")
        if edit.lora.shape != shape:
            raise ValueError(
                f"the adapter's LoRA for {name} makes a {edit.lora.shape} update but the tensor is {shape}."
            )
    if edit.tokens is not None and tuple(edit.tokens[1].shape[1:]) != shape[1:]:
        raise ValueError(
            f"the adapter's trainable tokens for {name} have width {edit.tokens[1].shape[1]}, the tensor {shape[1]}."
        )


# ---------------------------------------------------------------- computing


def apply_edit(edit: TensorEdit | None, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The merged tensor: edits in fp32, then cast. Never writes into `weight` (it may be a read-only mmap)."""
    if not weight.is_floating_point():
        return weight
    if edit is None:
        return weight if weight.dtype == dtype else weight.to(dtype)
    w = (edit.replacement if edit.replacement is not None else weight).float()
    if edit.grow_to:
        # Rows between the base's end and the last trained token that no token covers: the mean row, as
        # transformers' resize_token_embeddings starts them (their exact values were never saved).
        extra = w.mean(0, keepdim=True).expand(edit.grow_to - w.shape[0], *w.shape[1:])
        w = torch.cat([w, extra])
    if edit.lora is not None:
        w = _merge_lora(w, edit.lora)
    if edit.experts is not None:
        w = edit.experts.merged(w)
    if edit.add is not None:
        w = w + edit.add.float()
    if edit.tokens is not None:
        idx, rows = edit.tokens
        w = w.index_copy(0, idx, rows.float())
    return w.to(dtype)


def _merge_lora(w: torch.Tensor, u: LoraUpdate) -> torch.Tensor:
    """W + s·BA, and for DoRA m · (W + s·BA) / ||W + s·BA|| with the norm taken per output row (peft's dora.py)."""
    wt = w.T if u.transposed else w  # (out, in)
    merged = wt + u.scale * (u.B.float() @ u.A.float())
    if u.magnitude is not None:
        norm = torch.linalg.norm(merged, dim=1)
        merged = (u.magnitude.float() / norm).unsqueeze(1) * merged
    return merged.T.contiguous() if u.transposed else merged
