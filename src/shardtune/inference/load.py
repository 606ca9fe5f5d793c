"""Loading a model to generate with: a base model with an adapter, or a merged (or fully fine-tuned) model, with
the embeddings resized as training resized them. Used by `shardtune chat`, `shardtune eval` and the demo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardtune.config.precision import resolve_precision
from shardtune.models import adapter_fit, preflight
from shardtune.models.loading import resize_embeddings
from shardtune.models.preflight import tokenizer_load_error
from shardtune.models.weights import read_headers
from shardtune.runtime.hub import is_hub_id
from shardtune.runtime.log import print0
from shardtune.training.run_dir import checkpoint_given_as_adapter

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def _check_model(name: str, flag: str = "--model_name_or_path") -> None:
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{flag} {name}: no config.json there; give a model folder (a merged model or the "
                "base model) or a hub id."
            )
    elif not is_hub_id(name):
        raise ValueError(f"{flag} {name}: no such folder.")


def _check_adapter(adapter: str) -> dict:
    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise ValueError(f"--adapter {adapter}: no such folder; give the --output_dir of a LoRA/DoRA run.")
    if not (path / "adapter_config.json").is_file():
        if hint := checkpoint_given_as_adapter(adapter, "--adapter"):
            raise ValueError(hint)
        raise ValueError(
            f"--adapter {adapter}: no adapter_config.json there. For a merged or fully fine-tuned model "
            "pass the folder as --model_name_or_path instead."
        )
    return json.loads((path / "adapter_config.json").read_text())


def resolve_paths(model_name_or_path: str | None, adapter: str | None) -> tuple[str, str | None]:
    """(base model, adapter folder or None), checked; an adapter folder given as the model is taken as --adapter."""
    if model_name_or_path and adapter is None:
        p = Path(model_name_or_path).expanduser()
        if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
            model_name_or_path, adapter = None, model_name_or_path
    if adapter is not None:
        base = _check_adapter(adapter).get("base_model_name_or_path")
        model_name_or_path = model_name_or_path or base
        if not model_name_or_path:
            raise ValueError(
                f"--adapter {adapter}: its adapter_config.json names no base model; give --model_name_or_path."
            )
    if not model_name_or_path:
        raise ValueError("--model_name_or_path is required: a merged model folder, or the base model with --adapter.")
    _check_model(model_name_or_path)
    return model_name_or_path, adapter


def _device_and_dtype():
    """bf16 on a GPU that has it, fp16 on other GPUs, fp32 on the CPU; the dtype is the one a frozen base is held in
    when training with that precision (shardtune.config.precision)."""
    import torch

    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return ("cuda" if cuda else "cpu"), resolve_precision(bf16=bf16, fp16=cuda and not bf16, peft=True).storage


def _adapter_vocab_rows(model, adapter: str) -> int | None:
    """Rows of the embedding/output head saved in the adapter: peft saves them in full whenever the vocabulary
    was resized in training (also with trainable_token_indices), and the base must have as many to load them."""
    path = Path(adapter) / "adapter_model.safetensors"
    if not path.is_file():
        return None

    names = [
        n for n, m in model.named_modules() if m is model.get_input_embeddings() or m is model.get_output_embeddings()
    ]
    width = model.get_input_embeddings().weight.shape[1]
    rows = [
        shape[0]
        for key, shape in read_headers([path])[0].items()
        if any(f".{n}." in f".{key}" for n in names)
        and "lora_" not in key
        and "trainable_tokens" not in key
        and len(shape) == 2
        and shape[1] == width
    ]
    return max(rows) if rows else None


def _trainable_token_rows(adapter: str) -> int:
    """Rows the base needs for the adapter's trainable_token_indices (the chat tokens training added; peft saves
    their rows, not the whole embedding, and indexes the base's resized embedding with them)."""
    spec = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("trainable_token_indices")
    indices = [i for v in spec.values() for i in v] if isinstance(spec, dict) else list(spec or [])
    return max(indices) + 1 if indices else 0


def _resize_for(model, tokenizer, adapter: str | None) -> None:
    """Give the base as many embedding rows as training did: the rows the adapter saved in full when it saved any,
    else training's own rule (len(tokenizer) rounded up, data.templates.padded_rows, by models.loading.resize_embeddings):
    an adapter with trainable token rows holds rows up to that padded size, past len(tokenizer)."""

    current = model.get_input_embeddings().weight.shape[0]
    saved = _adapter_vocab_rows(model, adapter) if adapter else None
    if saved is not None and saved > current:
        model.resize_token_embeddings(saved, mean_resizing=False)  # every row is overwritten by the adapter's
        print0(f"Resized the embeddings from {current} to {saved} rows to match the adapter.")
        return
    resize_embeddings(model, len(tokenizer))
    # A tokenizer saved apart from the adapter may be shorter than training's: the trainable token rows say how
    # many rows training had.
    need = _trainable_token_rows(adapter) if adapter else 0
    if need > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(need, mean_resizing=False)


def _check_base_and_adapter(base: str, adapter: str | None, trust_remote_code: bool, tokenizer: str | None) -> None:
    """Before any weight is read: the base's config and weights, and the tokenizer, can be read (one bounded hub
    request for a hub id), and the adapter's tensors fit the base (an adapter of another base would fail in
    peft's loader)."""

    config, problem = preflight.model_config_or_problem(base, trust_remote_code=trust_remote_code)
    problem = problem or (tokenizer and preflight.tokenizer_problem(tokenizer, "--tokenizer_name_or_path"))
    if problem:
        raise ValueError(problem)
    if adapter is None:
        return
    skeleton = preflight.meta_skeleton(config, trust_remote_code)
    problem = adapter_fit.adapter_base_problem(
        adapter,
        adapter_fit.model_shapes(skeleton),
        base_name=base,
        flag="--adapter",
        vocab_size=getattr(config.get_text_config(), "vocab_size", None),
        skeleton=skeleton,
    )
    if problem:
        raise ValueError(problem)


def load_for_chat(
    model_name_or_path: str | None,
    adapter: str | None = None,
    *,
    use_4bit: bool = False,
    trust_remote_code: bool = False,
    tokenizer_name_or_path: str | None = None,
):
    """Load (model, tokenizer) ready to generate: the base (4-bit if asked) with the adapter applied, or a merged
    model. The tokenizer is tokenizer_name_or_path, else the adapter's when it saved one, else the model's; the
    base embeddings are resized to the adapter's/tokenizer's vocabulary before the adapter is loaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    base, adapter = resolve_paths(model_name_or_path, adapter)
    _check_base_and_adapter(base, adapter, trust_remote_code, tokenizer_name_or_path)
    has_tok = adapter and any((Path(adapter) / f).is_file() for f in TOKENIZER_FILES)
    tok_src = tokenizer_name_or_path or (adapter if has_tok else base)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_src, trust_remote_code=trust_remote_code)
    except Exception as e:  # a damaged tokenizer file: name its folder (tokenizers raises bare Exceptions)
        flag = (
            "--tokenizer_name_or_path" if tokenizer_name_or_path else "--adapter" if has_tok else "--model_name_or_path"
        )
        raise tokenizer_load_error(tok_src, flag, e) from e
    device, dtype = _device_and_dtype()
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if use_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
        if device == "cuda":
            kwargs["device_map"] = {"": torch.cuda.current_device()}
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if not use_4bit:
        model.to(device)
    _resize_for(model, tokenizer, adapter)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    print0(
        f"Loaded {base}"
        + (f" with the adapter {adapter}" if adapter else "")
        + f" on {device}"
        + (" in 4-bit" if use_4bit else "")
        + f"; tokenizer from {tok_src}."
    )
    return model, tokenizer
