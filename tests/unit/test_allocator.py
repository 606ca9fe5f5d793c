"""The caching allocator replay (shardtune.planning.allocator) against the rules of torch's
c10/cuda/CUDACachingAllocator.cpp, each case worked out by hand from those rules, and the recorder
(shardtune.planning.recorder) against a history whose allocations, frees and streams are known; and the
leave-one-out procedure of the fragmentation constant over the published rows (bench/plan_loo.py)."""

from __future__ import annotations

import torch

from bench.plan_loo import fit, leave_one_out, relative_errors, with_constant
from shardtune.planning import PlanInputs, estimate_memory
from shardtune.planning.allocator import CachingAllocator, block_size, replay, segment_size
from shardtune.planning.estimate import ALLOCATOR_OVERHEAD, SAVE_PHASE
from tests.unit.test_plan import PUBLISHED, _estimate_gib, _midpoint, _shape_and_settings

KiB, MiB = 1 << 10, 1 << 20


def _run(events, expandable: bool = False) -> CachingAllocator:
    a = CachingAllocator(expandable)
    for e in events:
        if e[0] == "free":
            a.free(e[1])
        else:
            _, key, nbytes, *stream = e
            a.malloc(key, nbytes, *stream)
    return a


def test_sizes_and_segments():
    # round_size: 512-byte blocks; get_allocation_size: 2 MiB, 20 MiB, or the request rounded to 2 MiB
    assert (block_size(1), block_size(512), block_size(513)) == (512, 512, 1024)
    a = _run([("m", 1, 1)])
    assert (a.allocated, a.peak.requested, a.peak.reserved) == (512, 1, 2 * MiB)
    assert [segment_size(n) for n in (MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB)] == [
        2 * MiB,
        20 * MiB,
        20 * MiB,
        10 * MiB,
        12 * MiB,
    ]


def test_small_requests_share_a_segment_and_mid_sized_ones_a_20_mib_one():
    a = _run([("m", i, 100 * KiB) for i in range(20)])  # 20 x 100 KiB = 1.95 MiB: one 2 MiB segment
    assert a.peak.reserved == 2 * MiB and a.peak.segments == 1
    a = _run([("m", i, 3 * MiB) for i in range(7)])  # six fit one 20 MiB segment (18 MiB), the seventh opens another
    assert a.peak.reserved == 40 * MiB and a.peak.segments == 2


def test_a_large_block_is_not_split_when_at_most_1_mib_would_remain():
    # a 12 MiB segment for 11 MiB + 1 byte; freed and asked 11 MiB again: 1 MiB would remain (not > kSmallSize),
    # so the whole 12 MiB block is handed out and counted as allocated
    a = _run([("m", 1, 11 * MiB + 1), ("free", 1), ("m", 2, 11 * MiB)])
    assert (a.allocated, a.peak.reserved, a.peak.segments) == (12 * MiB, 12 * MiB, 1)
    # asked 10 MiB instead: 2 MiB remain, the block is split and the rest stays cached
    a = _run([("m", 1, 11 * MiB + 1), ("free", 1), ("m", 2, 10 * MiB), ("m", 3, 2 * MiB)])
    assert (a.allocated, a.peak.reserved, a.peak.segments) == (12 * MiB, 12 * MiB, 1)


def test_best_fit_and_merging_of_free_neighbours():
    # two 8 MiB halves of one 20 MiB segment, then both freed: they merge with the 4 MiB tail into 20 MiB again
    a = _run([("m", 1, 8 * MiB), ("m", 2, 8 * MiB), ("free", 1), ("free", 2), ("m", 3, 19 * MiB)])
    assert (a.peak.reserved, a.peak.segments) == (20 * MiB, 1)
    # best fit: with a 30 MiB and a 12 MiB block cached, 11 MiB takes the 12 MiB one, leaving 30 MiB for 30 MiB
    a = _run([("m", 1, 30 * MiB), ("m", 2, 12 * MiB), ("free", 1), ("free", 2), ("m", 3, 11 * MiB), ("m", 4, 30 * MiB)])
    assert a.peak.reserved == 42 * MiB


def test_cached_blocks_serve_only_their_own_stream():
    a = _run([("m", 1, 64 * MiB, 1), ("free", 1), ("m", 2, 64 * MiB, 0)])
    assert a.peak.reserved == 128 * MiB
    assert a.result().by_stream == {0: 64 * MiB, 1: 64 * MiB}


def test_fragmentation_and_expandable_segments():
    # three 1 GiB blocks, the middle one kept: 2 GiB cached in two pieces cannot hold 1.5 GiB without a new
    # segment; with expandable segments the free block at the segment's end is extended by mapping 20 MiB pages
    events = [("m", 1, 1 << 30), ("m", 2, 1 << 30), ("m", 3, 1 << 30), ("free", 1), ("free", 3), ("m", 4, 3 << 29)]
    default, expandable = _run(events), _run(events, expandable=True)
    assert default.peak.reserved == (3 << 30) + (3 << 29)
    # pages mapped: 1024 MiB -> 52 (16 MiB left free at the end), 1024 - 16 -> 51 (12 left), 1024 - 12 -> 51
    # (8 left); block 3 freed merges with those 8 MiB into 1032 MiB; 1536 - 1032 -> 26 pages
    assert expandable.peak.reserved == (52 + 51 + 51 + 26) * 20 * MiB
    assert expandable.peak.reserved < default.peak.reserved


def test_peaks_by_stream():
    a = _run([("m", 1, 100 * MiB, 1), ("m", 2, 50 * MiB, 0), ("free", 1), ("m", 3, 80 * MiB, 0)])
    r = a.result()
    assert r.allocated == 150 * MiB
    # the default stream alone peaks at 130 MiB, after stream 1's block is freed
    assert r.peak_without == {1: 130 * MiB, 0: 100 * MiB}
    assert r.by_stream == {1: 100 * MiB, 0: 130 * MiB}


def test_replay_of_recorded_events_equals_the_direct_calls():
    events = [(1, 3 * MiB, 0), (2, 5 * MiB, 1), (1, 0, -1), (3, 2 * MiB, 0), (2, 0, -1)]
    direct = _run([("m", 1, 3 * MiB, 0), ("m", 2, 5 * MiB, 1), ("free", 1), ("m", 3, 2 * MiB, 0), ("free", 2)])
    assert replay(events) == direct.result()


def test_recorder_sees_allocations_frees_resizes_and_streams():
    """Storages made by ops, freed when their last reference goes, resized (as FSDP2 frees and re-allocates a
    gathered parameter) and made under `torch.cpu.stream(s)` on that stream."""
    from shardtune.planning.recorder import AllocationRecorder

    side = torch.cpu.Stream()
    rec = AllocationRecorder("cpu")
    with rec.recording():
        x = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        y = x * 2  # a new storage
        del y
        view = x[:10]  # no new storage
        with torch.cpu.stream(side):
            z = torch.empty(256, dtype=torch.float16)
        z.untyped_storage().resize_(0)
        z.untyped_storage().resize_(64)
        del x, view
    numbers = rec.stream_numbers()
    assert numbers[side] == 1
    kinds = [(nbytes, stream) for _, nbytes, stream in rec.events]
    assert kinds == [(4000, 0), (4000, 0), (0, -1), (512, 1), (0, -1), (64, 0), (0, -1)]
    keys = [k for k, _, _ in rec.events]
    assert keys[1] == keys[2] and keys[3] == keys[4] == keys[5] and keys[6] == keys[0]


# --- the fragmentation constant's leave-one-out error over the published rows (bench/plan_loo.py) ---------------


def test_leave_one_out_holds_each_row_out():
    """Worked by hand: rows A and B are best at 0.5, C at 1.0. On every row 0.5 is best (mean 0.1); without A (or
    B) 1.0 is (mean 0.1 against 0.15), so A's held-out error is its error at 1.0; without C the fit stays at 0.5."""
    grid = (0.0, 0.5, 1.0)
    errors = [[0.2, 0.0, 0.2], [0.2, 0.0, -0.2], [0.6, 0.3, 0.0]]
    assert grid[fit(errors, grid)] == 0.5
    loo = leave_one_out(errors, grid)
    assert [r["fit_without"] for r in loo] == [1.0, 1.0, 0.5]
    assert [r["held_out_error"] for r in loo] == [0.2, -0.2, 0.3]
    assert [r["in_sample_error"] for r in loo] == [0.0, 0.0, 0.3]


def test_leave_one_out_over_the_published_rows():
    """On the published rows: the errors are the estimates' with each constant (at the shipped one, the tests'
    estimate), the held-out error of a row is its estimate with the constant refitted without it, and the mean
    held-out error is at least the in-sample one (each refit is the best on the other rows, the full fit the best
    on all)."""
    grid = tuple(i / 20 for i in range(13)) + (ALLOCATOR_OVERHEAD,)  # 0 to 0.6, and the shipped constant
    errors = relative_errors(PUBLISHED, grid, with_constant)
    for pub, row in zip(PUBLISHED, errors, strict=True):
        assert row[-1] == _estimate_gib(pub) / _midpoint(pub.measured_gib) - 1
        # only reserved figures depend on the constant, and not where the checkpoint save (no fragmentation term)
        # is the peak at both ends of the grid (the guide's QLoRA run with offload)
        shape, settings = _shape_and_settings(pub)
        save_at_both = all(
            estimate_memory(shape, PlanInputs(**{**settings, "allocator_overhead": grid[k]})).peak_phase == SAVE_PHASE
            for k in (0, -2)
        )
        assert (row[0] == row[-2]) == (pub.metric == "allocated" or save_at_both), pub.name
    loo = leave_one_out(errors, grid)
    full = fit(errors, grid)
    for i, (pub, r) in enumerate(zip(PUBLISHED, loo, strict=True)):
        assert r["in_sample_error"] == errors[i][full]
        assert r["held_out_error"] == with_constant(pub, r["fit_without"]) / _midpoint(pub.measured_gib) - 1
    assert sum(abs(r["held_out_error"]) for r in loo) >= sum(abs(r["in_sample_error"]) for r in loo)
