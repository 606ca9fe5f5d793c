"""Checkpoint files of a model folder: the one home of the safetensors format facts shardtune relies on.

- which shard files a folder holds (its index, a single model.safetensors, or any *.safetensors);
- every tensor's shape and dtype from the shard headers, without reading a weight;
- reading tensors one at a time (`iter_checkpoint`, `open_shard`) and filling a meta skeleton from them
  (`load_checkpoint_into`, used by the 4-bit loader), renaming the family's stored names to its modules';
- writing shards one tensor at a time with their index (`ShardWriter`, used by `shardtune merge`).

Used by models.loading and models.quant (loading) and shardtune.merge (merging); imports none of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardtune.runtime.hub import is_hub_id

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors' header names of torch dtypes (the file format's own table; shardtune.config.dtypes has the user's names).
_ST = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8)
_ST_NAMES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
ST_DTYPES = dict(zip(_ST_NAMES, (*_ST, torch.uint8, torch.bool)))
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
# peft prefixes every key of a saved adapter (adapter_model.safetensors) with this.
PEFT_PREFIX = "base_model.model."


# ---------------------------------------------------------------- finding and reading shards


def shard_files(folder: Path, what: str) -> list[Path]:
    """The folder's safetensors shards in order: those its index names, else model.safetensors, else every
    *.safetensors file. `what` names the folder in the error (e.g. "--base /models/x")."""
    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / SINGLE).exists():
        return [folder / SINGLE]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(
        f"{what}: no *.safetensors weights there; shardtune reads safetensors checkpoints tensor by tensor. Convert "
        "the checkpoint first, e.g. AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)."
    )


def checkpoint_files(model_name_or_path: str) -> list[Path]:
    """The model's .safetensors files (downloaded from the hub when it is not a local folder)."""
    path = Path(model_name_or_path).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        if not is_hub_id(model_name_or_path):
            raise ValueError(f"{model_name_or_path}: no such folder; give a model folder or a hub id.")

        path = Path(snapshot_download(model_name_or_path, allow_patterns=["*.safetensors", "*.json"]))
    return shard_files(path, model_name_or_path)


# A safetensors header is a few KiB per hundred tensors; safetensors itself refuses headers over 100 MB.
_MAX_HEADER = 100_000_000
RESTORE = "restore it from the original model (a download or copy was cut short, or the file was damaged)"


def weight_file_problem(path: Path) -> str | None:
    """Why a weight file cannot be read (None when it looks whole), from its header and size alone: a safetensors
    file's 8-byte length, its JSON header and the end of its last tensor against the file's size; a torch .bin
    file's zip directory (at its end, so a cut-short file has none). Reads no weight."""
    try:
        size = path.stat().st_size
        if path.suffix == ".safetensors":
            return _safetensors_problem(path, size)
        if path.suffix == ".bin" and not _legacy_pickle(path):
            zipfile.ZipFile(path).close()
    except (OSError, zipfile.BadZipFile) as e:
        return f"{path} is unreadable or truncated ({type(e).__name__}: {e}); {RESTORE}"
    return None


def _legacy_pickle(path: Path) -> bool:
    """torch.save's format before torch 1.6: a bare pickle (protocol 2 opcode first), no zip directory to check."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"


def _safetensors_problem(path: Path, size: int) -> str | None:
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > min(size - 8, _MAX_HEADER):
            return f"{path} is truncated or not a safetensors file ({size} bytes, no whole header); {RESTORE}"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
            return f"{path} has a damaged safetensors header ({type(e).__name__}: {e}); {RESTORE}"
    if size < 8 + n + end:
        return f"{path} is truncated ({size} of {8 + n + end} bytes); {RESTORE}"
    return None


@contextlib.contextmanager
def _named_errors(path: Path) -> Iterator[None]:
    """safetensors' errors (SafetensorError) as a ValueError naming the file and the fix: a damaged file found
    while reading is a bad input, not a traceback. Other errors (a full disk while writing) pass unchanged."""

    try:
        yield
    except SafetensorError as e:
        raise ValueError(weight_file_problem(path) or f"{path} cannot be read ({e}); {RESTORE}") from e


def read_headers(files: list[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """({name: shape}, {name: dtype}) of every tensor in the shards, from their headers (no weight is read).
    A dtype this table does not know reads as uint8 (raw bytes)."""

    shapes, dtypes = {}, {}
    for file in files:
        with _named_errors(file), safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                sl = f.get_slice(name)
                shapes[name] = tuple(sl.get_shape())
                dtypes[name] = ST_DTYPES.get(sl.get_dtype(), torch.uint8)
    return shapes, dtypes


@contextlib.contextmanager
def open_shard(path: Path, *, pread: bool = False) -> Iterator[Any]:
    """One shard, memory-mapped (its pages are released when the block ends), or with pread: each tensor read
    into its own memory, returned once the tensor is dropped."""

    backend = {"backend": "pread"} if pread else {}
    with _named_errors(path), safe_open(str(path), framework="pt", device="cpu", **backend) as f:
        yield f


def iter_checkpoint(model_name_or_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time; pread, not mmap, so a tensor's memory is returned once it is dropped."""
    for file in checkpoint_files(model_name_or_path):
        with open_shard(file, pread=True) as f:
            for name in f.offset_keys():  # in file order: sequential reads
                yield name, f.get_tensor(name)


# ---------------------------------------------------------------- stored names and the model's


def causal_lm_class(config) -> type | None:
    """The AutoModelForCausalLM class of a config; None for remote code (its class is only known once loaded)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def layout_conversions(config, cls: type | None = None) -> list:
    """transformers' conversions from the family's checkpoint names to its modules' (none for most families);
    looked up by class name first, then model_type, as transformers does."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    cls = cls or causal_lm_class(config)
    for key in (getattr(cls, "__name__", None), getattr(config, "model_type", None)):
        found = get_checkpoint_conversion_mapping(key) if key else None
        if found:
            return list(found)
    return []


def checkpoint_renaming(config, cls: type | None = None) -> Callable[[str], str]:
    """Checkpoint name -> the model's name, through the family's renamings (GPT-NeoX's embed_out -> lm_head)."""
    from transformers.core_model_loading import WeightRenaming

    renamings = [c for c in layout_conversions(config, cls) if isinstance(c, WeightRenaming)]

    def rename(key: str) -> str:
        for r in renamings:
            key = r.rename_source_key(key)[0]
        return key

    return rename


def expert_slices(
    config, param: str, shapes: dict[str, tuple[int, ...]], resolve
) -> list[tuple[str, int, slice]] | None:
    """Where a fused expert parameter lives in a per-expert checkpoint: [(stored name, expert, rows)], the rows of
    the fused tensor's expert-e slice that the stored tensor holds; None when the
    family's conversion has no rule for it. Only the stack-then-concatenate conversion transformers uses for
    experts is inverted (stacked_experts); another raises ValueError."""
    from transformers.core_model_loading import WeightConverter

    for conv in layout_conversions(config):
        if not isinstance(conv, WeightConverter):
            continue
        targets = conv.target_patterns if isinstance(conv.target_patterns, list) else [conv.target_patterns]
        target = next((t for t in targets if param.endswith(t.lstrip("."))), None)
        if target is None or len(targets) != 1:
            continue
        if not stacked_experts(conv):
            ops = ", ".join(type(op).__name__ for op in conv.operations)
            raise ValueError(f"{param}: transformers builds it with {ops}; shardtune inverts experts stacked and "
                             "concatenated along dim 1 only.")  # fmt: skip
        prefix = param[: len(param) - len(target.lstrip("."))]
        return _expert_names(conv.source_patterns, prefix, shapes, resolve)
    return None


def stacked_experts(conv) -> bool:
    """Whether a transformers conversion only stacks per-expert tensors (MergeModulelist) and concatenates them
    along dim 1 (gate and up): the one conversion shardtune inverts, to load 4-bit experts and to merge expert
    LoRA into per-expert tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    if not isinstance(conv, WeightConverter):
        return False
    ops = [type(op) for op in conv.operations]
    return ops in ([MergeModulelist], [MergeModulelist, Concatenate]) and all(
        op.dim == 1 for op in conv.operations if isinstance(op, Concatenate)
    )


def _expert_names(sources, prefix: str, shapes, resolve) -> list[tuple[str, int, slice]]:
    out, e = [], 0
    sources = sources if isinstance(sources, list) else [sources]
    while True:
        names = [resolve(prefix + s.lstrip(".").replace("*", str(e))) for s in sources]
        if any(n is None for n in names):
            return out
        start = 0
        for name in names:
            rows = shapes[name][0]
            out.append((name, e, slice(start, start + rows)))
            start += rows
        e += 1


# ---------------------------------------------------------------- filling a skeleton


def load_checkpoint_into(
    model: nn.Module,
    model_name_or_path: str,
    *,
    dtype: torch.dtype,
    convert: Callable[[nn.Module, str, torch.Tensor], bool] | None = None,
    take: Callable[[str, torch.Tensor], bool] | None = None,
    finish: Callable[[], None] | None = None,
) -> None:
    """Fill a meta skeleton from the checkpoint one tensor at a time, each cast to dtype (as from_pretrained does).

    convert(module, name, tensor) may place a tensor itself (e.g. quantize it) and return True; take(key, tensor)
    is offered every tensor first, under the model's name, and returns True for one it placed (a stored tensor the
    family's conversion merges into another, such as one expert's slice of a fused expert tensor); finish(), after
    the last tensor, may refuse what take was left short of with its own message.
    """
    unexpected = []
    rename = checkpoint_renaming(model.config, type(model))
    for key, tensor in iter_checkpoint(model_name_or_path):
        key = rename(key)
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if take is not None and take(key, tensor):
            continue
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name) if _has_submodule(model, module_name) else None
        if module is None or (name not in module._parameters and name not in module._buffers):
            unexpected.append(key)
            continue
        if convert is not None and convert(module, name, tensor):
            continue
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(tensor, requires_grad=module._parameters[name].requires_grad)
        else:
            module._buffers[name] = tensor
        del tensor
        release_free_memory()
    if finish is not None:
        finish()
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{model_name_or_path}: the checkpoint lacks {len(missing)} of the model's weights (e.g. {missing[:3]}); "
            f"its tensor names (e.g. {unexpected[:3]}) do not match the model's. Load this model without "
            "--use_4bit_quantization, or save it again with transformers' save_pretrained."
        )


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc only; elsewhere a no-op).

    glibc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) in its heap; reading and quantizing
    tensor after tensor, or receiving shard after shard, then leaves a fragmented heap that holds on to memory
    nothing uses. Measured on a 1.1 GB checkpoint quantized to a 0.44 GiB 4-bit model: 0.83 GiB resident without
    this, 0.47 GiB with it.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # musl and macOS have none


# ---------------------------------------------------------------- writing shards


@dataclass
class PendingTensor:
    """An output tensor whose bytes are computed only when its shard is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_safetensors(entries: list[PendingTensor], path: Path) -> None:
    """Write a safetensors file one tensor at a time.

    safetensors.torch.save_file needs every tensor in memory and then copies each to bytes, which doubles an
    output shard in RAM; the format is a JSON header of offsets followed by the raw bytes, so it is written
    here as each tensor is computed, and only one tensor is ever held.
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


class ShardWriter:
    """Collects pending tensors and writes a shard whenever the next one would push it past max_bytes; `finish`
    names the shards as transformers does and writes the index when there are several."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: list[PendingTensor] = []
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, entry: PendingTensor) -> None:
        if self.pending and sum(e.nbytes for e in self.pending) + entry.nbytes > self.max_bytes:
            self.flush()
        self.pending.append(entry)
        self.total += entry.nbytes

    def flush(self) -> None:
        if self.pending:
            path = self.folder / f"part-{len(self.parts):05d}.safetensors"
            write_safetensors(self.pending, path)
            self.parts.append((path, [e.name for e in self.pending]))
            self.pending = []

    def finish(self) -> dict[str, str]:
        """Give the parts their final names, write the index when there are several, return the weight map."""
        self.flush()
        n = len(self.parts)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.parts, start=1):
            final = SINGLE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map
