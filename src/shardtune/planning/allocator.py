"""What the CUDA caching allocator reserves for a set of live tensors, by its size rules.

The rules are those of torch's c10/cuda/CUDACachingAllocator.cpp (default settings, no expandable segments, no
`roundup_power2_divisions`):

- every request is rounded up to a multiple of 512 bytes (`kMinBlockSize`); this rounded size is what
  `memory_allocated` counts;
- requests of at most 1 MiB (`kSmallSize`) come from the small pool, in 2 MiB segments (`kSmallBuffer`);
- larger requests come from the large pool: under 10 MiB (`kMinLargeAlloc`) in 20 MiB segments (`kLargeBuffer`),
  from 10 MiB on in a segment of their own, rounded up to 2 MiB (`kRoundLarge`).

`fresh_segments_overhead` is the reserved-minus-allocated of the live tensors if each pool were packed with no
cached free block: small and mid-sized requests filling their segments end to end, every large request in its
own segment. A real run reserves at least about this at its peak (a freed segment can be carved for a smaller
request, which moves the waste, not removes it) plus whatever freed blocks the step's history leaves cached
(fragmentation), which depends on the order of allocations and is measured only on a GPU (bench/gpu_checks.py,
memory_vs_plan). With expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) the large pool
grows one segment in 2 MiB pages and most of this rounding disappears.
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def block_size(nbytes: int) -> int:
    """The allocator's block for a request of `nbytes` (what memory_allocated counts)."""
    return max(MIN_BLOCK, _round_up(nbytes, MIN_BLOCK))


def fresh_segments_overhead(sizes: Iterable[int]) -> dict[str, int]:
    """{"requested", "allocated", "reserved"} bytes for live tensors of `sizes` (bytes each) under the rules above,
    each pool packed end to end with nothing else cached."""
    small = mid = large = requested = allocated = 0
    for n in sizes:
        if n <= 0:
            continue
        b = block_size(n)
        requested += n
        allocated += b
        if b <= SMALL_SIZE:
            small += b
        elif b < MIN_LARGE_ALLOC:
            mid += b
        else:
            large += _round_up(b, ROUND_LARGE)
    reserved = _round_up(small, SMALL_BUFFER) + _round_up(mid, LARGE_BUFFER) + large
    return {"requested": requested, "allocated": allocated, "reserved": reserved}
