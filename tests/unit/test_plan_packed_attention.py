"""The planner's attention terms against what shardtune's attention really keeps, on CPU.

On the fast path shardtune runs SDPA per span of whole documents (shardtune.models.fastpath.packed_sdpa_attention);
the planner's per-document terms (planning.activations.per_document_attention_bytes, span_mask_bytes) are
checked here against the tensors autograd saves in one decoder layer of a real forward of a tiny Llama with
grouped-query attention (4 query heads, 2 key heads) and LoRA on every linear, in fp32 and bf16, and against the
masks that forward holds. The counts are exact (tolerance 0: they are byte counts of whole tensors), and the
row-wide formula the planner used before for packed rows (transformers' SDPA with its 4-D mask, still right for
the trace and the family's own forward) is shown to miss them: the negative control.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shardtune.models import families, fastpath, training_module
from shardtune.objectives.heads import token_loss
from shardtune.planning import ModelShape, estimate_memory
from shardtune.planning import activations as act
from shardtune.planning.fit import plan_inputs, plan_shape, trains_per_document
from shardtune.planning.model import resolve_lora_targets
from shardtune.planning.recorder import AllocationRecorder
from shardtune.planning.report import traced_run_inputs

VOCAB, LORA_R = 301, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHORT = 64  # two short documents fill a span of fastpath.SPAN_TOKENS = 128 positions


def _config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=176, **kw)  # fmt: skip


def _training_module(dtype: torch.dtype):
    """A tiny Llama on shardtune's fast path with shardtune's SDPA, LoRA on every linear (no dropout)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(attn_implementation=fastpath.register_attention())).to(dtype).train()
    layer = model.model.layers[1]
    peft = get_peft_model(model, LoraConfig(r=LORA_R, lora_dropout=0.0, target_modules="all-linear"),
                          autocast_adapter_dtype=False)  # fmt: skip
    fastpath.use_fast_lora(peft)  # as the builder does
    return training_module.CausalLMForTraining(peft, layout=families.Layout(decoder="")), layer


def _measure(dtype: torch.dtype, docs: list[int]) -> dict:
    """One forward and backward of a row packing `docs`: the bytes autograd saves inside the second decoder layer
    (each storage once; not the parameters, nor the inputs it shares with every layer: the rotary cos and sin,
    the mask), the layer's attention mask, and the documents' span masks (fastpath.packed_documents, as the
    training module makes them). The layer's input hidden states count where the layer keeps them: in fp32 the
    input norm's fp32 copy is that tensor itself."""
    train, layer = _training_module(dtype)
    params = {p.untyped_storage().data_ptr() for p in train.parameters()}
    state: dict = {"seen": {}}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in state["inputs"]:
            state["seen"][ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def pre(mod, args, kwargs):
        shared = (*args[1:], *kwargs.values(), *kwargs.get("position_embeddings", ()))
        state["inputs"] = {t.untyped_storage().data_ptr() for t in shared if torch.is_tensor(t)}
        state["mask"] = kwargs.get("attention_mask")
        hooks.__enter__()

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True),
               layer.register_forward_hook(lambda *a, **k: hooks.__exit__(None, None, None), with_kwargs=True)]  # fmt: skip
    ids = torch.randint(0, VOCAB, (1, sum(docs)))
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    total, _ = train(ids, pos, ids, head=token_loss)
    total.backward()
    for h in handles:
        h.remove()
    spans = fastpath.packed_documents(pos)[0]
    mask = state["mask"]
    return {
        "saved": sum(state["seen"].values()),
        "row_mask": 0 if mask is None else mask.numel() * mask.element_size(),
        "span_masks": sum(s.mask.numel() for s in spans if s.mask is not None),
    }


def _planned(dtype: torch.dtype, seq_len: int, packed: bool, per_document: bool = True) -> int:
    """The planner's saved bytes per token of one layer of the model `_training_module` builds."""
    shape = ModelShape.from_config(_config())
    return act.layer_saved_bytes_per_token(
        shape,
        seq_len=seq_len,
        compute_bytes=torch.finfo(dtype).bits // 8,
        attn_implementation="sdpa",
        lora_targets=resolve_lora_targets(shape, "all-linear"),
        lora_r=LORA_R,
        masked=packed,
        per_document=per_document,
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_full_spans_of_short_documents_keep_what_the_planner_counts(dtype):
    """A row of 2048 positions in 64-position documents: 16 spans of 128 on the math kernel, each keeping its
    fp32 scaled queries, repeated keys and values and softmax output; o_proj's LoRA keeps the concatenated
    output. Per token that is the planner's bound for a row of SPAN_TOKENS positions, exactly."""
    docs = [SHORT] * 32
    got = _measure(dtype, docs)
    tokens = sum(docs)
    assert got["saved"] == tokens * _planned(dtype, fastpath.SPAN_TOKENS, packed=True)
    # the negative control: the row-wide formula (transformers' SDPA keeping a seq-wide additive mask per block)
    # misses this count by a third in bf16 and more in fp32, not by a rounding
    old = tokens * _planned(dtype, tokens, packed=True, per_document=False)
    assert abs(old / got["saved"] - 1) > 0.25
    # the masks: each span's own (128 x 128, two documents); Llama masks nothing beyond each document's causality,
    # so transformers builds no row-wide mask (fastpath.without_row_mask)
    assert got["row_mask"] == 0
    assert got["span_masks"] == act.span_mask_bytes(1, tokens, packed=True, per_document=True)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_long_document_keeps_the_rows_queries_keys_and_values(dtype):
    """One 200-position document runs on the fused kernel, which keeps its q, k and v as views of the row's
    tensors, so the whole row's stay alive beside the short spans' fp32 copies: the planner's bound. It is
    reached but for the long document's own tokens, which keep the kernel's output and logsumexp instead of a
    span's: the difference is exactly that."""
    long, docs = 200, [200] + [SHORT] * 28
    tokens = sum(docs)
    got = _measure(dtype, docs)
    planned = tokens * _planned(dtype, tokens, packed=True)
    shape, a = ModelShape.from_config(_config()), torch.finfo(dtype).bits // 8
    own = act.kernel_attention_bytes(shape, a) - a * (shape.q_dim + 2 * shape.kv_dim)  # output and logsumexp
    assert planned - got["saved"] == long * (act.math_span_bytes(shape, a, fastpath.SPAN_TOKENS) - own)
    assert got["span_masks"] <= act.span_mask_bytes(1, tokens, packed=True, per_document=True)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("seq", [96, 300])
def test_an_unpacked_row_is_one_span(dtype, seq):
    """One document per row: at most SPAN_TOKENS positions on the math kernel, more on the fused kernel (q, k, v
    at the key heads' width, output, logsumexp); either way o_proj's input is the concatenated copy. No mask."""
    got = _measure(dtype, [seq])
    assert got["saved"] == seq * _planned(dtype, seq, packed=False)
    assert got["row_mask"] == got["span_masks"] == 0


def _peak_bytes(events) -> int:
    live, sizes, peak = 0, {}, 0
    for key, nbytes, stream in events:
        if stream < 0:
            live -= sizes.pop(key, 0)
        else:
            sizes[key] = nbytes
            live += nbytes
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("packed", [True, False])
def test_building_the_mask_peaks_at_three_squares_for_a_packed_row(packed):
    """transformers' sdpa_mask ANDs the causal and the same-document comparisons: three [1, 1, seq, seq] bools at
    once for a packed row; an unpacked row needs no mask (SDPA's is_causal)."""
    from transformers.masking_utils import create_causal_mask

    config = _config()
    config._attn_implementation = fastpath.register_attention()
    docs = [SHORT] * 16 if packed else [1024]
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    embeds = torch.zeros(1, pos.shape[1], config.hidden_size)
    with AllocationRecorder("cpu").recording() as rec:
        mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                                  position_ids=pos)  # fmt: skip
    assert (mask is not None) == packed
    # beside the squares, the index vectors it broadcasts (aranges, positions, document ids: int64, seq entries
    # each; four at the peak here) are not planned: allowed up to eight
    seq = pos.shape[1]
    extra = _peak_bytes(rec.events) - act.mask_build_bytes(1, seq, 4, "sdpa", packed)
    assert 0 <= extra <= 8 * 8 * seq


def test_the_family_decides_whether_attention_runs_per_document(monkeypatch):
    """plan_shape reads the fact off the family as the builder does: Llama trains on shardtune's SDPA on the
    fast path; Gemma 2 (eager: no SDPA) and Falcon (attention classes chosen by name) do not; nor a family whose
    verdict trains its own forward."""
    from transformers import FalconConfig, Gemma2Config

    assert plan_shape(_config()).per_document_attention
    assert not plan_shape(Gemma2Config(num_hidden_layers=2)).per_document_attention
    assert not trains_per_document(FalconConfig())
    own = families.Verdict("llama", None, False, True, fastpath.ATTENTION)
    monkeypatch.setattr(families, "verdict", lambda *a: own)
    assert not trains_per_document(_config())


def test_the_run_and_the_trace_decide_it_too():
    """Compiled blocks and the trace run transformers' SDPA over whole rows: the row-wide terms, for the same
    family. On a packed row they differ from the per-document ones."""
    from shardtune.config.arguments import DataArguments, ModelArguments, RunConfig, TrainArguments
    from shardtune.config.fsdp import FSDPSettings
    from shardtune.planning.report import Launch

    model, data = ModelArguments(model_name_or_path="x"), DataArguments(packing=True, max_length=8192)

    def run(train: TrainArguments) -> RunConfig:
        return RunConfig(model, data, train, FSDPSettings())

    assert plan_inputs(run(TrainArguments()), Launch(world_size=1)).per_document_attention
    inputs = plan_inputs(run(TrainArguments(torch_compile=True)), Launch(world_size=1))
    assert not inputs.per_document_attention
    inputs = plan_inputs(run(TrainArguments()), Launch(world_size=1))
    traced = traced_run_inputs(inputs, "cuda")
    shape = plan_shape(_config())
    row_wide = estimate_memory(shape, replace(inputs, per_document_attention=False)).device["activations"]
    assert estimate_memory(shape, traced).device["activations"] == row_wide
    assert estimate_memory(shape, inputs).device["activations"] != row_wide
