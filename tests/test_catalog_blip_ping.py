"""One ping per statement on a server catalog: the backend's own check before the statement
(``ServerBackend._ensure_connected``), not a second one by clickhouse-driver's
``Client.execute`` (its ``force_connect``). Pings are counted by wrapping the driver
connection's ``ping``; the server and the driver are real."""

from __future__ import annotations

import socket

import pytest

from dmi.catalog import open_catalog

pytestmark = pytest.mark.live


def _counting(obj, name: str) -> list[None]:
    """Count the calls of ``obj.name`` (an instance attribute over the real method)."""
    calls: list[None] = []
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(None)
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def _count_pings(catalog) -> list[None]:
    return _counting(catalog._backend._client.connection, "ping")


def test_each_statement_pings_the_server_once(clickhouse_uri):
    with open_catalog(clickhouse_uri) as catalog:
        catalog.models()
        pings = _count_pings(catalog)
        statements = _counting(catalog._backend._client, "execute")
        for _ in range(5):
            assert catalog.models() == []
        publisher = catalog.publisher("ping", holder="A")
        assert publisher.acquire() == 1
        assert len(statements) >= 5 + 5  # acquire: read, claim, read-back, fence, confirm, ...
        assert len(pings) == len(statements)


def test_a_server_gone_between_statements_is_still_found_by_the_one_ping(clickhouse_uri):
    """The ping that stays is the one that finds a dead connection and reconnects outside
    the statement (so that a failure there is certain not to have reached the server)."""
    with open_catalog(clickhouse_uri) as catalog:
        catalog.models()
        pings = _count_pings(catalog)
        connection = catalog._backend._client.connection
        connection.socket.shutdown(socket.SHUT_RDWR)  # the connection dies between two statements
        assert catalog.models() == []
        assert len(pings) == 1 and connection.connected
        assert catalog.models() == []
        assert len(pings) == 2
