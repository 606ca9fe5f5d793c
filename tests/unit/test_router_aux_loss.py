"""The SFT loss of a mixture of experts adds the router load-balancing loss as the family's own forward does: on one
micro-batch, shardtune's loss (the backward tensor and the logged number) is transformers'
`model(input_ids, labels=..., output_router_logits=True).loss`, for Mixtral, Qwen3-MoE and OLMoE, tiny and
randomly initialised; with the coefficient 0 it is the cross-entropy alone; the router weights' gradient is
transformers'. The controls show that a coefficient applied twice, or the aux loss of the wrong layers' logits,
falls outside the same tolerance."""

from __future__ import annotations

import pytest
import torch

from shardtune.models.router_aux import log_line
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.loss import Objective
from tests.tolerance import decoder_chain, tol

VOCAB, HIDDEN, FFN, LAYERS, EXPERTS, TOP_K, SEQ, ROWS, PROMPT = 100, 32, 64, 2, 4, 2, 12, 3, 4
# A coefficient that makes the term large next to the tolerance (the configs' defaults are 0.001 and 0.01).
COEF = 0.5
FAMILIES = {
    "mixtral": ("MixtralConfig", {"num_local_experts": EXPERTS}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": EXPERTS, "moe_intermediate_size": FFN, "head_dim": 8}),
    "olmoe": ("OlmoeConfig", {"num_experts": EXPERTS}),
}


def _hf_model(family: str, coef: float = COEF):
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=TOP_K, router_aux_loss_coef=coef, eos_token_id=None,
        pad_token_id=0, bos_token_id=1, **extra,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    with torch.no_grad():  # routers far from uniform, so that each layer's aux loss is its own
        for w in _router_weights(model):
            w.mul_(20.0)
    return model


def _batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """shardtune's batch (labels shifted, prompts without targets) and transformers' unshifted labels."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
    hf_labels = ids.clone()
    hf_labels[:, :PROMPT] = -100
    labels = torch.cat([hf_labels[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ).repeat(ROWS, 1)}, hf_labels


def _tolerance(scale: float) -> float:
    """Two summation orders of the CE chain, plus the aux loss's sums (over the rows of every layer, the experts)."""
    targets = ROWS * (SEQ - PROMPT)
    chain = decoder_chain(hidden=HIDDEN, intermediate=FFN, layers=LAYERS, seq=SEQ, vocab=VOCAB, tokens=targets)
    return tol(torch.float32, chain + LAYERS * ROWS * SEQ + EXPERTS, scale)


def _ours(hf, coef: float | None = None):
    """(the backward tensor, the logged metrics) of shardtune's SFT objective on the batch, one process."""
    model = CausalLMForTraining(hf, chunk_size=16, router_aux_loss_coef=coef)
    objective, (batch, _) = Objective(), _batch()
    totals = objective.counts(batch)
    loss, sums = objective.step(model, batch, totals, grad_scale=1.0)
    return loss, objective.report({k: float(v) for k, v in sums.items()}, totals)


def _theirs(hf):
    batch, hf_labels = _batch()
    return hf(input_ids=batch["input_ids"], labels=hf_labels, output_router_logits=True)


def _router_weights(hf) -> list[torch.nn.Parameter]:
    return [m.weight for m in hf.modules() if "router" in type(m).__name__.lower()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_sft_loss_is_transformers_loss_with_the_aux_term(family):
    hf = _hf_model(family)
    loss, metrics = _ours(hf)
    loss = loss.detach()
    want = _theirs(hf)
    expected, aux = float(want.loss.detach()), float(want.aux_loss.detach())
    t = _tolerance(abs(expected))
    rel = abs(float(loss) - expected) / abs(expected)
    print(f"{family}: shardtune {float(loss):.9g} transformers {expected:.9g} relative {rel:.3g} (tol {t:.3g})")
    assert abs(float(loss) - expected) <= t
    assert abs(metrics["loss"] - expected) <= t
    assert metrics["aux_loss"] == pytest.approx(aux, abs=_tolerance(aux))
    # Controls, each at least 10 tolerances away: the coefficient applied twice; the aux of the wrong logits (the
    # routers' probabilities taken for their logits: softmax applied twice).
    assert abs(float(loss) + COEF * aux - expected) > 10 * t
    probs = tuple(torch.softmax(x, dim=-1) for x in want.router_logits)
    wrong = float(want.loss - COEF * want.aux_loss) + COEF * float(_aux_func(hf)(probs, EXPERTS, TOP_K, None))
    assert abs(wrong - expected) > 10 * t


def _aux_func(hf):
    import sys

    return sys.modules[type(hf).__module__].load_balancing_loss_func


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_coefficient_zero_gives_the_cross_entropy_alone(family):
    hf = _hf_model(family)
    loss, metrics = _ours(hf, coef=0.0)
    want = _theirs(hf)
    ce = float(want.loss - COEF * want.aux_loss)
    assert abs(float(loss) - ce) <= _tolerance(abs(ce))
    assert "aux_loss" not in metrics
    assert abs(float(loss) - float(want.loss)) > 10 * _tolerance(abs(ce))  # the term was there to remove


def test_the_router_gradient_is_transformers():
    hf = _hf_model("mixtral")
    routers = _router_weights(hf)
    assert len(routers) == LAYERS
    loss, _ = _ours(hf)
    loss.backward()
    ours = [w.grad.clone() for w in routers]
    hf.zero_grad(set_to_none=True)
    _theirs(hf).loss.backward()
    for got, want in zip(ours, (w.grad for w in routers), strict=True):
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=_tolerance(float(want.abs().max())))
    hf.zero_grad(set_to_none=True)
    # Without the term the routers' gradient (from the cross-entropy through the routing weights) differs.
    loss0, _ = _ours(hf, coef=0.0)
    loss0.backward()
    assert max(float((a - w.grad).abs().max()) for a, w in zip(ours, routers, strict=True)) > 1e-6


def test_micro_batches_average_the_aux_loss():
    """Two micro-batches: CE over both batches' targets + coef × the mean of the two forwards' aux losses."""
    hf = _hf_model("olmoe")
    model, objective = CausalLMForTraining(hf, chunk_size=16), Objective()
    batch, _ = _batch()
    micro = [{k: v[:1] for k, v in batch.items()}, {k: v[1:] for k, v in batch.items()}]
    totals = {k: sum(objective.counts(b)[k] for b in micro) for k in ("targets", "micro_batches")}
    parts = [objective.step(model, b, totals, grad_scale=1.0) for b in micro]
    sums = {k: sum(float(p[1][k]) for p in parts) for k in parts[0][1]}
    metrics = objective.report(sums, totals)
    aux = [float(_theirs_rows(hf, b).aux_loss) for b in micro]
    ce = sums["loss"] / totals["targets"]
    assert metrics["aux_loss"] == pytest.approx(sum(aux) / 2, abs=_tolerance(max(aux)))
    assert metrics["loss"] == pytest.approx(ce + COEF * sum(aux) / 2, abs=_tolerance(metrics["loss"]))
    assert float(sum(p[0] for p in parts)) == pytest.approx(metrics["loss"], abs=_tolerance(metrics["loss"]))


def _theirs_rows(hf, batch):
    return hf(input_ids=batch["input_ids"], output_router_logits=True)


def test_log_line_names_the_coefficient_and_how_to_turn_it_off():
    hf = _hf_model("mixtral")
    line = log_line(CausalLMForTraining(hf).router_aux)
    assert f"{COEF} (the config's)" in line and "--router_aux_loss_coef 0" in line
    assert "--router_aux_loss_coef; the config has 0.5" in log_line(
        CausalLMForTraining(hf, router_aux_loss_coef=0.1).router_aux
    )
    assert "off" in log_line(CausalLMForTraining(hf, router_aux_loss_coef=0.0).router_aux)


def test_the_own_forward_path_adds_the_same_term():
    """A family trained through its own forward (not the fast path) reads the router logits from that forward."""
    from shardtune.models import families

    hf = _hf_model("mixtral")
    model, objective, (batch, _) = CausalLMForTraining(hf, layout=families.OWN), Objective(), _batch()
    totals = objective.counts(batch)
    loss, _ = objective.step(model, batch, totals, grad_scale=1.0)
    expected = float(_theirs(hf).loss.detach())
    assert abs(float(loss.detach()) - expected) <= _tolerance(abs(expected))
