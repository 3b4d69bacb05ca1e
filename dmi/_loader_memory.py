"""Read memory the loader reuses once nothing views it any more.

A window's records (the shuffle buffer's rows: 256 MiB of bf16 rows of width 2048 by
default) are read into one region per window (:class:`Arena`), and batches are gathered
from them. Fresh memory is mapped one page fault at a time as it is first written, and
with 4 KiB pages those faults cost more than the gather (``bench/bench_loader_window.py``;
numbers in docs/benchmarks.md). So a region asks for 2 MiB pages (:func:`map_region`), and
is lent again once the window it held is consumed: torch counts the users of a storage, and
a region is reused when the pool holds its only reference. Batches are copies of their own,
lent the same way once the training loop lets go of them; a loop that keeps its batches gets
new memory for the next ones and never pins a read region.
"""

from __future__ import annotations

import mmap
import threading

import torch

__all__ = ["Arena", "LoaderMemory", "WindowMemory", "lent", "map_region"]


class WindowMemory:
    """At most ``keep`` regions, each lent again when the pool holds its only reference.
    Windows are read ahead on several threads: taking a region is atomic. ``reused`` counts
    the takes served by a region lent again, ``mapped`` those that got new memory."""

    def __init__(self, keep: int):
        self.keep = keep
        self._regions: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.mapped = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 memory (uninitialised): a free region large enough, else a new one."""
        with self._lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> torch.Tensor:
        self._regions = [r for r in self._regions if not r.is_shared()]
        for region in self._regions:
            if region.nbytes() >= nbytes and _unused(region):
                self.reused += 1
                return lent(region, nbytes)
        region = map_region(nbytes)
        self.mapped += 1
        if len(self._regions) < self.keep:
            self._regions.append(region)
        else:
            self._replace_a_free_smaller_region(region)
        return lent(region, nbytes)

    def _replace_a_free_smaller_region(self, region: torch.UntypedStorage) -> None:
        for i, old in enumerate(self._regions):
            if old.nbytes() < region.nbytes() and _unused(old):
                self._regions[i] = region
                return


class LoaderMemory:
    """One consumer's pools: the read regions of the windows read ahead, of the one being
    consumed, and of the one before it while a batch still takes rows from both; and batches
    — the one being filled, the ones the training loop still holds (a batch of 4096 float32
    rows of width 2048 is 32 MiB, which the C allocator maps afresh, and faults in, every
    time). A loader read in its own process keeps them from one epoch to the next (freed
    with the loader), so only its first epoch maps fresh memory; a pickled copy starts empty."""

    def __init__(self, prefetch: int):
        self.prefetch = prefetch
        self.reads = WindowMemory(prefetch + 2)
        self.batches = WindowMemory(BATCHES_KEPT)

    def __reduce__(self):
        return LoaderMemory, (self.prefetch,)


BATCHES_KEPT = 4
"""Batch regions a consumer keeps to lend again: the loop's current batch, the next being
filled, and two more for a loop that holds on to a batch or two (a pipeline stage)."""


def map_region(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of fresh anonymous memory, asked to be backed by 2 MiB pages where the
    kernel offers them on request (Linux's transparent huge pages in ``madvise`` mode, a
    common default): a direct read then pins, and a batch's gather of scattered rows walks,
    512 times fewer pages (``bench/bench_loader_timeline.py``; numbers in docs/benchmarks.md)."""
    region = mmap.mmap(-1, max(nbytes, 1), **PRIVATE)
    if HUGE_PAGES is not None:
        try:
            region.madvise(HUGE_PAGES)
        except OSError:  # huge pages off or absent: the region keeps 4 KiB pages, as malloc's would
            pass
    return torch.frombuffer(region, dtype=torch.uint8).untyped_storage()


HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)
"""The advice that asks for transparent huge pages (Linux only; ``None`` elsewhere)."""

PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
"""Process-private anonymous memory, as malloc's (an anonymous ``mmap`` is shared by default,
and shared memory takes its huge pages from a different, usually disabled, setting)."""


def lent(region: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """The first ``nbytes`` of ``region`` (all of it by default) as a uint8 tensor using it."""
    nbytes = region.nbytes() if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8).set_(region, 0, (nbytes,), (1,))


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""torch's count of a storage's users (private; where a torch lacks it, nothing is lent again)."""


def _unused(region: torch.UntypedStorage) -> bool:
    """Whether the pool's own reference is the only one: no tensor, view or batch uses it."""
    return _USE_COUNT is not None and _USE_COUNT(region._cdata) == 1


class Arena:
    """One lent region cut into consecutive pieces for the reads of one window (range reads and
    decoded records; reads of several packs run on several threads). A piece starts on a
    64-byte boundary, so a record's bytes view as its dtype; a request past the end gets new
    memory, never a piece of another's."""

    ALIGN = 64

    def __init__(self, region: torch.Tensor):
        self._region = region
        self._used = 0
        self._lock = threading.Lock()

    @classmethod
    def room_for(cls, sizes) -> int:
        """The region size that holds pieces of ``sizes`` bytes."""
        return sum(size + -size % cls.ALIGN for size in sizes)

    def __call__(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            start = self._used
            if start + nbytes > self._region.numel():
                return torch.empty(nbytes, dtype=torch.uint8)
            self._used = start + nbytes + -nbytes % self.ALIGN
        return self._region[start : start + nbytes]
