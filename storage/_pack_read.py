"""Reading a sealed pack's own description back: its index, and a full verification.

:func:`read_pack_descriptor` needs only the file's tail (Arrow footer + index batch), so
catalog recovery can rebuild every index row of a pack it never saw sealed.
:func:`verify_pack` reads everything and cross-checks the index against the rows and the
payload bytes against their checksums (``dmi verify``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dmi.storage._codecs import checksum
from dmi.storage._pack_format import META_INDEX, check_schema, decode_index
from dmi.storage._store import PackInput, PackStore
from dmi.storage.errors import PackCorruptError, PackFormatError
from dmi.storage.records import PackDescriptor, RecordEntry

__all__ = ["read_pack_descriptor", "read_pack_index", "verify_pack"]


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


def verify_pack(store: PackStore, pack_id: str) -> PackDescriptor:
    """Read the whole pack; raise unless rows, index, byte offsets and checksums all agree."""
    with store.open_input(pack_id) as source:
        descriptor = read_pack_index(source, store.location(pack_id))
        whole = bytearray(source.size)
        source.read_into(0, whole)
    buffer = pa.py_buffer(whole)
    entries = iter(descriptor.records)
    try:
        _scan_rows(pack_id, buffer, whole, entries)
    except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: damaged buffer sizes
        raise PackCorruptError(f"pack {pack_id}: record batches unreadable: {exc}") from exc
    if next(entries, None) is not None:
        raise PackCorruptError(f"pack {pack_id}: index lists more records than the file holds")
    return descriptor


def _scan_rows(pack_id: str, buffer: pa.Buffer, whole: bytearray, entries) -> None:
    """Walk every data batch; payload offsets come from buffer addresses, not the index."""
    reader = pa.ipc.open_file(pa.BufferReader(buffer))
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
