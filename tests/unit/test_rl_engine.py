"""The `transformers` rollout engine and the sync probe on a tiny Llama with a LoRA adapter (B non-zero), fp32, one
process:

- a sampled token's log-prob as the engine reports it equals the training forward's (the GRPO loss's) log-prob of
  that token, and the engine's `score` equals the training forward on the same rows;
- a completion depends on its prompt and seed only: the same row sampled alone and inside a batch of other prompts
  (another left padding) is the same, so 2 ranks and 1 process draw the same rollouts; planted: one generator for
  the whole batch (what `model.generate` does) gives other tokens;
- top-k / top-p filtering equals transformers' own logits warpers;
- the probe passes a synced engine and stops a stale one (an engine scoring with the adapter as it was before an
  update) with one line naming the engine, the version and the gap; planted: a tolerance above the stale gap lets
  it through, so the tolerance is what catches it.

Tolerances: fp32 log-probs through the same weights by two paths (one full forward vs a KV cache, other padding):
`tests.tolerance.tol` over the decoder's reduction chain, at the scale of the log-probs compared.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardtune.models.training_module import CausalLMForTraining
from shardtune.rl import batches
from shardtune.rl.engine import SamplingSettings
from shardtune.rl.generate import TransformersEngine, filter_top_k_top_p, sample_tokens
from shardtune.rl.probe import SyncError, SyncProbe
from tests.tolerance import TINY, decoder_chain, tol

VOCAB = 96


def _model() -> CausalLMForTraining:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
        num_hidden_layers=TINY["layers"], num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="sdpa",
    )  # fmt: skip
    base = LlamaForCausalLM(config)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # an adapter that changes the model
    return CausalLMForTraining(peft, chunk_size=16)


@pytest.fixture(scope="module")
def model() -> CausalLMForTraining:
    return _model()


PROMPTS = [[1, 5, 9, 14], [2, 7], [3, 11, 13, 17, 19, 23, 29], [4, 6, 8]]
SAMPLING = SamplingSettings(max_completion_length=12, temperature=0.8, top_p=1.0, top_k=0, eos_token_ids=(0,))
# fp32 log-probs (magnitude ~ln(96) = 4.6) through the tiny decoder's chain, cached vs uncached
LOGP_TOL = tol(torch.float32, decoder_chain(**TINY, seq=20, vocab=VOCAB), scale=5.0)


def test_sampled_log_probs_and_scores_equal_the_training_forwards(model):
    engine = TransformersEngine(model, torch.device("cpu"))
    done = engine.generate(PROMPTS, [11, 12, 13, 14], SAMPLING)
    comps = [c.token_ids for c in done]
    rows = batches.completion_rows(PROMPTS, comps, pad_id=0)
    trainer = batches.unaligned(batches.trainer_logps(model, rows, SAMPLING.temperature, "cpu"), PROMPTS, comps)
    gaps = [abs(a - b) for c, t in zip(done, trainer, strict=True) for a, b in zip(c.logps, t, strict=True)]
    assert len(gaps) == sum(len(c) for c in comps) > 0
    assert max(gaps) <= LOGP_TOL, (max(gaps), LOGP_TOL)
    # the probe's side: teacher-forced through the cache at temperature 1
    at_one = batches.unaligned(batches.trainer_logps(model, rows, 1.0, "cpu"), PROMPTS, comps)
    scored = engine.score(PROMPTS, comps)
    diffs = [abs(a - b) for s, t in zip(scored, at_one, strict=True) for a, b in zip(s, t, strict=True)]
    assert max(diffs) <= LOGP_TOL, (max(diffs), LOGP_TOL)
    # a completion ends at its first EOS (kept) or is truncated at the limit
    for c in done:
        assert (c.token_ids[-1] in SAMPLING.eos_token_ids) != c.truncated or len(c.token_ids) < 12
        assert c.truncated == (len(c.token_ids) == 12 and c.token_ids[-1] not in SAMPLING.eos_token_ids)


def test_a_completion_depends_on_its_prompt_and_seed_not_on_its_batch(model):
    engine = TransformersEngine(model, torch.device("cpu"))
    alone = engine.generate([PROMPTS[2]], [99], SAMPLING)[0]
    batched = engine.generate(PROMPTS, [1, 2, 99, 3], SAMPLING)[2]
    assert alone.token_ids == batched.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logps, batched.logps, strict=True)) <= LOGP_TOL
    other_seed = engine.generate([PROMPTS[2]], [100], SAMPLING)[0]
    assert other_seed.token_ids != alone.token_ids


def test_planted_one_generator_for_the_batch_draws_other_tokens(model, monkeypatch):
    """What `model.generate` does (one RNG stream for the whole batch): a row's tokens then depend on its batch."""
    import shardtune.rl.generate as gen

    def shared(logits, generators, s):
        return sample_tokens(logits, [generators[0]] * len(generators), s)

    engine = TransformersEngine(model, torch.device("cpu"))
    alone = engine.generate([PROMPTS[2]], [99], SAMPLING)[0]
    monkeypatch.setattr(gen, "sample_tokens", shared)
    batched = engine.generate(PROMPTS, [1, 2, 99, 3], SAMPLING)[2]
    assert alone.token_ids != batched.token_ids


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.7), (10, 0.5), (0, 0.999)])
def test_top_k_and_top_p_equal_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    scaled = torch.randn(6, VOCAB) * 3
    ours = filter_top_k_top_p(scaled, top_k, top_p)
    theirs = scaled.clone()
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])
    assert (~torch.isinf(ours)).sum(-1).min() >= 1


class _StaleEngine(TransformersEngine):
    """An engine that keeps the weights it had at its first sync (a server that never loaded the new adapter)."""

    def sync(self, model, version):
        if not hasattr(self, "frozen"):
            self.frozen = copy.deepcopy(model)
        self.version = version

    def score(self, prompts, completions):
        return TransformersEngine(self.frozen, self.device).score(prompts, completions)


def _step(model: CausalLMForTraining) -> None:
    """One update of the adapter (what an optimizer step does to the policy)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.05)


@pytest.mark.parametrize("tolerance", [1e-3, 10.0])
def test_the_probe_passes_a_synced_engine_and_stops_a_stale_one(tolerance):
    model = _model()
    probe = SyncProbe.from_prompts(PROMPTS, tolerance, pad_id=0)
    fresh, stale = TransformersEngine(model, torch.device("cpu")), _StaleEngine(model, torch.device("cpu"))
    for engine in (fresh, stale):
        engine.sync(model, 0)
    assert probe.check(model, fresh, 0, "cpu")["sync/probe_gap"] <= LOGP_TOL
    assert probe.check(model, stale, 0, "cpu")["sync/probe_gap"] <= LOGP_TOL  # nothing has changed yet
    _step(model)
    for engine in (fresh, stale):
        engine.sync(model, 1)
    metrics = probe.check(model, fresh, 1, "cpu")
    assert metrics["sync/probe_gap"] <= LOGP_TOL
    assert metrics["sync/probe_moved"] > 1e-2  # the update moved the probe: a stale engine can be told apart
    if tolerance > 1.0:  # planted: a tolerance above the stale engine's gap lets it through
        assert probe.check(model, stale, 1, "cpu")["sync/probe_gap"] > 1e-2
        return
    with pytest.raises(SyncError) as e:
        probe.check(model, stale, 1, "cpu")
    line = str(e.value)
    assert "'transformers'" in line and "policy version 1" in line and "\n" not in line
