"""`shardtune chat`: talk to a base model with a trained PEFT adapter, or to a merged model.

`--prompt TEXT` answers once (only the answer goes to stdout, so it can be scripted); without it, an
interactive loop keeps the conversation (`/reset` clears it, `/exit` or Ctrl-D quits). Replies stream as they
are generated. `load_for_chat` and `generate_reply` are the same steps for use from Python.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from shardtune.hub import is_hub_id
from shardtune.log import print0, setup_logging, warn0

# End-of-turn markers of common chat formats (chatml, Llama-3, Phi-3): generation stops at them as at EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
_WARNED_NO_TEMPLATE: set[str] = set()


@dataclass
class ChatArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Base model (with --adapter), or a merged model folder. With --adapter it defaults to the "
            "adapter's base_model_name_or_path."
        },
    )
    adapter: str | None = field(
        default=None,
        metadata={
            "help": "A PEFT adapter folder (the --output_dir of a LoRA/DoRA run); its tokenizer and chat template are "
            "used when it has one."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use instead of the adapter's or the model's own."}
    )
    prompt: str | None = field(default=None, metadata={"help": "Answer this one message and exit."})
    system: str | None = field(default=None, metadata={"help": "System message at the start of the conversation."})
    max_new_tokens: int = field(default=256, metadata={"help": "Most tokens per reply."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature; 0 decodes greedily."})
    top_p: float = field(default=0.9, metadata={"help": "Nucleus sampling: keep the most likely tokens up to p."})
    seed: int = field(default=0, metadata={"help": "Random seed of sampling."})
    use_4bit_quantization: bool = field(default=False, metadata={"help": "Load the base in 4-bit (bitsandbytes)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code from the hub repository."})


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
    when training with that precision (shardtune.precision)."""
    import torch

    from shardtune.precision import resolve_precision

    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return ("cuda" if cuda else "cpu"), resolve_precision(bf16=bf16, fp16=cuda and not bf16, peft=True).storage


def _adapter_vocab_rows(model, adapter: str) -> int | None:
    """Rows of the embedding/output head saved in the adapter: peft saves them in full whenever the vocabulary
    was resized in training (also with trainable_token_indices), and the base must have as many to load them."""
    path = Path(adapter) / "adapter_model.safetensors"
    if not path.is_file():
        return None
    from safetensors import safe_open

    names = [
        n for n, m in model.named_modules() if m is model.get_input_embeddings() or m is model.get_output_embeddings()
    ]
    width = model.get_input_embeddings().weight.shape[1]
    rows = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            if any(f".{n}." in f".{key}" for n in names) and "lora_" not in key and "trainable_tokens" not in key:
                shape = f.get_slice(key).get_shape()
                if len(shape) == 2 and shape[1] == width:
                    rows.append(shape[0])
    return max(rows) if rows else None


def _trainable_token_rows(adapter: str) -> int:
    """Rows the base needs for the adapter's trainable_token_indices (the chat tokens training added; peft saves
    their rows, not the whole embedding, and indexes the base's resized embedding with them)."""
    spec = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("trainable_token_indices")
    indices = [i for v in spec.values() for i in v] if isinstance(spec, dict) else list(spec or [])
    return max(indices) + 1 if indices else 0


def _resize_for(model, tokenizer, adapter: str | None) -> None:
    """Give the base as many embedding rows as training did: the rows the adapter saved in full when it saved any,
    else training's own rule (len(tokenizer) rounded up to a multiple of 8, shardtune.modeling.resize_embeddings):
    an adapter with trainable token rows holds rows up to that padded size, past len(tokenizer)."""
    from shardtune.modeling import resize_embeddings

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
    from shardtune import preflight

    config, problem = preflight.load_model_config(base, trust_remote_code=trust_remote_code)
    problem = problem or (tokenizer and preflight.tokenizer_problem(tokenizer, "--tokenizer_name_or_path"))
    if problem:
        raise ValueError(problem)
    if adapter is None:
        return
    skeleton = preflight.meta_skeleton(config, trust_remote_code)
    problem = preflight.adapter_base_problem(
        adapter,
        preflight.model_shapes(skeleton),
        base_name=base,
        flag="--adapter",
        vocab_size=getattr(config.get_text_config(), "vocab_size", None),
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
    tokenizer = AutoTokenizer.from_pretrained(tok_src, trust_remote_code=trust_remote_code)
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


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS of the generation config and the tokenizer, and the end-of-turn token of the chat format if any."""
    ids: list[int] = []
    eos = model.generation_config.eos_token_id
    for i in [*(eos if isinstance(eos, list) else [eos]), tokenizer.eos_token_id]:
        if i is not None and i not in ids:
            ids.append(i)
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
    return ids


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> dict:
    """Token ids (and attention mask) of the conversation with the assistant's turn opened, via the chat template.
    A tokenizer without a template (a base model before fine-tuning) gets plain `role: text` lines."""
    if tokenizer.chat_template:
        return dict(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        )
    if tokenizer.name_or_path not in _WARNED_NO_TEMPLATE:
        _WARNED_NO_TEMPLATE.add(tokenizer.name_or_path)
        warn0(f"{tokenizer.name_or_path} has no chat template; prompting with plain `role: text` lines.")
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return dict(tokenizer(text, return_tensors="pt"))


def generate_reply(
    model,
    tokenizer,
    messages: list[dict[str, str]],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    streamer=None,
) -> str:
    """Generate the assistant's next reply to `messages` (temperature 0: greedy) and return its text."""
    import torch
    from transformers import set_seed

    inputs = {k: v.to(model.device) for k, v in encode_messages(tokenizer, messages).items()}
    stops = stop_token_ids(model, tokenizer)
    sampling = temperature > 0
    gen: dict[str, Any] = {
        "do_sample": sampling,
        "max_new_tokens": max_new_tokens,
        "eos_token_id": stops,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0],
    }
    # Greedy: clear the model's own sampling defaults so that generate does not warn they are ignored.
    gen.update(
        {"temperature": temperature, "top_p": top_p}
        if sampling
        else {"temperature": None, "top_p": None, "top_k": None}
    )
    set_seed(seed)
    with torch.inference_mode():
        out = model.generate(**inputs, **gen, streamer=streamer)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True)


class PrintStreamer:
    """Prints a reply as it is generated, so that what is printed is exactly the decoded reply.

    transformers' TextStreamer holds text back until a space and restarts its cache at each newline; here the
    whole reply is decoded at each token and only a trailing incomplete UTF-8 character is held back.
    """

    def __init__(self, tokenizer, file: TextIO | None = None):
        self.tokenizer = tokenizer
        self.file = file
        self._tokens: list[int] = []
        self._printed = 0
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first passes the prompt
            self._prompt_seen = True
            return
        self._tokens += value.reshape(-1).tolist()
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        stable = len(text.rstrip("\ufffd"))
        if stable > self._printed:
            self._write(text[self._printed : stable])
            self._printed = stable

    def end(self) -> None:
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        self._write(text[self._printed :] + "\n")
        self._tokens, self._printed, self._prompt_seen = [], 0, False

    def _write(self, text: str) -> None:
        f = self.file or sys.stdout
        f.write(text)
        f.flush()


def _interactive(model, tokenizer, args: ChatArguments) -> None:
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print("Type a message. /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        try:
            reply = generate_reply(
                model,
                tokenizer,
                [*messages, {"role": "user", "content": line}],
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed + turn,
                streamer=PrintStreamer(tokenizer),
            )
        except KeyboardInterrupt:  # stop this reply, keep the conversation as it was
            print("\n(reply interrupted)", file=sys.stderr)
            continue
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
        turn += 1


def parse_chat_args(argv: list[str]) -> ChatArguments:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(ChatArguments, prog="shardtune chat", allow_abbrev=False)
    from shardtune.config import join_negative_values

    (args,) = parser.parse_args_into_dataclasses(args=join_negative_values(argv))
    if args.max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1 (got {args.max_new_tokens}).")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (got {args.temperature}); 0 decodes greedily.")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1] (got {args.top_p}).")
    return args


def main(argv: list[str] | None = None) -> int:
    """`shardtune chat`: see the module docstring and `shardtune chat --help`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging("info")
    try:
        args = parse_chat_args(argv)
        model, tokenizer = load_for_chat(
            args.model_name_or_path,
            args.adapter,
            use_4bit=args.use_4bit_quantization,
            trust_remote_code=args.trust_remote_code,
            tokenizer_name_or_path=args.tokenizer_name_or_path,
        )
    except (ValueError, OSError) as e:  # OSError: transformers could not find or read the model
        print(f"shardtune chat: {e}", file=sys.stderr)
        return 2
    if args.prompt is None:
        _interactive(model, tokenizer, args)
        return 0
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    generate_reply(
        model,
        tokenizer,
        messages,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        streamer=PrintStreamer(tokenizer),
    )
    return 0
