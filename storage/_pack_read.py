"""Reading a sealed pack's own description back: its index, and a full verification.

:func:`read_pack_descriptor` needs only the file's tail (Arrow footer + index batch), so
catalog recovery can rebuild every index row of a pack it never saw sealed.
:func:`verify_pack` reads everything and cross-checks the index against the rows and the
payload bytes against their checksums, and the file's leading magic and schema message (what a
stream reader, or any tool that ignores the footer, reads) against its footer. It is
:func:`read_whole_pack` then :func:`check_whole_pack`, apart so that ``dmi verify`` reads each
pack once: it reads its records back from the bytes it checks (``dmi.reader.check_records``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dmi.storage._codecs import checksum
from dmi.storage._pack_format import META_INDEX, check_schema, decode_index
from dmi.storage._store import PackInput, PackStore
from dmi.storage.errors import PackCorruptError, PackFormatError
from dmi.storage.records import PackDescriptor, RecordEntry

__all__ = ["WholePack", "read_pack_descriptor", "read_pack_index", "verify_pack", "read_whole_pack", "check_whole_pack"]

_MAGIC = b"ARROW1"
"""The Arrow IPC file magic, at the file's start (then 2 padding bytes) and at its end."""
_STREAM_START = 8
"""Where the file's stream (schema message, then every batch message) begins: past the magic
and its padding."""


def read_pack_descriptor(store: PackStore, pack_id: str) -> PackDescriptor:
    """The descriptor of sealed pack ``pack_id``, rebuilt from the file alone."""
    with store.open_input(pack_id) as source:
        return read_pack_index(source, store.location(pack_id))


def read_pack_index(source: PackInput, location: str) -> PackDescriptor:
    """Parse footer and index batch of an opened pack (what the footer cache holds)."""
    pack_id = source.pack_id
    size = source.size
    reader = _open_ipc(source)
    writer_id, version = check_schema(reader.schema, pack_id)
    n = reader.num_record_batches
    if n == 0:
        raise PackFormatError(f"pack {pack_id}: no index batch (not sealed by a DMI writer)")
    try:
        index_batch, metadata = reader.get_batch_with_custom_metadata(n - 1)
    except (pa.ArrowException, OSError) as exc:
        raise PackCorruptError(f"pack {pack_id}: index batch unreadable: {exc}") from exc
    if index_batch.num_rows != 0 or metadata is None or META_INDEX not in metadata:
        raise PackFormatError(f"pack {pack_id}: last batch is not a record index")
    entries, sealed_at, indexed_writer = decode_index(metadata, pack_id, version)
    if indexed_writer != writer_id:
        raise PackCorruptError(f"pack {pack_id}: schema says writer {writer_id!r}, index says {indexed_writer!r}")
    _check_ranges(pack_id, entries, size)
    return PackDescriptor(
        pack_id=pack_id,
        location=location,
        size=size,
        writer_id=writer_id,
        format_version=version,
        sealed_at=sealed_at,
        records=tuple(entries),
    )


def _check_ranges(pack_id: str, entries: list[RecordEntry], size: int) -> None:
    """Refuse an index whose payload ranges leave the file: a reader would size its buffer from
    such a length (gigabytes, from a crafted index) before finding the file too short."""
    for entry in entries:
        if entry.payload.end > size:
            raise PackCorruptError(
                f"pack {pack_id}: index puts record {entry.meta.key.describe()} at {entry.payload}, past the "
                f"file's {size} bytes; no record of it can be trusted: restore the pack from a copy or recapture it"
            )


@dataclass(frozen=True, slots=True, eq=False)
class WholePack:
    """A sealed pack read whole: its index (from its footer) and every byte of the file (uint8)."""

    descriptor: PackDescriptor
    data: np.ndarray


def verify_pack(store: PackStore, pack_id: str) -> PackDescriptor:
    """Read the whole pack; raise unless rows, index, byte offsets and checksums all agree, and the
    file read as a stream (from its leading schema message) is the file its footer describes."""
    pack = read_whole_pack(store, pack_id)
    check_whole_pack(pack)
    return pack.descriptor


def read_whole_pack(store: PackStore, pack_id: str) -> WholePack:
    """The pack's index and all its bytes, read once through one open (:class:`PackCorruptError`
    for an unreadable index, :class:`PackNotFoundError` for a missing file)."""
    with store.open_input(pack_id) as source:
        descriptor = read_pack_index(source, store.location(pack_id))
        data = np.empty(source.size, dtype=np.uint8)
        source.read_into(0, data)
    return WholePack(descriptor, data)


def check_whole_pack(pack: WholePack) -> None:
    """Raise :class:`PackCorruptError` unless the held pack's rows, index, byte offsets and
    checksums all agree, and its bytes read as a stream are the file its footer describes."""
    pack_id = pack.descriptor.pack_id
    buffer = pa.py_buffer(pack.data)
    entries = iter(pack.descriptor.records)
    try:
        by_footer = pa.ipc.open_file(pa.BufferReader(buffer))
        _scan_rows(pack_id, by_footer, buffer, pack.data, entries)
        _check_stream(pack_id, by_footer, buffer)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: damaged buffer sizes
        raise PackCorruptError(f"pack {pack_id}: record batches unreadable: {exc}") from exc
    if next(entries, None) is not None:
        raise PackCorruptError(f"pack {pack_id}: index lists more records than the file holds")


def _scan_rows(pack_id: str, reader: pa.ipc.RecordBatchFileReader, buffer: pa.Buffer, whole: np.ndarray,
               entries) -> None:
    """Walk every data batch; payload offsets come from buffer addresses, not the index."""
    for i in range(reader.num_record_batches - 1):
        batch = reader.get_batch(i)
        batch.validate(full=True)  # IPC reads trust offsets; damaged ones must not be followed
        payload = batch.column(batch.num_columns - 1)
        _, offsets_buf, data = payload.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[payload.offset : payload.offset + batch.num_rows + 1]
        base = 0 if data is None else data.address - buffer.address
        for row in range(batch.num_rows):
            entry = next(entries, None)
            if entry is None:
                raise PackCorruptError(f"pack {pack_id}: more rows than index entries")
            start, end = int(offsets[row]), int(offsets[row + 1])
            offset = base + start if end > start else 0
            _check_row(pack_id, entry, batch, row, offset, end - start)
            stored = memoryview(whole)[offset : offset + (end - start)]
            if checksum(stored) != entry.meta.checksum:
                raise PackCorruptError(f"pack {pack_id}: record {entry.meta.key.describe()} fails its checksum")


def _check_stream(pack_id: str, by_footer: pa.ipc.RecordBatchFileReader, buffer: pa.Buffer) -> None:
    """Refuse a file whose start disagrees with its footer. The file reader (every DMI read)
    takes the schema and the batch locations from the footer and never reads the leading magic
    or schema message; a stream reader, or a tool that ignores the footer, reads only those.
    Both must get the same file: the magic, the same schema and metadata, and the same batches
    over the same bytes, with the same custom metadata. Bytes neither reads (padding) are not
    checked: docs/pack-format.md, "What verify checks"."""
    if buffer[: len(_MAGIC)].to_pybytes() != _MAGIC:
        raise _stream_damage(pack_id, "the leading Arrow magic is damaged")
    as_stream = pa.ipc.open_stream(pa.BufferReader(buffer.slice(_STREAM_START)))
    if not as_stream.schema.equals(by_footer.schema, check_metadata=True):
        raise _stream_damage(pack_id, "the leading schema message differs from the footer's schema")
    for i in range(by_footer.num_record_batches):
        expected = by_footer.get_batch_with_custom_metadata(i)
        try:
            got = as_stream.read_next_batch_with_custom_metadata()
        except StopIteration:
            raise _stream_damage(pack_id, f"the stream ends before batch {i}") from None
        if _layout(got) != _layout(expected):
            raise _stream_damage(pack_id, f"batch {i} read as a stream differs from the footer's batch {i}")
    try:
        as_stream.read_next_batch()
    except StopIteration:
        return
    raise _stream_damage(pack_id, f"the stream holds more than the footer's {by_footer.num_record_batches} batches")


def _layout(batch_with_metadata) -> tuple:
    """What a batch is, as bytes of the file: its custom metadata, rows, each column's null count,
    and every column's buffers by address and size (both readers read zero-copy from the same
    buffer, so equal addresses are the same bytes)."""
    batch, metadata = batch_with_metadata
    nulls = tuple(c.null_count for c in batch.columns)
    buffers = tuple((b.address, b.size) if b is not None else None for c in batch.columns for b in c.buffers())
    return dict(metadata or {}), batch.num_rows, nulls, buffers


def _stream_damage(pack_id: str, what: str) -> PackCorruptError:
    return PackCorruptError(
        f"pack {pack_id}: {what}: the file is damaged where a stream reader (or any tool that reads it "
        "from its start) would read it; restore the pack from a copy or recapture it"
    )


def _check_row(pack_id: str, entry: RecordEntry, batch: pa.RecordBatch, row: int, offset: int, length: int) -> None:
    key = entry.meta.key
    observed = {name: batch.column(name)[row].as_py() for name in ("model_id", "request_id", "hook", "layer", "start_token", "checksum", "dtype")}
    expected = {
        "model_id": key.model_id,
        "request_id": key.request_id,
        "hook": key.hook,
        "layer": key.layer,
        "start_token": key.start_token,
        "checksum": entry.meta.checksum,
        "dtype": entry.meta.dtype,
    }
    if observed != expected or (offset, length) != (entry.payload.offset, entry.payload.length):
        raise PackCorruptError(
            f"pack {pack_id}: row {row} disagrees with index entry {entry.meta.key.describe()} "
            f"(row {observed} at {offset}+{length}, index {expected} at {entry.payload})"
        )


def _open_ipc(source: PackInput) -> pa.ipc.RecordBatchFileReader:
    try:
        return pa.ipc.open_file(source.arrow_file())
    except (pa.ArrowException, OSError) as exc:
        raise PackCorruptError(
            f"pack {source.pack_id}: not a readable Arrow IPC file (truncated or corrupt): {exc}"
        ) from exc
