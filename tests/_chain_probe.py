"""Live tests that ``test_fixture_chain.py`` runs in a child pytest to watch the chain's outcomes.

Not collected by a plain ``pytest`` run (the name does not match ``test_*.py``): they fail on purpose.
"""

import pytest

pytestmark = pytest.mark.live


def test_fails_inside_its_database(clickhouse_server, clickhouse_database):
    from clickhouse_driver import Client

    client = Client(
        clickhouse_server.host,
        port=clickhouse_server.port,
        user=clickhouse_server.user,
        password=clickhouse_server.password,
        database=clickhouse_database,
    )
    try:
        client.execute("CREATE TABLE probe (x UInt8) ENGINE = Memory")
    finally:
        client.disconnect()
    raise AssertionError(f"failing on purpose in database {clickhouse_database}")


def test_skips_itself():
    pytest.skip("skipping on purpose")


@pytest.mark.container
def test_needs_an_engine_and_skips():
    pytest.skip("no engine, on purpose")
