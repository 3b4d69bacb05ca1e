"""The ring: a bounded set of host slots that hook tensors are copied into.

The model thread *reserves* a region of the open slot for each (hook, layer) tensor, copies
into it, and notes an :class:`Entry` (where the bytes are and which step plan cuts them
into records). **Slots fill by bytes, across steps**: one slot holds as many steps' tensors
as fit, so a small model's steps do not each take a whole slot.

When the open slot is *submitted* to the drain thread (which turns it into records and
*releases* it) — the latency rule:

* when the next tensor does not fit in it (it is full);
* at the end of a step (:meth:`Ring.end_step`) when the drain has fewer than
  ``HANDOVER_DEPTH`` (2) slots in hand — so the drain always has the next slot queued
  behind the one it works on, and otherwise (the drain is behind) the open slot keeps taking the next steps' bytes: the ring
  absorbs the start instead of spending a slot per step;
* on :meth:`Ring.submit` — the session's ``flush()`` and detach.

Also:

* Slots are pinned host memory when CUDA is available. On CUDA the copies run on a side
  stream that first ``wait_stream``s the model's stream; the source is
  ``record_stream``-ed on the side stream so the allocator cannot recycle it early, and an
  event recorded at submission (after every copy into the slot, of every step it holds)
  tells the drain thread when the bytes are there. Nothing synchronises the model's stream.
* On CPU the copy is a plain memcpy (``copy_`` / ``index_select(out=)``) into the slot —
  the model cannot overwrite a tensor we only referenced, because we never keep references.
* **Lossless by default** (``drop_policy="wait"``): when a tensor fits neither in the open
  slot nor in a free one, the open slot goes to the drain and the producer waits up to
  ``timeout`` seconds for a free slot, then raises :class:`RingFullError`. With
  ``drop_policy="drop"`` that tensor is not copied (counted in :class:`RingStats`, and the
  caller counts every record it would have produced as a loss — nothing is dropped
  silently); the open slot stays open, so a later, smaller tensor that fits is still kept.
* A tensor larger than a slot grows that slot's buffer (memory stays bounded by the largest
  single tensor times the slot count).
* :attr:`Ring.fill` — the bytes handed to the drain and not yet released, as a fraction of
  the ring — tells the drain how far behind it is (it switches to a cheaper codec above a
  threshold; see ``_drain.py``).
* :attr:`Slot.ends_step` says whether a submitted slot ends at a step's edge (the step ended,
  or the next step had not reserved anything yet) rather than in the middle of a step that
  filled it: the drain publishes only at step edges, so that a reader never sees one step
  published for some layers and not others (see ``_drain.py``).
* :meth:`Ring.abandon_step`: a step whose forward raised (an out-of-memory error, a
  ``KeyboardInterrupt``) takes its regions back out of the open slot, so that the drain never
  gets a step that stops at some layer; it returns the step's entries already handed over
  (in a slot the step filled), which the caller accounts for.
"""

from __future__ import annotations

import numbers
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from dmi.storage.errors import InvalidArgumentError, RingFullError

__all__ = ["Entry", "Slot", "Ring", "RingStats", "HANDOVER_DEPTH"]

_ALIGN = 16
HANDOVER_DEPTH = 2  # at a step end the open slot is handed over while the drain holds fewer slots


@dataclass(slots=True)
class Entry:
    """One (hook, layer) tensor inside a slot."""

    hook: str
    layer: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    rows: int  # leading dimension as copied ([rows, features])
    plan: object  # the StepPlan that cuts the rows into records
    kv_tokens: int = 0  # attn_pattern only: the key columns kept (padding stripped)
    span_index: int = -1  # attn_pattern only: the request this region belongs to


@dataclass(slots=True)
class Slot:
    index: int
    buffer: torch.Tensor  # uint8
    used: int = 0
    entries: list = field(default_factory=list)
    event: object = None
    ends_step: bool = True  # set at submission: no later slot holds bytes of this slot's last step
    _typed: dict = field(default_factory=dict)  # dtype -> the buffer viewed as that dtype

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def grow(self, buffer: torch.Tensor) -> None:
        """``buffer`` (larger) in place of the old one; the old one's dtype views go with it."""
        self.buffer = buffer
        self._typed.clear()

    def rows(self, offset: int, dtype: torch.dtype, n: int, width: int) -> torch.Tensor:
        """The ``[n, width]`` ``dtype`` tensor at byte ``offset`` (16-aligned) of the buffer:
        one view op on the model thread, where slicing and two dtype/shape views took three."""
        typed = self._typed.get(dtype)
        if typed is None:  # the whole elements of the buffer (slot_bytes need not be a multiple)
            whole = self.buffer.numel() // dtype.itemsize * dtype.itemsize
            typed = self._typed[dtype] = self.buffer[:whole].view(dtype)
        return typed.as_strided((n, width), (width, 1), offset // dtype.itemsize)


@dataclass(slots=True)
class RingStats:
    reservations: int = 0
    reserved_bytes: int = 0
    copies: int = 0
    submitted_slots: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    dropped_tensors: int = 0
    dropped_bytes: int = 0  # bytes (16-aligned) of the dropped tensors
    steps: int = 0  # step ends seen with bytes in the open slot
    steps_packed: int = 0  # of those, the ends at which the slot stayed open for the next step


def _check_fits_memory(n_slots: int, slot_bytes: int) -> None:
    """Refuse a ring larger than the machine's physical memory before allocating any of it: its
    slots are allocated one by one, so a mistyped size would otherwise fail (or page) only
    after the first ones took what memory there is."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name: nothing to check by
        return
    total = n_slots * slot_bytes
    if physical > 0 and total > physical:
        raise InvalidArgumentError(
            f"a ring of {n_slots} slots of {slot_bytes} bytes is {total} bytes of host memory, more than this "
            f"machine has ({physical} bytes); lower ring_slots or slot_bytes")


class Ring:
    """Bounded slots; one producer (the model thread), one consumer (the drain thread)."""

    def __init__(
        self,
        n_slots: int = 8,
        slot_bytes: int = 32 << 20,
        *,
        pin: bool | None = None,
        timeout: float = 60.0,
        drop_policy: str = "wait",
    ):
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise InvalidArgumentError(f"ring_slots must be an int >= 1, got {n_slots!r}")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < _ALIGN:
            raise InvalidArgumentError(f"slot_bytes must be an int >= {_ALIGN}, got {slot_bytes!r}")
        if drop_policy not in ("wait", "drop"):
            raise InvalidArgumentError(f"drop_policy must be 'wait' or 'drop', got {drop_policy!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
            raise InvalidArgumentError(f"ring_timeout must be a number of seconds >= 0, got {timeout!r}")
        _check_fits_memory(n_slots, slot_bytes)
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self.slot_bytes = slot_bytes
        self.timeout = float(timeout)
        self.drop_policy = drop_policy
        self.stats = RingStats()
        self._on_submit = None  # callable(slot): hands a filled slot to the drain (see connect)
        self._stamp = None  # callable() -> event or None: marks when a slot's copies are done
        self._slots = [Slot(i, self._alloc(slot_bytes)) for i in range(n_slots)]
        self._free = list(reversed(self._slots))
        self._cond = threading.Condition()
        self._current: Slot | None = None
        self._capacity = n_slots * slot_bytes
        self._in_flight = 0  # slots handed to the drain and not yet released
        self._backlog = 0  # bytes in those slots
        self._in_step = False  # a region was reserved since the last step end
        self._step_first = 0  # the open slot's first entry of the step in progress
        self._step_used = 0  # the open slot's bytes before the step in progress
        self._step_handed: list[Entry] = []  # entries of the step in progress already handed to the drain

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """A slot's buffer, pinned where the ring pins: allocated pinned, not pinned by a copy
        (``Tensor.pin_memory()`` copies the whole buffer; the GPU bench's ring is 2 GiB)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    @property
    def in_flight(self) -> int:
        """Slots handed to the drain and not yet released."""
        return self._in_flight

    @property
    def fill(self) -> float:
        """Bytes handed to the drain and not yet released, as a fraction of the ring's
        ``n_slots × slot_bytes`` (above 1 only when grown slots are waiting)."""
        return self._backlog / self._capacity

    def connect(self, on_submit, *, stamp=None) -> None:
        """Hand every filled slot to ``on_submit(slot)`` (the drain). ``stamp()``, if given, is
        called as a slot with entries is submitted — whether the step ended or the slot filled
        up — and its result (e.g. a CUDA event after the copies) becomes ``slot.event``."""
        self._on_submit = on_submit
        self._stamp = stamp

    # -- producer side (model thread) ---------------------------------------------------------
    def reserve(self, nbytes: int, *, check=None) -> tuple[Slot, int] | None:
        """A region of ``nbytes`` (rounded up to 16) in the open slot, or ``None`` when the
        drop policy drops it. ``check`` is called before a new slot is taken (to surface
        drain errors)."""
        need = (nbytes + _ALIGN - 1) & ~(_ALIGN - 1)
        slot = self._current
        if slot is None or slot.used + need > slot.capacity:
            slot = self._next_slot(need, check)
            if slot is None:
                return None
        if not self._in_step:  # the step's first region: where abandon_step cuts the slot back to
            self._step_first, self._step_used = len(slot.entries), slot.used
        off = slot.used
        slot.used += need
        self._in_step = True
        self.stats.reservations += 1
        self.stats.reserved_bytes += need
        return slot, off

    def _next_slot(self, need: int, check) -> Slot | None:
        """A slot with room for ``need`` bytes, made the open one; ``None`` when dropped."""
        if check is not None:
            check()  # a failed drain surfaces here, before more is copied
        slot = self._take_free()
        if slot is None:
            if self.drop_policy == "drop":
                self.stats.dropped_tensors += 1
                self.stats.dropped_bytes += need
                return None  # the open slot stays open: a later tensor that fits is kept
            self.submit()  # the drain gets what is filled while we wait
            slot = self._wait_free(check)
        else:
            self.submit()
        if need > slot.capacity:
            slot.grow(self._alloc(need))
        self._current = slot
        return slot

    def _take_free(self) -> Slot | None:
        with self._cond:
            return self._free.pop() if self._free else None

    def _wait_free(self, check) -> Slot:
        with self._cond:
            self.stats.waits += 1
            t0 = time.monotonic()
            deadline = t0 + self.timeout
            while not self._free:
                if check is not None:
                    check()
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats.wait_seconds += time.monotonic() - t0
                    raise RingFullError(
                        f"no free ring slot after waiting {self.timeout:.1f}s "
                        f"({self.n_slots} slots of {self.slot_bytes} bytes, all waiting for the "
                        "drain thread); raise ring_slots / slot_bytes or ring_timeout, or pass "
                        "drop_policy='drop' to drop (and count) records instead of waiting"
                    )
                self._cond.wait(min(left, 0.05))
            self.stats.wait_seconds += time.monotonic() - t0
            return self._free.pop()

    def end_step(self) -> None:
        """A step ended: hand the open slot over if the drain holds fewer than
        ``HANDOVER_DEPTH`` slots, else keep it open for the next step's bytes."""
        self._in_step = False
        self._step_handed = []
        slot = self._current
        if slot is None or not slot.entries:
            return
        self.stats.steps += 1
        if self._in_flight < HANDOVER_DEPTH:
            self.submit()
        else:
            self.stats.steps_packed += 1

    def submit(self) -> None:
        """Hand the open slot (if it holds anything) to the drain."""
        slot = self._current
        if slot is None:
            return
        self._current = None
        if self._in_step:  # the step goes on in the next slot
            self._step_handed.extend(slot.entries[self._step_first:])
            self._step_first = self._step_used = 0
        if not slot.entries:
            self._recycle(slot)
            return
        if self._stamp is not None:
            slot.event = self._stamp()
        slot.ends_step = not self._in_step
        with self._cond:
            self._in_flight += 1
            self._backlog += slot.used
        self.stats.submitted_slots += 1
        self._on_submit(slot)

    def abandon_step(self) -> list[Entry]:
        """The step in progress will not complete (its forward raised): take its regions out of
        the open slot, so that none of it reaches the drain, and end it. Returns its entries
        already handed to the drain (a slot it filled, a flush in its middle), which cannot be
        taken back: the caller counts the rest of the step as lost."""
        handed, self._step_handed = self._step_handed, []
        slot = self._current
        if self._in_step and slot is not None:
            del slot.entries[self._step_first:]
            slot.used = self._step_used
        self._in_step = False
        return handed

    # -- consumer side (drain thread) ---------------------------------------------------------
    def release(self, slot: Slot) -> None:
        """The drain is done with ``slot`` (handed over by :meth:`submit`): free it."""
        with self._cond:
            self._in_flight -= 1
            self._backlog -= slot.used
        self._recycle(slot)

    def _recycle(self, slot: Slot) -> None:
        slot.used = 0
        slot.entries = []
        slot.event = None
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def close(self) -> None:
        """Let go of every slot's buffer (the session is over)."""
        with self._cond:
            self._slots.clear()
            self._free.clear()
