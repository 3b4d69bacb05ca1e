"""Hostile SQL through the index's query surface (``Store.sql``, ``Catalog.sql``,
``select_records(where=...)``), on the default chDB catalog: each is refused with a named
``InvalidArgumentError`` or ClickHouse's own ``ServerError`` and changes nothing, while
legitimate text that holds the same words (a column named ``format``) still runs.

The ``FORMAT`` guard once took a column named ``format`` followed by ``FROM`` (or ``AND``,
``IN``, ``IS``, ``DESC``, ...) for a ``FORMAT FROM`` clause and refused a valid filter."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.catalog._sql import _KEYWORDS_AFTER_AN_EXPRESSION, output_clause
from dmi.storage import PackWriter
from dmi.storage.errors import InvalidArgumentError, ServerError
from dmi.storage.records import RecordKey


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with dmi.open(home=tmp_path_factory.mktemp("where-format")) as opened:
        descriptors = []
        with PackWriter(opened.packs, on_seal=descriptors.append) as writer:
            for request in ("a", "b"):
                writer.append(RecordKey("m", "r", request, "resid_post", 0, 0, 4, phase="forward"), torch.ones(4, 8))
        with opened.catalog.publisher("where-format") as publisher:
            publisher.publish(descriptors)
        yield opened


def _requests(store, where: str) -> list[str]:
    return [e.meta.key.request_id for e in store.catalog.select_records("m", where=where)]


def _unchanged(store) -> None:
    assert [r.request_id for r in store.requests("m")] == ["a", "b"]
    assert store.sql("SELECT count() AS n FROM {records_all}").to_pylist() == [{"n": 2}]


# A column (or alias) named ``format`` followed by a keyword: a filter, not a FORMAT clause.
FORMAT_COLUMN = [
    ("request_id IN (SELECT format FROM (SELECT 'a' AS format))", ["a"]),
    ("request_id IN (SELECT r FROM (SELECT 'b' AS r, 'x' AS format) WHERE format IN ('x'))", ["b"]),
    ("request_id IN (SELECT r FROM (SELECT 'a' AS r, 1 AS format) WHERE format AND 1)", ["a"]),
    ("request_id IN (SELECT r FROM (SELECT 'b' AS r, 'x' AS format) WHERE format IS NOT NULL)", ["b"]),
    ("request_id IN (SELECT r FROM (SELECT 'a' AS r, 'x' AS format) WHERE format LIKE 'x')", ["a"]),
    ("request_id IN (SELECT r FROM (SELECT 'b' AS r, 'x' AS format) ORDER BY format DESC)", ["b"]),
    ("request_id IN (SELECT format AS r FROM (SELECT 'a' AS format))", ["a"]),
]


@pytest.mark.parametrize("where, requests", FORMAT_COLUMN,
                         ids=["from", "in", "and", "is", "like", "desc", "as"])
def test_a_column_named_format_filters_in_where(store, where, requests):
    assert output_clause(where) is None
    assert _requests(store, where) == requests


@pytest.mark.parametrize("query, expected", [
    ("SELECT format FROM (SELECT 'x' AS format)", [{"format": "x"}]),
    ("SELECT n FROM (SELECT 1 AS n, 'x' AS format) WHERE format = 'x' AND format IN ('x')", [{"n": 1}]),
], ids=["select-from", "where-and-in"])
def test_a_column_named_format_runs_in_sql(store, query, expected):
    assert store.sql(query).to_pylist() == expected


# A FORMAT clause whose name is any word but those keywords is still refused, wherever it is.
FORMAT_CLAUSE = [
    ("request_id IN (SELECT request_id FROM {table} FORMAT CSV)", "FORMAT CSV"),
    ("request_id IN (SELECT format FROM (SELECT 'a' AS format) FORMAT JSON)", "FORMAT JSON"),
    ("request_id IN (SELECT format FROM {table} AS t format Null)", "FORMAT Null"),
    ("request_id IN (SELECT request_id FROM {table} FORMAT `FROM`)", "FORMAT `FROM`"),
    ("request_id IN (SELECT request_id FROM {table} FORMAT\nValues)", "FORMAT Values"),
]


@pytest.mark.parametrize("where, clause", FORMAT_CLAUSE, ids=["csv", "after-format-column", "null", "quoted",
                                                              "newline"])
def test_a_format_clause_is_still_refused(store, where, clause):
    where = where.format(table=store.catalog.tables["records_published"])
    with pytest.raises(InvalidArgumentError) as info:
        store.catalog.select_records("m", where=where)
    assert f"{clause} is refused" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="a FORMAT clause"):
        store.catalog.sql(f"SELECT 1 AS n {clause}")
    _unchanged(store)


def test_no_output_format_is_named_like_a_keyword_that_follows_an_expression(store):
    """The keywords that make ``format`` a column must never be a format's name, or a real
    FORMAT clause would pass the guard: checked against the formats this ClickHouse knows."""
    formats = {name.upper() for name in store.sql("SELECT name FROM system.formats").column("name").to_pylist()}
    assert len(formats) > 50 and {"CSV", "JSON", "NULL", "VALUES"} <= formats
    assert formats & _KEYWORDS_AFTER_AN_EXPRESSION == set()


@pytest.mark.parametrize("query", ["", "   ", "\n", "-- nothing", "/* nothing */", ";", " ; -- x"],
                         ids=["empty", "blank", "newline", "line-comment", "block-comment", "semicolon", "mixed"])
def test_sql_without_a_statement_is_refused(store, query):
    """chDB answered these with an empty table, as if a query had matched nothing."""
    with pytest.raises(InvalidArgumentError) as info:
        store.sql(query)
    assert str(info.value) == (
        f"one statement per call: the text {query!r} holds no statement (it is empty, blank, or only comments "
        "and ';'); pass the query to run")


@pytest.mark.parametrize("where", [
    "request_id IN (SELECT c1 FROM file('{secret}', 'TSV'))",
    "request_id IN (SELECT c1 FROM file('{secret}', 'TSV') SETTINGS readonly=0)",
    "request_id IN (SELECT 'a' FROM (SELECT 1 FROM file('{secret}', 'TSV') SETTINGS readonly=2))",
    "request_id IN (SELECT a FROM url('http://127.0.0.1:9/x', 'CSV', 'a String'))",
    "request_id IN (SELECT request_id FROM remote('127.0.0.1:9', system.one))",
], ids=["file", "file-settings-readonly-0", "file-settings-readonly-2", "url", "remote"])
def test_table_functions_in_where_are_refused_by_readonly(store, tmp_path, where):
    """A filter may not read files or reach the network: ClickHouse refuses table functions under
    readonly=1, and a subquery's own SETTINGS cannot lift it."""
    secret = tmp_path / "secret.tsv"
    secret.write_text("a\nb\n")
    with pytest.raises(ServerError) as info:
        store.catalog.select_records("m", where=where.format(secret=secret))
    assert (info.value.code, info.value.name) == (164, "READONLY")
    _unchanged(store)


def test_a_subquery_cannot_turn_readonly_off(store):
    where = "request_id IN (SELECT 'a' WHERE getSetting('readonly') = 0 SETTINGS readonly=0)"
    assert _requests(store, where) == []
    assert _requests(store, "request_id IN (SELECT 'a' WHERE getSetting('readonly') = 1)") == ["a"]


@pytest.mark.parametrize("where, message", [
    ("1 = 1 -- x", "without ';' or comments"),
    ("1 /* c */ = 1", "without ';' or comments"),
    ("request_id = 'a'; DROP TABLE {table}", "without ';' or comments"),
    ("request_id = 'a') OR (1 = 1", "closes a parenthesis it did not open"),
    ("request_id = 'a\\'", "unterminated quote or parenthesis"),
    ("request_id IN (SELECT request_id FROM {table} INTO OUTFILE 'x')", "INTO OUTFILE is refused"),
], ids=["line-comment", "block-comment", "second-statement", "escape-parenthesis", "escaped-quote", "outfile"])
def test_where_that_could_leave_its_expression_is_refused(store, where, message):
    where = where.format(table=store.catalog.tables["records_published"])
    with pytest.raises(InvalidArgumentError, match=message):
        store.catalog.select_records("m", where=where)
    _unchanged(store)


@pytest.mark.parametrize("value", ["a' OR 1=1 --", "x'); DROP TABLE t; --", "a\\", "é", "'"], ids=repr)
def test_where_parameters_are_values_never_sql(store, value):
    entries = store.catalog.select_records("m", where="request_id = %(v)s OR %(v)s = 'a'", params={"v": value})
    assert entries == []
    _unchanged(store)


def test_a_system_table_subquery_only_reads(store):
    where = "request_id IN (SELECT name FROM system.tables WHERE name = 'a')"
    assert _requests(store, where) == []
    _unchanged(store)
