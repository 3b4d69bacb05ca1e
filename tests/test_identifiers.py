"""Identifiers and values against a hostile corpus: each is refused, or stored and read back
verbatim — nothing else runs.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest

from dmi.catalog._schema import SCHEMA_VERSION
from dmi.catalog import open_catalog
from dmi.storage import InvalidArgumentError, InvalidIdentifierError
from dmi.catalog._sql import (
    bind,
    quote_identifier,
    render_literal,
    single_statement,
    validate_identifier,
    validate_value_id,
)

HOSTILE = [
    "it's",
    'say "hi"',
    "`tick`",
    "back\\slash",
    "trailing\\",
    "escaped\\n",
    "hex\\x41",
    "quote\\'",
    "50%",
    "%(x)s",
    "%s",
    "../../etc/passwd",
    "..",
    ".",
    "a/b",
    "nul\x00byte",
    "new\nline",
    "tab\there",
    "bell\x07",
    "zero\u200bwidth",
    "line\u2028sep",
    "\ud800lone",
    "x" * 10_000,
    "",
    " padded ",
    "x'; DROP TABLE t; --",
    "1); DROP DATABASE default; --",
    "SELECT 1",
    "unicode é 漢字 🙂",
]
LEGAL_NAMES = ["my-analytics-db", "9lives", "défaut", "db_1", "with space", "a'b", 'a"b', "SELECT"]
MUST_REFUSE_AS_NAME = {
    "`tick`", "back\\slash", "trailing\\", "escaped\\n", "hex\\x41", "quote\\'", "50%", "%(x)s", "%s", "../../etc/passwd", "..", ".", "a/b", "nul\x00byte",
    "new\nline", "tab\there", "bell\x07", "zero\u200bwidth", "line\u2028sep", "\ud800lone", "x" * 10_000, "",
    " padded ",
}
MUST_REFUSE_AS_VALUE = {"nul\x00byte", "new\nline", "tab\there", "bell\x07", "\ud800lone", "x" * 10_000, ""}


@pytest.mark.parametrize("name", HOSTILE + LEGAL_NAMES, ids=lambda s: repr(s)[:30])
def test_identifier_validation(name):
    if name in MUST_REFUSE_AS_NAME:
        with pytest.raises(InvalidIdentifierError):
            validate_identifier(name, "database name")
        with pytest.raises(InvalidIdentifierError):
            quote_identifier(name)
    else:
        assert validate_identifier(name) == name
        assert quote_identifier(name) == f"`{name}`"


@pytest.mark.parametrize("value", HOSTILE, ids=lambda s: repr(s)[:30])
def test_value_validation(value):
    if value in MUST_REFUSE_AS_VALUE:
        with pytest.raises(InvalidIdentifierError):
            validate_value_id(value, "model id")
    else:
        assert validate_value_id(value) == value


def test_identifier_refusals_name_the_problem():
    with pytest.raises(InvalidIdentifierError, match="backtick"):
        validate_identifier("a`b", "table name")
    with pytest.raises(InvalidIdentifierError, match="percent"):
        validate_identifier("a%b", "database name")
    with pytest.raises(InvalidIdentifierError, match="U\\+0000"):
        validate_identifier("a\x00b")
    with pytest.raises(InvalidIdentifierError, match="10000 characters"):
        validate_value_id("x" * 10_000, "request id")
    with pytest.raises(InvalidIdentifierError, match="must be a str"):
        validate_value_id(7, "model id")


def test_rendered_literals_are_exactly_the_value():
    assert render_literal("it's") == "'it\\'s'"
    assert render_literal("back\\slash") == "'back\\\\slash'"
    assert render_literal("tab\t") == "'tab\\x09'"
    assert render_literal(None) == "NULL"
    assert render_literal((1, 2)) == "(1, 2)"
    assert render_literal(["a"]) == "['a']"
    assert bind("x = %(v)s AND y = %(w)s", {"v": "%(w)s", "w": 5}) == "x = '%(w)s' AND y = 5"
    assert bind("SELECT '50%%', %(v)s", {"v": 1}) == "SELECT '50%', 1"  # pyformat, as clickhouse-driver
    assert bind("SELECT '50%%'", None) == "SELECT '50%%'"  # no params: the text as it is, as the driver
    with pytest.raises(InvalidArgumentError, match="cannot pass a object"):
        render_literal(object())
    with pytest.raises(InvalidArgumentError, match="'w'"):
        bind("x = %(w)s", {"v": 1})
    with pytest.raises(InvalidArgumentError, match="stray"):
        bind("x LIKE 'a%' AND y = %(v)s", {"v": 1})


@pytest.mark.parametrize(
    ("text", "single"),
    [
        ("SELECT 1", True),
        ("SELECT 1;", True),
        ("SELECT 1 ; -- done", True),
        ("SELECT 'a;b', \"c;d\", `e;f` /* ; */", True),
        ("SELECT 'it''s;'", True),
        ("SELECT 'a\\';' ;", True),
        ("SELECT 1; SELECT 2", False),
        ("SELECT 1;;SELECT 2", False),
        ("SELECT 1; 'x'", False),
        ("SELECT 1 /* a */; /* b */ DROP TABLE t", False),
    ],
)
def test_single_statement(text, single):
    if single:
        assert single_statement(text) == text
    else:
        with pytest.raises(InvalidArgumentError, match="one statement per call"):
            single_statement(text)


@pytest.fixture(scope="module")
def chdb_catalog(tmp_path_factory):
    with open_catalog(f"chdb://{tmp_path_factory.mktemp('ids') / 'catalog'}") as catalog:
        yield catalog


def _round_trip(catalog, value):
    return catalog._backend.query("SELECT %(v)s AS v, length(%(v)s) AS n", {"v": value}).to_pylist()[0]


# Values with control characters are refused as ids but must still render safely if anyone
# binds them: every string the renderer accepts means exactly itself.
RENDERABLE = [v for v in HOSTILE if v != "\ud800lone"]


@pytest.mark.parametrize("value", RENDERABLE, ids=lambda s: repr(s)[:30])
def test_values_read_back_verbatim_on_chdb(chdb_catalog, value):
    row = _round_trip(chdb_catalog, value)
    assert row["v"] == value
    assert row["n"] == len(value.encode())


def test_unrenderable_value_is_refused():
    with pytest.raises(InvalidIdentifierError):
        render_literal("\ud800lone")


@pytest.mark.parametrize("name", LEGAL_NAMES, ids=repr)
def test_legal_names_work_as_databases_and_prefixes_on_chdb(chdb_catalog, name):
    before = set(chdb_catalog.sql("SELECT name FROM system.databases").column("name").to_pylist())
    with open_catalog(chdb_catalog.where, database=name, table_prefix=name + "_") as catalog:
        assert catalog.schema_version() == SCHEMA_VERSION
        tables = catalog.sql(
            f"SELECT name FROM system.tables WHERE database = {render_literal(name)} ORDER BY name"
        ).column("name").to_pylist()
        assert f"{name}_records" in tables and f"{name}_leases" in tables
    after = set(chdb_catalog.sql("SELECT name FROM system.databases").column("name").to_pylist())
    assert after - before == {name} or (name in before and after == before)
    chdb_catalog._backend.command(f"DROP DATABASE {quote_identifier(name)}")  # sql() is read-only


@pytest.mark.live
def test_values_and_names_on_the_server(clickhouse_uri, clickhouse_server):
    with open_catalog(clickhouse_uri) as catalog:
        for value in RENDERABLE:
            row = _round_trip(catalog, value)
            assert row["v"] == value, value
            assert row["n"] == len(value.encode())
        for name in LEGAL_NAMES:
            uri = clickhouse_server.uri(quote(name, safe=""))
            with open_catalog(uri, table_prefix=name + "_") as other:
                assert other.tables["records"] == f"`{name}`.`{name}_records`"
                assert other.schema_version() == SCHEMA_VERSION
                databases = catalog.sql("SELECT name FROM system.databases").column("name").to_pylist()
                assert name in databases
                other._backend.command(f"DROP DATABASE {quote_identifier(name)}")  # sql() is read-only
    # The URI path is a database name too: the same refusals apply there.
    for name in ("a`b", "a%25b", "a%5Cb"):
        with pytest.raises(InvalidIdentifierError):
            open_catalog(clickhouse_server.uri(name))
