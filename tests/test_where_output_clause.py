"""``Catalog.select_records(where=...)`` refuses ``INTO OUTFILE`` and ``FORMAT``, a subquery's
included, with the ``InvalidArgumentError`` ``Catalog.sql`` gives them (the same scan,
outside strings and quoted names) — before anything runs, so no file is written; a
ClickHouse syntax error used to be the answer. On the default chDB catalog."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.storage import PackWriter
from dmi.storage.errors import InvalidArgumentError
from dmi.storage.records import RecordKey


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with dmi.open(home=tmp_path_factory.mktemp("where-output")) as opened:
        descriptors = []
        with PackWriter(opened.packs, on_seal=descriptors.append) as writer:
            for request in ("a", "b"):
                writer.append(RecordKey("m", "r", request, "resid_post", 0, 0, 4, phase="forward"), torch.ones(4, 8))
        with opened.catalog.publisher("where-output") as publisher:
            publisher.publish(descriptors)
        yield opened


@pytest.mark.parametrize("tail, clause", [
    ("INTO OUTFILE {path}", "INTO OUTFILE"),
    ("INTO OUTFILE {path} TRUNCATE", "INTO OUTFILE"),
    ("into  outfile {path} FORMAT CSV", "INTO OUTFILE"),
    ("FORMAT CSV", "FORMAT CSV"),
    ("format JSONEachRow", "FORMAT JSONEachRow"),
], ids=["outfile", "truncate", "outfile-lower", "format", "format-lower"])
def test_an_output_clause_in_a_where_subquery_is_refused_and_writes_nothing(store, tmp_path, tail, clause):
    target = tmp_path / "out.csv"
    table = store.catalog.tables["records_published"]
    where = f"request_id IN (SELECT request_id FROM {table} {tail.format(path=repr(str(target)))})"
    with pytest.raises(InvalidArgumentError) as info:
        store.catalog.select_records("m", where=where)
    assert str(info.value) == (
        f"where is a filter that only reads: {clause} is refused, in a subquery too (chDB would write an OUTFILE "
        f"even under readonly=1; a FORMAT clause has no place in an expression): {where!r}")
    assert not target.exists()
    with pytest.raises(InvalidArgumentError, match=f"{clause} is refused"):
        store.loader("m", where=where)
    assert not target.exists()


@pytest.mark.parametrize("where, requests", [
    ("request_id != 'INTO OUTFILE x FORMAT CSV'", ["a", "b"]),
    ("request_id IN (SELECT request_id FROM {table} WHERE request_id = 'b')", ["b"]),
    ("request_id IN (SELECT `format` FROM (SELECT 'a' AS `format`))", ["a"]),
    ("request_id IN (SELECT `format` FROM (SELECT 'b' AS format))", ["b"]),
], ids=["in-a-string", "subquery", "quoted-name", "alias"])
def test_output_keywords_in_strings_or_names_still_filter(store, where, requests):
    table = store.catalog.tables["records_published"]
    entries = store.catalog.select_records("m", where=where.format(table=table))
    assert [e.meta.key.request_id for e in entries] == requests
