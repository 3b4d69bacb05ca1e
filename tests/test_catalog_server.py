"""The server catalog (clickhouse-driver, native protocol): the conformance suite, live."""

from __future__ import annotations

import pytest

from dmi.catalog._schema import SCHEMA_VERSION
from dmi.catalog import open_catalog
from dmi.storage import CatalogUnavailableError, ServerError
from tests._ports import free_port
from tests.catalog_conformance import CatalogConformance

pytestmark = pytest.mark.live


class TestServerCatalog(CatalogConformance):
    @pytest.fixture
    def catalog_uri(self, clickhouse_uri):
        return clickhouse_uri


def test_unreachable_server_is_unavailable_and_certainly_not_landed():
    port = free_port()
    with pytest.raises(CatalogUnavailableError) as info:
        open_catalog(f"clickhouse://default:@127.0.0.1:{port}/dmi", connect_timeout=2)
    assert info.value.outcome_unknown is False
    assert isinstance(info.value, ConnectionError)


def test_authentication_error_keeps_code_and_name(clickhouse_server):
    with pytest.raises(ServerError) as info:
        open_catalog(f"clickhouse://nobody:wrong@{clickhouse_server.host}:{clickhouse_server.port}/dmi")
    assert info.value.code in (192, 193, 516)  # UNKNOWN_USER / WRONG_PASSWORD / AUTHENTICATION_FAILED
    assert info.value.name in ("UNKNOWN_USER", "WRONG_PASSWORD", "AUTHENTICATION_FAILED")


def test_unusual_legal_database_names_work(clickhouse_server):
    for name in ("my-analytics-db", "9lives", "défaut"):
        with open_catalog(clickhouse_server.uri(name)) as catalog:
            assert catalog.schema_version() == SCHEMA_VERSION
            assert catalog.tables["records"] == f"`{name}`.`dmi_records`"
            catalog._backend.command(f"DROP DATABASE `{name}`")  # sql() is read-only
