"""The allocation history of a traced step: every storage made or freed, in order, with the stream it was made on.

FSDP2's memory tracker (shardtune.parallel.fake) reports what is alive at each moment; what the CUDA caching
allocator reserves also depends on the order in which storages come and go and on which stream makes them (its
cached blocks serve only their own stream), so `AllocationRecorder` writes that history down for
shardtune.planning.allocator to replay:

- a storage is seen when an op dispatched under the recorder first returns it (as the tracker sees storages);
  its free is seen when its Python object dies (a weak reference's callback), as CPython frees on the last
  reference, which is when a real run hands the block back to the allocator;
- `UntypedStorage.resize_` (FSDP2 frees and re-allocates a gathered parameter's storage this way) is a free of
  the old size and an allocation of the new one;
- FSDP2 runs its all-gathers and reduce-scatters under `device_handle.stream(s)`; the recorder wraps that
  context manager of the traced device's module (torch.cpu or torch.cuda) to know the current stream.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

# One event of the history: (key, bytes, stream) for an allocation, (key, 0, -1) for a free.
Event = tuple[int, int, int]


class AllocationRecorder(TorchDispatchMode):
    """Writes down the storages made and freed under it, in order (`events`, for planning.allocator.replay)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.events: list[Event] = []
        self._live: set[int] = set()
        self._keys = WeakIdKeyDictionary()  # storage -> key
        self._count = itertools.count()
        self._streams: dict[object, int] = {}  # stream -> its number in the replay (0: the default stream)
        self._current: list[int] = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self._see(storage)
        return out

    @contextlib.contextmanager
    def recording(self) -> Iterator[AllocationRecorder]:
        try:
            with self._patched_resize(), self._patched_streams(), self:
                yield self
        finally:
            self._live.clear()  # storages that outlive the recording are freed after it: not part of the history

    def _see(self, storage: torch.UntypedStorage) -> None:
        if storage in self._keys:
            return
        key = next(self._count)
        self._keys[storage] = key
        weakref.finalize(storage, self._freed, key)
        if storage.nbytes():
            self._malloc(key, storage.nbytes())

    def _malloc(self, key: int, nbytes: int) -> None:
        self._live.add(key)
        self.events.append((key, nbytes, self._current[-1]))

    def _freed(self, key: int) -> None:
        if key in self._live:
            self._live.remove(key)
            self.events.append((key, 0, -1))

    @contextlib.contextmanager
    def _patched_resize(self) -> Iterator[None]:
        original = torch.UntypedStorage.resize_
        recorder = self

        def resize_(storage, size):
            before = storage.nbytes()
            known = storage in recorder._keys
            result = original(storage, size)
            if not known:  # first seen here: its existing bytes were made before the recorder started
                recorder._see(storage)
            elif storage.nbytes() != before:
                key = recorder._keys[storage]
                recorder._freed(key)
                if storage.nbytes():
                    recorder._malloc(key, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original

    @contextlib.contextmanager
    def _patched_streams(self) -> Iterator[None]:
        handle = getattr(torch, self.device_type)
        original = handle.stream
        # Streams by value (a CUDA stream object compares by its handle; torch.cpu's by identity, and FSDP2 keeps
        # its streams for the whole run); the stream current when recording starts is the default one, 0.
        self._streams = {handle.current_stream(): 0}
        recorder = self

        @contextlib.contextmanager
        def stream(s):
            number = recorder._current[-1] if s is None else recorder._streams.setdefault(s, len(recorder._streams))
            recorder._current.append(number)
            try:
                with original(s):
                    yield
            finally:
                recorder._current.pop()

        handle.stream = stream
        try:
            yield
        finally:
            handle.stream = original

    def stream_numbers(self) -> dict[object, int]:
        """{stream: its number in the replay} for the streams the recorded code entered."""
        return dict(self._streams)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under `t`: its own, or its inner tensors' for a wrapper subclass such as DTensor (whose
    local shard is what the device holds). The same walk as torch.distributed._tools.common_utils'
    get_untyped_storages, which the tracker uses; written here because only shardtune.parallel imports
    torch.distributed (tests/unit/test_structure.py)."""
    if not is_traceable_wrapper_subclass(t):
        return [t.untyped_storage()]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, n) for n in names)
    return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
