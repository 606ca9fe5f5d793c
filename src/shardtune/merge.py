"""`shardtune merge`: fold a PEFT LoRA/DoRA adapter into its base model, one safetensors shard at a time.

The base checkpoint is never built as a model: each base shard is memory-mapped, every tensor the adapter touches
is recomputed in fp32 (LoRA, DoRA, modules_to_save, trainable tokens) and cast to the output dtype, and the shard's
tensors are written out before the next shard is opened. Peak memory is about one base shard plus the adapter.
The output is a standard Hugging Face model folder, written to a temporary sibling folder and renamed into place
only once it is complete.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import math
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardtune import atomic
from shardtune.config import ConfigError
from shardtune.log import error, print0, setup_logging, warn0

DTYPES = {
    **dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16"), torch.float16),
    **dict.fromkeys(("fp32", "float32"), torch.float32),
}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ST = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8)
_ST_NAMES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
ST_DTYPES = dict(zip(_ST_NAMES, (*_ST, torch.uint8, torch.bool)))
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}  # safetensors' header names for torch dtypes
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model", "vocab.*", "merges.txt")
# Fields of LoraConfig that do not mark a variant yet change what merging means.
UNMERGEABLE_OPTIONS = ("use_qalora", "target_parameters", "layer_replication")
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


def _arg(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class MergeArguments:
    base: str | None = _arg(
        None,
        "Base model in its original precision: a local folder with safetensors weights, or a hub id. For a QLoRA "
        "adapter, the unquantized model that was loaded in 4-bit for training.",
    )
    adapter: str | None = _arg(
        None, "PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or hub id."
    )
    output_dir: str | None = _arg(
        None, "Where the merged model is written; a model folder there is replaced only once the new one is complete."
    )
    dtype: str | None = _arg(
        None,
        "Dtype of the merged weights (default: the base config's). Merges are computed in fp32.",
        choices=[*DTYPES],
    )
    max_shard_size: str = _arg("5GB", "Largest output shard, e.g. 5GB or 500MB.")
    trust_remote_code: bool = _arg(False, "Run the base model's own code (config auto_map) to find its embeddings.")


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


# ---------------------------------------------------------------- command line


def parse_merge_args(argv: list[str] | None = None) -> MergeArguments:
    """Parse `shardtune merge` flags; raise ConfigError naming every missing or unknown flag."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        MergeArguments,
        prog="shardtune merge",
        allow_abbrev=False,
        description="Merge a LoRA/DoRA adapter into its base model, one shard at a time.",
    )
    args, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    known = [f.name for f in dataclasses.fields(MergeArguments)]
    problems = []
    for tok in remaining:
        name = tok[2:].split("=", 1)[0] if tok.startswith("--") else tok
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        problems.append(f"unknown argument {tok!r}" + (f"; did you mean --{close[0]}?" if close else ""))
    for name in ("base", "adapter", "output_dir"):
        if not getattr(args, name):
            problems.append(f"--{name} is required.")
    if problems:
        raise ConfigError(problems)
    return args


def main(argv: list[str] | None = None) -> int:
    """`shardtune merge --base MODEL --adapter DIR --output_dir OUT [--dtype bf16] [--max_shard_size 5GB]`."""
    setup_logging()
    try:
        args = parse_merge_args(list(sys.argv[1:] if argv is None else argv))
        merge_adapter(
            args.base,
            args.adapter,
            args.output_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            trust_remote_code=args.trust_remote_code,
        )
    except SystemExit as e:  # --help, or argparse's own usage errors
        return int(e.code or 0)
    except ConfigError as e:
        error(str(e))
        return 2
    except (ValueError, atomic.DiskFullError) as e:
        error(f"shardtune merge: {e}")
        return 1
    return 0


# ---------------------------------------------------------------- the merge


def merge_adapter(
    base_dir: str | Path,
    adapter_dir: str | Path,
    output_dir: str | Path,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    trust_remote_code: bool = False,
) -> Path:
    """Merge the PEFT adapter in adapter_dir into base_dir and write a Hugging Face model folder to output_dir."""
    from transformers.utils.hub import convert_file_size_to_int

    max_bytes = convert_file_size_to_int(max_shard_size)
    if max_bytes <= 0:
        raise ValueError(f"--max_shard_size must be positive (got {max_shard_size!r}).")
    out = Path(output_dir).expanduser().absolute()
    base = read_base_checkpoint(_local_or_download(str(base_dir), "base", trust_remote_code))
    adapter = _local_or_download(str(adapter_dir), "adapter", trust_remote_code)
    if out in (base.folder.absolute(), adapter.absolute()):
        raise ValueError(f"--output_dir {out} is the base or adapter folder; write the merged model elsewhere.")
    peft_config = _read_adapter_config(adapter)
    _check_adapter_fits(base, adapter, str(base_dir))
    plan = plan_merge(base, peft_config, _load_adapter_weights(adapter), dtype, trust_remote_code)
    print0(
        f"merging {adapter} into {base.folder}: {len(plan.edits)} tensors change, output in {DTYPE_NAMES[plan.dtype]}"
    )
    with _atomic_folder(out) as tmp:
        weight_map, untied = _write_weights(base, plan, tmp, max_bytes)
        _write_config(base, plan, tmp, untied)
        _copy_side_files(base.folder, adapter, tmp)
    n_shards = len(set(weight_map.values()))
    print0(f"merged model written to {out} ({len(weight_map)} tensors in {n_shards} shard{'s' * (n_shards > 1)})")
    return out


def _check_adapter_fits(base: BaseCheckpoint, adapter: Path, base_name: str) -> None:
    """An adapter trained on another base is a user's mistake (exit 2), named before anything is written."""
    from shardtune.preflight import adapter_base_problem

    text = base.config.get("text_config") or base.config
    problem = adapter_base_problem(
        adapter,
        base.shapes,
        base_name=base_name,
        flag="--adapter",
        vocab_size=text.get("vocab_size"),
        require_all=False,
    )
    if problem:
        raise ConfigError([problem])


def read_base_checkpoint(folder: Path) -> BaseCheckpoint:
    """Read the base's config and every tensor's shape and dtype from the shard headers (no weights are read)."""
    from safetensors import safe_open

    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"--base {folder}: no config.json there; give a model folder or a hub id.")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config"):
        raise ValueError(
            f"--base {folder} is quantized (quantization_config in config.json); the merge needs the "
            "original-precision weights. For a QLoRA adapter give the unquantized model it was loaded "
            "from (see docs/merge.md)."
        )
    shards = _shard_files(folder)
    shapes, dtypes = {}, {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                sl = f.get_slice(name)
                shapes[name] = tuple(sl.get_shape())
                dtypes[name] = ST_DTYPES.get(sl.get_dtype(), torch.uint8)
    return BaseCheckpoint(folder, shards, shapes, dtypes, config)


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(
        f"--base {folder}: no *.safetensors weights there. Convert the checkpoint first, e.g. "
        "AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)."
    )


def _local_or_download(ref: str, flag: str, trust_remote_code: bool) -> Path:
    """A local folder as it is; otherwise a hub id, of which only weights, configs and tokenizer files are fetched."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.exists() or ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ValueError(f"--{flag} {ref}: no such folder.")
    from huggingface_hub import snapshot_download

    patterns = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"] + (["*.py"] if trust_remote_code else [])
    try:
        return Path(snapshot_download(ref, allow_patterns=patterns))
    except Exception as e:  # network, auth or missing repo: all the same to the user
        raise ValueError(f"--{flag} {ref}: not a local folder, and fetching it from the hub failed: {e}") from e


# ---------------------------------------------------------------- reading the adapter


def _read_adapter_config(adapter: Path) -> Any:
    """The adapter's LoraConfig; refuse other adapter types and LoRA variants that do not merge as W + s·BA."""
    from peft import LoraConfig

    path = adapter / "adapter_config.json"
    if not path.exists():
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


def _load_adapter_weights(adapter: Path) -> dict[str, torch.Tensor]:
    for name in ADAPTER_WEIGHTS:
        path = adapter / name
        if path.exists():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"--adapter {adapter}: no {' or '.join(ADAPTER_WEIGHTS)} there.")


def _parse_keys(weights: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
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
    in_name, aliases = _embedding_layout(base, trust_remote_code)
    plan = MergePlan({}, aliases, in_name, _output_dtype(base, dtype))
    names = {n: n for n in [*base.shapes, *aliases]} | _renamed_tensors(base, trust_remote_code)
    groups = _parse_keys(weights)
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
    return plan


def _embedding_layout(base: BaseCheckpoint, trust_remote_code: bool) -> tuple[str | None, dict[str, str]]:
    """Find the input embedding and, when the output embedding is tied to it, map the output name to it.

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
        return in_name, ({"lm_head.weight": in_name} if tied and in_name else {})
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    ie, oe = model.get_input_embeddings(), model.get_output_embeddings()
    in_name = _match_checkpoint_name(f"{modules[id(ie)]}.weight", base.shapes)
    tied = oe is not None and oe.weight is ie.weight
    return in_name, ({f"{modules[id(oe)]}.weight": in_name} if tied and in_name else {})


def _match_checkpoint_name(model_name: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    if model_name in shapes:
        return model_name
    found = [n for n in shapes if n.endswith("." + model_name) or model_name.endswith("." + n)]
    return found[0] if len(found) == 1 else None


def _output_dtype(base: BaseCheckpoint, dtype: str | None) -> torch.dtype:
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: use bf16, fp16 or fp32.")
        return DTYPES[dtype]
    text = base.config.get("text_config") if isinstance(base.config.get("text_config"), dict) else {}
    for value in (base.config.get("dtype"), base.config.get("torch_dtype"), text.get("dtype")):
        if value in DTYPES:
            return DTYPES[value]
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

    from shardtune.modeling import checkpoint_renaming

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


# ---------------------------------------------------------------- computing and writing


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


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[Any]:
    """Memory-map one base shard; its pages are released when the block ends."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        yield f


@dataclass
class _Pending:
    """An output tensor whose bytes are computed only when its shard is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _save_shard(entries: list[_Pending], path: Path) -> None:
    """Write a safetensors file one tensor at a time.

    safetensors.torch.save_file needs every tensor in memory and then copies each to bytes, which doubles an
    output shard in RAM; the format is a JSON header of offsets followed by the raw bytes, so it is written
    here as each tensor is computed, and only one merged tensor is ever held.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": ST_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for e in entries:
            tensor = e.produce()
            assert tensor.dtype == e.dtype and tuple(tensor.shape) == e.shape, (e.name, tensor.dtype, tensor.shape)
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


class _ShardWriter:
    """Collects pending tensors and writes a shard whenever the next one would push it past max_bytes."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: list[_Pending] = []
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, entry: _Pending) -> None:
        if self.pending and sum(e.nbytes for e in self.pending) + entry.nbytes > self.max_bytes:
            self.flush()
        self.pending.append(entry)
        self.total += entry.nbytes

    def flush(self) -> None:
        if self.pending:
            path = self.folder / f"part-{len(self.parts):05d}.safetensors"
            _save_shard(self.pending, path)
            self.parts.append((path, [e.name for e in self.pending]))
            self.pending = []

    def finish(self) -> dict[str, str]:
        """Give the parts their final names, write the index when there are several, return the weight map."""
        self.flush()
        n = len(self.parts)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.parts, start=1):
            final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def _write_weights(base: BaseCheckpoint, plan: MergePlan, folder: Path, max_bytes: int) -> tuple[dict, bool]:
    """Stream the base shard by shard; return the weight map and whether the output embedding had to be untied.

    Output shards never span two base shards: every tensor is computed from the open (memory-mapped) base shard
    while its output shard is written, so only one base shard and one merged tensor are in memory at a time.
    """
    writer = _ShardWriter(folder, max_bytes)
    untied = False
    for i, shard in enumerate(base.shards, start=1):
        changed = 0
        with _open_shard(shard) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name in plan.aliases:
                    continue  # a tied copy stored in the checkpoint: transformers re-ties it on load
                changed += name in plan.edits
                entries = _tied_entries(f, name, plan) if name in plan.aliases.values() else []
                untied |= len(entries) > 1
                for entry in entries or [_lazy_entry(f, name, plan, base)]:
                    writer.add(entry)
            writer.flush()
        print0(f"  shard {i}/{len(base.shards)} {shard.name}: {changed} tensors merged")
    return writer.finish(), untied


def _lazy_entry(f: Any, name: str, plan: MergePlan, base: BaseCheckpoint) -> _Pending:
    edit, base_dtype = plan.edits.get(name), base.dtypes[name]
    dtype = plan.dtype if base_dtype.is_floating_point else base_dtype
    shape = edit.final_shape(base.shapes[name]) if edit else base.shapes[name]
    return _Pending(name, dtype, tuple(shape), lambda: apply_edit(edit, f.get_tensor(name), plan.dtype))


def _tied_entries(f: Any, name: str, plan: MergePlan) -> list[_Pending]:
    """The input embedding, plus its tied output embedding when the adapter leaves the two different.

    The tied head is the merged embedding itself (trained token rows and rows added by the resize included) unless
    the adapter edits the head on its own; only then can the two differ and the head be written separately."""
    weight = f.get_tensor(name)
    merged = apply_edit(plan.edits.get(name), weight, plan.dtype)
    entries = [_Pending(name, merged.dtype, tuple(merged.shape), lambda: merged)]
    for alias in (a for a, src in plan.aliases.items() if src == name and a in plan.edits):
        edit = plan.edits[alias]
        if edit.replacement is None and merged.shape[0] > weight.shape[0]:
            # The head was tied to the resized embedding in training: its added rows are the embedding's.
            grown = torch.cat([weight.to(merged.dtype), merged[weight.shape[0] :]])
            edit = dataclasses.replace(edit, replacement=grown, grow_to=None)
        copy = apply_edit(edit, weight, plan.dtype)
        if copy.shape != merged.shape or not torch.allclose(copy, merged, rtol=1e-5, atol=1e-6):
            warn0(
                f"the adapter leaves {alias} different from {name}; writing it separately and setting "
                "tie_word_embeddings to false."
            )
            entries.append(_Pending(alias, copy.dtype, tuple(copy.shape), lambda copy=copy: copy))
    return entries


def _write_config(base: BaseCheckpoint, plan: MergePlan, folder: Path, untied: bool) -> None:
    config = copy.deepcopy(base.config)
    text = (
        config["text_config"] if "vocab_size" not in config and isinstance(config.get("text_config"), dict) else config
    )
    name = plan.input_embedding
    if name is not None and name in plan.edits:
        rows = plan.edits[name].final_shape(base.shapes[name])[0]
        if rows != text.get("vocab_size"):
            print0(f"vocabulary size {text.get('vocab_size')} -> {rows} (the adapter carries resized embeddings)")
            text["vocab_size"] = rows
    if untied:
        for cfg in {id(config): config, id(text): text}.values():
            cfg["tie_word_embeddings"] = False
    dtype_keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in dtype_keys:
        config[key] = DTYPE_NAMES[plan.dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_side_files(base: Path, adapter: Path, folder: Path) -> None:
    """generation_config.json and remote code from the base; the tokenizer from the adapter if it has one."""
    for path in [base / "generation_config.json", *sorted(base.glob("*.py"))]:
        if path.exists():
            shutil.copy2(path, folder / path.name)
    tokenizer_source = adapter if (adapter / "tokenizer_config.json").exists() else base
    for path in {p for pattern in (*TOKENIZER_FILES, "chat_template.*") for p in tokenizer_source.glob(pattern)}:
        shutil.copy2(path, folder / path.name)


@contextlib.contextmanager
def _atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out`, on any error it is removed."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} is a file; give a folder.")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists():
        raise ValueError(
            f"--output_dir {out} is not empty and holds no model (no config.json); refusing to replace "
            "it. Give a new or empty folder."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    with atomic.staged_folder(tmp, what="the merged model", final=out) as staged:
        yield staged
        atomic.replace_folder(staged, out)
