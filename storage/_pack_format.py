"""Pack format (v4, and reading v1–v3): the Arrow schema, its metadata, the record index and dtype names.

A pack is one Arrow IPC *file*. Data record batches hold one row per record (key
columns, tensor description, codec, sizes, checksum, statistics, and the stored
``payload`` last). After the data batches comes one zero-row *index batch* whose custom
metadata holds the record index — every record's description and the exact byte range
of its payload in the file — so a reader finds any record from the file's tail alone.
The full specification is ``docs/pack-format.md``; this module is its executable form.
"""

from __future__ import annotations

import base64
import functools
import json
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import zstandard

if TYPE_CHECKING:
    import torch

from dmi.storage._pack_names import PACK_SUFFIX, is_pack_id  # re-exported: the names pack files carry
from dmi.storage._pack_v1 import V1_PACK_ROW_SCHEMA, decode_v1_columns
from dmi.storage.record_schema import (
    PAYLOAD_FIELDS,
    RECORD_FIELDS,
    RECORD_SCHEMA_VERSION,
    add_legacy_columns,
    entries_from_columns,
    field_columns,
    fields_of_version,
)
from dmi.storage.errors import PackCorruptError, PackFormatError, UnsupportedDtypeError
from dmi.storage.records import RecordEntry

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PACK_SUFFIX",
    "READABLE_VERSIONS",
    "PACK_ROW_SCHEMA",
    "dtype_name",
    "torch_dtype",
    "dtype_itemsize",
    "is_pack_id",
    "schema_with_metadata",
    "check_schema",
    "encode_index",
    "decode_index",
]

FORMAT_NAME = "dmi-pack"
FORMAT_VERSION = RECORD_SCHEMA_VERSION
"""The pack format follows the record schema: v1 = record schema v1, v2 = v1 plus token layout,
v3 = v2 plus the writer's data- and pipeline-parallel ranks, v4 = v3 plus what a lossy codec lost
(``codec_max_abs_error``, ``codec_rel_l2_error``)."""
READABLE_VERSIONS = tuple(range(1, FORMAT_VERSION + 1))

META_FORMAT = b"dmi.format"
META_VERSION = b"dmi.format_version"
META_PACK_ID = b"dmi.pack_id"
META_WRITER_ID = b"dmi.writer_id"
META_INDEX = b"dmi.index"


def _row_schema(version: int) -> pa.Schema:
    """Columns of a format ``version`` (>= 2) pack's data batches: its record fields, then the
    payload — which must stay last: its data buffer is then the last buffer of each batch
    body, which is how the writer knows every payload's file offset."""
    fields = [pa.field(f.name, f.arrow, nullable=True) for f in fields_of_version(version)]
    return pa.schema(fields + [pa.field("payload", pa.large_binary())])


PACK_ROW_SCHEMA = _row_schema(FORMAT_VERSION)
"""Columns of the packs this code writes."""

_SCHEMAS = {1: V1_PACK_ROW_SCHEMA, **{v: _row_schema(v) for v in READABLE_VERSIONS[1:]}}
"""Row schema of every format version this code reads."""


@functools.cache
def _dtype_table() -> dict[str, torch.dtype]:
    """Every torch dtype by its canonical name; torch is imported here, on first use, so reading
    a pack's index or a record's bytes (``dmi show``'s token strings) loads none."""
    import torch

    table = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[str(value).removeprefix("torch.")] = value
    return table


_NUMPY_SHARED = frozenset({"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                           "float16", "float32", "float64", "complex64", "complex128"})
"""Canonical dtype names NumPy gives the same element under the same name."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the canonical name stored in packs and the catalog."""
    name = str(dtype).removeprefix("torch.")
    if _dtype_table().get(name) is not dtype:
        raise UnsupportedDtypeError(f"dtype {dtype} has no canonical name")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; unknown names raise :class:`UnsupportedDtypeError`."""
    try:
        return _dtype_table()[name]
    except KeyError:
        import torch

        raise UnsupportedDtypeError(
            f"dtype {name!r} is not a torch dtype this build knows (torch {torch.__version__})"
        ) from None


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the canonical dtype ``name``: without torch for the dtypes NumPy
    shares (token ids, strings, floats), through :func:`torch_dtype` for the others."""
    if name in _NUMPY_SHARED:
        return np.dtype(name).itemsize
    return torch_dtype(name).itemsize


def schema_with_metadata(pack_id: str, writer_id: str) -> pa.Schema:
    return PACK_ROW_SCHEMA.with_metadata(
        {
            META_FORMAT: FORMAT_NAME.encode(),
            META_VERSION: str(FORMAT_VERSION).encode(),
            META_PACK_ID: pack_id.encode(),
            META_WRITER_ID: writer_id.encode(),
        }
    )


def check_schema(schema: pa.Schema, pack_id: str) -> tuple[str, int]:
    """Refuse anything that is not a readable DMI pack named ``pack_id``; return its writer id
    and format version. Damaged metadata is a :class:`PackFormatError`, never a decode error."""
    meta = schema.metadata or {}
    if meta.get(META_FORMAT) != FORMAT_NAME.encode():
        raise PackFormatError(f"pack {pack_id}: not a DMI pack (no {META_FORMAT.decode()} metadata)")
    version = _text(meta.get(META_VERSION, b"?"))
    if version not in {str(v) for v in READABLE_VERSIONS}:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise PackFormatError(f"pack {pack_id}: format version {version}, this code reads versions {readable}")
    if _text(meta.get(META_PACK_ID, b"")) != pack_id:
        raise PackFormatError(f"pack {pack_id}: file says it is pack {_text(meta.get(META_PACK_ID, b'?'))}")
    if not schema.remove_metadata().equals(_SCHEMAS[int(version)]):
        raise PackFormatError(f"pack {pack_id}: columns differ from format version {version}")
    writer_id = meta.get(META_WRITER_ID, b"")
    try:
        return writer_id.decode(), int(version)
    except UnicodeDecodeError as exc:
        raise PackFormatError(f"pack {pack_id}: writer id {_text(writer_id)!r} is not UTF-8 (damaged footer)") from exc


def _text(raw: bytes) -> str:
    """Metadata bytes for a message: never raises on damaged (non-UTF-8) bytes."""
    return raw.decode(errors="replace")


# --- the record index ---------------------------------------------------------------
# Columnar JSON (one list per record field, then payload_offset/payload_length),
# zstd-compressed, base64 so the flatbuffer string stays ASCII for every Arrow
# implementation; the zstd frame carries a content checksum so a damaged index is
# refused, never misread.


def encode_index(entries: list[RecordEntry], sealed_at: float, writer_id: str) -> dict[bytes, bytes]:
    """Custom metadata of the index batch for ``entries`` (all of one pack).

    Everything lives inside the checksummed blob; the writer id is repeated there so
    that damage to the unchecksummed schema metadata cannot go unnoticed.
    """
    cols = field_columns([e.meta for e in entries])
    cols["payload_offset"] = [e.payload.offset for e in entries]
    cols["payload_length"] = [e.payload.length for e in entries]
    blob = json.dumps({"n": len(entries), "writer_id": writer_id, "sealed_at": sealed_at, "columns": cols}, separators=(",", ":"), allow_nan=True)
    packed = base64.b64encode(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(blob.encode()))
    return {META_INDEX: packed}


def decode_index(metadata, pack_id: str, version: int = FORMAT_VERSION) -> tuple[list[RecordEntry], float, str]:
    """Entries, seal time and writer id from the index batch's custom metadata."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(metadata[META_INDEX], validate=True))
        doc = json.loads(raw)
        cols, n = doc["columns"], doc["n"]
        sealed_at = float(doc["sealed_at"])
        if version == 1:
            cols = decode_v1_columns(cols, n)
        add_legacy_columns(cols, n, version)
        _check_columns(cols, n)
        entries = entries_from_columns(cols, [pack_id] * n)
        writer_id = doc["writer_id"]
        if type(writer_id) is not str:
            raise ValueError(f"writer id {writer_id!r} is not a string")
    except (KeyError, ValueError, TypeError, IndexError, zstandard.ZstdError) as exc:
        raise PackCorruptError(f"pack {pack_id}: unreadable record index ({exc}); no record of it can be trusted: restore the pack from a copy or recapture it") from exc
    return entries, sealed_at, writer_id


_INDEX_COLUMNS = (
    *((f.name, f.arrow, f.nullable) for f in RECORD_FIELDS),
    *((name, arrow, False) for name, arrow, _ in PAYLOAD_FIELDS),
)
"""Every column of a decoded index: its name, the Arrow type its values must fit, nullability."""

_INTEGER_RANGES = {pa.int32(): (-(2**31), 2**31 - 1), pa.int64(): (-(2**63), 2**63 - 1), pa.uint64(): (0, 2**64 - 1)}

_SIZES = ("shape", "full_shape")
"""List columns of dimension sizes, which cannot be negative."""


def _check_columns(cols: dict, n: int) -> None:
    """Refuse (``ValueError``) an index column that does not hold ``n`` values of its type.

    The zstd checksum proves the index is the one written, not that a DMI writer wrote it: a
    crafted index could hold a list where a name goes (unhashable), a float or negative shape,
    or an offset past 2**64, each failing later as a raw ``TypeError``/``OverflowError`` in the
    reader, or be published by catalog recovery. A few C-level passes per column, so a 10,000
    record index stays cheap to check."""
    for name, arrow, nullable in _INDEX_COLUMNS:
        values = cols[name]
        if len(values) != n:
            raise ValueError(f"index column {name} holds {len(values)} values for {n} records")
        present = [v for v in values if v is not None] if nullable else values
        sizes = name in _SIZES
        if not _fits(present, arrow, sizes=sizes):
            misfit = next(v for v in present if not _fits([v], arrow, sizes=sizes))
            raise ValueError(f"index column {name} holds {misfit!r}, not a value of type {arrow}")


def _fits(values: list, arrow: pa.DataType, *, sizes: bool) -> bool:
    """Whether every one of ``values`` is a value of ``arrow``; with ``sizes``, a list of
    dimension sizes, none negative."""
    if pa.types.is_string(arrow):
        return all(type(v) is str for v in values)
    if pa.types.is_floating(arrow):
        return all(type(v) is float or type(v) is int for v in values)
    if pa.types.is_list(arrow):
        low, high = _INTEGER_RANGES[arrow.value_type]
        return all(type(v) is list for v in values) and _ints_in([i for v in values for i in v], 0 if sizes else low, high)
    return _ints_in(values, *_INTEGER_RANGES[arrow])


def _ints_in(values: list, low: int, high: int) -> bool:
    """Whether ``values`` are all ``int`` (not ``bool``) in ``[low, high]``."""
    return all(type(v) is int for v in values) and (not values or (low <= min(values) and max(values) <= high))
