"""The module shardtune trains computes the model's own function: on a representative slice of families (Llama;
Granite's logits_scaling; Gemma 2's soft-caps and eager attention; an MoE; Falcon-H1, a hybrid with a muP head
multiplier and Mamba mixers; GPT-OSS, eager with sinks; Llama 4, chunked attention and a decoder get_decoder()
does not find), the training module's logits and loss equal the model's own forward's, on one document and on a
packed row against each document alone, or packing is refused before weights load. The full sweep over every
registered architecture is bench/conformance.py; here each planted bug of the check's classes must be caught."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import CONFIG_MAPPING

from shardtune.config.errors import ConfigError
from shardtune.models import builder, documents, families, fastpath
from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.heads import token_loss

SLICE = ["llama", "granite", "gemma2", "qwen2_moe", "falcon_h1", "gpt_oss", "llama4_text"]
# fp32, tiny models, the same products summed in other orders: at most 5e-7 of the logits' largest magnitude on
# this slice (bench/results/conformance.json); the wrong functions below differ by 8e-4 (the smallest: Falcon-H1's
# recurrent state across documents) to more than 1e-1 (a dropped multiplier, a leak). 1e-5 keeps 20x from both.
RTOL = 1e-5


def _tiny(model_type: str, **overrides):
    config = families.tiny_config(CONFIG_MAPPING[model_type](**overrides), discriminating=True)
    return config, families.family_attention(config, fastpath.register_attention())


def _model(config, attention: str):
    with families._quiet():
        return families.build_tiny(config, attention)


def _own(model, ids, pos, attention: str) -> torch.Tensor:
    """The reference: the model's own forward in eager attention, fp32 logits [seq, vocab]."""
    model.set_attn_implementation("eager")
    try:
        return families.own_logits(model, ids, pos)
    finally:
        model.set_attn_implementation(attention)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    """Each test checks afresh; one thread, as the check itself runs (a pool costs more than these products)."""
    families._CACHE.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    families._CACHE.clear()


@pytest.mark.parametrize("model_type", SLICE)
def test_training_forward_is_the_models_own(model_type):
    config, attention = _tiny(model_type)
    model = _model(config, attention)
    train = CausalLMForTraining(model, packing=True)
    ids, pos, docs = families.probe_inputs(config.get_text_config().vocab_size)
    one_pos = torch.arange(docs[0].shape[1])[None]
    with torch.no_grad():
        want = _own(model, docs[0], one_pos, attention)
        got = train.logits(docs[0], one_pos)[0]
        loss, n = train(docs[0], one_pos, docs[0].roll(-1, 1), head=token_loss)
        alone = torch.cat([_own(model, d, torch.arange(d.shape[1])[None], attention) for d in docs])
        packed = train.logits(ids, pos)[0]
        own_packed = _own(model, ids, pos, attention)
    assert _rel(got, want) <= RTOL
    ce = F.cross_entropy(want, docs[0].roll(-1, 1)[0], reduction="sum")
    assert int(n) == docs[0].shape[1] and abs(loss.item() - ce.item()) <= RTOL * abs(ce.item())
    if train.verdict.packing_ok(train.layout):
        assert _rel(packed, alone) <= RTOL
    else:
        # Refused for a reason: the family's own forward really mixes packed documents.
        assert _rel(own_packed, alone) > 10 * RTOL


def test_conforming_families_take_the_fast_path():
    """The fast path is kept where it conforms: Granite with its logits_scaling division, Falcon-H1 with its muP
    lm_head_multiplier, Llama 4 with its decoder found by the check (get_decoder() fails on it)."""
    found = {}
    for model_type in ("granite", "falcon_h1", "llama4_text"):
        config, attention = _tiny(model_type)
        found[model_type] = CausalLMForTraining(_model(config, attention), packing=False).layout
    assert found["granite"] == families.Layout(head="/ logits_scaling")
    assert found["falcon_h1"] == families.Layout(head="x lm_head_multiplier")
    assert found["llama4_text"].path == "fast" and found["llama4_text"].decoder != ""


def test_a_dropped_head_multiplier_is_caught(monkeypatch):
    """Planted bug: the head's transforms reduced to the identity. The check then finds no fast layout and the
    module trains on the model's own forward, still the model's logits; the identity head is 2.5x off."""
    config, attention = _tiny("falcon_h1")
    model = _model(config, attention)
    ids = families.probe_inputs(config.vocab_size)[2][0]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = _own(model, ids, pos, attention)
        bare = CausalLMForTraining(model, layout=families.Layout()).logits(ids, pos)[0]
        transforms = families.head_transforms
        monkeypatch.setattr(families, "head_transforms", lambda cfg: {"identity": transforms(cfg)["identity"]})
        train = CausalLMForTraining(model)
        got = train.logits(ids, pos)[0]
    assert _rel(bare, want) > 0.1
    assert train.verdict.fast is None and train.layout.path == "own"
    assert _rel(got, want) <= RTOL


def test_a_leak_across_packed_documents_is_caught(monkeypatch):
    """Planted bug: per-document attention that runs each row as one causal span, ignoring the family's mask."""
    config, attention = _tiny("llama")
    ok = CausalLMForTraining(_model(config, attention), packing=True).verdict
    monkeypatch.setattr(
        fastpath,
        "packed_documents",
        lambda pos, span_tokens=0: tuple((fastpath.Span(pos.shape[1], None),) for _ in pos),
    )
    monkeypatch.setattr(fastpath, "_family_mask", lambda *a: None)
    families._CACHE.clear()
    train = CausalLMForTraining(_model(config, attention), packing=True)
    assert ok.fast_packing and ok.errors["fast packed"] <= RTOL
    assert not train.verdict.fast_packing and train.verdict.errors["fast packed"] > 100 * RTOL
    assert train.layout == families.OWN  # transformers' own block-diagonal mask keeps the documents apart


def test_chunked_attention_uses_the_familys_mask_within_documents(monkeypatch):
    """Llama 4's attention_chunk_size: the per-document spans take the family's mask on their diagonal block;
    planted bug: spans as plain causal attention, which the check rejects past the first chunk."""
    config, attention = _tiny("llama4_text")
    assert config.attention_chunk_size < families.DOCS[0]  # the check's document crosses a chunk boundary
    assert CausalLMForTraining(_model(config, attention), packing=False).layout.path == "fast"
    monkeypatch.setattr(fastpath, "_family_mask", lambda *a: None)
    families._CACHE.clear()
    assert CausalLMForTraining(_model(config, attention), packing=False).layout == families.OWN


@pytest.mark.parametrize(("model_type", "split"), [("llama", False), ("gpt_oss", True), ("mamba2", True)])
def test_packing_layout_is_chosen_before_weights_load(tmp_path, model_type, split):
    """A config.json alone (no weights): shardtune train's layout step keeps packed documents apart on every family,
    with per-document attention (Llama) or each document a row of its own (GPT-OSS's sinks, Mamba-2's state);
    without packing the rows are decoded as they are."""
    config, _ = _tiny(model_type)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    spec = builder.ModelSpec(str(tmp_path), torch.float32, 128, attn_impl=fastpath.register_attention(), packing=True)
    assert builder.training_layout(spec) == families.Layout(split=split)
    spec.packing = False
    assert builder.training_layout(spec) == families.Layout()


def _one_document_per_row(position_ids):
    """Planted bug: the split layout with each packed row taken as one document (state carried across them)."""
    batch, seq = position_ids.shape
    flat = torch.arange(batch * seq)
    return documents.DocumentRows(batch, seq, flat, flat, torch.arange(seq).repeat(batch, 1))


def test_a_state_carried_across_documents_is_refused(tmp_path, monkeypatch):
    """Planted bug: rows of their own that are not one document each (Mamba-2's state runs across the packed
    documents). The check measures the leak and shardtune train refuses --packing, naming the fix."""
    config, _ = _tiny("mamba2")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    monkeypatch.setattr(documents, "document_rows", _one_document_per_row)
    spec = builder.ModelSpec(str(tmp_path), torch.float32, 128, attn_impl=fastpath.register_attention(), packing=True)
    with pytest.raises(ConfigError, match="--packing: mamba2 cannot keep packed documents apart.*--packing False"):
        builder.training_layout(spec)
    assert families._CACHE and all(v.errors["split packed"] > 100 * RTOL for v in families._CACHE.values())


def test_outputs_put_back_in_the_wrong_place_are_caught(monkeypatch):
    """Planted bug: the split layout's outputs joined one position late: the check rejects the layout."""
    join = documents.DocumentRows.join
    monkeypatch.setattr(documents.DocumentRows, "join", lambda self, x: join(self, x).roll(1, dims=1))
    config, attention = _tiny("falcon_h1")
    verdict = CausalLMForTraining(_model(config, attention), packing=True).verdict
    assert not verdict.split_packing and verdict.errors["split packed"] > 100 * RTOL


def _packed_batch(vocab: int):
    """Two packed rows of several documents (the second ends with padding, a document of its own), their
    shifted labels (no target across a document's end) and each document alone."""
    g = torch.Generator().manual_seed(3)
    rows = [(11, 6, 7), (9, 12, 3)]
    ids = torch.randint(5, vocab, (2, 24), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    labels = torch.full_like(ids, -100)
    docs = []
    for b, r in enumerate(rows):
        start = 0
        for n in r:
            labels[b, start : start + n - 1] = ids[b, start + 1 : start + n]
            docs.append((ids[b : b + 1, start : start + n], labels[b : b + 1, start : start + n]))
            start += n
    return ids, pos, labels, docs


# Packed rows against each document alone, fp32, the same products batched otherwise. Measured on the three
# families below: the loss within 8e-8 relative, every gradient within 2.5e-6 of its largest element. Packed
# without the split (the state and the sinks carried across documents) the loss moves by 7e-6 (Falcon-H1) to 1e-3
# and the gradients by 0.8 to 1.7: the loss bound is 1e-6 (12x the spread, 7x under the smallest leak), the
# gradients' 1e-4 (40x the spread, thousands of times under the leak), which the leak is then checked to break.
PACKED_LOSS_RTOL, PACKED_GRAD_RTOL = 1e-6, 1e-4


def _grads(model) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    model.zero_grad()
    return out


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(_rel(got[k], want[k]) for k in want)


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_next", "falcon_h1"])
def test_packed_rows_train_each_document_alone(model_type):
    """Attention sinks (GPT-OSS, a mixture of experts) and recurrent mixers (Qwen3-Next's gated DeltaNet and experts,
    Falcon-H1's Mamba-2) on packed rows: the loss and every parameter's gradient equal the sums over each document
    alone in the model's own forward (bounds: PACKED_LOSS_RTOL, PACKED_GRAD_RTOL). The planted bug, the same rows
    decoded packed without the split, fails the same gradient comparison."""
    config, attention = _tiny(model_type)
    model = _model(config, attention).train()
    train = CausalLMForTraining(model, packing=True)
    assert train.layout.split and train.verdict.split_packing
    ids, pos, labels, docs = _packed_batch(config.get_text_config().vocab_size)
    loss, n = train(ids, pos, labels, head=token_loss)
    loss.backward()
    got = _grads(model)
    want_loss = 0.0
    for d, y in docs:
        logits = model(input_ids=d, position_ids=torch.arange(d.shape[1])[None], use_cache=False).logits[0]
        part = F.cross_entropy(logits.float(), y[0], ignore_index=-100, reduction="sum")
        part.backward()
        want_loss += part.item()
    want = _grads(model)
    assert int(n) == int((labels != -100).sum())
    assert abs(loss.item() - want_loss) <= PACKED_LOSS_RTOL * abs(want_loss)
    assert _worst(got, want) <= PACKED_GRAD_RTOL
    leaky = CausalLMForTraining(model, layout=dataclasses.replace(train.layout, split=False))
    leaky(ids, pos, labels, head=token_loss)[0].backward()
    assert _worst(_grads(model), want) > 100 * PACKED_GRAD_RTOL


def test_tiny_copy_keeps_what_sets_the_family_apart():
    """The copy is small but keeps the multipliers (the run's own values), a layer of each kind of a hybrid, and
    windows shorter than the check's documents."""
    from transformers import FalconH1Config, Qwen3NextConfig

    next_ = families.tiny_config(Qwen3NextConfig())
    kinds = set(Qwen3NextConfig().layer_types)
    assert set(next_.layer_types) == kinds and len(next_.layer_types) == next_.num_hidden_layers < 48
    assert next_.hidden_size == families.HIDDEN and next_.num_experts == families.EXPERTS
    falcon = families.tiny_config(FalconH1Config(lm_head_multiplier=25.0))
    assert falcon.lm_head_multiplier == 25.0 and falcon.hidden_size == families.HIDDEN
    assert families.tiny_config(FalconH1Config(), discriminating=True).lm_head_multiplier == 2.5
    assert families.tiny_config(CONFIG_MAPPING["mistral"](sliding_window=4096)).sliding_window < families.DOCS[0]


def test_context_parallelism_on_documents_decoded_as_rows_is_refused_naming_why(tmp_path):
    """Context parallelism splits each row over ranks, which the split layout (each document a row of its own) does
    not do yet: --context_parallel_size 2 on Mamba-2 with packing is refused before weights load, saying why; on
    Llama (per-document attention on the fast path) the same layout step accepts it."""
    for model_type, refused in (("mamba2", True), ("llama", False)):
        config, _ = _tiny(model_type)
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config.to_dict()))
        attn = fastpath.register_attention()
        spec = builder.ModelSpec(str(folder), torch.float32, 128, attn_impl=attn, packing=True, context_parallel=2)
        if refused:
            with pytest.raises(ConfigError, match="--context_parallel_size 2: mamba2's packed documents are decoded "
                               "as rows of their own.*--context_parallel_size 1"):  # fmt: skip
                builder.training_layout(spec)
        else:
            assert builder.training_layout(spec) == families.Layout()
