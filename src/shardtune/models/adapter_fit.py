"""Whether a PEFT adapter folder fits a base model, read from headers and configs only (no weight is read): every
tensor of adapter_model.safetensors, by name and shape, against the base's modules and parameters (from its weight
headers, or its skeleton on the meta device). An adapter of another model (other widths, another number of layers
or experts, modules the base does not have) is refused with one line naming its first tensor that does not fit and
the base it names, before `train --adapter_path`, `chat --adapter` or `merge --adapter` hand it to PEFT's loader, which
would fail with a size-mismatch traceback.

What each kind of tensor must match (PEFT's layouts):
- lora_A [r, in] and lora_B [out, r] of a linear layer (GPT-2's Conv1D with fan_in_fan_out: its weight is (in, out));
- lora_embedding_A [r, rows] and lora_embedding_B [width, r] of an embedding;
- DoRA's magnitude [out]; trainable token rows [n, width]; a module saved in full (modules_to_save) its weight's shape;
- a parameter's LoRA (PEFT's target_parameters: fused experts, routers): lora_A [r·E, in], lora_B [out, r·E] for a
  parameter of E experts, as PEFT lays it out; found by letting PEFT wrap a copy of the base's meta skeleton.
The rows of the embeddings and of the output head may differ (training resizes them for new tokens).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from shardtune.models.weights import PEFT_PREFIX, read_headers, weight_file_problem
from shardtune.runtime.log import warn0

# The part of an adapter key that says what it is, after the module's path.
MARKERS = (
    ".lora_A.",
    ".lora_B.",
    ".lora_embedding_A",
    ".lora_embedding_B",
    ".lora_magnitude_vector",
    ".token_adapter.",
)


def adapter_tensor_shapes(adapter_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in adapter_model.safetensors, from the header only (empty without that file)."""
    path = Path(adapter_dir).expanduser() / "adapter_model.safetensors"
    if not path.is_file():
        return {}
    return read_headers([path])[0]


def model_shapes(model) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def skeleton_of(folder: str | Path, trust_remote_code: bool = False):
    """The base's modules on the meta device from its config.json, or None where transformers cannot build them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an unusual family: its parameter LoRA is left to the merge's own checks
        return None


def _module_mismatch(key: str, shape: tuple, base: dict[str, tuple], vocab: int | None, fan_in_fan_out: bool):
    """(the base module an adapter tensor belongs to, whether the base has it, what does not fit or None)."""
    k = key.removeprefix(PEFT_PREFIX)
    marker = next((m for m in MARKERS if m in k), "")
    module = k.split(marker)[0] if marker else k.rsplit(".", 1)[0]  # no marker: a module saved in full
    module = module.replace(".base_layer", "")  # a resized layer's base weight, saved with its adapter
    want = base.get(module + ".weight")
    if want is None:
        return module, False, f"belongs to {module}, which the base does not have"
    if len(want) != 2:
        return module, True, None  # convolutions and the like: left to peft
    # GPT-2's Conv1D stores (in, out) and its adapters say fan_in_fan_out; nn.Linear and embeddings (out, in).
    out_dim, in_dim = (want[1], want[0]) if fan_in_fan_out else want
    # Rows of the embeddings and output head may differ: new tokens resize them in training.
    rows_free = vocab is not None and want[0] == vocab
    has = f"but the base's {module} ({want[0]} x {want[1]}) has"
    checks = {
        ".lora_A.": (shape[-1] == in_dim, f"expects in_features {shape[-1]} {has} {in_dim}"),
        ".lora_B.": (rows_free or shape[0] == out_dim, f"expects out_features {shape[0]} {has} {out_dim}"),
        ".lora_embedding_A": (rows_free or shape[-1] == want[0], f"expects {shape[-1]} embedding rows {has} {want[0]}"),
        ".lora_embedding_B": (shape[0] == want[1], f"expects embedding width {shape[0]} {has} {want[1]}"),
        ".lora_magnitude_vector": (
            rows_free or shape[0] == out_dim,
            f"expects out_features {shape[0]} {has} {out_dim}",
        ),
        ".token_adapter.": (shape[-1] == want[1], f"expects rows of width {shape[-1]} {has} {want[1]}"),
        "": (
            tuple(shape[1:]) == tuple(want[1:]) and (rows_free or shape[0] == want[0]),
            f"is {tuple(shape)} but the base's {module}.weight is {tuple(want)}",
        ),
    }
    fits, detail = checks[marker]
    return module, True, None if fits else detail


def _parameter_lora_layout(saved: dict, skeleton) -> tuple[dict[str, tuple], str | None]:
    """({adapter key: (its shape, the parameter's path, the parameter's shape, experts, rank)}, or a problem) for
    the LoRA of every parameter the adapter's target_parameters name, as PEFT lays it out on this base."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import ParamWrapper

    names = list(saved.get("target_parameters") or [])
    probe = LoraConfig(
        r=saved.get("r", 8), rank_pattern=saved.get("rank_pattern") or {}, target_modules=[], target_parameters=names
    )
    try:
        model = inject_adapter_in_model(probe, copy.deepcopy(skeleton), low_cpu_mem_usage=True)
    except (ValueError, RuntimeError, KeyError) as e:  # a parameter the base does not have
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return {}, f"its target_parameters ({', '.join(names)}) do not fit the base ({first})"
    layout = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            param = f"{name.replace('.base_layer', '')}.{module.parameter_name}"
            shape, r = tuple(module.get_param().shape), module.r["default"]
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            for part, w in (("lora_A", a), ("lora_B", b)):
                layout[f"{PEFT_PREFIX}{name}.{part}.weight"] = (tuple(w.shape), param, shape, module.num_experts, r)
    return layout, None


def _parameter_mismatch(key: str, shape: tuple, layout: dict[str, tuple]) -> str | None:
    """What does not fit in one tensor of a parameter's LoRA (PEFT's layout: A [r·E, in], B [out, r·E])."""
    if key not in layout:
        return "belongs to a parameter LoRA the base does not have (another number of layers, or another family)"
    want, param, pshape, experts, r = layout[key]
    if tuple(shape) == want:
        return None
    has = f"but the base's {param} {pshape} has"
    is_a = ".lora_A." in key
    width_axis, rank_axis = (1, 0) if is_a else (0, 1)
    if shape[width_axis] != want[width_axis]:
        what = "in_features" if is_a else "out_features"
        return f"expects {what} {shape[width_axis]} {has} {want[width_axis]}"
    if experts > 1 and shape[rank_axis] % r == 0:
        return f"holds rank {r} for {shape[rank_axis] // r} experts {has} {experts} experts"
    return f"is {tuple(shape)} where the base's {param} {pshape} needs {want}"


def _parameter_lora_keys(target_parameters: list[str]):
    """Whether an adapter key belongs to the LoRA of a targeted parameter: PEFT's ParamWrapper keys are the owning
    module's path (with a .base_layer per nested wrapper) and lora_A/lora_B, for a module owning a target."""
    owners = {t.rpartition(".")[0] for t in target_parameters}

    def wrapped(key: str) -> bool:
        module = re.sub(r"\.lora_[AB](\.[^.]+)?\.weight$", "", key).replace(".base_layer", "")
        return module != key and any(module == o or module.endswith("." + o) for o in owners if o)

    return wrapped


def _mismatches(adapter_dir: Path, saved: dict, base_shapes, vocab_size, require_all: bool, skeleton) -> list[str]:
    """'tensor KEY what does not fit' for every tensor of the adapter that does not fit the base, in key order."""
    shapes = adapter_tensor_shapes(adapter_dir)
    wrapped = _parameter_lora_keys(saved.get("target_parameters") or [])
    layout, problem = {}, None
    if skeleton is not None and any(wrapped(k) for k in shapes):
        layout, problem = _parameter_lora_layout(saved, skeleton)
    bad = [problem] if problem else []
    for key, shape in sorted(shapes.items()):
        if wrapped(key):
            detail = None if skeleton is None or problem else _parameter_mismatch(key, shape, layout)
        else:
            module, present, detail = _module_mismatch(
                key, shape, base_shapes, vocab_size, bool(saved.get("fan_in_fan_out"))
            )
            # A tied output head (a top-level module such as lm_head) is not stored in a checkpoint's files.
            if not present and not require_all and "." not in module:
                detail = None
        if detail:
            bad.append(f"adapter tensor {key} {detail}")
    return bad


def adapter_base_problem(
    adapter_dir: str | Path,
    base_shapes: dict[str, tuple[int, ...]],
    *,
    base_name: str,
    flag: str,
    vocab_size: int | None,
    require_all: bool = True,
    skeleton=None,
    base_flag: str = "--model_name_or_path",
) -> str | None:
    """The adapter's tensors against the base's: an adapter trained on another base is refused here (its first
    tensor that does not fit, and the base it names) instead of failing in peft's loader with a size-mismatch
    traceback. base_shapes: the base's parameter shapes (model names, or the names its weight files store);
    skeleton: the base on the meta device, for the LoRA of parameters (experts, routers); require_all=False accepts
    a missing top-level module (the tied head, which a checkpoint's files do not hold)."""
    adapter_dir = Path(adapter_dir)
    weights_file = adapter_dir / "adapter_model.safetensors"
    if weights_file.is_file() and (problem := weight_file_problem(weights_file)):
        return f"{flag} {adapter_dir}: {problem}."
    cfg_file = adapter_dir / "adapter_config.json"
    saved = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    saved_base = saved.get("base_model_name_or_path")
    bad = _mismatches(adapter_dir, saved, base_shapes, vocab_size, require_all, skeleton)
    if bad:
        names = f" (its base_model_name_or_path: {saved_base})" if saved_base else ""
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return (
            f"{flag} {adapter_dir} was trained on another base than {base_name}: {bad[0]}{more}; the adapter was "
            f"trained on another model{names}: pass that base with {base_flag}, or an adapter trained on {base_name}."
        )
    if saved_base and Path(saved_base).name != Path(base_name).name:
        warn0(
            f"{flag} {adapter_dir} names {saved_base} as its base, not {base_name}; every tensor of it fits "
            f"{base_name} (names and shapes), so it is used."
        )
    return None
