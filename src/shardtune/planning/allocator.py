"""The CUDA caching allocator replayed over a traced step's history: what torch.cuda.max_memory_reserved would show.

The rules are those of torch's c10/cuda/CUDACachingAllocator.cpp (no `roundup_power2_divisions`, no
`max_split_size_mb`; with or without expandable segments):

- every request is rounded up to a multiple of 512 bytes (`kMinBlockSize`); the block handed out is what
  `memory_allocated` counts;
- requests of at most 1 MiB (`kSmallSize`) come from the small pool, in 2 MiB segments (`kSmallBuffer`);
- larger requests come from the large pool: under 10 MiB (`kMinLargeAlloc`) in 20 MiB segments (`kLargeBuffer`),
  from 10 MiB on in a segment of their own, rounded up to 2 MiB (`kRoundLarge`);
- the rest (best fit per stream, splitting, merging, expandable segments) is described on `CachingAllocator`.

planning.recorder writes the history down while planning.trace runs the step under fake tensors; bench/
allocator_replay.py replays a calibration set and tests/unit/test_allocator.py checks each rule on cases worked
by hand. What the replay cannot see: allocations inside a kernel that autograd does not dispatch (a fused
kernel's workspace), cuBLAS workspaces, and NCCL's own buffers (outside torch's allocator).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

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


def segment_size(block: int) -> int:
    """The segment cudaMalloc is asked for when no cached block fits a request of `block` bytes
    (get_allocation_size)."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(block, ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: tuple[int, bool, int]  # (stream, small pool, segment number)
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.segment[0], self.size, self.addr)


@dataclass
class Replay:
    """Peaks of a replayed allocation history: `allocated` and `reserved` as torch.cuda.max_memory_allocated and
    max_memory_reserved would report them (blocks and segments, in bytes), `requested` the largest sum of the
    bytes asked for (the tensors' own sizes, what FSDP2's memory tracker counts), and `segments` how many times
    the history asked the driver for memory (cudaMalloc, or a mapping of pages with expandable segments)."""

    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    segments: int = 0
    by_stream: dict[int, int] = field(default_factory=dict)  # reserved bytes per stream at the end
    # {stream: the largest allocated on all other streams together}: what the other streams' pools had to hold
    peak_without: dict[int, int] = field(default_factory=dict)


class CachingAllocator:
    """A replay of c10/cuda/CUDACachingAllocator.cpp's block management, with device memory to spare (nothing is
    released back to the driver, which the real allocator does only when the driver refuses memory or on
    empty_cache):

    - free blocks are kept per pool (small: blocks of at most 1 MiB, large: the rest) and ordered by (stream,
      size, address): a request takes the smallest cached block of its own stream's pool that is large enough
      (best fit; blocks never move between streams, so memory one stream frees is reusable only by that stream);
    - a block larger than the request is split, the request taking the lower part, when what remains is at least
      512 bytes in the small pool or more than 1 MiB in the large pool; otherwise the whole block is handed out
      and counts as allocated;
    - when no cached block fits, a new segment is reserved (`segment_size`);
    - a freed block merges with free neighbours of its segment.

    With `expandable=True` (expandable_segments:True in PYTORCH_ALLOC_CONF) each stream's pool is one segment
    of virtual addresses mapped in pages of 2 MiB (small pool) or 20 MiB (large pool): a request no cached block
    fits maps the pages it needs at the segment's end, merged with the free block already there (find_expandable_
    block, try_allocate_expandable_block, map_block), and any block is split when at least 512 bytes remain.

    `malloc`/`free` take a caller's key for each live allocation (the traced storages' ids)."""

    def __init__(self, expandable: bool = False) -> None:
        self.expandable = expandable
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._by_key: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[object, tuple[_Block, int]] = {}
        self._last: dict[tuple[int, bool, int], _Block] = {}  # each segment's highest block
        self._next_addr = 0
        self.allocated = self.requested = 0
        self._by_stream: dict[int, int] = {}
        self.peak = Replay()

    def malloc(self, key: object, nbytes: int, stream: int = 0) -> None:
        size = block_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, stream, small) or self._reserve(size, stream, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if (small or self.expandable) else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, block.segment, prev=block, next=block.next)
            self._link_after(block, rest)
            block.size = size
            self._insert(rest)
        block.allocated = True
        self._live[key] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes
        self._by_stream[stream] = self._by_stream.get(stream, 0) + block.size
        for s, n in self._by_stream.items():
            if self.allocated - n > self.peak.peak_without.get(s, 0):
                self.peak.peak_without[s] = self.allocated - n
        self.peak.requested = max(self.peak.requested, self.requested)
        self.peak.allocated = max(self.peak.allocated, self.allocated)

    def free(self, key: object) -> None:
        block, nbytes = self._live.pop(key)
        self.allocated -= block.size
        self._by_stream[block.segment[0]] -= block.size
        self.requested -= nbytes
        block.allocated = False
        self._insert(self._merged(block))

    def result(self) -> Replay:
        out = dataclasses.replace(self.peak, by_stream={})
        for block in self._last.values():
            while block is not None:
                out.by_stream[block.segment[0]] = out.by_stream.get(block.segment[0], 0) + block.size
                block = block.prev
        return out

    def _take_free(self, size: int, stream: int, small: bool) -> _Block | None:
        free = self._free[small]
        i = bisect.bisect_left(free, (stream, size, -1))
        if i == len(free) or free[i][0] != stream:
            return None
        return self._by_key.pop(free.pop(i))

    def _reserve(self, size: int, stream: int, small: bool) -> _Block:
        """New device memory for a request no cached block fits: a segment, or pages at the end of the stream's
        expandable segment merged with the free block there."""
        if not self.expandable:
            n = segment_size(size)
            segment = (stream, small, self.peak.segments)
            block = _Block(self._next_addr, n, segment)
            self._next_addr += n
            self._last[segment] = block
        else:
            segment = (stream, small, 0)
            tail = self._last.get(segment)
            have = tail.size if tail is not None and not tail.allocated else 0
            n = _round_up(size - have, SMALL_BUFFER if small else LARGE_BUFFER)
            end = tail.addr + tail.size if tail is not None else 0
            block = _Block(end, n, segment, prev=tail)
            if tail is not None:
                tail.next = block
            self._last[segment] = block
            block = self._merged(block)  # with the free block at the segment's end, if there is one
        self.peak.segments += 1
        self.peak.reserved += n  # nothing is released here: reserved only grows
        return block

    def _merged(self, block: _Block) -> _Block:
        """`block` merged with its free neighbours (taken off the free lists)."""
        for side in (block.prev, block.next):
            if side is None or side.allocated:
                continue
            self._remove(side)
            if side is block.prev:
                block.addr, block.prev = side.addr, side.prev
                if side.prev is not None:
                    side.prev.next = block
            else:
                block.next = side.next
                if side.next is not None:
                    side.next.prev = block
                elif self._last.get(block.segment) is side:
                    self._last[block.segment] = block
            block.size += side.size
        return block

    def _link_after(self, block: _Block, rest: _Block) -> None:
        if block.next is not None:
            block.next.prev = rest
        elif self._last.get(block.segment) is block:
            self._last[block.segment] = rest
        block.next = rest

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.segment[1]], block.key)
        self._by_key[block.key] = block

    def _remove(self, block: _Block) -> None:
        free = self._free[block.segment[1]]
        del free[bisect.bisect_left(free, block.key)]
        del self._by_key[block.key]


def replay(events: Iterable[tuple[int, int, int]], *, expandable: bool = False) -> Replay:
    """Replay a recorded history (planning.recorder: (key, bytes, stream) allocations, (key, 0, -1) frees)."""
    allocator = CachingAllocator(expandable)
    for key, nbytes, stream in events:
        if stream < 0:
            allocator.free(key)
        else:
            allocator.malloc(key, nbytes, stream)
    return allocator.result()
