"""Shared fixtures: the live ClickHouse server chain and a fresh database per live test.

The chain tries, in order, and reports the one it used in the test header:
1. ``DMI_CLICKHOUSE_URL`` (``clickhouse://user:password@host:port``): a server someone runs;
2. a local ``clickhouse-server`` binary started on free loopback ports in a temp directory;
3. otherwise every ``live`` test is skipped with the reason naming what was missing.
"""

from __future__ import annotations

import os
import uuid
from urllib.parse import urlsplit

import pytest

from tests._clickhouse import LiveServer, LocalServerProcess, find_server_binary

_chain_result: dict[str, object] = {}


def _server_from_env() -> LiveServer | None:
    url = os.environ.get("DMI_CLICKHOUSE_URL")
    if not url:
        return None
    parts = urlsplit(url)
    return LiveServer(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 9000,
        http_port=None,
        how=f"DMI_CLICKHOUSE_URL={parts.hostname}:{parts.port}",
        user=parts.username or "default",
        password=parts.password or "",
    )


def pytest_report_header(config):
    how = _chain_result.get("how")
    return f"clickhouse live server: {how}" if how else "clickhouse live server: started on first live test"


@pytest.fixture(scope="session")
def clickhouse_server():
    """A live ClickHouse server for the whole session (see the module docstring)."""
    server = _server_from_env()
    if server is not None:
        _chain_result["how"] = server.how
        yield server
        return
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no live ClickHouse: DMI_CLICKHOUSE_URL is unset and no clickhouse-server binary is installed")
    process = LocalServerProcess(binary)
    server = process.start()
    _chain_result["how"] = server.how
    try:
        yield server
    finally:
        process.stop()


@pytest.fixture
def clickhouse_database(clickhouse_server):
    """A fresh, empty database on the live server; dropped afterwards, also on failure."""
    from clickhouse_driver import Client

    name = f"dmi_test_{uuid.uuid4().hex[:12]}"
    client = Client(
        clickhouse_server.host,
        port=clickhouse_server.port,
        user=clickhouse_server.user,
        password=clickhouse_server.password,
    )
    client.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {name}")
        client.disconnect()


@pytest.fixture
def clickhouse_uri(clickhouse_server, clickhouse_database):
    """``clickhouse://...`` URI of a fresh database on the live server."""
    return clickhouse_server.uri(clickhouse_database)
