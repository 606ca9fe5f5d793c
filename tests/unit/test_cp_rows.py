"""What context parallelism keeps per row besides the attention: which of a rank's positions are the rows' own
(not padding added for the split), and the one-sequence rows' real tokens the router loss counts, read off the
position ids at the row positions a rank holds (shardtune.models.router_aux.sequence_mask)."""

from __future__ import annotations

import torch

from shardtune.models.router_aux import sequence_mask
from shardtune.parallel import split
from shardtune.parallel.context_parallel import local_shard


def _rows():
    # two one-sequence rows of 11 positions: 7 and 4 real tokens, padding positions restarting at 0
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
    return {"input_ids": torch.zeros_like(pos), "position_ids": pos, "labels": torch.zeros_like(pos)}


def test_a_ranks_real_tokens_are_the_whole_rows_real_tokens_at_its_positions():
    """Every rank's mask, put back at its row positions, is the 1-process mask of the whole rows; the positions
    the split pads with (11 -> 12 for 2·cp = 4 chunks) are never real."""
    batch = _rows()
    keep = torch.tensor([True, True])
    want = sequence_mask(batch["position_ids"], keep)
    assert want.sum(1).tolist() == [7, 4]
    size, full = 2, split.padded_length(11, 2)
    got = torch.full((2, full), -1)
    for rank in range(size):
        local, rows, _ = split.split(batch, size=size, rank=rank, pad_id=0)
        mine = split.zigzag(full, size, rank)
        got[:, mine] = sequence_mask(local["position_ids"], keep, mine)
        shard = local_shard(rows, local["position_ids"], None, size=size)
        real = split.CPShard(shard.rows, None, row_index=mine, length=11).real()
        assert real.tolist() == [[int(i < 11) for i in mine.tolist()]] * 2
    assert torch.equal(got[:, :11], want) and (got[:, 11:] == 0).all()


def test_without_the_row_positions_the_split_rows_lose_their_tokens():
    """The negative control: the mask read as if the rank's positions were a row of their own (the index
    0..L_local-1) marks a different set of tokens."""
    batch = _rows()
    keep = torch.tensor([True, True])
    local, _, _ = split.split(batch, size=2, rank=1, pad_id=0)
    mine = split.zigzag(12, 2, 1)
    assert not torch.equal(sequence_mask(local["position_ids"], keep), sequence_mask(local["position_ids"], keep, mine))
