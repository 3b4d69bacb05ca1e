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

import numpy as np
import pyarrow as pa

from dmi.catalog._audits import AUDITS_DDL
from dmi.storage.record_schema import PAYLOAD_FIELDS, RECORD_FIELDS, entries_from_columns, field_columns
from dmi.storage.records import PackDescriptor, RecordEntry

SCHEMA_VERSION = 4
"""Bump when a table changes shape; a catalog with a higher version row is refused, one with
a lower version is upgraded in place when opened: missing record columns are added
(:func:`record_column_upgrades`), then :data:`UPGRADES` run, then the idempotent CREATEs.

Version 2: records gain the token layout (``token_axis``, ``key_axis``); ``deletions``
(tombstones) is added and ``records_published`` honours them; ``audits`` (what
``dmi audit`` checked and found) is added. Version 3: records gain the writer's data- and
pipeline-parallel ranks (``dp_rank``, ``pp_rank``). Version 4: records gain what a lossy
codec lost (``codec_max_abs_error``, ``codec_rel_l2_error``)."""

_LOCATION_FIELDS = (("pack_id", pa.string(), "String"), ("record_index", pa.uint32(), "UInt32"), *PAYLOAD_FIELDS)
"""Index-only columns of a record row: which pack, which record in it, which bytes."""

_RECORD_COLUMNS_DDL = ",\n            ".join(
    [f"{f.name} {f.clickhouse}" for f in RECORD_FIELDS] + [f"{name} {ch}" for name, _, ch in _LOCATION_FIELDS]
)

TABLES = ("schema", "packs", "records", "leases", "fences", "watermarks", "losses", "deletions", "audits")

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
            """ + _RECORD_COLUMNS_DDL.replace("{", "{{").replace("}", "}}") + """
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
    "deletions": """
        CREATE TABLE IF NOT EXISTS {deletions} (
            deletion_id String, model_id String, run_id String, pack_ids Array(String),
            n_records UInt64, deleted_by String, deleted_at Float64
        ) ENGINE = MergeTree ORDER BY (model_id, run_id, deletion_id)""",
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

# Records a tombstone hides: one (pack, model, run) triple per pack a deletion named. A
# record is hidden iff its own triple is here, so a pack that also holds another run's
# records keeps showing those.
DELETED_TRIPLES = "SELECT pack_id, model_id, run_id FROM {deletions} ARRAY JOIN pack_ids AS pack_id"
NOT_DELETED = "(pack_id, model_id, run_id) NOT IN (" + DELETED_TRIPLES + ")"

# A view over published, unfenced, undeleted records for raw SQL users (one row per record).
PUBLISHED_RECORDS_VIEW = """
    CREATE VIEW IF NOT EXISTS {records_published} AS
    SELECT * FROM {records}
    WHERE pack_id IN (""" + PUBLISHED_PACK_IDS + """) AND """ + NOT_DELETED + """
    LIMIT 1 BY pack_id, record_index"""

UPGRADES = {
    2: ["DROP TABLE IF EXISTS {records_published}"],
    3: ["DROP TABLE IF EXISTS {records_published}"],
    4: ["DROP TABLE IF EXISTS {records_published}"],
}
"""Statements that bring a catalog of an older version up to a newer one, by the version
they lead to; run after the record columns are added and before the (idempotent) CREATE
statements re-create what they drop. Version 2 re-creates ``records_published`` so that
it has the new record columns and honours tombstones; version 3 re-creates it with the
parallel-rank columns (its ``SELECT *`` was expanded when it was made), version 4 with the
codec-error columns."""


def ddl_statements(names: dict[str, str]) -> list[str]:
    """CREATE statements for every table, formatted with quoted, qualified names."""
    return [_DDL[table].format(**names) for table in TABLES] + [PUBLISHED_RECORDS_VIEW.format(**names)]


def upgrade_statements(found: int, names: dict[str, str]) -> list[str]:
    """What turns a catalog at version ``found`` into one at :data:`SCHEMA_VERSION`, once its
    records table has every column (:func:`record_column_upgrades`)."""
    return [
        statement.format(**names)
        for version in range(found + 1, SCHEMA_VERSION + 1)
        for statement in UPGRADES.get(version, [])
    ]


def record_column_upgrades(names: dict[str, str], existing_columns: Iterable[str]) -> list[str]:
    """ALTERs that bring an older records table up to :data:`RECORD_FIELDS`.

    Each missing field is added at the end with its ``legacy`` expression (what rows
    written before the field existed mean) as the column default, so old rows read back
    exactly as an old pack of the same records does.
    """
    have = set(existing_columns)
    return [
        f"ALTER TABLE {names['records']} ADD COLUMN {f.name} {f.clickhouse} DEFAULT {f.legacy}"
        for f in RECORD_FIELDS
        if f.legacy is not None and f.name not in have
    ]


RECORD_SCHEMA = pa.schema(
    [(f.name, f.arrow) for f in RECORD_FIELDS] + [(name, arrow) for name, arrow, _ in _LOCATION_FIELDS]
)
"""Arrow schema of a records-table row: every record field, then where its bytes are."""
RECORD_COLUMNS = tuple(RECORD_SCHEMA.names)

PACKS_TABLE_SCHEMA = pa.schema(
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

DELETION_SCHEMA = pa.schema(
    [
        ("deletion_id", pa.string()),
        ("model_id", pa.string()),
        ("run_id", pa.string()),
        ("pack_ids", pa.list_(pa.string())),
        ("n_records", pa.uint64()),
        ("deleted_by", pa.string()),
        ("deleted_at", pa.float64()),
    ]
)

SCHEMA_ROW = pa.schema([("version", pa.uint32()), ("written_at", pa.float64()), ("written_by", pa.string())])


def records_table(descriptors: Iterable[PackDescriptor]) -> pa.Table:
    """One Arrow row per record of every descriptor, in RECORD_SCHEMA (column at a time)."""
    descriptors = list(descriptors)
    entries = [entry for d in descriptors for entry in d.records]
    columns = field_columns([e.meta for e in entries])
    columns["pack_id"] = [d.pack_id for d in descriptors for _ in d.records]
    columns["record_index"] = [i for d in descriptors for i in range(len(d.records))]
    columns["payload_offset"] = [e.payload.offset for e in entries]
    columns["payload_length"] = [e.payload.length for e in entries]
    return pa.Table.from_arrays(
        [pa.array(columns[field.name], type=field.type) for field in RECORD_SCHEMA], schema=RECORD_SCHEMA
    )


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
        schema=PACKS_TABLE_SCHEMA,
    )


def entries_from_table(table: pa.Table) -> list[RecordEntry]:
    """Turn rows in RECORD_SCHEMA (any column order, extra columns ignored) into RecordEntry."""
    cols = {name: table.column(name).to_pylist() for name in RECORD_COLUMNS}
    return entries_from_columns(cols, cols["pack_id"])


def string_array(values: pa.ChunkedArray | Sequence[str]) -> pa.Array:
    """``values`` (a column of strings a query returned, or a list of ``str``) as one string
    array. Built from the column's own chunks, or from the list's UTF-8 bytes and their offsets,
    never by ``pa.array(list)``: that imports pandas where it is installed, which every
    process's first read (``find_records``, with the keys deletions hide) would otherwise pay
    (``dmi show``'s 0.18 s, docs/cli.md)."""
    if isinstance(values, pa.ChunkedArray):
        column = pa.concat_arrays(values.chunks) if values.num_chunks else pa.nulls(0, values.type)
        return column if column.type == pa.string() else column.cast(pa.string())
    encoded = [value.encode() for value in values]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    column = pa.LargeStringArray.from_buffers(len(encoded), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded)))
    return column.cast(pa.string())
