"""The loader's reused memory (dmi/_loader_memory.py): a region is lent again only when
nothing uses it, never after it went to another process, and a window's reads get
disjoint, aligned pieces of one region; regions are private memory asked for huge pages."""

from __future__ import annotations

import mmap
import os
import re

import pytest
import torch

from dmi._loader_memory import Arena, WindowMemory


def test_a_region_is_lent_again_only_when_no_tensor_uses_it():
    memory = WindowMemory(keep=2)
    first = memory.take(4096)
    batch = first[1024:2048].view(torch.float32)  # a batch: a view of the window
    del first
    second = memory.take(4096)
    assert second.data_ptr() != batch.data_ptr() - 1024 and memory.reused == 0
    del batch
    third = memory.take(1000)  # smaller requests fit in a free larger region
    assert third.data_ptr() == _start(memory, 0) and memory.reused == 1
    del second, third


def test_a_region_sent_to_another_process_is_never_lent_again():
    memory = WindowMemory(keep=2)
    window = memory.take(4096)
    window.share_memory_()  # what a DataLoader worker's batches go through: the storage moves to shared memory
    address = window.data_ptr()
    del window
    again = memory.take(4096)
    assert again.data_ptr() != address and memory.reused == 0


def test_at_most_keep_regions_are_kept_a_larger_one_replacing_a_free_smaller_one():
    memory = WindowMemory(keep=1)
    small = memory.take(100)
    del small
    large = memory.take(10_000)  # the free 100-byte region is too small: replaced
    assert memory._regions[0].nbytes() == 10_000
    del large
    assert memory.take(5000).data_ptr() == _start(memory, 0)


def test_an_arena_hands_out_aligned_disjoint_pieces_and_new_memory_past_its_end():
    region = torch.empty(Arena.room_for([100, 30]), dtype=torch.uint8)
    arena = Arena(region)
    a, b = arena(100), arena(30)
    assert a.data_ptr() == region.data_ptr() and b.data_ptr() == region.data_ptr() + 128
    assert (a.numel(), b.numel()) == (100, 30)
    c = arena(10)  # no room left: its own memory, not a piece of another's
    assert not region.data_ptr() <= c.data_ptr() < region.data_ptr() + region.numel()
    assert c.numel() == 10


def test_without_torch_s_use_count_nothing_is_lent_again(monkeypatch):
    import dmi._loader_memory as loader_memory

    monkeypatch.setattr(loader_memory, "_USE_COUNT", None)
    memory = WindowMemory(keep=2)
    first = memory.take(4096)
    address = first.data_ptr()
    del first
    assert memory.take(4096).data_ptr() != address and memory.reused == 0


@pytest.mark.skipif(not (os.path.exists("/proc/self/smaps") and hasattr(mmap, "MADV_HUGEPAGE")
                         and os.path.isdir("/sys/kernel/mm/transparent_hugepage")),
                    reason="transparent huge pages are a Linux feature, and this kernel has none")
def test_a_region_is_private_memory_advised_to_use_huge_pages():
    memory = WindowMemory(keep=1)
    region = memory.take(8 << 20)
    flags = _vm_flags(region.data_ptr())
    assert "hg" in flags  # MADV_HUGEPAGE taken: the kernel backs it with 2 MiB pages where it can
    assert "sh" not in flags  # private: shared memory would take its huge pages from another setting
    assert region.data_ptr() % mmap.PAGESIZE == 0  # page-aligned, as direct reads need


def _vm_flags(address: int) -> set[str]:
    """The kernel's flags for the mapping holding ``address`` (``VmFlags`` in /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        smaps = f.read()
    for mapping in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^VmFlags:(.*?)$", smaps, re.S | re.M):
        if int(mapping.group(1), 16) <= address < int(mapping.group(2), 16):
            return set(mapping.group(3).split())
    raise AssertionError(f"no mapping holds {address:#x}")


def _start(memory: WindowMemory, i: int) -> int:
    return memory._regions[i].data_ptr()
