"""`shardtune chat`: greedy replies of a merged model and of base + adapter equal transformers/peft's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardtune.commands.chat import generate_reply, main
from shardtune.commands.demo import build_model, build_tokenizer
from shardtune.data.templates import padded_vocab_size, setup_tokenizer
from shardtune.inference.load import load_for_chat

PROMPT = "What is the capital of France?"
# hidden and intermediate sizes are multiples of 64, bitsandbytes' 4-bit block size on CPU
SIZES = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A base model without chat template, a chat model (chatml) and a LoRA adapter trained on a resized vocab."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    base, chat, adapter = root / "base", root / "chat", root / "adapter"
    tok = build_tokenizer(base, vocab_size=400)
    build_model(base, vocab_size=len(tok), seed=1, **SIZES)

    chat_tok = AutoTokenizer.from_pretrained(base)
    new_ids = setup_tokenizer(chat_tok, "chatml")
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(chat_tok), pad_to_multiple_of=8)
    model.save_pretrained(chat)
    chat_tok.save_pretrained(chat)

    # as `shardtune train --chat_template_format chatml --use_peft_lora True` saves it: new token rows trained as
    # trainable tokens, so peft stores the resized embedding and head with the adapter
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(chat),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            init_lora_weights=False,
            trainable_token_indices={"embed_tokens": new_ids, "lm_head": new_ids},
        ),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a visible change of the replies
    peft_model.peft_config["default"].base_model_name_or_path = str(base)
    peft_model.save_pretrained(adapter)
    chat_tok.save_pretrained(adapter)
    assert padded_vocab_size(chat_tok) == model.get_input_embeddings().weight.shape[0] > len(tok)
    return {"base": base, "chat": chat, "adapter": adapter, "tokenizer": chat_tok, "peft_model": peft_model.eval()}


def _greedy(model, tokenizer, messages, max_new_tokens=8) -> str:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    stops = [model.generation_config.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        out = model.generate(
            **ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardtune", "chat", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )


def test_cli_prompt_prints_the_greedy_reply_of_a_merged_model(assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["chat"]).eval()
    expected = _greedy(model, assets["tokenizer"], [{"role": "user", "content": PROMPT}])
    assert expected.strip()
    res = _cli(
        "--model_name_or_path", str(assets["chat"]), "--prompt", PROMPT, "--temperature", "0", "--max_new_tokens", "8"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected + "\n"


def test_cli_applies_the_adapter(assets):
    peft_model, tok = assets["peft_model"], assets["tokenizer"]
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": PROMPT}]
    expected = _greedy(peft_model, tok, messages)
    with peft_model.disable_adapter():
        base_only = _greedy(peft_model, tok, messages)
    assert expected.strip() and expected != base_only
    res = _cli(
        "--model_name_or_path",
        str(assets["base"]),
        "--adapter",
        str(assets["adapter"]),
        "--prompt",
        PROMPT,
        "--system",
        "You answer briefly.",
        "--temperature",
        "0",
        "--max_new_tokens",
        "8",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected + "\n"
    assert "Resized the embeddings from 400 to 408 rows" in res.stderr


def test_adapter_folder_alone_finds_its_base(assets):
    model, tok = load_for_chat(str(assets["adapter"]))
    messages = [{"role": "user", "content": PROMPT}]
    reply = generate_reply(model, tok, messages, max_new_tokens=8, temperature=0, top_p=1.0, seed=0)
    assert reply == _greedy(assets["peft_model"], assets["tokenizer"], messages)


def test_interactive_keeps_history_and_resets(assets, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    lines = iter(["hi", "hi", "/reset", "hi", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["--model_name_or_path", str(assets["chat"]), "--temperature", "0", "--max_new_tokens", "6"]) == 0
    replies = capsys.readouterr().out.splitlines()
    model = AutoModelForCausalLM.from_pretrained(assets["chat"]).eval()
    first = _greedy(model, assets["tokenizer"], [{"role": "user", "content": "hi"}], max_new_tokens=6)
    second = _greedy(
        model,
        assets["tokenizer"],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first}, {"role": "user", "content": "hi"}],
        max_new_tokens=6,
    )
    assert replies == [first, second, first]
    assert next(lines) == "never read"


def test_sampling_is_seeded(assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["chat"]).eval()
    messages = [{"role": "user", "content": PROMPT}]

    def sample(seed):
        return generate_reply(
            model, assets["tokenizer"], messages, max_new_tokens=12, temperature=1.5, top_p=1.0, seed=seed
        )

    a, b, c = sample(0), sample(0), sample(1)
    assert a == b and a != c


def test_4bit_base_gives_the_greedy_reply_of_its_4bit_weights(assets):
    import bitsandbytes as bnb

    model, tok = load_for_chat(str(assets["chat"]), use_4bit=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    messages = [{"role": "user", "content": PROMPT}]
    reply = generate_reply(model, tok, messages, max_new_tokens=8, temperature=0, top_p=1.0, seed=0)
    assert reply.strip() and reply == _greedy(model, tok, messages)


def test_base_without_template_is_prompted_with_plain_lines(assets):
    model, tok = load_for_chat(str(assets["base"]))
    assert not tok.chat_template
    reply = generate_reply(
        model, tok, [{"role": "user", "content": PROMPT}], max_new_tokens=8, temperature=0, top_p=1.0, seed=0
    )
    ids = tok(f"user: {PROMPT}\nassistant:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **ids, do_sample=False, max_new_tokens=8, eos_token_id=[tok.eos_token_id], pad_token_id=tok.eos_token_id
        )
    assert reply == tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model_name_or_path", "{tmp}/nope"], "--model_name_or_path {tmp}/nope: no such folder"),
        (["--model_name_or_path", "{tmp}"], "--model_name_or_path {tmp}: no config.json there"),
        (["--model_name_or_path", "{chat}", "--adapter", "{chat}"], "--adapter {chat}: no adapter_config.json there"),
        (["--model_name_or_path", "{chat}", "--adapter", "{tmp}/nope"], "--adapter {tmp}/nope: no such folder"),
        (["--model_name_or_path", "{chat}", "--temperature", "-1"], "--temperature must be >= 0"),
    ],
)
def test_cli_errors(assets, tmp_path, capsys, args, message):
    paths = {"tmp": tmp_path, "chat": assets["chat"]}
    assert main([a.format(**paths) for a in args]) == 2
    assert message.format(**paths) in capsys.readouterr().err
