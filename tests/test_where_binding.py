"""``select_records(where=..., params=...)`` binding problems are the same named
``InvalidArgumentError`` on both backends. On a ClickHouse server the driver substituted the
parameters itself: a stray ``%`` in ``where`` (``LIKE 'a%'``) was a bare ``TypeError``, a
parameter ``params`` lacks a bare ``KeyError``, and a ``bytes`` value went on as broken SQL
(a ``ServerError`` syntax error) — where chDB named each. A filter ClickHouse itself refuses (an
unknown column) stays a ``ServerError`` with ClickHouse's code, named with the filter it came from."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.storage import PackWriter
from dmi.storage.errors import InvalidArgumentError, ServerError
from dmi.storage.records import RecordKey

CASES = [
    ("request_id LIKE 'a%'", None, "stray '%' at character 18 of a statement with parameters"),
    ("request_id LIKE 'a%' AND layer = %(x)s", {"x": 0}, "stray '%' at character 18"),
    ("request_id = %(x)s", None, "the statement names the parameter 'x', which params does not have"),
    ("request_id = %(x)s", {"y": "a"}, "the statement names the parameter 'x', which params does not have"),
    ("request_id = %(x)s", {"x": b"a"}, "cannot pass a bytes as a SQL parameter"),
]
IDS = ["stray-percent", "stray-percent-with-params", "missing", "other-name", "bytes"]


def _filled(store) -> None:
    descriptors = []
    with PackWriter(store.packs, on_seal=descriptors.append) as writer:
        for request in ("a", "b"):
            writer.append(RecordKey("m", "r", request, "resid_post", 0, 0, 4, phase="forward"), torch.ones(4, 8))
    with store.catalog.publisher("where-binding") as publisher:
        publisher.publish(descriptors)


def _check(store, where, params, message) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        store.catalog.select_records("m", where=where, params=params)
    assert message in str(info.value)
    assert [e.meta.key.request_id for e in store.catalog.select_records("m", where="request_id LIKE 'a%%'")] == ["a"]
    assert [e.meta.key.request_id for e in
            store.catalog.select_records("m", where="request_id = %(x)s", params={"x": "b"})] == ["b"]


@pytest.fixture(scope="module")
def chdb_store(tmp_path_factory):
    with dmi.open(home=tmp_path_factory.mktemp("where-binding")) as store:
        _filled(store)
        yield store


@pytest.mark.parametrize("where, params, message", CASES, ids=IDS)
def test_binding_problems_are_argument_errors_on_chdb(chdb_store, where, params, message):
    _check(chdb_store, where, params, message)


@pytest.mark.parametrize("where, params, message", CASES, ids=IDS)
def test_binding_problems_are_argument_errors_on_a_server(clickhouse_uri, tmp_path, where, params, message):
    with dmi.open(catalog=clickhouse_uri, packs=str(tmp_path / "packs")) as store:
        _filled(store)
        _check(store, where, params, message)


def _check_refused_filter(store) -> None:
    """A filter ClickHouse refuses is named with the selection it broke, keeping ClickHouse's own
    code and words."""
    with pytest.raises(ServerError) as info:
        store.catalog.select_records("m", where="nonsense > 0")
    message = str(info.value)
    assert message.startswith("the selection with where='nonsense > 0' (--where on the command line) failed; "
                              "check it names columns of {records} (")
    assert "UNKNOWN_IDENTIFIER" in message and info.value.name == "UNKNOWN_IDENTIFIER"
    assert info.value.code == 47


def test_a_filter_clickhouse_refuses_is_named_on_chdb(chdb_store):
    _check_refused_filter(chdb_store)


def test_a_filter_clickhouse_refuses_is_named_on_a_server(clickhouse_uri, tmp_path):
    with dmi.open(catalog=clickhouse_uri, packs=str(tmp_path / "packs")) as store:
        _filled(store)
        _check_refused_filter(store)
