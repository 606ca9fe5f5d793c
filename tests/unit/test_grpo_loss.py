"""GRPO's math (shardtune.objectives.grpo) against trl 1.16's GRPOTrainer, each check with a planted bug it catches.

1. Advantages: `group_advantages` equals the advantages TRL's `_generate_and_score_completions` returns (the real
   method: it generates with a tiny model and scores with a reward function that hands back preset rewards, NaN
   for an unscorable one), for each scale_rewards, and the formula written out here.
2. Loss parity: TRL's `GRPOTrainer._compute_loss` on its layout (left-padded prompts, completions with their mask)
   and our objective on ours (right-padded prompt+completion rows, shifted labels): the loss, every parameter's
   gradient and the metrics, for each loss type with beta 0 and 0.04, old log-probs perturbed so that both clip
   bounds bite, a temperature of 0.7, and a completion masked whole (mask_truncated_completions). The
   importance-sampling correction is compared on TRL's loss with the ratio its generation step would hand it
   (that step needs vLLM: its token_truncate formula is written out here); so is the on-policy case (no old
   log-probs). A micro-batch with no completion token still reaches every parameter (zero gradients).
3. Global normalisation: 2 simulated ranks × 2 micro-batches (a filler row, unequal tokens) give the loss and
   gradient of one micro-batch of all rows, for each loss type.
4. The KL estimator's sign: k3 of (log π − ref) instead of (ref − log π) moves the loss beyond the tolerance.

Planted bugs are edits of the real source of objectives/grpo.py (the text must occur once, as tests/mutation.py's),
written to a file and loaded in-process as a separate module, so that a control whose target changes stops with an
error instead of planting nothing.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives import grpo
from shardtune.objectives.loss import OBJECTIVES, build_objective
from tests.tolerance import decoder_chain, tol_rounding

trl = pytest.importorskip("trl")

VOCAB, PAD, EOS = 64, 1, 2
HIDDEN, INTERMEDIATE, LAYERS = 32, 64, 2
MAX_COMPLETION = 8
TEMPERATURE = 0.7
EPSILON, EPSILON_HIGH = 0.2, 0.28
# Two prompts (lengths 3 and 5) × 3 generations; completion lengths, the first one truncated and masked whole.
NUM_GENERATIONS = 3
PROMPT_LENGTHS = (3, 5)
COMPLETION_LENGTHS = (8, 3, 6, 8, 2, 5)
MASKED_ROW = 0
SEQ = max(PROMPT_LENGTHS) + MAX_COMPLETION
TOKENS = sum(n for r, n in enumerate(COMPLETION_LENGTHS) if r != MASKED_ROW)  # 24 completion tokens that count


# --------------------------------------------------------------------------- planted bugs


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """planted(old, new): objectives/grpo.py with `old` (found exactly once) replaced by `new`, written to a file of
    its own and loaded as a module of its own (its imports are the real shardtune's)."""
    folder, modules = tmp_path_factory.mktemp("planted"), {}

    def load(old: str, new: str):
        if (old, new) not in modules:
            source = Path(grpo.__file__).read_text()
            assert source.count(old) == 1, f"the planted edit finds {source.count(old)} copies of {old!r}"
            path = folder / f"planted_grpo_{len(modules)}.py"
            path.write_text(source.replace(old, new))
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)  # dataclasses look it up
            real = OBJECTIVES["grpo"]
            try:
                spec.loader.exec_module(module)
            finally:
                OBJECTIVES["grpo"] = real  # the planted copy registers itself: the registry keeps the real one
            modules[old, new] = module
        return modules[old, new]

    return load


# --------------------------------------------------------------------------- tiny model, tokenizer, batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny fp32 Llama (hidden 32, 2 layers, 64 tokens) and a word-level tokenizer of its 64 ids ("t0".."t63"),
    saved locally: nothing comes from the hub."""
    out = tmp_path_factory.mktemp("tiny_grpo")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1", eos_token="t2")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=3, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).float().save_pretrained(out)
    return out


def _head_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    objective = grpo.GRPOObjective(**_knobs("grpo", 0.0))
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    with torch.no_grad():
        return CausalLMForTraining(model, chunk_size=8)(**inputs, head=objective.head)


@pytest.fixture(scope="module")
def rows(model_dir) -> dict:
    """The same completions in both layouts: TRL's (`trl`: prompt_ids left-padded, completion_ids with their mask,
    [B, C] log-probs) and ours (`ours`: prompt+completion rows right-padded, labels shifted, [B, T] log-probs)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=g) for n in PROMPT_LENGTHS]
    n_rows, width = len(COMPLETION_LENGTHS), max(PROMPT_LENGTHS)
    prompt_ids = torch.full((n_rows, width), PAD)
    prompt_mask = torch.zeros(n_rows, width, dtype=torch.long)
    completion_ids = torch.full((n_rows, MAX_COMPLETION), PAD)
    completion_mask = torch.zeros(n_rows, MAX_COMPLETION, dtype=torch.long)
    ours = {k: torch.full((n_rows, SEQ), v) for k, v in (("input_ids", PAD), ("position_ids", 0), ("labels", -100))}
    starts = []
    for r, n in enumerate(COMPLETION_LENGTHS):
        prompt = prompts[r // NUM_GENERATIONS]
        completion = torch.randint(4, VOCAB, (n,), generator=g)
        if n < MAX_COMPLETION:
            completion[-1] = EOS  # a finished completion ends with EOS; the truncated one does not
        p = len(prompt)
        prompt_ids[r, width - p :], prompt_mask[r, width - p :] = prompt, 1
        completion_ids[r, :n], completion_mask[r, :n] = completion, int(r != MASKED_ROW)
        ours["input_ids"][r, : p + n] = torch.cat([prompt, completion])
        ours["position_ids"][r, : p + n] = torch.arange(p + n)
        if r != MASKED_ROW:
            ours["labels"][r, p - 1 : p - 1 + n] = completion
        starts.append(p - 1)
    rewards = torch.randn(n_rows, generator=g)
    advantages, _ = grpo.group_advantages(rewards, NUM_GENERATIONS, "group")
    ours.update(advantages=advantages, row_valid=torch.ones(n_rows, dtype=torch.bool))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    current, _ = _head_logps(model, ours)
    mask = ours["labels"] != -100
    # Old log-probs off by up to ±0.4 (ratios 0.67..1.5: both clip bounds bite), the reference by more.
    old = torch.where(mask, current + (torch.rand(current.shape, generator=g) - 0.5) * 0.8, 0.0)
    ref = torch.where(mask, current + torch.randn(current.shape, generator=g) * 0.5, 0.0)
    sampling = torch.where(mask, old + torch.randn(current.shape, generator=g) * 0.6, 0.0)
    ours.update(old_logps=old, ref_logps=ref, sampling_logps=sampling)
    to_trl = _completion_view(starts, completion_mask)
    trl_rows = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": advantages, "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": to_trl(old), "ref_per_token_logps": to_trl(ref),
        "sampling_per_token_logps": to_trl(sampling),
    }  # fmt: skip
    return {"ours": ours, "trl": trl_rows, "tokens": int(mask.sum())}


def _completion_view(starts: list[int], completion_mask: torch.Tensor):
    """Our [B, T] label-aligned values as TRL's [B, C] completion-aligned ones (0 off the completion mask)."""

    def view(x: torch.Tensor) -> torch.Tensor:
        out = torch.stack([x[r, s : s + MAX_COMPLETION] for r, s in enumerate(starts)])
        return torch.where(completion_mask.bool(), out, 0.0)

    return view


def _knobs(loss_type: str, beta: float, cap: float | None = None) -> dict:
    return {
        "beta": beta, "loss_type": loss_type, "epsilon": EPSILON, "epsilon_high": EPSILON_HIGH,
        "max_completion_length": MAX_COMPLETION, "temperature": TEMPERATURE, "importance_sampling_cap": cap,
    }  # fmt: skip


# --------------------------------------------------------------------------- TRL's side and ours


def _preset_reward(prompts, completions, reward, **_):
    """The reward each input row carries (None: unscorable), whatever was generated."""
    return [None if math.isnan(r) else r for r in reward]


def _trainer(model_dir: Path, out: Path, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer

    n_rows = config.pop("rows", len(COMPLETION_LENGTHS))
    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=n_rows, num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", model_init_kwargs={"dtype": "float32"},
        **config,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=str(model_dir), reward_funcs=_preset_reward, args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
        train_dataset=Dataset.from_dict({"prompt": ["t4"] * n_rows}),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which does not run here
    trainer.model.train()
    return trainer


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _trl_step(trainer, inputs: dict) -> dict:
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": float(loss.detach()), "grads": _grads(trainer.model), "metrics": metrics, "model": trainer.model}


def _our_step(objective, model, batch: dict) -> dict:
    module = CausalLMForTraining(model, chunk_size=8)  # several chunks of the 24 completion tokens
    module.train()
    totals = objective.counts(batch)
    loss, sums = objective.step(module, batch, totals, grad_scale=1.0)
    loss.backward()
    metrics = objective.report({k: float(v) for k, v in sums.items()}, totals)
    return {"loss": float(loss.detach()), "grads": _grads(model), "metrics": metrics}


def _our_batch(rows: dict, beta: float, cap: float | None) -> dict:
    drop = {"ref_logps"} if beta == 0 else set()
    drop |= {"sampling_logps"} if cap is None else set()
    return {k: v for k, v in rows["ours"].items() if k not in drop}


def _trl_inputs(rows: dict, beta: float, cap: float | None) -> dict:
    inputs = {k: v for k, v in rows["trl"].items() if k != "sampling_per_token_logps"}
    if beta == 0:
        del inputs["ref_per_token_logps"]
    if cap is not None:  # _generate_and_score_completions, vllm_importance_sampling_mode token_truncate
        t, mask = rows["trl"], rows["trl"]["completion_mask"]
        diff = torch.nan_to_num((t["old_per_token_logps"] - t["sampling_per_token_logps"]) * mask, nan=0.0)
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp(diff), min=None, max=cap)
    return inputs


@pytest.fixture(scope="module")
def trl_result(model_dir, rows, tmp_path_factory):
    """TRL's loss, gradients and metrics for (loss_type, beta, cap), each computed once."""
    cache = {}

    def get(loss_type: str, beta: float, cap: float | None = None, *, on_policy: bool = False) -> dict:
        key = (loss_type, beta, cap, on_policy)
        if key not in cache:
            trainer = _trainer(model_dir, tmp_path_factory.mktemp("trl"), loss_type=loss_type, beta=beta)
            # Its IS correction runs with vLLM only; the flag is what _compute_loss reads, the ratio is an input.
            trainer.use_vllm = cap is not None
            inputs = _trl_inputs(rows, beta, cap)
            if on_policy:  # no old log-probs: TRL uses the current ones, detached
                del inputs["old_per_token_logps"]
            cache[key] = _trl_step(trainer, inputs)
        return cache[key]

    return get


# Tolerances (tests/tolerance.py's statistical model, fp32): the loss is a (weighted) mean over the 24 completion
# tokens of values each computed through a chain of FORWARD sums (the tiny decoder over 13 positions, the softmax
# over 64 logits, the sum over tokens), in another order on each side (left- vs right-padded rows, other
# absolute RoPE positions, TRL's fused head vs our chunked one): 8σ = tol_rounding(fp32, FORWARD, n=24) = 2.2e-6,
# relative. A gradient element is a sum over the tokens whose terms cancel, so its error is the chain's own
# (forward and back): 8σ = tol_rounding(fp32, BACKWARD) = 1.5e-5 of the tensor's largest |gradient|.
# Measured (AMD EPYC, torch 2.13 CPU): the loss within 0.03 of its tolerance (6e-8 relative), the gradients within
# 0.05 of theirs (7.5e-7 of their scale); every planted bug below moves one of them by more than 400 tolerances.
FORWARD = decoder_chain(hidden=HIDDEN, intermediate=INTERMEDIATE, layers=LAYERS, seq=SEQ, vocab=VOCAB, tokens=TOKENS)
BACKWARD = decoder_chain(
    hidden=HIDDEN, intermediate=INTERMEDIATE, layers=LAYERS, seq=SEQ, vocab=VOCAB, tokens=TOKENS, backward=True
)
LOSS_TOL = tol_rounding(torch.float32, FORWARD, n=TOKENS)
GRAD_TOL = tol_rounding(torch.float32, BACKWARD)


def _loss_off(ours: dict, theirs: dict) -> float:
    """|Δ loss| in units of the loss tolerance."""
    return abs(ours["loss"] - theirs["loss"]) / (LOSS_TOL * max(abs(theirs["loss"]), 1.0))


def _grads_off(ours: dict, theirs: dict) -> float:
    """The largest |Δ gradient| in units of the gradient tolerance (each tensor's own scale)."""
    return max(float((ours["grads"][n] - g).abs().max() / (GRAD_TOL * g.abs().max()))
               for n, g in theirs["grads"].items())  # fmt: skip


def _assert_close(ours: dict, theirs: dict, *, metrics: tuple[str, ...]) -> None:
    assert _loss_off(ours, theirs) <= 1, (ours["loss"], theirs["loss"])
    assert ours["grads"].keys() == theirs["grads"].keys() and all(g.abs().max() > 0 for g in theirs["grads"].values())
    assert _grads_off(ours, theirs) <= 1
    for key in metrics:
        want = theirs["metrics"][key]
        assert ours["metrics"][key] == pytest.approx(want, abs=LOSS_TOL * max(abs(want), 1.0)), key


# --------------------------------------------------------------------------- 1. advantages

# 4 groups of 3: random, equal (std 0), random, one unscorable (NaN: left out, advantage 0).
REWARDS = torch.tensor([0.3, -1.2, 0.8, 0.5, 0.5, 0.5, 2.0, 1.1, -0.4, 0.7, float("nan"), -0.9])


def _formula(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """The advantages written out: each reward minus its group's mean over its scored rewards, divided by the
    group's (or the batch's) sample std (n − 1) + 1e-4; 0 for an unscorable one."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    scored = rewards[~rewards.isnan()].double()
    for start in range(0, len(rewards), NUM_GENERATIONS):
        group = rewards[start : start + NUM_GENERATIONS].double()
        values = group[~group.isnan()]
        std = {"group": values.std(), "batch": scored.std(), "none": None}[scale]
        for i, r in enumerate(group):
            if not r.isnan():
                out[start + i] = (r - values.mean()) / (1.0 if std is None else std + 1e-4)
    return out


@pytest.fixture(scope="module")
def bessel_bug(planted):
    """The std without Bessel's correction (the population std)."""
    return planted("count / (count - 1)", "count / count")


@pytest.mark.parametrize("scale", ["group", "batch", "none", True])
def test_advantages_equal_trls(model_dir, tmp_path, scale, bessel_bug):
    trainer = _trainer(model_dir, tmp_path, rows=len(REWARDS), beta=0.0, scale_rewards=scale)
    out = trainer._generate_and_score_completions([{"prompt": "t4 t5", "reward": float(r)} for r in REWARDS])
    advantages, std = grpo.group_advantages(REWARDS, NUM_GENERATIONS, scale)
    # The same float32 operations as TRL's on 12 values: equal to a few ulp.
    torch.testing.assert_close(advantages, out["advantages"], rtol=0, atol=1e-6)
    name = "group" if scale is True else scale
    torch.testing.assert_close(advantages.double(), _formula(REWARDS, name), rtol=0, atol=1e-5)
    groups = [REWARDS[i : i + NUM_GENERATIONS] for i in range(0, len(REWARDS), NUM_GENERATIONS)]
    want = torch.cat([g[~g.isnan()].std().expand(len(g)) for g in groups])
    torch.testing.assert_close(std, want, rtol=1e-6, atol=1e-7)
    assert std[3:6].eq(0).all() and advantages[3:6].eq(0).all() and advantages[10] == 0
    if name != "batch":  # TRL counts the rows of a zero-std group (under 'batch', of a zero batch std)
        assert trainer._metrics["train"]["frac_reward_zero_std"][-1] == pytest.approx(float(std.eq(0).float().mean()))
    # Control: the population std moves a scaled advantage by a factor sqrt(2/3) or sqrt(10/11), far beyond 1e-6.
    planted_advantages, _ = bessel_bug.group_advantages(REWARDS, NUM_GENERATIONS, scale)
    shift = float((planted_advantages - out["advantages"]).abs().max())
    assert shift > 1e-2 if name != "none" else shift == 0


# --------------------------------------------------------------------------- 2. loss parity with TRL

METRICS = ("entropy", *grpo.CLIP_METRICS)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_loss_gradients_and_metrics_equal_trls(rows, trl_result, loss_type, beta):
    theirs = trl_result(loss_type, beta)
    # A batch that tells the bounds apart: tokens clipped below (A < 0) and above (A > 0, by ε_high, not ε).
    assert theirs["metrics"]["clip_ratio/low_mean"] > 0 and theirs["metrics"]["clip_ratio/high_mean"] > 0
    ours = _our_step(grpo.GRPOObjective(**_knobs(loss_type, beta)), theirs["model"], _our_batch(rows, beta, None))
    _assert_close(ours, theirs, metrics=METRICS + (("kl",) if beta else ()))
    assert ("kl" in ours["metrics"]) == bool(beta)


def test_importance_sampling_correction_equals_trls(rows, trl_result):
    cap = 1.5
    theirs = trl_result("dapo", 0.04, cap)
    ours = _our_step(grpo.GRPOObjective(**_knobs("dapo", 0.04, cap)), theirs["model"], _our_batch(rows, 0.04, cap))
    _assert_close(ours, theirs, metrics=METRICS + ("kl",))
    # The ratio's mean over the completion tokens, as TRL's generation step logs it (one process).
    ratio = _trl_inputs(rows, 0.04, cap)["importance_sampling_ratio"][rows["trl"]["completion_mask"].bool()]
    assert (ratio == cap).any() and (ratio < 1).any()  # the cap bites, and some tokens are down-weighted
    assert ours["metrics"][grpo.IS_RATIO] == pytest.approx(float(ratio.mean()), abs=1e-6)
    assert _loss_off(ours, trl_result("dapo", 0.04)) > 100  # the correction matters on this batch


def test_without_old_logps_the_current_ones_count_as_trls(rows, trl_result):
    """On-policy (no old_logps): the ratio is 1, nothing clips, and the KL term's gradient still carries the
    ratio's (use_bias_correction_kl, TRL's default)."""
    theirs = trl_result("grpo", 0.04, on_policy=True)
    batch = {k: v for k, v in _our_batch(rows, 0.04, None).items() if k != "old_logps"}
    ours = _our_step(grpo.GRPOObjective(**_knobs("grpo", 0.04)), theirs["model"], batch)
    _assert_close(ours, theirs, metrics=METRICS + ("kl",))
    assert ours["metrics"]["clip_ratio/region_mean"] == 0


def test_a_micro_batch_without_completion_tokens_still_reaches_every_parameter(model_dir, rows):
    """Only the masked (truncated) completion: a loss of 0 whose backward reaches every parameter with a zero
    gradient, so that this rank's FSDP reduce-scatters run like the other ranks'."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = {k: v[MASKED_ROW : MASKED_ROW + 1] for k, v in rows["ours"].items()}
    for loss_type in grpo.GRPO_LOSS_TYPES:
        objective = grpo.GRPOObjective(**_knobs(loss_type, 0.04, 1.5))
        assert objective.counts(batch) == {"sequences": 1, "tokens": 0, "micro_batches": 1}
        out = _our_step(objective, model, batch)
        assert out["loss"] == 0 and out["metrics"]["kl"] == 0
        assert {n for n, _ in model.named_parameters()} == out["grads"].keys()
        assert all(g.abs().max() == 0 for g in out["grads"].values())


# Planted bugs of the per-token loss, each caught by the comparison with TRL (dapo, beta 0.04).
LOSS_BUGS = {
    "temperature not applied": ("temperature=self.temperature)", "temperature=1.0)"),
    "symmetric clip (ε for ε_high)": ("1 + self.epsilon_high)\n", "1 + self.epsilon_low)\n"),
    "KL term without the ratio": ("if self.use_bias_correction_kl:", "if False:"),
    "ratio of old over new": ("ratio = torch.exp(logps - old)", "ratio = torch.exp(old - logps)"),
}


@pytest.mark.parametrize("bug", LOSS_BUGS)
def test_a_planted_loss_bug_fails_the_trl_comparison(rows, trl_result, planted, bug):
    theirs = trl_result("dapo", 0.04)
    buggy = planted(*LOSS_BUGS[bug]).GRPOObjective(**_knobs("dapo", 0.04))
    ours = _our_step(buggy, theirs["model"], _our_batch(rows, 0.04, None))
    with pytest.raises(AssertionError):
        _assert_close(ours, theirs, metrics=METRICS + ("kl",))
    # Caught by a wide margin: the loss or the gradient moves by more than 10 tolerances.
    assert max(_loss_off(ours, theirs), _grads_off(ours, theirs)) > 10


# --------------------------------------------------------------------------- 3. global normalisation


def _with_fillers(rows: dict) -> dict:
    """The 6 rows and 2 filler rows (row_valid False; labels, a NaN advantage and wild log-probs that must count
    nowhere), ordered so that 4 micro-batches of 2 rows hold 2, 1, 2 and 1 valid rows and 3, 6, 10, 5 tokens."""
    ours = rows["ours"]
    order = torch.tensor([0, 1, 2, 1, 3, 4, 5, 4])  # positions 3 and 7: fillers copied from rows 1 and 4
    batch = {k: v[order].clone() for k, v in ours.items()}
    fill = torch.tensor([3, 7])
    batch["row_valid"][fill] = False
    batch["advantages"][fill] = float("nan")
    for key in ("old_logps", "ref_logps", "sampling_logps"):
        batch[key][fill] = 1e4
    return batch


def _micro_step(objective, module, batch: dict, parts: list[slice]) -> dict:
    """2 simulated ranks of 2 micro-batches each: totals over all 4, each step's tensor × 2 (the data-parallel
    size), the gradients averaged over the ranks as FSDP does (the sum of the 4 backwards / 2), sums added."""
    chunks = [{k: v[s] for k, v in batch.items()} for s in parts]
    counts = [objective.counts(c) for c in chunks]
    totals = {k: sum(c[k] for c in counts) for k in counts[0]}
    loss, sums = 0.0, {}
    for c in chunks:
        part, part_sums = objective.step(module, c, totals, grad_scale=2.0)
        loss = loss + part / 2
        sums = {k: sums.get(k, 0.0) + float(v) for k, v in part_sums.items()}
    loss.backward()
    model = module.model
    return {"loss": float(loss.detach()), "grads": _grads(model), "metrics": objective.report(sums, totals)}


PARTS = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
# Every rank normalising by its own micro-batches' counts: the mean of the 4 micro-batches' own means.
LOCAL_NORMALISER = (
    "loss = self.normalise(terms.loss, terms.mask, totals)",
    (
        'loss = self.normalise(terms.loss, terms.mask, {k: v * totals["micro_batches"] for k, v in '
        "self.counts(batch).items()})"
    ),
)


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_ranks_and_micro_batches_give_one_batchs_loss_and_gradient(model_dir, rows, planted, loss_type):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    module = CausalLMForTraining(model, chunk_size=8)
    batch = _with_fillers(rows)
    objective = grpo.GRPOObjective(**_knobs(loss_type, 0.04, 1.5))
    assert [objective.counts({k: v[s] for k, v in batch.items()})["tokens"] for s in PARTS] == [3, 6, 10, 5]
    whole = _our_step(objective, model, batch)
    valid_only = _our_step(objective, model, rows["ours"])  # the fillers count nowhere
    _assert_close(whole, valid_only, metrics=(*METRICS, "kl", grpo.IS_RATIO))
    split = _micro_step(objective, module, batch, PARTS)
    _assert_close(split, whole, metrics=(*METRICS, "kl", grpo.IS_RATIO))
    # Control: a per-micro-batch normaliser moves the loss by far more than the tolerance.
    local = _micro_step(planted(*LOCAL_NORMALISER).GRPOObjective(**_knobs(loss_type, 0.04, 1.5)), module, batch, PARTS)
    assert _loss_off(local, whole) > 10


# --------------------------------------------------------------------------- 4. the KL estimator's sign


@pytest.mark.parametrize("loss_type", grpo.GRPO_LOSS_TYPES)
def test_a_flipped_kl_sign_fails_the_trl_comparison(rows, trl_result, planted, loss_type):
    theirs = trl_result(loss_type, 0.04)
    flipped = planted(
        "kl = torch.exp(ref - logps) - (ref - logps) - 1", "kl = torch.exp(logps - ref) - (logps - ref) - 1"
    ).GRPOObjective(**_knobs(loss_type, 0.04))
    ours = _our_step(flipped, theirs["model"], _our_batch(rows, 0.04, None))
    # k3(x) − k3(−x) = x³/3 + ...: third order in ref − log π (σ 0.5 here), times beta; still > 10 tolerances.
    assert _loss_off(ours, theirs) > 10
    with pytest.raises(AssertionError):
        _assert_close(ours, theirs, metrics=("kl",))


def test_objective_grpo_is_built_from_the_runs_knobs():
    knobs = {"simpo_gamma": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.0}  # other objectives' knobs
    objective = build_objective("grpo", **knobs, **_knobs("bnpo", 0.04, 2.0))
    assert isinstance(objective, grpo.GRPOObjective) and objective.needs_reference
    assert (objective.loss_type, objective.epsilon_low, objective.epsilon_high) == ("bnpo", EPSILON, EPSILON_HIGH)
    assert (objective.temperature, objective.importance_sampling_cap) == (TEMPERATURE, 2.0)
    assert objective.head.keywords == {"temperature": TEMPERATURE}
    symmetric = build_objective("grpo", **{**_knobs("dapo", 0.0), "epsilon_high": None})
    assert symmetric.epsilon_high == EPSILON and not symmetric.needs_reference
    with pytest.raises(ValueError, match="loss_type 'sigmoid'"):
        build_objective("grpo", **{**_knobs("dapo", 0.0), "loss_type": "sigmoid"})
