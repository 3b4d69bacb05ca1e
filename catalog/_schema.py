"""The catalog's tables, their Arrow schemas, and conversions to and from value objects.

Every statement here runs unchanged on ClickHouse 18.16 (Debian's server) and on chDB
(ClickHouse 26.x): no Map, no DateTime64 (times are Float64 Unix seconds), no server-side
``{x:Type}`` parameters, no LowCardinality, plain (Replacing)MergeTree engines. Idempotency
never relies on insert deduplication (non-replicated tables have none): index rows are
keyed so a duplicate collapses (ReplacingMergeTree) and queries read them with
``LIMIT 1 BY`` so duplicates are invisible even before a merge.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

import pyarrow as pa

from dmi.catalog._audits import AUDITS_DDL
from dmi.storage.records import (
    ByteRange,
    PackDescriptor,
    RecordEntry,
    RecordKey,
    RecordMeta,
    RecordStats,
    ShardGeometry,
)

SCHEMA_VERSION = 2
"""Bump when a table changes shape; a catalog with a higher version row is refused. An older
catalog is upgraded in place: the new tables are created (``IF NOT EXISTS``) and a row with
the new version is added. History: 1 initial; 2 adds ``audits``."""

TABLES = ("schema", "packs", "records", "leases", "fences", "watermarks", "losses", "audits")

_DDL = {
    "schema": """
        CREATE TABLE IF NOT EXISTS {schema} (
            version UInt32, written_at Float64, written_by String
        ) ENGINE = MergeTree ORDER BY version""",
    "packs": """
        CREATE TABLE IF NOT EXISTS {packs} (
            pack_id String, location String, size UInt64, n_records UInt64,
            writer_id String, format_version UInt32, sealed_at Float64,
            scope String, term UInt64, indexed_at Float64
        ) ENGINE = ReplacingMergeTree ORDER BY pack_id""",
    "records": """
        CREATE TABLE IF NOT EXISTS {records} (
            model_id String, run_id String, request_id String, hook String, layer Int32,
            start_token Int64, n_tokens Int64, step Int64, phase String,
            shard_rank Int32, tp_size Int32,
            dtype String, shape Array(Int64), codec String, raw_size UInt64, checksum UInt64,
            shard_axis Int32, shard_offset Int64, full_shape Array(Int64),
            l2_norm Nullable(Float64), mean Nullable(Float64), absmax Nullable(Float64),
            pack_id String, record_index UInt32, payload_offset UInt64, payload_length UInt64
        ) ENGINE = ReplacingMergeTree
        ORDER BY (model_id, request_id, hook, layer, start_token, shard_rank, pack_id, record_index)""",
    "leases": """
        CREATE TABLE IF NOT EXISTS {leases} (
            scope String, term UInt64, kind String, holder String, nonce String,
            expires_at Float64, written_at Float64
        ) ENGINE = MergeTree ORDER BY (scope, term, written_at)""",
    "fences": """
        CREATE TABLE IF NOT EXISTS {fences} (
            scope String, fencing_term UInt64, cut_term UInt64, cut_seq UInt64,
            holder String, nonce String, written_at Float64
        ) ENGINE = MergeTree ORDER BY (scope, fencing_term)""",
    "watermarks": """
        CREATE TABLE IF NOT EXISTS {watermarks} (
            scope String, term UInt64, seq UInt64, holder String, nonce String,
            pack_ids Array(String), n_records UInt64, published_at Float64
        ) ENGINE = MergeTree ORDER BY (scope, term, seq)""",
    "losses": """
        CREATE TABLE IF NOT EXISTS {losses} (
            model_id String, run_id String, request_id String, hook String, layer Int32,
            count UInt64, reason String, recorded_by String, recorded_at Float64
        ) ENGINE = MergeTree ORDER BY (model_id, run_id, request_id, hook, layer, recorded_at)""",
    "audits": AUDITS_DDL,
}

# Watermarks readers may see: not cut off by any fence a later term wrote.
# A fence (fencing_term F, cut (ct, cs)) hides every watermark of a term < F that sorts
# after (ct, cs); the successor computed the cut on the server at fence time.
# ClickHouse 18.16 prunes subquery columns that are used only inside a lambda, so the
# flag also names ``term`` and ``seq`` outside it (``term >= 0 AND seq >= 0``).
VISIBLE_WATERMARKS = """
    SELECT scope, term, seq, holder, nonce, pack_ids, n_records, published_at FROM (
        SELECT scope, term, seq, holder, nonce, pack_ids, n_records, published_at,
               arrayAll((ft, ct, cs) -> ft <= term OR term < ct OR (term = ct AND seq <= cs),
                        f_terms, f_cut_terms, f_cut_seqs) AND term >= 0 AND seq >= 0 AS visible
        FROM {watermarks}
        ANY LEFT JOIN (
            SELECT scope, groupArray(fencing_term) AS f_terms, groupArray(cut_term) AS f_cut_terms,
                   groupArray(cut_seq) AS f_cut_seqs
            FROM {fences} GROUP BY scope
        ) AS fence_cuts USING scope
    )
    WHERE visible"""

PUBLISHED_PACK_IDS = "SELECT DISTINCT arrayJoin(pack_ids) AS pack_id FROM (" + VISIBLE_WATERMARKS + ")"

# A view over published, unfenced records for raw SQL users (one row per record).
PUBLISHED_RECORDS_VIEW = """
    CREATE VIEW IF NOT EXISTS {records_published} AS
    SELECT * FROM {records}
    WHERE pack_id IN (""" + PUBLISHED_PACK_IDS + """)
    LIMIT 1 BY pack_id, record_index"""


def ddl_statements(names: dict[str, str]) -> list[str]:
    """CREATE statements for every table, formatted with quoted, qualified names."""
    return [_DDL[table].format(**names) for table in TABLES] + [PUBLISHED_RECORDS_VIEW.format(**names)]


RECORD_SCHEMA = pa.schema(
    [
        ("model_id", pa.string()),
        ("run_id", pa.string()),
        ("request_id", pa.string()),
        ("hook", pa.string()),
        ("layer", pa.int32()),
        ("start_token", pa.int64()),
        ("n_tokens", pa.int64()),
        ("step", pa.int64()),
        ("phase", pa.string()),
        ("shard_rank", pa.int32()),
        ("tp_size", pa.int32()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("codec", pa.string()),
        ("raw_size", pa.uint64()),
        ("checksum", pa.uint64()),
        ("shard_axis", pa.int32()),
        ("shard_offset", pa.int64()),
        ("full_shape", pa.list_(pa.int64())),
        ("l2_norm", pa.float64()),
        ("mean", pa.float64()),
        ("absmax", pa.float64()),
        ("pack_id", pa.string()),
        ("record_index", pa.uint32()),
        ("payload_offset", pa.uint64()),
        ("payload_length", pa.uint64()),
    ]
)
RECORD_COLUMNS = tuple(RECORD_SCHEMA.names)

PACK_SCHEMA = pa.schema(
    [
        ("pack_id", pa.string()),
        ("location", pa.string()),
        ("size", pa.uint64()),
        ("n_records", pa.uint64()),
        ("writer_id", pa.string()),
        ("format_version", pa.uint32()),
        ("sealed_at", pa.float64()),
        ("scope", pa.string()),
        ("term", pa.uint64()),
        ("indexed_at", pa.float64()),
    ]
)

LEASE_SCHEMA = pa.schema(
    [
        ("scope", pa.string()),
        ("term", pa.uint64()),
        ("kind", pa.string()),
        ("holder", pa.string()),
        ("nonce", pa.string()),
        ("expires_at", pa.float64()),
        ("written_at", pa.float64()),
    ]
)

WATERMARK_SCHEMA = pa.schema(
    [
        ("scope", pa.string()),
        ("term", pa.uint64()),
        ("seq", pa.uint64()),
        ("holder", pa.string()),
        ("nonce", pa.string()),
        ("pack_ids", pa.list_(pa.string())),
        ("n_records", pa.uint64()),
        ("published_at", pa.float64()),
    ]
)

LOSS_SCHEMA = pa.schema(
    [
        ("model_id", pa.string()),
        ("run_id", pa.string()),
        ("request_id", pa.string()),
        ("hook", pa.string()),
        ("layer", pa.int32()),
        ("count", pa.uint64()),
        ("reason", pa.string()),
        ("recorded_by", pa.string()),
        ("recorded_at", pa.float64()),
    ]
)

SCHEMA_ROW = pa.schema([("version", pa.uint32()), ("written_at", pa.float64()), ("written_by", pa.string())])


def records_table(descriptors: Iterable[PackDescriptor]) -> pa.Table:
    """One Arrow row per record of every descriptor, in RECORD_SCHEMA (column at a time)."""
    descriptors = list(descriptors)
    entries = [entry for d in descriptors for entry in d.records]
    metas = list(map(_get_meta, entries))
    keys = list(map(_get_key, metas))
    shards = list(map(_get_shard, metas))
    stats = list(map(_get_stats, metas))
    payloads = list(map(_get_payload, entries))
    pack_ids: list[str] = []
    indices: list[int] = []
    for d in descriptors:
        n = len(d.records)
        pack_ids.extend([d.pack_id] * n)
        indices.extend(range(n))
    sharded = any(s is not None for s in shards)
    with_stats = [s for s in stats if s is not None]
    n = len(entries)

    def keycol(name):
        return list(map(attrgetter(name), keys))

    def statcol(name):
        if not with_stats:
            return [None] * n
        if len(with_stats) == n:
            return list(map(attrgetter(name), stats))
        return [None if s is None else getattr(s, name) for s in stats]

    columns = {
        "model_id": keycol("model_id"),
        "run_id": keycol("run_id"),
        "request_id": keycol("request_id"),
        "hook": keycol("hook"),
        "layer": keycol("layer"),
        "start_token": keycol("start_token"),
        "n_tokens": keycol("n_tokens"),
        "step": keycol("step"),
        "phase": keycol("phase"),
        "shard_rank": keycol("shard_rank"),
        "tp_size": keycol("tp_size"),
        "dtype": list(map(attrgetter("dtype"), metas)),
        "shape": list(map(attrgetter("shape"), metas)),
        "codec": list(map(attrgetter("codec"), metas)),
        "raw_size": list(map(attrgetter("raw_size"), metas)),
        "checksum": list(map(attrgetter("checksum"), metas)),
        "shard_axis": [-1 if s is None else s.axis for s in shards] if sharded else [-1] * n,
        "shard_offset": [0 if s is None else s.offset for s in shards] if sharded else [0] * n,
        "full_shape": [() if s is None else s.full_shape for s in shards] if sharded else [()] * n,
        "l2_norm": statcol("l2_norm"),
        "mean": statcol("mean"),
        "absmax": statcol("absmax"),
        "pack_id": pack_ids,
        "record_index": indices,
        "payload_offset": list(map(attrgetter("offset"), payloads)),
        "payload_length": list(map(attrgetter("length"), payloads)),
    }
    return pa.Table.from_arrays(
        [pa.array(columns[field.name], type=field.type) for field in RECORD_SCHEMA], schema=RECORD_SCHEMA
    )


_get_meta = attrgetter("meta")
_get_key = attrgetter("key")
_get_shard = attrgetter("shard")
_get_stats = attrgetter("stats")
_get_payload = attrgetter("payload")


def packs_table(descriptors: Sequence[PackDescriptor], *, scope: str, term: int, now: float) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "pack_id": d.pack_id,
                "location": d.location,
                "size": d.size,
                "n_records": len(d.records),
                "writer_id": d.writer_id,
                "format_version": d.format_version,
                "sealed_at": float(d.sealed_at),
                "scope": scope,
                "term": term,
                "indexed_at": now,
            }
            for d in descriptors
        ],
        schema=PACK_SCHEMA,
    )


def entries_from_table(table: pa.Table) -> list[RecordEntry]:
    """Turn rows in RECORD_SCHEMA (any column order, extra columns ignored) into RecordEntry."""
    cols = {name: table.column(name).to_pylist() for name in RECORD_COLUMNS}
    entries = []
    for i in range(table.num_rows):
        axis = cols["shard_axis"][i]
        shard = (
            None
            if axis is None or axis < 0
            else ShardGeometry(int(axis), int(cols["shard_offset"][i]), tuple(cols["full_shape"][i]))
        )
        l2 = cols["l2_norm"][i]
        stats = None if l2 is None else RecordStats(l2, cols["mean"][i], cols["absmax"][i])
        key = RecordKey(
            model_id=cols["model_id"][i],
            run_id=cols["run_id"][i],
            request_id=cols["request_id"][i],
            hook=cols["hook"][i],
            layer=int(cols["layer"][i]),
            start_token=int(cols["start_token"][i]),
            n_tokens=int(cols["n_tokens"][i]),
            step=int(cols["step"][i]),
            phase=cols["phase"][i],
            shard_rank=int(cols["shard_rank"][i]),
            tp_size=int(cols["tp_size"][i]),
        )
        meta = RecordMeta(
            key=key,
            dtype=cols["dtype"][i],
            shape=tuple(cols["shape"][i]),
            codec=cols["codec"][i],
            raw_size=int(cols["raw_size"][i]),
            checksum=int(cols["checksum"][i]),
            shard=shard,
            stats=stats,
        )
        entries.append(
            RecordEntry(
                meta=meta,
                pack_id=cols["pack_id"][i],
                payload=ByteRange(int(cols["payload_offset"][i]), int(cols["payload_length"][i])),
            )
        )
    return entries
