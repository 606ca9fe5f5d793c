"""The family matrix: every architecture family trains, saves, reloads, merges and chats through the CLI.

One 1-process run and one 2-rank FSDP2 (gloo) run each loop over all families in a single interpreter
(tests/family_worker.py), so the matrix pays for starting Python and torch twice, not once per family. Every family
trains LoRA (all-linear) with the same global batch in both, and two tied families also train in full in both: the
2-rank run equals the 1-process one in its per-step losses and gradient norms and in its saved tensors, elementwise.
The 2-rank run also trains the other methods on some families, checked for training only (finite losses that moved:
no 1-process twin, for time; the full cross product is bench/family_matrix.py). Tokenizers: `llama` and `mistral`
use one without chat tokens (chatml adds them, 600 -> 608 rows), the others one that already has <|im_start|>/<|im_end|> and 602 tokens
(chatml adds 4 more; training pads to 608, past len(tokenizer)).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from shardtune.config.errors import ConfigError
from tests.conftest import run_cli, train_records
from tests.families import (
    FAMILIES,
    FFN,
    HIDDEN,
    LAYERS,
    LR,
    ROUTED,
    STEPS,
    assert_runs_match,
    build_assets,
    build_family_model,
    chat_answer_ids,
    eval_rows_file,
    matrix_tolerance,
    merge_logit_error,
    peft_and_merged,
    reload_eval_losses,
    run_jobs,
    saved_tensors,
    train_argv,
)
from tests.mutation import Edit, plant
from tests.tolerance import decoder_chain, tol

# The families' tiny decoders (tests/families.py), rows of 96 positions, a 608-row vocabulary after chatml's tokens.
CHAIN = {"hidden": HIDDEN, "intermediate": FFN, "layers": LAYERS, "seq": 96, "vocab": 608}
# 12 test conversations, each at most one row of 96 positions: a bound on the eval loss's targets.
EVAL_TOKENS = 12 * 96

TIED = ("llama-tied", "qwen3", "gemma2", "gemma3", "gemma4", "gpt2")
# (family, method, lora_dropout) trained on 2 ranks only, besides LoRA on every family.
EXTRA = [
    ("mixtral", "lora", 0.1),  # the guide's flags on mixtures of experts
    ("qwen3-moe", "lora", 0.1),
    ("gemma2", "dora", 0.0),
    ("phi3", "dora", 0.0),
    ("gpt2", "dora", 0.0),
    ("qwen3", "full", 0.0),
    ("gemma3", "full", 0.0),
    ("gemma4", "full", 0.0),  # tied, per-layer input embeddings trained in full
    ("llama-tied", "qlora", 0.0),
    ("gpt-neox", "qlora", 0.0),
    ("mixtral", "qlora-experts", 0.0),  # 4-bit experts with expert LoRA; against 1 process in test_4bit_experts_...
]
FULL = ("qwen3", "gemma4")  # full fine-tuning in 1 process too: tied, q/k norms; Gemma 4's per-layer embeddings
MOE = tuple(n for n, f in FAMILIES.items() if not f.dense)  # expert LoRA in 1 process and on 2 ranks


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    assets = build_assets(root)
    one = [
        {"name": n, "argv": train_argv(root / n, assets["data"], root / "one" / n, "lora", batch=4)} for n in FAMILIES
    ]
    two = [
        {"name": n, "argv": train_argv(root / n, assets["data"], root / "two" / n, "lora", batch=2)} for n in FAMILIES
    ]
    one += [{"name": f"{n}/full", "argv": train_argv(root / n, assets["data"], root / "one-full" / n, "full", batch=4)}
            for n in FULL]  # fmt: skip
    two += [
        {"name": f"{n}/{m}", "argv": train_argv(root / n, assets["data"], root / m / n, m, batch=2, dropout=p)}
        for n, m, p in EXTRA
    ]
    # The same micro-batches as the 2-rank run (2 rows, accumulated twice): a token whose top-k experts are nearly
    # tied may route differently once one micro-batch of 4 rows has summed its gradients in another order.
    qlora = train_argv(root / "mixtral", assets["data"], root / "one-qlora" / "mixtral", "qlora-experts", batch=2)
    one.append({"name": "mixtral/qlora-experts", "argv": [*qlora, "--gradient_accumulation_steps", "2"]})
    for n in MOE:
        one.append(
            {
                "name": f"{n}/experts",
                "argv": train_argv(root / n, assets["data"], root / "one-experts" / n, "experts", batch=4),
            }
        )
        two.append(
            {
                "name": f"{n}/experts",
                "argv": train_argv(root / n, assets["data"], root / "experts" / n, "experts", batch=2),
            }
        )
    return {**assets, "one": run_jobs(one, root, nproc=1), "two": run_jobs(two, root, nproc=2)}


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in train_records(out)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_two_ranks_match_one_process(matrix, family):
    assert matrix["one"][family] == 0, matrix["one"][family]
    assert matrix["two"][family] == 0, matrix["two"][family]
    one, two, close = matrix["root"] / "one" / family, matrix["root"] / "two" / family, matrix_tolerance(family)
    adapter = assert_runs_match(one, two, close, min_updates=STEPS)
    assert len(_losses(one)) == STEPS and abs(_losses(one)[-1] - _losses(one)[0]) > 1e-3  # it trained
    # lora_B starts at 0; AdamW moves an element by up to lr per step (2 · lr in all with the linear decay): far more
    # than the tolerance, so agreeing to it says both runs made the same updates.
    moved = max(float(v.abs().max()) for k, v in adapter.items() if "lora_B" in k)
    assert moved > LR > 3 * close.atol, moved


@pytest.mark.parametrize("family", FULL)
def test_full_fine_tuning_two_ranks_match_one_process(matrix, family):
    root = matrix["root"]
    assert matrix["one"][f"{family}/full"] == 0, matrix["one"][f"{family}/full"]
    assert matrix["two"][f"{family}/full"] == 0, matrix["two"][f"{family}/full"]
    close = matrix_tolerance(family)
    trained = assert_runs_match(root / "one-full" / family, root / "full" / family, close, min_updates=STEPS)
    base = saved_tensors(root / family)
    moved = max(float((trained[k] - v).abs().max()) for k, v in base.items() if trained[k].shape == v.shape)
    assert moved > LR > 3 * close.atol, moved


# The loss is not multiplied by the data-parallel size: on 2 ranks FSDP's average halves the gradient.
UNSCALED_LOSS = Edit(
    "training/trainer.py",
    "objective.step(model, b, totals, info.dims.gradient_divisor)",
    "objective.step(model, b, totals, 1)",
)


def test_halved_gradient_on_two_ranks_is_caught(matrix, tmp_path):
    """Negative control: a loss left unscaled by the data-parallel size (FSDP averages the ranks' gradients, so 2
    ranks step with half the gradient) fails the comparison, through grad_norm: max_grad_norm 1 clips both runs'
    early steps to the same update, and Adam's update hardly depends on the gradient's scale."""
    planted = plant(UNSCALED_LOSS, tmp_path)
    out = tmp_path / "llama"
    argv = train_argv(matrix["root"] / "llama", matrix["data"], out, "lora", batch=2)
    assert run_jobs([{"name": "llama", "argv": argv}], tmp_path, nproc=2, env=planted)["llama"] == 0
    with pytest.raises(AssertionError, match=r"step 1 grad_norm: .*\(relative 0\.5 ") as caught:
        assert_runs_match(matrix["root"] / "one" / "llama", out, matrix_tolerance("llama"))
    assert " loss:" not in str(caught.value)  # the losses agree: a comparison of losses alone passes this bug


@pytest.mark.parametrize(("family", "method", "dropout"), EXTRA)
def test_other_methods(matrix, family, method, dropout):
    result = matrix["two"][f"{family}/{method}"]
    log = (matrix["root"] / "log-2.txt").read_text()
    assert result == 0, result
    losses = _losses(matrix["root"] / method / family)
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses))) and abs(losses[-1] - losses[0]) > 1e-3
    if not FAMILIES[family].dense:
        assert "LoRA targets (all-linear" in log and "not adapted, the experts' fused tensors" in log


def test_4bit_experts_two_ranks_match_one_process(matrix):
    """QLoRA on a mixture of experts: the experts' packed 4-bit tensors sharded over 2 ranks (rank 1 fed by rank 0,
    its stacked quantization states broadcast), carrying expert and router LoRA, train as 1 process holding them
    whole: losses, grad_norm, adapter; every expert's LoRA B moved. The adapter is plain PEFT's: it loads onto the
    16-bit base (transformers does not quantize experts) with every saved tensor in place."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = matrix["root"]
    assert matrix["one"]["mixtral/qlora-experts"] == 0, matrix["one"]["mixtral/qlora-experts"]
    out = root / "qlora-experts" / "mixtral"
    adapter = assert_runs_match(root / "one-qlora" / "mixtral", out, matrix_tolerance("mixtral"), min_updates=STEPS)
    experts_b = {k: v for k, v in adapter.items() if "lora_B" in k and ".experts." in k}
    assert len(experts_b) == 2 * LAYERS and all(float(v.abs().max()) > LR for v in experts_b.values())
    log = (root / "log-2.txt").read_text()
    assert re.search(r"4-bit base: [\d.]+ MiB of packed weights \(experts [\d.]+ MiB\) sharded over 2 rank", log)
    base = AutoModelForCausalLM.from_pretrained(root / "mixtral", dtype=torch.float32)
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(out)), pad_to_multiple_of=8)
    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(base, out))
    saved = saved_tensors(out)
    assert saved.keys() == adapter.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_adapters_reload_in_fresh_process_with_trained_eval_loss(matrix):
    root = matrix["root"]
    jobs = [
        {"name": n, "base": str(root / n), "out": str(root / "two" / n),
         "rows": str(eval_rows_file(matrix["data"], root / "two" / n, root, n, packing=FAMILIES[n].packing))}
        for n in FAMILIES
    ]  # fmt: skip
    got = reload_eval_losses(jobs)
    for n in FAMILIES:
        trained = json.loads((root / "two" / n / "train_summary.json").read_text())["final_eval_loss"]
        # fp32 on both sides; the training forward (chunked loss, per-document SDPA) sums in another order.
        assert got[n] == pytest.approx(trained, rel=tol(torch.float32, decoder_chain(**CHAIN, tokens=EVAL_TOKENS))), n


def test_gemma4_trains_and_saves_its_per_layer_token_rows(matrix):
    """Gemma 4's per-layer input embedding (embed_tokens_per_layer) grows with the chat tokens (602 -> 608 rows):
    its new rows are trainable tokens, saved with the adapter, and the role tokens the data uses moved."""
    from safetensors.torch import load_file

    adapter = load_file(str(matrix["root"] / "two" / "gemma4" / "adapter_model.safetensors"))
    base = load_file(str(matrix["root"] / "gemma4" / "model.safetensors"))
    key = "base_model.model.model.language_model.embed_tokens_per_layer.token_adapter.trainable_tokens_delta"
    rows, table = adapter[key], base["model.language_model.embed_tokens_per_layer.weight"]
    assert rows.shape == (608 - 602, table.shape[1])
    # The resize starts new rows at the mean row (a sample with 1e-9 of the rows' covariance); AdamW moves every
    # element it updates by about lr = 5e-3 per step. 603-605: <|im_start|>user/assistant/system, in every row.
    moved = (rows - table.mean(0)).abs().amax(1)
    assert (moved[1:4] > 1e-3).all(), moved


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merge_loads_and_equals_base_plus_adapter(matrix, family):
    root = matrix["root"]
    peft, merged = peft_and_merged(root / family, root / "two" / family, root / "merged" / family)
    config = json.loads((root / "merged" / family / "config.json").read_text())
    config = config.get("text_config", config)  # Gemma 4: the language model's config
    emb, head = merged.get_input_embeddings().weight, merged.get_output_embeddings().weight
    assert emb.shape == head.shape == (608, emb.shape[1]) and config["vocab_size"] == 608
    if "vocab_size_per_layer_input" in config:  # Gemma 4: its per-layer input embedding grows with the vocabulary
        per_layer = merged.get_per_layer_input_embeddings().weight
        assert config["vocab_size_per_layer_input"] == per_layer.shape[0] == 608
    if family in TIED:  # the adapter leaves the head equal to the embedding: it stays tied
        assert config["tie_word_embeddings"] is True and head is emb
    ids = torch.tensor([[1, 40, 77, 602, 605, 607, 9, 300]])  # includes the chat tokens and a padding row
    # fp32: W + s·BA summed before (merged) or after (adapter) each product: two summation orders of one forward to
    # the logits, relative to the largest logit.
    assert merge_logit_error(peft, merged, ids) < tol(torch.float32, decoder_chain(**{**CHAIN, "vocab": 0, "seq": 8}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_answers_with_adapter_and_merged_folder(matrix, family):
    from shardtune.commands.chat import generate_reply
    from shardtune.inference.load import load_for_chat

    root = matrix["root"]
    peft_and_merged(root / family, root / "two" / family, root / "merged" / family)  # writes the merged folder
    with_adapter, rows = chat_answer_ids(root / family, root / "two" / family)
    merged, merged_rows = chat_answer_ids(root / "merged" / family, None)
    assert rows == merged_rows == 608  # as trained, not len(tokenizer)
    assert len(with_adapter) == 6 and with_adapter == merged
    model, tok = load_for_chat(str(root / "merged" / family))
    assert isinstance(
        generate_reply(model, tok, [{"role": "user", "content": "Hi"}], max_new_tokens=3, temperature=0), str
    )


def test_chat_cli_on_tied_model_whose_tokenizer_had_chat_tokens(matrix):
    """`shardtune chat --adapter` sizes the base as training did (602 tokens + 4 chatml tokens -> 608 rows)."""
    out = matrix["root"] / "two" / "llama-tied"
    args = ["chat", "--model_name_or_path", str(matrix["root"] / "llama-tied"), "--adapter", str(out)]
    proc = run_cli([*args, "--prompt", "What is the capital of Peru?", "--max_new_tokens", "4", "--temperature", "0"])
    assert "Resized the embeddings from 602 to 608 rows" in proc.stderr + proc.stdout


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_counts_the_familys_parameters(family, tmp_path):
    """The planner's parameter count equals the real model's numel (GPT-2, not Llama-shaped, is refused clearly)."""
    from transformers import AutoModelForCausalLM

    from shardtune.commands.plan import plan_shape
    from shardtune.planning import base_param_count

    config = FAMILIES[family].config(602)
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if family == "gpt2":
        with pytest.raises(ConfigError, match="model_type 'gpt2' is not a Llama-style decoder"):
            plan_shape(config, "none")
        return
    assert base_param_count(plan_shape(config, "none")) == real


def test_qlora_quantizes_gpt2_conv1d_as_transformers_does(tmp_path):
    """GPT-2's Conv1D stores (in, out) weights: shardtune's 4-bit loader transposes them as transformers' does."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from shardtune.models import loading

    build_family_model("gpt2", tmp_path, 256)
    config = loading.bnb_config(
        use_4bit=True, use_8bit=False, quant_type="nf4", compute_dtype_name="float32", nested=False,
        storage_dtype_name="float32",
    )  # fmt: skip
    ours = loading.load_base_model(
        str(tmp_path), dtype=torch.float32, attn_impl="sdpa", trust_remote_code=False, quantization_config=config
    )
    ref = dict(
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=config).named_modules()
    )
    layers = [(n, m) for n, m in ours.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 8  # c_attn, c_proj, c_fc, c_proj in 2 blocks
    for name, module in layers:
        mine = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        theirs = bnb.functional.dequantize_4bit(ref[name].weight.data, ref[name].weight.quant_state)
        assert torch.equal(mine, theirs), name


def test_steps_at_learning_rate_zero_do_not_count(tmp_path):
    """assert_runs_match counts the updates whose rate was not 0: with warmup_steps 1 over 2 steps, step 1 updates
    nothing (metrics.jsonl logs, at each step, the rate of the next one)."""
    config = {"train": {"learning_rate": 1e-3, "warmup_steps": 1, "warmup_ratio": 0.0}}
    records = [{"type": "start", "config": config}] + [
        {"type": "train", "step": s, "loss": 1.0, "grad_norm": 1.0, "learning_rate": lr}
        for s, lr in ((1, 1e-3), (2, 0))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(AssertionError, match=r"only steps \[2\] of \[1, 2\] updated the weights"):
        assert_runs_match(tmp_path, tmp_path, matrix_tolerance("llama"), min_updates=2)


# ---------------------------------------------------------------- expert LoRA on the mixtures of experts

# PEFT's keys for the LoRA of each block's two fused expert tensors (nested wrappers) and its router's weight.
EXPERT_LORA = (".mlp.experts.base_layer.lora_B.weight", ".mlp.experts.lora_B.weight")
ROUTER = {"gpt-oss": "mlp.router"}  # the others' router is mlp.gate


@pytest.mark.parametrize("family", MOE)
def test_expert_lora_two_ranks_match_one_process(matrix, family):
    """LoRA on every expert (`--lora_target_experts True`) and on the routers (`--lora_target_parameters routers`)
    trains on 2 FSDP2 ranks as in one process: losses, grad_norm and every saved tensor. The adapter names the
    parameters as PEFT's target_parameters and holds a LoRA for each, moved by training (B starts at zero): a run
    that left the experts out would have neither."""
    root = matrix["root"]
    assert matrix["one"][f"{family}/experts"] == 0 and matrix["two"][f"{family}/experts"] == 0
    close = matrix_tolerance(family, ROUTED)  # routing near-ties (tests/families.py); 5.5x below one update (LR)
    trained = assert_runs_match(root / "one-experts" / family, root / "experts" / family, close, min_updates=STEPS)
    config = json.loads((root / "experts" / family / "adapter_config.json").read_text())
    router = ROUTER.get(family, "mlp.gate")
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                                                   f"{router}.weight"]  # fmt: skip
    assert config["lora_dropout"] == 0.0  # what PEFT needs to load a parameter's LoRA
    blocks = _moe_blocks(root / family)
    assert blocks  # DeepSeek-V3's first block is dense
    for layer in blocks:
        for suffix in (*EXPERT_LORA, f".{router}.lora_B.weight"):
            moved = float(trained[f"base_model.model.model.layers.{layer}{suffix}"].abs().max())
            assert moved > LR > 3 * close.atol, (layer, suffix, moved)


def _moe_blocks(model_dir: Path) -> list[int]:
    """The indices of the decoder blocks that hold fused experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.models import targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    found = targets.expert_modules(model, targets.num_experts(model.config))
    return [int(name.split(".")[2]) for name in found]


@pytest.mark.parametrize("family", MOE)
def test_expert_lora_reloads_in_peft_merges_and_chats(matrix, family):
    """The expert adapter reloads in plain transformers + PEFT with the trained eval loss; `shardtune merge` folds
    each expert's delta into the base's per-expert tensors (the layout the checkpoint stores them in), so the merged
    folder's fused tensors minus the base's are PEFT's own deltas, and its logits are base + adapter's; `shardtune
    chat` gives the same answer with the adapter and with the merged folder."""
    from peft.tuners.lora import ParamWrapper
    from transformers import AutoModelForCausalLM

    root, out = matrix["root"], matrix["root"] / "experts" / family
    rows = eval_rows_file(matrix["data"], out, root, f"{family}-experts", packing=FAMILIES[family].packing)
    got = reload_eval_losses([{"name": family, "base": str(root / family), "out": str(out), "rows": str(rows)}])
    trained = json.loads((out / "train_summary.json").read_text())["final_eval_loss"]
    assert got[family] == pytest.approx(trained, rel=tol(torch.float32, decoder_chain(**CHAIN, tokens=EVAL_TOKENS)))

    peft, merged = peft_and_merged(root / family, out, root / "merged-experts" / family)
    base = AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32)
    merged_params, base_params = dict(merged.named_parameters()), dict(base.named_parameters())
    wrappers = [(n, m) for n, m in peft.named_modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 3 * len(_moe_blocks(root / family))
    for name, module in wrappers:
        param = f"{name.removeprefix('base_model.model.').replace('.base_layer', '')}.{module.parameter_name}"
        delta = module.get_delta_weight("default").detach()
        assert delta.abs().max() > 0, param
        # fp32: the merge rounds w + delta once, this subtraction once more, and the two deltas (bmm against PEFT's
        # einsum over r terms) differ by a few roundings of |delta|: 8 eps of the larger magnitude bounds all four.
        w = merged_params[param] - base_params[param]
        atol = 8 * torch.finfo(torch.float32).eps * float(base_params[param].abs().max() + delta.abs().max())
        torch.testing.assert_close(w, delta, rtol=0, atol=atol, msg=lambda m, p=param: f"{p}: {m}")
    ids = torch.tensor([[1, 40, 77, 602, 605, 607, 9, 300]])
    assert merge_logit_error(peft, merged, ids) < tol(torch.float32, decoder_chain(**{**CHAIN, "vocab": 0, "seq": 8}))
    with_adapter, _ = chat_answer_ids(root / family, out)
    from_merged, _ = chat_answer_ids(root / "merged-experts" / family, None)
    assert len(with_adapter) == 6 and with_adapter == from_merged
