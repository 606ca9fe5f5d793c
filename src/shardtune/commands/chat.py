"""`shardtune chat`: talk to a base model with a trained PEFT adapter, or to a merged model.

`--prompt TEXT` answers once (only the answer goes to stdout, so it can be scripted); without it, an
interactive loop keeps the conversation (`/reset` clears it, `/exit` or Ctrl-D quits). Replies stream as they
are generated. `load_for_chat` and `generate_reply` are the same steps for use from Python.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from shardtune.config.run import join_negative_values
from shardtune.inference.load import load_for_chat
from shardtune.runtime.log import setup_logging, warn0

# End-of-turn markers of common chat formats (chatml, Llama-3, Phi-3): generation stops at them as at EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")
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
