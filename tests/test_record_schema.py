"""One record schema: the pack rows, the footer index, the catalog DDL and its Arrow schema
all come from storage/record_schema.RECORD_FIELDS, and agree field by field."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
import torch

from dmi.catalog import _schema as catalog_schema
from dmi.catalog import open_catalog
from dmi.storage import PackStore, PackWriter, RecordKey, ShardGeometry, read_pack_descriptor
from dmi.storage._pack_format import PACK_ROW_SCHEMA
from dmi.storage.record_schema import PAYLOAD_FIELDS, RECORD_FIELDS, field_columns, metas_from_columns

# The one correspondence the schema relies on: which ClickHouse type each Arrow type is.
CLICKHOUSE_OF_ARROW = {
    pa.string(): "String",
    pa.int32(): "Int32",
    pa.int64(): "Int64",
    pa.uint32(): "UInt32",
    pa.uint64(): "UInt64",
    pa.float64(): "Float64",
    pa.list_(pa.int64()): "Array(Int64)",
}


def test_field_types_agree_between_arrow_and_clickhouse():
    for f in RECORD_FIELDS:
        base = f.clickhouse.removeprefix("Nullable(").removesuffix(")") if f.nullable else f.clickhouse
        assert CLICKHOUSE_OF_ARROW[f.arrow] == base, f.name
        if f.nullable:
            assert f.absent is None, f"{f.name}: stored as null when absent"
        if f.group in ("shard", "stats") or f.name == "key_axis":  # may be None in Python
            assert f.nullable or f.absent is not None, f"{f.name}: no way to store None"
        if f.since > 1:  # older catalogs and older packs must both learn what it meant before
            assert f.legacy is not None and f.legacy_of is not None, f.name


def test_pack_rows_are_the_record_fields_then_the_payload():
    assert PACK_ROW_SCHEMA.names == [f.name for f in RECORD_FIELDS] + ["payload"]
    for f in RECORD_FIELDS:
        assert PACK_ROW_SCHEMA.field(f.name).type == f.arrow, f.name


def test_catalog_arrow_schema_and_ddl_are_the_record_fields():
    names = [f.name for f in RECORD_FIELDS]
    assert list(catalog_schema.RECORD_COLUMNS[: len(names)]) == names
    assert catalog_schema.RECORD_COLUMNS[len(names):] == ("pack_id", "record_index", *(n for n, _, _ in PAYLOAD_FIELDS))
    ddl = catalog_schema.ddl_statements({t: t for t in (*catalog_schema.TABLES, "records_published")})
    records_ddl = next(s for s in ddl if "TABLE IF NOT EXISTS records (" in s)
    declared = re.findall(r"^\s*(\w+) ([\w()]+),?$", records_ddl, re.M)
    assert declared[: len(names)] == [(f.name, f.clickhouse) for f in RECORD_FIELDS]
    for f in RECORD_FIELDS:
        assert catalog_schema.RECORD_SCHEMA.field(f.name).type == f.arrow, f.name


def test_only_one_pack_schema_name():
    """The pack's row schema and the catalog's packs table had the same constant name."""
    assert not hasattr(catalog_schema, "PACK_SCHEMA")
    assert catalog_schema.PACKS_TABLE_SCHEMA.names[0] == "pack_id"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A pack with a sharded record with stats, a pattern-layout record, and one with neither."""
    store = PackStore.local(tmp_path_factory.mktemp("schema"))
    key = lambda hook, n, **kw: RecordKey("m", "r", "q", hook, 0, 0, n, **kw)  # noqa: E731
    with PackWriter(store, stats=True) as w:
        w.append(key("attn_q", 3, shard_rank=1, tp_size=2), torch.randn(3, 2, 4), shard=ShardGeometry(1, 2, (3, 4, 4)))
        w.append(key("attn_pattern", 2), torch.rand(4, 2, 2).to(torch.float16), token_axis=1, key_axis=2)
        w.append(key("embed", 0), torch.empty(0, 8))
        descriptor = w.seal()
    return store, descriptor


def test_every_encoding_holds_the_same_values(written):
    """Footer index (the descriptor), pack rows and catalog Arrow rows: the same value per
    field, and each decodes back to the same RecordMeta."""
    store, descriptor = written
    metas = [e.meta for e in descriptor.records]
    assert [m.token_axis for m in metas] == [0, 1, 0] and [m.key_axis for m in metas] == [None, 2, None]
    assert metas[0].shard == ShardGeometry(1, 2, (3, 4, 4)) and metas[0].stats is not None
    assert metas[2].shard is None and metas[2].stats is None
    with pa.memory_map(store.location(descriptor.pack_id)) as source:
        rows = pa.ipc.open_file(source).read_all().slice(0, len(metas)).to_pylist()
    catalog_rows = catalog_schema.records_table([descriptor]).to_pylist()
    for meta, row, crow in zip(metas, rows, catalog_rows):
        encoded = field_columns([meta])
        for f in RECORD_FIELDS:
            (expected,) = encoded[f.name]
            expected = list(expected) if isinstance(expected, tuple) else expected
            assert row[f.name] == expected, (f.name, row[f.name], expected)
            assert crow[f.name] == expected, (f.name, crow[f.name], expected)
        for decoded in (row, crow):
            assert metas_from_columns({name: [value] for name, value in decoded.items()}) == [meta]
    assert catalog_schema.entries_from_table(catalog_schema.records_table([descriptor])) == list(descriptor.records)
    assert read_pack_descriptor(store, descriptor.pack_id) == descriptor


def test_real_catalog_columns_and_round_trip(written, tmp_path):
    """chDB's own description of the table matches the fields; a published record comes back equal."""
    store, descriptor = written
    with open_catalog(f"chdb://{tmp_path / 'cat'}") as catalog:
        described = catalog.sql(f"DESCRIBE TABLE {catalog.tables['records']}").to_pylist()
        types = {r["name"]: r["type"] for r in described}
        assert {f.name: types[f.name] for f in RECORD_FIELDS} == {f.name: f.clickhouse for f in RECORD_FIELDS}
        publisher = catalog.publisher("scope")
        publisher.acquire()
        publisher.publish([descriptor])
        found = catalog.find_records(model_id="m")
    key = lambda e: e.meta.key.hook  # noqa: E731
    assert sorted(found, key=key) == sorted(descriptor.records, key=key)


V1_CATALOG = """
import chdb
conn = chdb.connect({path!r})
cur = conn.cursor()
for sql in [
    "CREATE DATABASE IF NOT EXISTS dmi",
    "CREATE TABLE dmi.dmi_schema (version UInt32, written_at Float64, written_by String) ENGINE = MergeTree ORDER BY version",
    "INSERT INTO dmi.dmi_schema VALUES (1, 0, 'dmi')",
    '''CREATE TABLE dmi.dmi_records (
        model_id String, run_id String, request_id String, hook String, layer Int32,
        start_token Int64, n_tokens Int64, step Int64, phase String, shard_rank Int32, tp_size Int32,
        dtype String, shape Array(Int64), codec String, raw_size UInt64, checksum UInt64,
        shard_axis Int32, shard_offset Int64, full_shape Array(Int64),
        l2_norm Nullable(Float64), mean Nullable(Float64), absmax Nullable(Float64),
        pack_id String, record_index UInt32, payload_offset UInt64, payload_length UInt64
    ) ENGINE = ReplacingMergeTree
    ORDER BY (model_id, request_id, hook, layer, start_token, shard_rank, pack_id, record_index)''',
    "INSERT INTO dmi.dmi_records VALUES ('m','r','q','attn_pattern',0,0,2,0,'prefill',0,1,'float16',[4,2,2],"
    "'raw',32,1,-1,0,[],NULL,NULL,NULL,'{pack}',0,8,32)",
    "INSERT INTO dmi.dmi_records VALUES ('m','r','q','resid_post',0,0,2,0,'prefill',0,1,'float32',[2,8],"
    "'raw',64,2,-1,0,[],1.0,0.5,0.9,'{pack}',1,40,64)",
    *{extra},
]:
    cur.execute(sql)
conn.close()
"""


def test_schema_v1_catalog_is_upgraded_in_place(tmp_path):
    """A catalog written by schema version 1 gains the layout columns, with the values v1 implied."""
    path = tmp_path / "v1"
    pack = "ab" * 16
    code = textwrap.dedent(V1_CATALOG).format(path=str(path), pack=pack, extra=[])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with open_catalog(f"chdb://{path}") as catalog:
        assert catalog.schema_version() == catalog_schema.SCHEMA_VERSION
        table = catalog.sql(f"SELECT * FROM {catalog.tables['records']} ORDER BY record_index")
    entries = catalog_schema.entries_from_table(table)
    assert [(e.meta.key.hook, e.meta.token_axis, e.meta.key_axis) for e in entries] == [
        ("attn_pattern", 1, 2), ("resid_post", 0, None)]
    assert entries[1].meta.stats is not None and entries[0].meta.shard is None
    with open_catalog(f"chdb://{path}") as again:  # upgrading is done once
        assert again.schema_version() == catalog_schema.SCHEMA_VERSION


def test_upgrade_racing_another_process_is_not_an_error(tmp_path, monkeypatch):
    """Another process added ``token_axis`` between this one's DESCRIBE and its ALTER (a
    fake: the first column listing is stale; chDB's directory lock keeps two processes from
    really racing). The failed ALTER is re-checked, not raised, and the upgrade completes."""
    path = tmp_path / "v1"
    added = ["ALTER TABLE dmi.dmi_records ADD COLUMN token_axis Int32 DEFAULT if(hook = 'attn_pattern', 1, 0)"]
    code = textwrap.dedent(V1_CATALOG).format(path=str(path), pack="cd" * 16, extra=added)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    real = catalog_schema.record_column_upgrades
    calls = []

    def stale_first(names, columns):
        calls.append(1)
        return real(names, [c for c in columns if c != "token_axis"] if len(calls) == 1 else columns)

    monkeypatch.setattr(catalog_schema, "record_column_upgrades", stale_first)
    with open_catalog(f"chdb://{path}") as catalog:
        assert catalog.schema_version() == catalog_schema.SCHEMA_VERSION
        table = catalog.sql(f"SELECT * FROM {catalog.tables['records']} ORDER BY record_index")
    assert [(e.meta.token_axis, e.meta.key_axis) for e in catalog_schema.entries_from_table(table)] == [(1, 2), (0, None)]
