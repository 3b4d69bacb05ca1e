"""Fetching records as checked bytes, without torch: range reads, footers, checksums, decoding.

A record is one byte range of its pack. :func:`read_raw_records` executes
:func:`plan_reads` (one read per planned range, into memory the caller may lend) and
returns each record's decoded bytes (``uint8``), after its checksum and its size claim were
verified; ``raw`` records come back as views of the read buffer, no copy. With a
:class:`FooterCache`, each entry is also checked against its pack's own index (loaded once
per pack and cached), which catches a stale or wrong catalog row before any payload is
trusted; :func:`find_record` uses the same index to locate a record by key.

:mod:`dmi.reader._read` turns these bytes into torch tensors; this module imports no torch,
so what needs only bytes (``dmi show``'s token strings) starts without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from dmi.storage import CodecError, PackInput, PackStore, checksum, decode, dtype_itemsize, read_pack_index
from dmi.storage.errors import DuplicateChunkError, PackCorruptError, PackTruncatedError, RecordNotFoundError
from dmi.storage.records import PackDescriptor, RecordEntry, RecordKey
from dmi.reader._footer_cache import FooterCache
from dmi.reader._ranges import DEFAULT_MAX_GAP, PlannedRead, plan_reads

__all__ = ["PackFooter", "load_footer", "find_record", "find_in_footer", "read_raw_records", "read_raw_record",
           "check_raw_records", "new_bytes"]

Memory = Callable[[int], np.ndarray]
"""Gives the writable ``uint8`` buffer of ``nbytes`` that a range read or a decode goes into."""

_ENTRY_COST = 1024  # estimated bytes of Python objects per indexed record
_FOOTER_BASE_COST = 4096


@dataclass(frozen=True, slots=True)
class PackFooter:
    """A pack's parsed index, as held by the footer cache, with the :attr:`PackInput.version`
    of the file it was read from."""

    descriptor: PackDescriptor
    by_key: dict[RecordKey, tuple[RecordEntry, ...]]
    version: Hashable = None

    @property
    def nbytes(self) -> int:
        return _FOOTER_BASE_COST + _ENTRY_COST * len(self.descriptor.records)


def load_footer(
    store: PackStore, pack_id: str, *, cache: FooterCache | None = None, source: PackInput | None = None
) -> PackFooter:
    """The pack's index, from ``cache`` when present there (refreshing its recency).

    With ``source`` (the pack, opened), a cached index read from another version of the file
    (:attr:`PackInput.version`: for a local pack its size, times and inode; for an S3 pack its
    size and ETag; for other ``pyarrow.fs`` stores its size and modification time) is reloaded
    from ``source``: the file under that name was replaced since it was cached, and its old
    index would refuse the records of the new one as stale or corrupt, or locate a key at the
    bytes it had in the old one. A ``source`` whose version is ``None`` (its filesystem gives
    no modification time) has its index read again every time: nothing tells it from a
    replacement of the same size."""

    def load() -> tuple[PackFooter, int]:
        if source is not None:
            footer = _parse_footer(store, pack_id, source)
        else:
            with store.open_input(pack_id) as opened:
                footer = _parse_footer(store, pack_id, opened)
        return footer, footer.nbytes

    if cache is None:
        return load()[0]
    key = (store.uri, pack_id)
    if source is None:
        return cache.get_or_load(key, load)
    footer = None if source.version is None else cache.get_or_load(key, load)
    if footer is None or footer.version != source.version:
        footer, nbytes = load()
        cache.put(key, footer, nbytes)
    return footer


def _parse_footer(store: PackStore, pack_id: str, source: PackInput) -> PackFooter:
    """The index of the opened pack ``source``, by key, with the version of the file read."""
    version = source.version
    return _footer_of(read_pack_index(source, store.location(pack_id)), version)


def _footer_of(descriptor: PackDescriptor, version: Hashable = None) -> PackFooter:
    """``descriptor``'s records by key."""
    by_key: dict[RecordKey, tuple[RecordEntry, ...]] = {}
    for e in descriptor.records:
        by_key[e.meta.key] = (*by_key.get(e.meta.key, ()), e)
    return PackFooter(descriptor, by_key, version)


def find_record(store: PackStore, pack_id: str, key: RecordKey, *, cache: FooterCache | None = None) -> RecordEntry:
    """The entry for ``key`` in pack ``pack_id``, from the pack's own index."""
    return find_in_footer(load_footer(store, pack_id, cache=cache), pack_id, key)


def find_in_footer(footer: PackFooter, pack_id: str, key: RecordKey) -> RecordEntry:
    """The one entry of ``footer`` with ``key``."""
    found = footer.by_key.get(key, ())
    if not found:
        raise RecordNotFoundError(f"pack {pack_id} has no record {key.describe()}")
    if len(found) > 1:
        raise DuplicateChunkError(f"pack {pack_id} holds {len(found)} records with key {key.describe()}")
    return found[0]


def read_raw_records(
    store: PackStore,
    entries: Sequence[RecordEntry],
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    cache: FooterCache | None = None,
    memory: Memory | None = None,
    direct: bool = False,
) -> list[np.ndarray]:
    """Each entry's decoded bytes (``uint8``, same order), reading exactly
    ``plan_reads(entries, max_gap=)``; checksums verified before decoding.

    ``memory(nbytes)`` gives the buffers that range reads and decoded records go into
    (default: new NumPy arrays), for a caller that reuses its memory: the training loader
    reads every window into one region it lends again (dmi/_loader_memory.py).
    ``direct``: read around the page cache where the store can; each range is then read
    widened to the input's ``alignment`` and takes up to ``3 * alignment`` more memory."""
    memory = memory or new_bytes
    entries = list(entries)
    out: list[np.ndarray | None] = [None] * len(entries)
    for i, e in enumerate(entries):
        _require_range(e)
        if e.payload.length == 0:
            out[i] = decode_raw(e, np.empty(0, dtype=np.uint8), memory)
    by_pack: dict[str, list[PlannedRead]] = {}
    for plan in plan_reads(entries, max_gap=max_gap):
        by_pack.setdefault(plan.pack_id, []).append(plan)
    for pack_id, plans in by_pack.items():
        with store.open_input(pack_id, direct=direct) as source:
            if cache is not None:
                _check_against_footer(store, [entries[i] for p in plans for i in p.members], cache, source)
            for plan in plans:
                buffer = _read_range(source, plan.range, [entries[i] for i in plan.members], memory)
                for i in plan.members:
                    rel = entries[i].payload.offset - plan.range.offset
                    out[i] = decode_raw(entries[i], buffer[rel : rel + entries[i].payload.length], memory)
    return out  # type: ignore[return-value]


def read_raw_record(source: PackInput, entry: RecordEntry) -> np.ndarray:
    """One record's decoded bytes from the opened pack ``source``, with one range read."""
    _require_range(entry)
    if entry.payload.length == 0:
        return decode_raw(entry, np.empty(0, dtype=np.uint8), new_bytes)
    return decode_raw(entry, _read_range(source, entry.payload, [entry], new_bytes), new_bytes)


def check_raw_records(descriptor: PackDescriptor, data: np.ndarray, entries: Sequence[RecordEntry]) -> None:
    """Check ``entries`` (rows of the pack ``descriptor`` indexes) against ``data``, the pack's
    whole file already in memory (``uint8``): each against the pack's own index, its checksum
    and its decoding, with no read of the file. Raises the first failure's :class:`PackError`;
    each decoded record is dropped at once."""
    entries = list(entries)
    _check_listed(entries, _footer_of(descriptor))
    for e in entries:  # listed: in the file's range (``read_pack_index`` refuses an index that is not)
        decode_raw(e, data[e.payload.offset : e.payload.end], new_bytes)


def _require_range(entry: RecordEntry) -> None:
    """A pack's index and the catalog hold unsigned offsets and lengths; a negative one can
    only come from a damaged or hand-built entry, and would read nothing or the wrong bytes."""
    if entry.payload.offset < 0 or entry.payload.length < 0:
        raise PackCorruptError(
            f"pack {entry.pack_id}: record {entry.meta.key.describe()} has the impossible byte range {entry.payload}"
        )


def new_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _read_range(source: PackInput, rng, entries: list[RecordEntry], memory: Memory) -> np.ndarray:
    """``rng``'s bytes in a buffer from ``memory``; a range past the file's end is refused
    before that buffer is taken (a damaged length could ask for gigabytes)."""
    try:
        if rng.end > source.size:
            raise PackTruncatedError(
                f"pack {source.pack_id}: file ends at byte {source.size}, before byte {rng.end} "
                f"(range {rng}); the pack is truncated or the catalog row is wrong: run `dmi verify`"
            )
        if source.alignment:
            return _read_range_direct(source, rng, memory)
        buffer = memory(rng.length)
        source.read_into(rng.offset, buffer)
        return buffer
    except PackTruncatedError as exc:
        names = ", ".join(e.meta.key.describe() for e in entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise PackTruncatedError(f"{exc}; records affected: {names}") from exc


def _read_range_direct(source: PackInput, rng, memory: Memory) -> np.ndarray:
    """``rng``'s bytes, read as the aligned range around it into an aligned piece of ``memory``."""
    align = source.alignment
    start = rng.offset - rng.offset % align
    end = rng.end + -rng.end % align
    room = memory(rng.length + 3 * align)  # widened at both ends, started on an aligned address
    skip = -room.ctypes.data % align
    region = room[skip : skip + end - start]
    source.read_direct_into(start, region, needed=rng.end - start)
    return region[rng.offset - start : rng.offset - start + rng.length]


def decode_raw(entry: RecordEntry, stored: np.ndarray, memory: Memory) -> np.ndarray:
    """Verify, then decode ``stored`` (``uint8``) into the record's bytes: a view of ``stored``
    for a ``raw`` record whose first byte sits on its element size, else a buffer from ``memory``."""
    meta = entry.meta
    if checksum(stored) != meta.checksum:
        raise PackCorruptError(f"pack {entry.pack_id}: record {entry.meta.key.describe()} fails its checksum")
    itemsize = dtype_itemsize(meta.dtype)
    if min(meta.shape, default=0) < 0 or math.prod(meta.shape) * itemsize != meta.raw_size:
        raise PackCorruptError(
            f"pack {entry.pack_id}: record {entry.meta.key.describe()} claims shape {meta.shape} {meta.dtype} "
            f"but {meta.raw_size} raw bytes"
        )
    if meta.codec == "raw" and stored.ctypes.data % max(itemsize, 1) == 0 and stored.size == meta.raw_size:
        return stored
    taken = _Sized(meta.raw_size, memory)
    try:
        decode(meta.codec, stored, taken, itemsize)
    except CodecError as exc:
        raise PackCorruptError(
            f"pack {entry.pack_id}: record {entry.meta.key.describe()} cannot be decoded: {exc}"
        ) from exc
    return taken.buffer


class _Sized:
    """The decode buffer of a record of ``raw_size`` bytes, taken from ``memory`` only when the
    payload's headers say it decodes to that size: a damaged size must not ask for gigabytes."""

    def __init__(self, raw_size: int, memory: Memory):
        self.raw_size = raw_size
        self.memory = memory
        self.buffer: np.ndarray | None = None

    def __call__(self, nbytes: int) -> np.ndarray:
        if nbytes != self.raw_size:
            raise CodecError(f"its payload decodes to {nbytes} bytes, its row says {self.raw_size}")
        self.buffer = self.memory(nbytes)
        return self.buffer


def _check_against_footer(store: PackStore, entries: list[RecordEntry], cache: FooterCache, source: PackInput) -> None:
    _check_listed(entries, load_footer(store, source.pack_id, cache=cache, source=source))


def _check_listed(entries: list[RecordEntry], footer: PackFooter) -> None:
    """Refuse any of ``entries`` that ``footer``'s index does not hold as it is."""
    for e in entries:
        if not _listed(e, footer.by_key.get(e.meta.key, ())):
            raise PackCorruptError(
                f"pack {e.pack_id}: record {e.meta.key.describe()} at {e.payload} does not match the pack's "
                f"own index; the catalog row is stale or wrong"
            )


def _listed(entry: RecordEntry, listed: tuple[RecordEntry, ...]) -> bool:
    """Whether ``listed`` holds ``entry``, a NaN statistic or codec error equal to a NaN: a
    record whose values hold NaN has NaN statistics, and NaN != NaN would refuse it."""
    return entry in listed or any(_nan_free(entry) == _nan_free(other) for other in listed)


def _nan_free(value):
    """``value``'s fields as nested tuples, every float NaN replaced by one marker."""
    if isinstance(value, float):
        return _NAN if math.isnan(value) else value
    if dataclasses.is_dataclass(value):
        return tuple(_nan_free(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, tuple):
        return tuple(_nan_free(v) for v in value)
    return value


_NAN = object()
