"""Shared fixtures: the live ClickHouse server chain and a fresh database per live test.

The chain (``tests/_clickhouse.py``) tries, in order: ``DMI_CLICKHOUSE_URL``; a container when
a Docker API answers (image ``DMI_CLICKHOUSE_IMAGE``); a local ``clickhouse-server`` binary;
otherwise every ``live`` test is skipped with the reason naming what was missing. The header
says which step the chain will take, the summary which server was used.

``DMI_LIVE_SERVER=env|container|binary`` forces one step and makes the live suite strict: the
forced step not being available, or any ``live`` test skipping, is a failure (CI runs the live
suite once per path this way). Tests marked ``cluster`` (a local ZooKeeper and two
``clickhouse-server`` replicas, ``tests/_cluster.py``) and ``s3`` (a moto S3 endpoint,
``tests/_s3.py``) and ``vllm`` (vLLM installed, run with ``-m vllm`` in its own environment) are held to the same rule: under a forced mode they never skip. Tests marked
``container`` need a Docker API themselves; they may skip unless the forced step is ``container``.
"""

from __future__ import annotations

import importlib.util
import uuid

import pytest

from tests._clickhouse import (
    MODE_VARIABLE,
    LiveServerUnavailable,
    chain_mode,
    choose_live_server,
    start_live_server,
)

_chain_result: dict[str, str] = {}

VLLM_MODULES = ["test_vllm.py", "test_vllm_serve.py", "test_vllm_tp.py", "test_vllm_bench.py", "test_vllm_audit.py",
                "test_vllm_guards.py", "test_vllm_serve_tp.py", "test_vllm_capture_failure.py",
                "test_vllm_worker_errors.py", "test_vllm_qwen2_moe.py", "test_vllm_qwen2_moe_tp.py",
                "test_vllm_edges.py", "test_vllm_families.py"]
"""The modules that need vLLM; where it is not installed they are not collected (the header says
so), so a run without vLLM — the README's main pass — neither imports nor skips them. Their own
pass (``pytest -m vllm`` in vLLM's environment) collecting nothing is an error (exit 5)."""

_VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if _VLLM_INSTALLED else VLLM_MODULES


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"container: needs a container engine's Docker API (a skip fails only under {MODE_VARIABLE}=container)",
    )


def pytest_report_header(config):
    vllm = "vllm: installed" if _VLLM_INSTALLED else (
        f"vllm: not installed, {len(VLLM_MODULES)} modules not collected (README: the vllm pass runs them)")
    try:
        return [f"clickhouse live server: {choose_live_server().describe()}", vllm]
    except (LiveServerUnavailable, ValueError) as exc:
        return [f"clickhouse live server: none ({exc})", vllm]


def pytest_terminal_summary(terminalreporter):
    if "how" in _chain_result:
        terminalreporter.write_line(f"clickhouse live server used: {_chain_result['how']}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # cluster and s3 tests need the local binaries and packages that the forced chain promises
    kind = next((m for m in ("live", "cluster", "s3", "vllm") if item.get_closest_marker(m) is not None), None)
    if not report.skipped or hasattr(report, "wasxfail") or kind is None:
        return
    mode = chain_mode()
    if mode == "auto" or (item.get_closest_marker("container") is not None and mode != "container"):
        return
    reason = report.longrepr[2].removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"{MODE_VARIABLE}={mode} requires every {kind} test to run, but this one skipped: {reason}"


@pytest.fixture
def store_and_catalog(tmp_path):
    """A local pack store and an embedded catalog in the test's own directory."""
    from dmi.catalog import open_catalog
    from dmi.storage import PackStore

    store = PackStore.local(tmp_path / "packs")
    catalog = open_catalog(f"chdb://{tmp_path / 'catalog'}")
    try:
        yield store, catalog
    finally:
        catalog.close()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server for the session, with test credentials in the environment."""
    from tests._s3 import CREDENTIALS, MotoServer, moto_available

    if not moto_available():
        pytest.skip("moto[server] is not installed (pip install -e '.[test]')")  # a failure under DMI_LIVE_SERVER
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        with MotoServer() as endpoint:
            yield endpoint


@pytest.fixture(scope="session")
def clickhouse_server():
    """A live ClickHouse server for the whole session (see the module docstring)."""
    try:
        choice = choose_live_server()
    except LiveServerUnavailable as exc:
        pytest.skip(str(exc))  # under a forced DMI_LIVE_SERVER, the hook above makes this a failure
    with start_live_server(choice) as server:
        _chain_result["how"] = server.how
        yield server


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
    try:
        client.execute(f"CREATE DATABASE {name}")
        try:
            yield name
        finally:
            client.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        client.disconnect()


@pytest.fixture
def clickhouse_uri(clickhouse_server, clickhouse_database):
    """``clickhouse://...`` URI of a fresh database on the live server."""
    return clickhouse_server.uri(clickhouse_database)


@pytest.fixture
def own_server():
    """A ``clickhouse-server`` of the test's own (``tests._clickhouse.OwnServer``), to kill, stop
    and restart; stopped afterwards. Skipped without a local server binary."""
    from tests._clickhouse import OwnServer, find_server_binary

    binary = find_server_binary()
    if binary is None:
        pytest.skip("needs a local clickhouse-server binary (tests/_clickhouse.py)")
    server = OwnServer(binary)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(clickhouse_server):
    """A TCP proxy to the live server that cuts a connection at a chosen moment (a fake: the
    real server cannot be made to break a connection mid-statement; ``tests/_proxy.py``)."""
    from tests._proxy import CuttingProxy

    with CuttingProxy(clickhouse_server.host, clickhouse_server.port) as p:
        yield p


@pytest.fixture
def direct(clickhouse_uri):
    """A catalog that bypasses the proxy: what every other reader sees."""
    from dmi.catalog import open_catalog

    with open_catalog(clickhouse_uri) as catalog:
        yield catalog


@pytest.fixture
def via_proxy(proxy, clickhouse_server, clickhouse_database, direct):
    """The same database as ``direct``, through ``proxy``."""
    from dmi.catalog import open_catalog

    uri = proxy.uri(clickhouse_database, clickhouse_server.user, clickhouse_server.password)
    with open_catalog(uri, send_receive_timeout=30) as catalog:
        yield catalog
