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
import json

import pyarrow as pa
import torch
import zstandard

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


def _build_dtype_table() -> dict[str, torch.dtype]:
    table = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[str(value).removeprefix("torch.")] = value
    return table


_DTYPES = _build_dtype_table()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: the canonical name stored in packs and the catalog."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise UnsupportedDtypeError(f"dtype {dtype} has no canonical name")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; unknown names raise :class:`UnsupportedDtypeError`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {name!r} is not a torch dtype this build knows (torch {torch.__version__})"
        ) from None


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

_PAYLOAD_NAMES = tuple(name for name, _, _ in PAYLOAD_FIELDS)


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
        if any(len(cols[name]) != n for name in [*(f.name for f in RECORD_FIELDS), *_PAYLOAD_NAMES]):
            raise ValueError(f"index columns do not all hold {n} records")
        entries = entries_from_columns(cols, [pack_id] * n)
        writer_id = doc["writer_id"]
    except (KeyError, ValueError, TypeError, IndexError, zstandard.ZstdError) as exc:
        raise PackCorruptError(f"pack {pack_id}: unreadable record index ({exc})") from exc
    return entries, sealed_at, writer_id
