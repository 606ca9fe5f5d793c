"""Packed documents decoded as rows of their own: packing for families whose mixers cannot keep documents apart.

A packed row holds several documents. Per-document attention keeps them apart for attention-only families
(shardtune.models.fastpath), but a recurrent mixer (Mamba, gated DeltaNet: Qwen3-Next, Falcon-H1, Jamba) carries its
state and its short convolution across a document's end, and attention with sinks or a family's own mask
(GPT-OSS under eager attention) attends the whole row. Rather than a per-family kernel path, `DocumentRows` lays
the micro-batch's documents out as rows of their own, [documents, longest document], runs the decoder there, so
that every mixer starts each document from a zero state and every attention (sinks included) sees one document,
and puts the outputs back in the packed layout, where the loss and the objective's heads read them as before.

The function is then, by construction, the model's on each document alone (the conformance check,
shardtune.models.families, verifies it per family on a tiny copy). The cost is the padding of each document to the
micro-batch's longest one: a document's trailing padding follows it causally and never reaches its outputs.
On CUDA the recurrent kernels' cu_seqlens would avoid that padding; this layout is the one every family has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentRows:
    """Where each document of a packed [batch, seq] micro-batch goes in the [documents, longest] layout.

    `take`: for each position of the split layout, the packed position it reads (padding repeats the document's
    last token); `back`: for each packed position, its position in the split layout; `positions`: the split
    layout's position ids (each document's own, continued over its padding)."""

    batch: int
    seq: int
    take: torch.Tensor  # [documents * longest] indices into batch * seq
    back: torch.Tensor  # [batch * seq] indices into documents * longest
    positions: torch.Tensor  # [documents, longest]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, ...] -> [documents, longest, ...]."""
        flat = x.reshape(self.batch * self.seq, *x.shape[2:])
        return flat.index_select(0, self.take).reshape(*self.shape, *x.shape[2:])

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """[documents, longest, ...] -> [batch, seq, ...]: the packed layout again."""
        n, longest = self.shape
        flat = x.reshape(n * longest, *x.shape[2:])
        return flat.index_select(0, self.back).reshape(self.batch, self.seq, *x.shape[2:])

    def join_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token outputs of the split layout ([documents * longest, ...], e.g. a layer's router logits) in
        the packed layout's token order, [batch * seq, ...]; other shapes are returned as they are."""
        n, longest = self.shape
        if x.shape[0] == n and x.ndim > 1 and x.shape[1] == longest:
            x = x.reshape(n * longest, *x.shape[2:])
        return x.index_select(0, self.back) if x.shape[0] == n * longest else x


def document_rows(position_ids: torch.Tensor) -> DocumentRows:
    """The split layout of a packed micro-batch. A document starts where the position does not follow the previous
    one (as fastpath.packed_documents and transformers' find_packed_sequence_indices read packed rows); the
    padding at a row's end, whose positions restart at 0, is a document of its own."""
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.ndim == 1:
        pos = pos[None]
    batch, seq = pos.shape
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat_starts = torch.nonzero(starts.flatten()).flatten()  # documents never cross rows: each row starts one
    lengths = torch.diff(flat_starts, append=torch.tensor([batch * seq]))
    longest = int(lengths.max())
    offset = torch.arange(longest)
    within = torch.minimum(offset[None], lengths[:, None] - 1)  # padding repeats the last token
    take = (flat_starts[:, None] + within).flatten()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    back = doc * longest + (torch.arange(batch * seq) - flat_starts[doc])
    positions = pos.flatten()[flat_starts][:, None] + offset[None]
    device = position_ids.device
    return DocumentRows(batch, seq, take.to(device), back.to(device), positions.to(device))
