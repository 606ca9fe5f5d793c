"""The training module, the FSDP2 root of a run: the decoder, the family's chunked logits, and the objective's head
(shardtune.objectives.heads) run in its forward."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from shardtune.models import documents, families, fastpath, router_aux
from shardtune.runtime.log import warn0

# The chunked lm_head + cross-entropy (chunk_logits) holds one chunk's fp32 log-softmax, its gradient and the logits'
# gradient: 12 bytes per logit. Its chunk is sized in logits, not positions, so that this working set does not grow
# with the vocabulary: 2**25 logits (384 MiB for the three fp32 copies) is 1024 positions of Llama-2's 32,000-token
# vocabulary, the size the planner's traced rows were first checked at, and 256 positions of Llama-3's 128,256
# (1.47 -> 0.37 GiB on torchtune's one-GPU rows, docs/plan.md). Bounded by 1024 positions (a small vocabulary gains
# nothing from longer chunks but a larger working set) and by 64 (the head's product stays a wide matrix product).
LOSS_CHUNK_LOGITS = 2**25
LOSS_CHUNK_MAX_TOKENS = 1024
LOSS_CHUNK_MIN_TOKENS = 64


def loss_chunk_tokens(vocab_size: int) -> int:
    """Positions per chunk of the lm_head + cross-entropy for a head of `vocab_size` rows: the one rule
    models.builder.ModelSpec (None: this rule), the planner (planning.estimate) and `shardtune plan
    --loss_chunk_tokens`'s default read. A multiple of 64 positions."""
    fits = LOSS_CHUNK_LOGITS // max(int(vocab_size), 1) // 64 * 64
    return max(LOSS_CHUNK_MIN_TOKENS, min(LOSS_CHUNK_MAX_TOKENS, fits))


class CausalLMForTraining(nn.Module):
    """Wraps a (PEFT) causal LM: runs the decoder, then the objective's head (shardtune.objectives.heads) on its
    output: the output head and the loss in chunks of positions, each chunk's logits recomputed in backward, so
    full fp32 [batch, seq, vocab] logits are never held.

    That fast path is used where it is the model's own function (shardtune.models.families checks it on a tiny copy of
    the config: the decoder it calls, the head's logit transform, per-document attention); elsewhere the model's
    own forward runs (full logits) and only the loss is chunked. `layout` forces one (the check passes its
    candidates); `packing`: whether rows hold several documents (None: maybe), which the fast path must keep
    apart to be chosen.

    Labels are already shifted (labels[i] is the target of position i; -100 means none). What forward returns is
    the objective's head's (shardtune.objectives.heads: the summed loss and the number of targets, so that the
    caller normalises over the whole global batch, or per-row log-probs); with `router_aux=True` also the forward's
    router load-balancing loss (models.router_aux; None without one).
    `router_aux_loss_coef` overrides the config's coefficient of that loss (None: the config's; 0: off).
    """

    def __init__(
        self,
        model: nn.Module,
        chunk_size: int | None = None,
        per_document_attention: bool = True,
        layout: families.Layout | None = None,
        packing: bool | None = None,
        router_aux_loss_coef: float | None = None,
        cp_varlen: bool = False,
    ):
        super().__init__()
        self.model = model
        self.per_document_attention = per_document_attention  # see shardtune.models.fastpath
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.verdict = None
        if layout is None:
            self.verdict = families.verdict(base.config, base.config._attn_implementation, type(self))
            layout = self.verdict.layout(packing)
            if packing is not False and self.verdict.checked and not self.verdict.packing_ok(layout):
                # shardtune train refuses --packing here (builder.training_layout); a direct caller is told.
                warn0(f"{families.summary(self.verdict, layout, True)} Give it rows of one document each.")
        self.layout = layout
        # Plain attributes, not registered submodules: they are already registered under self.model.
        if layout.path == "fast":
            object.__setattr__(self, "_decoder", families.resolve_decoder(base, layout.decoder))
            # whether the family masks nothing beyond each document's causality (decided once: no row mask then)
            self._plain_mask = families.plain_causal(self._decoder.config)
        object.__setattr__(self, "_head", base.get_output_embeddings())
        # None: sized by the head's rows (the vocabulary after new tokens), loss_chunk_tokens's rule
        self.chunk_size = chunk_size or loss_chunk_tokens(
            getattr(self._head, "out_features", 0) or self._head.weight.shape[0]
        )
        # The family's logit transform (Granite's division by logits_scaling, a muP multiplier, Gemma's final
        # soft-capping, ...), read from the language model's config: a multimodal class loaded as a causal LM
        # (Gemma 3n and Gemma 4 are *ForConditionalGeneration) keeps it in its text_config.
        self._transform = families.head_transform(base.config, layout.head)
        self.router_aux = router_aux.family_router_aux(base, router_aux_loss_coef)  # None: a dense model
        # With context parallelism, the micro-batch's CPShard (set by shardtune.training.trainer before each
        # forward): the fast path's attention then gathers each row's keys and values over the cp ranks.
        self.cp_shard = None
        self.cp_varlen = cp_varlen  # the shard's attention as one flash-attention varlen call (models.fastpath)
        # The KV cache's keyword: transformers 5.24 renamed past_key_values to cache (the old name warns until 5.40).
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"
        )

    @property
    def router_aux_loss_coef(self) -> float:
        """The coefficient of the router load-balancing loss in the SFT loss (0: none)."""
        return self.router_aux.coef if self.router_aux is not None else 0.0

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self._decode(input_ids, position_ids).last_hidden_state

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **extra):
        # Compiled blocks take the masked path: spans that change every batch would recompile them.
        if self.cp_shard is not None:  # context parallelism: this rank's positions of each row
            extra[fastpath.DOCUMENTS_KWARG] = self.cp_shard
        elif self.per_document_attention and self._decoder.config._attn_implementation == fastpath.ATTENTION:
            extra[fastpath.DOCUMENTS_KWARG] = fastpath.packed_documents(position_ids)
        skip = fastpath.DOCUMENTS_KWARG in extra and self._plain_mask
        with fastpath.without_row_mask() if skip else contextlib.nullcontext():  # the attention reads no row mask
            return self._decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)

    def _outputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states (fast path), or the own forward's logits, which the head then leaves as they are."""
        return self._outputs_and_aux(input_ids, position_ids, False)[0]

    def _outputs_and_aux(self, input_ids: torch.Tensor, position_ids: torch.Tensor, with_aux: bool, aux_mask=None):
        """(_outputs, the router load-balancing loss or None). The router logits come from the decoder's (or the
        own forward's) output with output_router_logits, as the family's forward reads them; asked for only when
        the term is on, so that a run without it computes exactly what it did before."""
        with_aux = with_aux and self.router_aux_loss_coef > 0
        extra = {"output_router_logits": True} if with_aux else {}
        rows = None
        if self.layout.split:  # each packed document decoded as a row of its own (models.documents)
            rows = documents.document_rows(position_ids)
            input_ids, position_ids = rows.split(input_ids), rows.positions
        if self.layout.path == "fast":
            out = self._decode(input_ids, position_ids, **extra)
            h = out.last_hidden_state
        else:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
            h = out.logits
        if rows is not None:
            h = rows.join(h)
        if not with_aux:
            return h, None
        logits = getattr(out, "router_logits", None)
        if rows is not None and isinstance(logits, tuple):
            logits = tuple(rows.join_tokens(t) for t in logits)
        if self.cp_shard is not None and isinstance(logits, tuple) and logits:  # the whole rows' tokens
            mask = self.cp_shard.real() if aux_mask is None else aux_mask
            logits, aux_mask = self.cp_shard.gather_tokens(logits, mask)
        return h, self.router_aux(logits, aux_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        head=None,
        router_aux: bool = False,
        aux_mask: torch.Tensor | None = None,
        cache=None,
        attention_mask: torch.Tensor | None = None,
    ):
        """What the objective's `head` (shardtune.objectives.heads) computes from the decoder's output and the
        labels, inside the root's forward so that FSDP's hooks run; with router_aux, the router load-balancing loss
        (over aux_mask's tokens, or all) appended.

        With a KV `cache`, a generation step instead (shardtune.rl.generate): the model's own forward over the new
        positions with `attention_mask` (left-padded prompts), returning the last position's logits. It runs here,
        in the root's forward, so that the root's FSDP hooks (or one process's mixed-precision casts) run as they do
        in training: generation samples from the weights the trainer trains."""
        if cache is not None:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
            return out.logits[:, -1].clone()  # not a view: FSDP2 warns of a root output that is one
        h, aux = self._outputs_and_aux(input_ids, position_ids, router_aux, aux_mask)
        out = head(self, h, labels)
        return (*out, aux) if router_aux else out

    def chunk_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The family's fp32 logits of a chunk of hidden states, as its own forward computes them (the head's
        logit transform verified by shardtune.models.families): the one place every loss gets its logits from. On the
        own-forward path `h` already holds the model's logits."""
        if self.layout.path != "fast":
            return h.float()
        return self._transform(self._head(h).float())

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The fp32 logits the loss sees, [batch, seq, vocab] (the conformance check compares them with the
        model's own forward's)."""
        if hasattr(self, "unshard"):
            # Sharded root: calling the decoder directly skips the root's FSDP hooks, so gather its weights here.
            self.unshard()
        return self.chunk_logits(self._outputs(input_ids, position_ids))
