"""Preference tuning (DPO, KTO) off the Llama path: a tied-embeddings family with a Qwen3 chat template (an empty
thinking block, `chat_template_kwargs`), Gemma 2 with final-logit soft-capping, tied embeddings and its chat template
(BOS and <end_of_turn> rendered by the template), and a mixture of experts (Mixtral) with Mistral's [INST] template
(BOS from the template, EOS closing the answer).

- The first step's numbers equal trl 1.16's DPOTrainer / KTOTrainer on the same conversational batch (TRL tokenizes
  with the same template itself), in-process, no spawn.
- A mixture of experts trains DPO and KTO with the router load-balancing loss (the config's coefficient, TRL's
  default): shardtune's loss and aux_loss equal TRL's, padding left out of the aux as TRL's attention mask does;
  TRL with router_aux_loss_coef=0 differs by coef × aux, far outside the bound (the loss without the term fails).
- With LoRA on a tied-embeddings model whose new tokens are trained (on the tied embedding and head), the reference
  (the adapter disabled) is the base exactly, as transformers' own forward computes it.
- One process runs three `shardtune train` jobs (tests/family_worker.py): Qwen3 LoRA DPO, Gemma 2 full fine-tuning
  DPO (precomputed reference, tied weights that the first step changes), Mixtral LoRA KTO. The logged log-probs of
  step 1 and the reference implied by step 2's and the eval's rewards (log π − reward/β) equal transformers'
  log-probs of the base model: the reference stays the frozen base.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.commands.demo import build_tokenizer, write_preference_dataset
from shardtune.data import setup_tokenizer
from shardtune.models.router_aux import family_router_aux, log_line
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.heads import sequence_logps
from shardtune.objectives.loss import build_objective
from tests.conftest import train_records
from tests.families import FAMILIES, FFN, HIDDEN, LAYERS, build_family_model, run_jobs
from tests.mutation import Edit, plant
from tests.tolerance import decoder_chain, tol
from tests.trl_parity import build_pairs, shardtune_first_step, trl_first_step

trl = pytest.importorskip("trl")

BETA = 0.1
KTO_WEIGHTS = {"desirable_weight": 1.0, "undesirable_weight": 1.5}
N_TRAIN, N_TEST = 6, 4  # pairs; KTO: each pair's chosen (desirable) and rejected (undesirable) as examples
MAX_LENGTH = 96

# Qwen3's template, cut to what decides the prompt/completion boundary: the last assistant turn opens with an empty
# thinking block, and the generation prompt holds that block only with enable_thinking=false.
QWEN3 = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Gemma's template: BOS from the template, `model` turns closed by <end_of_turn> and a newline.
GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# Mistral's: BOS from the template, no generation prompt, the answer closed by EOS.
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
# family: (its template, the special tokens the template uses, the EOS token, config changes)
SETUPS = {
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", {}),
    # Gemma 2 caps at 30; the tiny model's logits (std ~0.16 at the default initializer_range 0.02) are far below
    # that, so a cap of 1 on logits of std ~1.6 (initializer_range 0.2) makes soft-capping matter.
    "gemma2": (
        GEMMA,
        ["<start_of_turn>", "<end_of_turn>"],
        None,
        {"final_logit_softcapping": 1.0, "initializer_range": 0.2},
    ),
    # Gemma 4 loads as Gemma4ForConditionalGeneration (text only here), whose soft-cap lives in its text_config.
    "gemma4": (
        GEMMA,
        ["<start_of_turn>", "<end_of_turn>"],
        None,
        {"final_logit_softcapping": 1.0, "initializer_range": 0.2},
    ),
    # A large coefficient, so that a router loss leaking into the objective would be far outside the tolerances.
    "mixtral": (MISTRAL, [], None, {"router_aux_loss_coef": 1.0}),
}
# Which copy gets the noise in the KTO comparison: it decides the sign of the KL estimate, which TRL clamps at 0;
# the side that gives these tiny models a positive estimate, so that the KL term is exercised (asserted below).
KTO_NOISY = {"qwen3": "ref", "gemma2": "policy", "gemma4": "ref", "mixtral": "ref"}
CHAIN = {"hidden": HIDDEN, "intermediate": FFN, "layers": LAYERS, "seq": MAX_LENGTH}


def logps_tol(vocab: int, scale: float) -> float:
    """fp32 sums of up to MAX_LENGTH token log-probs of magnitude `scale` in two summation orders (chunked head vs
    full logits, per-document vs whole-row attention): tests/tolerance.py's bound over the decoder's chain."""
    return tol(torch.float32, decoder_chain(**CHAIN, vocab=vocab, tokens=MAX_LENGTH), scale)


def _with_template_kwargs(path: Path, key: str = "prompt") -> None:
    """Give every row TRL's `chat_template_kwargs`, alternating enable_thinking: both boundaries of the Qwen3 template
    (other templates ignore the variable)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for i, row in enumerate(rows):
        assert key in row
        row["chat_template_kwargs"] = {"enable_thinking": i % 2 == 0}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_kto(pairs: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = []
        for line in (pairs / f"{split}.jsonl").read_text().splitlines():
            p = json.loads(line)
            rows += [
                {"prompt": p["prompt"], "completion": p["chosen"], "label": True},
                {"prompt": p["prompt"], "completion": p["rejected"], "label": False},
            ]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        _with_template_kwargs(out / f"{split}.jsonl")
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preference-families")
    pairs = write_preference_dataset(root / "pairs", n_train=N_TRAIN, n_test=N_TEST, seed=5, conversational=True)
    for split in ("train", "test"):
        _with_template_kwargs(pairs / f"{split}.jsonl")
    kto = _write_kto(pairs, root / "kto")
    for name, (template, special, eos, changes) in SETUPS.items():
        tok = build_tokenizer(root / name, vocab_size=600)
        if special:
            tok.add_special_tokens({"additional_special_tokens": special})
        if eos:
            tok.eos_token = eos
        tok.chat_template = template
        tok.save_pretrained(str(root / name))
        family = FAMILIES[name]  # Gemma 4: Gemma4ForConditionalGeneration, changes in its text_config
        build_family_model(replace(family, kwargs={**family.kwargs, **changes}), root / name, len(tok))
    return {"root": root, "pairs": pairs, "kto": kto}


def _tokenizer(model_dir: Path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    setup_tokenizer(tok, "auto")  # the family's own template; pad = EOS, as TRL sets it
    return tok


def _models(model_dir: Path, noisy: str):
    """(policy, reference): the family's model and a copy with seeded noise on every weight (`noisy` says which),
    so that rewards, margins and (for KTO) the KL estimate are not trivially zero."""
    models = {k: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for k in ("policy", "ref")}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in models[noisy].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return models["policy"], models["ref"]


def _setup(root: str, family: str, objective: str) -> tuple:
    """(tokenizer, policy, reference, shardtune's train split, the objective's knobs) of the first-step comparison."""
    model_dir, data = Path(root) / family, Path(root) / ("pairs" if objective == "dpo" else "kto")
    tok = _tokenizer(model_dir)
    knobs = {"beta": BETA, "loss_type": "sigmoid", "simpo_gamma": 0.5}
    if objective == "dpo":
        policy, ref = _models(model_dir, noisy="policy")
        train, _ = build_pairs(tok, data, splits="train", max_length=MAX_LENGTH)
    else:
        policy, ref = _models(model_dir, noisy=KTO_NOISY[family])
        train, _ = build_pairs(tok, data, splits="train", max_length=MAX_LENGTH, kto_group=N_TRAIN)
        knobs.update(KTO_WEIGHTS)
    return tok, policy, ref, train, knobs


def shardtune_side(root: str, family: str, objective: str, setup: tuple | None = None) -> dict:
    """shardtune's first-step metrics (the negative control runs this in a subprocess with planted sources)."""
    tok, policy, ref, train, knobs = setup or _setup(root, family, objective)
    objective = build_objective(objective, **knobs)
    return shardtune_first_step(objective, policy, ref, train, batch_size=N_TRAIN, pad_id=tok.pad_token_id)


@functools.cache
def _first_steps(root: str, family: str, objective: str, trl_coef: float | None) -> tuple[dict, dict]:
    """(shardtune's, TRL's) first-step metrics on the first N_TRAIN pairs (KTO: examples) of the conversational set.
    trl_coef: TRL's router_aux_loss_coef (None: its default, the config's coefficient)."""
    setup = _setup(root, family, objective)
    ours = shardtune_side(root, family, objective, setup)
    tok, policy, ref, _, _ = setup
    if objective == "dpo":
        config, trainer = {"loss_type": ["sigmoid"]}, (trl.DPOTrainer, trl.DPOConfig)
    else:
        config, trainer = dict(KTO_WEIGHTS), (trl.KTOTrainer, trl.KTOConfig)
    if trl_coef is not None:
        config["router_aux_loss_coef"] = trl_coef
    data = Path(root) / ("pairs" if objective == "dpo" else "kto")
    theirs = trl_first_step(
        *trainer, policy=policy, ref=ref, data=data / "train.jsonl", tok=tok, batch_size=N_TRAIN,
        out=Path(root) / f"trl-{family}-{objective}", beta=BETA, max_length=MAX_LENGTH, **config,
    )  # fmt: skip
    return ours, theirs


def _assert_equals_trl(ours: dict, theirs: dict, vocab: int, objective: str) -> None:
    t = logps_tol(vocab, max(abs(theirs["logps/chosen"]), abs(theirs["logps/rejected"])))
    # Rewards are β × (log π − log ref): two sums, each within t. DPO's loss moves at most as much as β times the
    # margin's four sums; KTO's (λ · σ' ≤ λ/4 times β · (ratio + KL), each two sums) at most λ_max · β · t.
    bounds = {"logps/chosen": t, "logps/rejected": t, "rewards/chosen": 2 * BETA * t, "rewards/rejected": 2 * BETA * t,
              "rewards/margins": 4 * BETA * t}  # fmt: skip
    if objective == "dpo":
        bounds["loss"] = 4 * BETA * t
        # a fraction of N_TRAIN pairs; TRL logs it as an fp32 mean
        assert ours["rewards/accuracies"] == pytest.approx(theirs["rewards/accuracies"], abs=torch.finfo().eps)
    else:
        bounds.update(loss=max(KTO_WEIGHTS.values()) * BETA * t, kl=2 * t)
    for key, bound in bounds.items():
        assert ours[key] == pytest.approx(theirs[key], abs=bound), key


@pytest.mark.parametrize("objective", ["dpo", "kto"])
@pytest.mark.parametrize("family", list(SETUPS))
def test_first_step_equals_trl(assets, family, objective):
    ours, theirs = _first_steps(str(assets["root"]), family, objective, None)
    assert theirs["rewards/margins"] != 0
    if objective == "kto":
        assert theirs["kl"] > 0.01  # the batch exercises the KL term
    _assert_equals_trl(ours, theirs, len(_tokenizer(assets["root"] / family)), objective)


def test_dpo_loss_without_its_reference_fails_the_trl_comparison(assets, tmp_path):
    """Negative control: DPO's loss on the policy's margin alone (the reference log-probs dropped from the loss, the
    rewards left right) differs from TRL's by far more than the bound, in shardtune's own process with the bug
    planted."""
    planted = plant(
        Edit(
            "objectives/loss.py",
            "-F.logsigmoid(beta * (chosen_ratio - rejected_ratio))",
            "-F.logsigmoid(beta * (chosen - rejected))",
        ),
        tmp_path,
    )
    code = (
        "import json, sys, shardtune; from tests.e2e.test_preference_families import shardtune_side; "
        "print(json.dumps({'file': shardtune.__file__, **shardtune_side(sys.argv[1], 'qwen3', 'dpo')}))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", **planted}
    cmd = [sys.executable, "-c", code, str(assets["root"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ours.pop("file").startswith(str(tmp_path))
    _, theirs = _first_steps(str(assets["root"]), "qwen3", "dpo", None)
    # The log-probs and rewards (compared first) still agree: the loss alone is caught.
    with pytest.raises(AssertionError, match=r"^loss\n"):
        _assert_equals_trl(ours, theirs, len(_tokenizer(assets["root"] / "qwen3")), "dpo")


@pytest.mark.parametrize("family", ["gemma2", "gemma4"])
def test_soft_capping_is_in_the_logps(assets, family):
    """The policy's and the reference's log-probs use the soft-capped logits of the model's own forward (Gemma 4:
    Gemma4ForConditionalGeneration, the cap in its text_config); without the cap they would differ by far more than
    the tolerance."""
    model_dir = assets["root"] / family
    tok = _tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    train, _ = build_pairs(tok, assets["pairs"], splits="train", max_length=MAX_LENGTH)
    batch = next(iter(train.iterate(batch_size=2, rank=0, world_size=1, epoch=0, seed=0, shuffle=False, pad_id=0)))
    head = CausalLMForTraining(model, chunk_size=16)
    with torch.no_grad():
        ours = head(batch["input_ids"], batch["position_ids"], batch["labels"], head=sequence_logps)[0]
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
        labels = batch["labels"]
        token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        theirs = (token * (labels != -100)).sum(-1)
        head._transform = lambda z: z  # the raw head, without the cap
        uncapped = head(batch["input_ids"], batch["position_ids"], batch["labels"], head=sequence_logps)[0]
    t = logps_tol(len(tok), float(theirs.abs().max()))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=t)
    assert float((uncapped - theirs).abs().min()) > 10 * t


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_mixture_of_experts_trains_with_the_router_loss(assets, objective):
    """shardtune's DPO and KTO losses add the config's coefficient (1.0 here) times the router load-balancing loss
    of the policy's forward over the rows' real tokens, as TRL's default does: the aux losses agree to fp32 rounding,
    and so do the losses. TRL with router_aux_loss_coef=0 (the loss without the term) is far outside the bound."""
    root = str(assets["root"])
    ours, default = _first_steps(root, "mixtral", objective, None)
    _, without = _first_steps(root, "mixtral", objective, 0.0)
    assert "aux_loss" not in without and default["aux_loss"] > 0.1
    # The aux is a mean over the batch's routed tokens (at most 2·N_TRAIN rows of MAX_LENGTH) of softmaxed fp32
    # router logits: fp32 rounding of sums of that many terms, from logits that two forwards sum alike.
    assert ours["aux_loss"] == pytest.approx(default["aux_loss"], rel=tol(torch.float32, 2 * N_TRAIN * MAX_LENGTH))
    t = logps_tol(len(_tokenizer(assets["root"] / "mixtral")), abs(default["logps/chosen"]))
    assert ours["loss"] == pytest.approx(default["loss"], abs=4 * BETA * t)
    assert abs(ours["loss"] - without["loss"]) > 100 * BETA * t
    mixtral = family_router_aux(AutoModelForCausalLM.from_pretrained(assets["root"] / "mixtral"))
    assert "the loss adds 1.0 (the config's) x the router load-balancing loss" in log_line(mixtral)
    assert family_router_aux(AutoModelForCausalLM.from_pretrained(assets["root"] / "qwen3")) is None


def test_chat_template_kwargs_move_the_empty_thinking_block_into_the_prompt(assets):
    from shardtune.data.preference import tokenize_pair, tokenize_unpaired

    tok = _tokenizer(assets["root"] / "qwen3")
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    pair = json.loads((assets["pairs"] / "train.jsonl").read_text().splitlines()[1])
    assert pair["chat_template_kwargs"] == {"enable_thinking": False}
    prompt, chosen, _ = tokenize_pair(tok, pair, "train", 1, False)
    assert prompt[-len(think) :] == think and chosen[: len(think)] != think
    thinking = {**pair, "chat_template_kwargs": {"enable_thinking": True}}
    prompt, chosen, _ = tokenize_pair(tok, thinking, "train", 1, False)
    assert chosen[: len(think)] == think  # TRL's default boundary: the block is part of the completion
    example = {"prompt": pair["prompt"], "completion": pair["chosen"], "label": True, "tools": "[]",
               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    prompt, completion, _ = tokenize_unpaired(tok, example, "train", 0, False)
    assert prompt[-len(think) :] == think and completion[: len(think)] != think
    with pytest.raises(ValueError, match="row 3: `chat_template_kwargs` must be a mapping"):
        tokenize_pair(tok, {**pair, "chat_template_kwargs": "enable_thinking"}, "train", 3, False)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_tied_reference_with_trained_new_tokens_is_the_base(assets, family):
    """LoRA on a tied-embeddings model with 4 new tokens, whose rows PEFT trains on the embedding and the tied head:
    with every trainable weight moved, the adapter-disabled reference is still the base (transformers' forward)."""
    from shardtune.models.builder import ModelSpec, build_training_module
    from shardtune.parallel.adapters import disabled_adapter

    model_dir = assets["root"] / family
    n = len(AutoTokenizer.from_pretrained(model_dir))
    spec = ModelSpec(model_name_or_path=str(model_dir), dtype=torch.float32, n_tokens=n + 4,
                     new_token_ids=list(range(n, n + 4)), lora_r=4)  # fmt: skip
    torch.manual_seed(0)
    model, _ = build_training_module(spec, on_meta=False, quantize_device=None)
    base = model.model.get_base_model()
    # Tied: one set of trained rows, on the embedding, that the head (wrapped by PEFT too) shares.
    deltas = [n for n, p in model.named_parameters() if p.requires_grad and "trainable_tokens_delta" in n]
    assert base.config.tie_word_embeddings and len(deltas) == 1 and ".embed_tokens." in deltas[0]
    assert type(base.get_output_embeddings()).__name__ == "TrainableTokensWrapper"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, n + 4, (2, 24), generator=g)  # new tokens included
    pos, labels = torch.arange(24).expand(2, 24), ids.roll(-1, 1)
    labels[:, -1], labels[:, :6] = -100, -100
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        policy = model(ids, pos, labels, head=sequence_logps)[0]
        with disabled_adapter(model):
            ref = model(ids, pos, labels, head=sequence_logps)[0]
            logits = model.model(input_ids=ids, position_ids=pos).logits.float()
    token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    truth = (token * (labels != -100)).sum(-1)
    t = logps_tol(n + 4, float(truth.abs().max()))
    torch.testing.assert_close(ref, truth, rtol=0, atol=t)
    assert float((policy - truth).abs().min()) > 10 * t  # the trained rows and LoRA did move the policy


# ---------------------------------------------------------------- through the CLI

JOBS = {  # family: (objective, method)
    "qwen3": ("dpo", "lora"),  # the reference: the adapter disabled each step
    "gemma2": ("dpo", "full"),  # precomputed once, before the tied weights change
    "gemma4": ("dpo", "lora-precomputed"),  # the adapter disabled, precomputed once
    "mixtral": ("kto", "lora"),
}


def _argv(root: Path, family: str, out: Path) -> list[str]:
    """3 steps, each the whole train split in one micro-batch (so each step's logged means are over known rows), an
    eval of the test split at step 3. LoRA starts as the identity and moves slowly: a larger learning rate, so that
    the policy leaves the reference by much more than the tolerance."""
    objective, method = JOBS[family]
    per_device = N_TRAIN if objective == "dpo" else 2 * N_TRAIN
    flags = {
        "model_name_or_path": root / family, "dataset_name": root / ("pairs" if objective == "dpo" else "kto"),
        "objective": objective, "beta": BETA, "max_length": MAX_LENGTH, "chat_template_format": "auto",
        "per_device_train_batch_size": per_device, "per_device_eval_batch_size": 2 * N_TEST, "max_steps": 3,
        "learning_rate": 1e-2 if method == "full" else 5e-2, "logging_steps": 1, "save_strategy": "no",
        "eval_strategy": "steps", "eval_steps": 3,
        "seed": 3, "output_dir": out, "use_peft_lora": method != "full",
    }  # fmt: skip
    if objective == "kto":
        flags.update(KTO_WEIGHTS)
    if method != "full":
        flags.update(lora_r=4, lora_alpha=16, lora_target_modules="all-linear")
    if method == "lora-precomputed":
        flags.update(precompute_ref_log_probs=True)
    return ["train", *(x for k, v in flags.items() for x in (f"--{k}", str(v)))]


@pytest.fixture(scope="module")
def cli(assets) -> dict:
    root = assets["root"]
    jobs = [{"name": f, "argv": _argv(root, f, root / "runs" / f)} for f in JOBS]
    # Qwen3 with chatml: 4 new tokens whose rows LoRA trains on the tied embedding and head (their random first
    # rows are not in the model folder, so this run is checked against its own step 1).
    chatml = [*_argv(root, "qwen3", root / "runs" / "qwen3-chatml"), "--chat_template_format", "chatml"]
    jobs.append({"name": "qwen3-chatml", "argv": chatml})
    return {"results": run_jobs(jobs, root, nproc=1), "log": (root / "log-1.txt").read_text()}


def _base_logps(model_dir: Path, rows: list[dict], completion: str) -> list[float]:
    """transformers' log-probs of each row's completion under the base model: the prompt rendered with the
    generation prompt (and the row's template variables) is a prefix of prompt+completion, whose later tokens count."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        kw = row["chat_template_kwargs"]
        prompt = tok.apply_chat_template(row["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True,
                                         **kw)["input_ids"]  # fmt: skip
        full = tok.apply_chat_template(row["prompt"] + row[completion], tokenize=True, return_dict=True, **kw)
        ids = torch.tensor([full["input_ids"]])
        assert ids[0, : len(prompt)].tolist() == list(prompt)
        with torch.no_grad():
            token = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        out.append(float(token[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).sum()))
    return out


def _expected(root: Path, family: str, split: str) -> dict[str, float]:
    """The base model's mean log-probs of the chosen / rejected (KTO: desirable / undesirable) completions."""
    objective, _ = JOBS[family]
    rows = [json.loads(line) for line in (root / ("pairs" if objective == "dpo" else "kto") / f"{split}.jsonl")
            .read_text().splitlines()]  # fmt: skip
    if objective == "dpo":
        sides = {"chosen": _base_logps(root / family, rows, "chosen"),
                 "rejected": _base_logps(root / family, rows, "rejected")}  # fmt: skip
    else:
        sides = {side: _base_logps(root / family, [r for r in rows if r["label"] == want], "completion")
                 for side, want in (("chosen", True), ("rejected", False))}  # fmt: skip
    return {side: sum(v) / len(v) for side, v in sides.items()}


@pytest.mark.parametrize("family", list(JOBS))
def test_cli_reference_is_the_frozen_base(assets, cli, family):
    assert cli["results"][family] == 0, cli["results"][family]
    root, out = assets["root"], assets["root"] / "runs" / family
    steps = {r["step"]: r for r in train_records(out)}
    evaluated = train_records(out, "eval")[-1]
    train, test = _expected(root, family, "train"), _expected(root, family, "test")
    t = logps_tol(len(AutoTokenizer.from_pretrained(root / family)), max(map(abs, [*train.values(), *test.values()])))
    objective, _ = JOBS[family]
    # Step 1: the policy is the reference; its log-probs are the base's as transformers computes them. A mixture
    # of experts adds its config's coefficient (1.0) times the router loss, logged as aux_loss.
    router = steps[1].get("aux_loss", 0.0)
    assert (router > 0) == (family == "mixtral")
    if objective == "dpo":
        assert steps[1]["loss"] - router == pytest.approx(math.log(2), abs=1e-6)
    else:  # 1 − σ(0) = 1/2 per example, weighted
        mean_weight = (KTO_WEIGHTS["desirable_weight"] + KTO_WEIGHTS["undesirable_weight"]) / 2
        assert steps[1]["loss"] - router == pytest.approx(0.5 * mean_weight, abs=1e-6)
    for side in ("chosen", "rejected"):
        assert steps[1][f"logps/{side}"] == pytest.approx(train[side], abs=t), side
        # The reference log-probs implied by the rewards stay the base's, while by step 3 the policy has moved
        # (were the reference the current policy, the rewards would be 0).
        for record, prefix, expected in ((steps[2], "", train), (steps[3], "", train), (evaluated, "eval_", test)):
            if record is not steps[2]:
                assert abs(record[f"{prefix}rewards/{side}"]) > 10 * BETA * t, (prefix, side)
            implied = record[f"{prefix}logps/{side}"] - record[f"{prefix}rewards/{side}"] / BETA
            assert implied == pytest.approx(expected[side], abs=3 * t), (prefix, side)
    if family == "mixtral":
        assert "MixtralForCausalLM: mixture of experts; the loss adds 1.0 (the config's) x the router" in cli["log"]


def test_a_prompt_the_template_renders_otherwise_is_cut_as_trl_cuts_it_and_said(assets, monkeypatch):
    """A template whose generation prompt ends with an empty thought block that the rendered conversation drops
    (TRL's example: Gemma 4): the completion starts where the two renderings differ, as in TRL's tokens, and the
    log says how many rows lost the prompt's end, and which tokens."""
    from shardtune.data import preference

    tok = _tokenizer(assets["root"] / "gemma2")
    tok.chat_template = GEMMA.replace("'<start_of_turn>model\\n'", "'<start_of_turn>model\\n<thought></thought>'")
    said = []
    monkeypatch.setattr(preference, "warn0", said.append)
    train, _ = build_pairs(tok, assets["pairs"], splits="train", max_length=MAX_LENGTH)
    assert train.stats["prompt_ends_left_out"] == N_TRAIN and train.stats["prompt_end_example"] == "<thought></thought>"
    assert len(said) == 1 and f"in {N_TRAIN} rows the tokenized prompt is not a prefix" in said[0]
    model = AutoModelForCausalLM.from_pretrained(assets["root"] / "gemma2")
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(assets["pairs"] / "train.jsonl"), split="train")
    args = trl.DPOConfig(output_dir=str(assets["root"] / "trl-cut"), report_to="none", use_cpu=True, max_length=None)
    theirs = trl.DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok).train_dataset
    for i, row in enumerate(theirs):
        assert train.input_ids[2 * i] == row["prompt_ids"] + row["chosen_ids"]
        assert [y for y in train.labels[2 * i + 1] if y != -100] == row["rejected_ids"]


def test_cli_tied_new_token_rows_leave_the_reference_at_the_start(assets, cli):
    """LoRA DPO on 1 FSDP2 process of a tied model with trained new-token rows: the reference implied by the rewards
    of steps 2 and 3 (the same pairs: one batch per epoch) is step 1's policy, i.e. the starting model."""
    assert cli["results"]["qwen3-chatml"] == 0, cli["results"]["qwen3-chatml"]
    assert "Resized the embeddings from" in cli["log"]
    steps = {r["step"]: r for r in train_records(assets["root"] / "runs" / "qwen3-chatml")}
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    t = logps_tol(len(AutoTokenizer.from_pretrained(assets["root"] / "qwen3")) + 4, abs(steps[1]["logps/rejected"]))
    assert max(abs(steps[3]["rewards/chosen"]), abs(steps[3]["rewards/rejected"])) > 10 * BETA * t  # it moved
    for side in ("chosen", "rejected"):
        for step in (2, 3):
            implied = steps[step][f"logps/{side}"] - steps[step][f"rewards/{side}"] / BETA
            assert implied == pytest.approx(steps[1][f"logps/{side}"], abs=2 * t), (step, side)
