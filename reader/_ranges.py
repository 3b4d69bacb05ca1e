"""The read planner: which byte ranges a batch of records turns into.

Records of one pack are sorted by offset and neighbours closer than ``max_gap`` bytes
are merged into one read (the gap bytes are read and dropped: one larger sequential read
beats two round trips). ``plan_reads`` is exactly what ``read_records`` executes, one
``PackInput.read_into`` per :class:`PlannedRead`, so its output predicts the I/O.
Zero-length payloads need no read and appear in no plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmi.storage.errors import InvalidArgumentError
from dmi.storage.records import ByteRange, RecordEntry

__all__ = ["DEFAULT_MAX_GAP", "PlannedRead", "plan_reads"]

DEFAULT_MAX_GAP = 1024 * 1024
"""Merge ranges separated by at most 1 MiB: on local disks and object stores alike a
round trip costs more than reading that many extra bytes."""


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One range read of one pack, and which of the requested entries it serves.

    ``members`` are indexes into the ``entries`` passed to :func:`plan_reads`.
    """

    pack_id: str
    range: ByteRange
    members: tuple[int, ...]


def plan_reads(entries: Sequence[RecordEntry], *, max_gap: int = DEFAULT_MAX_GAP) -> list[PlannedRead]:
    """Coalesced reads for ``entries``, ordered by pack id then offset."""
    if max_gap < 0:
        raise InvalidArgumentError(f"max_gap must be >= 0, got {max_gap}")
    order = sorted(
        (i for i, e in enumerate(entries) if e.payload.length > 0),
        key=lambda i: (entries[i].pack_id, entries[i].payload.offset, entries[i].payload.end),
    )
    plans: list[PlannedRead] = []
    pack, start, end, members = None, 0, 0, []
    for i in order:
        e = entries[i]
        if pack == e.pack_id and e.payload.offset - end <= max_gap:
            end = max(end, e.payload.end)
            members.append(i)
            continue
        if pack is not None:
            plans.append(PlannedRead(pack, ByteRange(start, end - start), tuple(members)))
        pack, start, end, members = e.pack_id, e.payload.offset, e.payload.end, [i]
    if pack is not None:
        plans.append(PlannedRead(pack, ByteRange(start, end - start), tuple(members)))
    return plans
