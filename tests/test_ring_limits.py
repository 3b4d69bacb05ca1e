"""A ring larger than the machine's memory is refused by name before any slot is allocated
(slots are allocated one by one: a mistyped size would otherwise take the memory there is,
then fail with torch's bare allocator error, or page for minutes)."""

from __future__ import annotations

import os

import pytest

from dmi.capture import Ring, attach
from dmi.storage.errors import InvalidArgumentError

from ._models import MemoryWriter, tiny

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_ring_past_physical_memory_is_refused_before_allocating():
    with pytest.raises(InvalidArgumentError) as refused:
        Ring(2, PHYSICAL)
    assert str(refused.value) == (f"a ring of 2 slots of {PHYSICAL} bytes is {2 * PHYSICAL} bytes of host memory, "
                                  f"more than this machine has ({PHYSICAL} bytes); lower ring_slots or slot_bytes")


def test_attach_refuses_it_and_leaves_the_model_without_hooks():
    model = tiny("llama")
    with pytest.raises(InvalidArgumentError, match=r"^a ring of 1000 slots of "):
        with attach(model, writer=MemoryWriter(), ring_slots=1000, slot_bytes=PHYSICAL // 999):
            pass
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_ring_within_memory_is_made_as_asked():
    ring = Ring(3, 4096)
    assert (ring.n_slots, ring.slot_bytes) == (3, 4096)
