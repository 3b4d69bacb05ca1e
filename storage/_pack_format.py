"""Pack format v1: the Arrow schema, its metadata, the record index and dtype names.

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
from dmi.storage.errors import PackCorruptError, PackFormatError, UnsupportedDtypeError
from dmi.storage.records import ByteRange, RecordEntry, RecordKey, RecordMeta, RecordStats, ShardGeometry

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PACK_SUFFIX",
    "PACK_SCHEMA",
    "dtype_name",
    "torch_dtype",
    "is_pack_id",
    "schema_with_metadata",
    "check_schema",
    "encode_index",
    "decode_index",
]

FORMAT_NAME = "dmi-pack"
FORMAT_VERSION = 1

META_FORMAT = b"dmi.format"
META_VERSION = b"dmi.format_version"
META_PACK_ID = b"dmi.pack_id"
META_WRITER_ID = b"dmi.writer_id"
META_INDEX = b"dmi.index"


_list_i64 = pa.list_(pa.int64())

PACK_SCHEMA = pa.schema(
    [
        ("model_id", pa.string()),
        ("run_id", pa.string()),
        ("request_id", pa.string()),
        ("hook", pa.string()),
        ("layer", pa.int32()),
        ("shard_rank", pa.int32()),
        ("tp_size", pa.int32()),
        ("start_token", pa.int64()),
        ("n_tokens", pa.int64()),
        ("step", pa.int64()),
        ("phase", pa.string()),
        ("dtype", pa.string()),
        ("shape", _list_i64),
        ("shard_axis", pa.int32()),
        ("shard_offset", pa.int64()),
        ("shard_full_shape", _list_i64),
        ("codec", pa.string()),
        ("raw_size", pa.int64()),
        ("checksum", pa.uint64()),
        ("stat_l2_norm", pa.float64()),
        ("stat_mean", pa.float64()),
        ("stat_absmax", pa.float64()),
        # Must stay the last column: its data buffer is then the last buffer of each
        # batch body, which is how the writer knows every payload's file offset.
        ("payload", pa.large_binary()),
    ]
)
"""Columns of a v1 pack, in order. Nullable: shard_axis/offset (unsharded), stat_* (no stats)."""


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
    return PACK_SCHEMA.with_metadata(
        {
            META_FORMAT: FORMAT_NAME.encode(),
            META_VERSION: str(FORMAT_VERSION).encode(),
            META_PACK_ID: pack_id.encode(),
            META_WRITER_ID: writer_id.encode(),
        }
    )


def check_schema(schema: pa.Schema, pack_id: str) -> str:
    """Refuse anything that is not a v1 DMI pack named ``pack_id``; return its writer id."""
    meta = schema.metadata or {}
    if meta.get(META_FORMAT) != FORMAT_NAME.encode():
        raise PackFormatError(f"pack {pack_id}: not a DMI pack (no {META_FORMAT.decode()} metadata)")
    version = meta.get(META_VERSION, b"?").decode(errors="replace")
    if version != str(FORMAT_VERSION):
        raise PackFormatError(
            f"pack {pack_id}: format version {version}, this code reads version {FORMAT_VERSION}"
        )
    if meta.get(META_PACK_ID, b"").decode(errors="replace") != pack_id:
        raise PackFormatError(
            f"pack {pack_id}: file says it is pack {meta.get(META_PACK_ID, b'?').decode(errors='replace')}"
        )
    if not schema.remove_metadata().equals(PACK_SCHEMA):
        raise PackFormatError(f"pack {pack_id}: columns differ from format version {FORMAT_VERSION}")
    return meta.get(META_WRITER_ID, b"").decode()


# --- the record index ---------------------------------------------------------------
# Columnar JSON (one list per field), zstd-compressed, base64 so the flatbuffer string
# stays ASCII for every Arrow implementation; the zstd frame carries a content checksum
# so a damaged index is refused, never misread.

_KEY_FIELDS = RecordKey.__slots__


def encode_index(entries: list[RecordEntry], sealed_at: float, writer_id: str) -> dict[bytes, bytes]:
    """Custom metadata of the index batch for ``entries`` (all of one pack).

    Everything lives inside the checksummed blob; the writer id is repeated there so
    that damage to the unchecksummed schema metadata cannot go unnoticed.
    """
    cols: dict[str, list] = {f: [] for f in _KEY_FIELDS}
    extra = ("dtype", "shape", "codec", "raw_size", "checksum", "shard", "stats", "offset", "length")
    cols.update({f: [] for f in extra})
    for e in entries:
        m = e.meta
        for f in _KEY_FIELDS:
            cols[f].append(getattr(m.key, f))
        cols["dtype"].append(m.dtype)
        cols["shape"].append(list(m.shape))
        cols["codec"].append(m.codec)
        cols["raw_size"].append(m.raw_size)
        cols["checksum"].append(m.checksum)
        cols["shard"].append(None if m.shard is None else [m.shard.axis, m.shard.offset, list(m.shard.full_shape)])
        cols["stats"].append(None if m.stats is None else [m.stats.l2_norm, m.stats.mean, m.stats.absmax])
        cols["offset"].append(e.payload.offset)
        cols["length"].append(e.payload.length)
    blob = json.dumps({"n": len(entries), "writer_id": writer_id, "sealed_at": sealed_at, "columns": cols}, separators=(",", ":"), allow_nan=True)
    packed = base64.b64encode(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(blob.encode()))
    return {META_INDEX: packed}


def decode_index(metadata, pack_id: str) -> tuple[list[RecordEntry], float, str]:
    """Entries, seal time and writer id from the index batch's custom metadata."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(metadata[META_INDEX], validate=True))
        doc = json.loads(raw)
        cols, n = doc["columns"], doc["n"]
        sealed_at = float(doc["sealed_at"])
        entries = [_entry_from_columns(cols, i, pack_id) for i in range(n)]
        writer_id = doc["writer_id"]
    except (KeyError, ValueError, TypeError, IndexError, zstandard.ZstdError) as exc:
        raise PackCorruptError(f"pack {pack_id}: unreadable record index ({exc})") from exc
    return entries, sealed_at, writer_id


def _entry_from_columns(cols: dict, i: int, pack_id: str) -> RecordEntry:
    key = RecordKey(**{f: cols[f][i] for f in _KEY_FIELDS})
    shard = cols["shard"][i]
    stats = cols["stats"][i]
    meta = RecordMeta(
        key=key,
        dtype=cols["dtype"][i],
        shape=tuple(cols["shape"][i]),
        codec=cols["codec"][i],
        raw_size=cols["raw_size"][i],
        checksum=cols["checksum"][i],
        shard=None if shard is None else ShardGeometry(shard[0], shard[1], tuple(shard[2])),
        stats=None if stats is None else RecordStats(*stats),
    )
    return RecordEntry(meta=meta, pack_id=pack_id, payload=ByteRange(cols["offset"][i], cols["length"][i]))
