"""A publisher riding out a short catalog outage (``ride_out_seconds``), against a real server.

The server, clickhouse-driver and the catalog are real. The only fakes are the network in
between, a TCP proxy (tests/_proxy.py) that cuts a connection after a statement landed
(outcome unknown) or refuses new connections (outcome known: nothing sent), and, for the
outages of a whole server, a ``clickhouse-server`` of the test's own killed with SIGKILL and
restarted on the same ports and data (tests/_clickhouse.py's ``LocalServerProcess``).

What is checked: a cut whose outcome is unknown is ridden out by taking a new term, and a
watermark that landed is not written again (each pack named by one visible watermark); a
cut before the statement keeps the term; a scope someone else claimed meanwhile is not
taken back; ClickHouse's own errors are not retried; a server back within the deadline
costs nothing, one that stays away fails with the named error after the deadline, having
retried, and loses no sealed pack.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
from clickhouse_driver import Client

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackStore
from dmi.storage.errors import (
    CatalogUnavailableError,
    DrainError,
    InvalidArgumentError,
    QuarantinedError,
    ServerError,
)
from tests._models import left_padded_batch, tiny
from tests.catalog_conformance import pack

RENEWAL = b"\x05renew"
WATERMARK = b"\x08pack_ids\x0dArray(String)"  # the watermark block's column header




def _riding(catalog, ride_out_seconds: float, **options):
    """A publisher of scope ``s`` for holder ``A`` that rides out outages this long
    (``Catalog.publisher`` does not take the option: it is set on the publisher)."""
    publisher = catalog.publisher("s", holder="A", **options)
    publisher.ride_out_seconds = ride_out_seconds
    return publisher


def _naming(catalog, pack_id: str) -> list[dict]:
    """Every watermark row (visible or not) that names ``pack_id``."""
    return catalog.sql(
        f"SELECT term, seq FROM {catalog.tables['watermarks']} WHERE has(pack_ids, %(p)s) ORDER BY term, seq",
        {"p": pack_id},
    ).to_pylist()


@pytest.mark.live
def test_a_cut_during_publish_with_outcome_unknown_is_ridden_out_without_publishing_twice(proxy, via_proxy, direct):
    writer = _riding(via_proxy, 30)
    writer.acquire()
    landed = pack(request="landed")
    proxy.cut_after(WATERMARK)
    watermark = writer.publish([landed])
    assert proxy.cuts == 1
    assert (watermark.term, watermark.seq, watermark.pack_ids) == (1, 1, (landed.pack_id,))  # the one that landed
    assert (writer.reacquired, writer.term, writer.quarantined) == (1, 2, False)
    assert writer.retries >= 1
    assert _naming(direct, landed.pack_id) == [{"term": 1, "seq": 1}]  # not written again under term 2
    assert [(w.term, w.seq) for w in direct.watermarks("s")] == [(1, 1)]
    after = pack(request="after")
    assert writer.publish([after]).position == (2, 1)
    assert {e.meta.key.request_id for e in direct.find_records("gpt2")} == {"landed", "after"}


@pytest.mark.live
def test_a_cut_renewal_is_ridden_out_by_a_new_term(proxy, via_proxy, direct):
    writer = _riding(via_proxy, 30)
    writer.acquire()
    proxy.cut_after(RENEWAL)
    expires = writer.renew()
    assert (writer.reacquired, writer.term, writer.expires_at) == (1, 2, expires)
    state = direct.lease_state("s")
    assert (state.term, state.holder, state.max_fence) == (2, "A", 2)


@pytest.mark.live
def test_a_refused_connection_is_ridden_out_keeping_the_term(proxy, via_proxy, direct):
    writer = _riding(via_proxy, 30)
    term = writer.acquire()
    proxy.cut_after(b"SELECT")  # break the idle connection so the next call must reconnect
    with pytest.raises(CatalogUnavailableError):
        via_proxy.models()
    proxy.refusing = True
    opened = threading.Timer(0.5, setattr, (proxy, "refusing", False))
    opened.start()
    watermark = writer.publish([pack(request="fine")])
    opened.join()
    assert writer.retries >= 1 and writer.reacquired == 0  # nothing was sent: no quarantine, same term
    assert watermark.position == (term, 1) and writer.term == term
    assert {e.meta.key.request_id for e in direct.find_records("gpt2")} == {"fine"}


@pytest.mark.live
def test_a_scope_claimed_by_another_meanwhile_is_not_taken_back(proxy, via_proxy, direct):
    """Cut after the renewal landed, and connections refused: while A rides out, a publisher
    of the same holder name (another process) takes the scope over. A then does not re-acquire."""
    writer = _riding(via_proxy, 30)
    writer.acquire()
    proxy.cut_after(RENEWAL)
    proxy.refusing = True  # the open connection carries the renewal; no new one is let through
    outcome: dict[str, BaseException] = {}

    def renew():
        try:
            writer.renew()
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome["error"] = exc

    thread = threading.Thread(target=renew)
    thread.start()
    assert proxy.cut_event.wait(20)
    other = direct.publisher("s", holder="A")
    assert other.acquire() == 2
    proxy.refusing = False
    thread.join(60)
    assert isinstance(outcome.get("error"), QuarantinedError), outcome
    assert "another publisher has claimed the scope since its term 1" in str(outcome["error"])
    assert (writer.reacquired, writer.quarantined) == (0, True)
    other.publish([pack(request="other")])
    assert direct.lease_state("s").term == 2


@pytest.mark.live
def test_an_error_clickhouse_answered_is_not_retried(clickhouse_server, clickhouse_database, direct):
    writer = _riding(direct, 30)
    writer.acquire()
    client = Client(clickhouse_server.host, port=clickhouse_server.port, user=clickhouse_server.user,
                    password=clickhouse_server.password)
    try:
        client.execute(f"DROP TABLE {direct.tables['watermarks']}")
    finally:
        client.disconnect()
    with pytest.raises(ServerError):
        writer.publish([pack(request="x")])
    assert (writer.retries, writer.reacquired, writer.term) == (0, 0, 1)


@pytest.mark.live
def test_no_retry_starts_past_the_lease_s_expiry(proxy, clickhouse_server, clickhouse_database, monkeypatch):
    """The lease's clock is a fake that only the publisher's backoff moves (``time.sleep`` is
    replaced by a fake that advances it); the catalog refuses every connection, and the
    ride-out deadline is far. The retries stop before the clock reaches the lease's expiry:
    every reading during the publish is below it."""
    now = [1_700_000_000.0]
    readings: list[float] = []

    def clock() -> float:
        readings.append(now[0])
        return now[0]

    uri = proxy.uri(clickhouse_database, clickhouse_server.user, clickhouse_server.password)
    with open_catalog(uri) as catalog:
        writer = catalog.publisher("s", holder="A", lease_seconds=10, clock=clock)
        writer.ride_out_seconds = 600
        writer.acquire()
        expires = writer.expires_at
        proxy.cut_after(b"SELECT")  # break the idle connection so the next call must reconnect
        with pytest.raises(CatalogUnavailableError):
            catalog.models()
        proxy.refusing = True
        del readings[:]
        monkeypatch.setattr(time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
        with pytest.raises(CatalogUnavailableError, match=r"cannot reach ClickHouse .*tried \d+ times"):
            writer.publish([pack(request="x")])
        assert writer.retries >= 5 and max(readings) < expires


def test_ride_out_seconds_is_checked(store_and_catalog):
    _, catalog = store_and_catalog
    publisher = catalog.publisher("s", holder="A")
    assert publisher.ride_out_seconds == 0.0  # by default every failure is raised at once
    for bad in (-1, float("nan"), float("inf"), True, "3", None):
        with pytest.raises(InvalidArgumentError, match="ride_out_seconds must be a finite number of seconds"):
            publisher.ride_out_seconds = bad
    publisher.ride_out_seconds = 2
    assert publisher.ride_out_seconds == 2.0


def _uri(server) -> str:
    return server.live.uri(f"dmi_blip_{uuid.uuid4().hex[:12]}")


@pytest.mark.slow
def test_a_server_back_within_the_deadline_costs_a_publish_nothing(own_server):
    with open_catalog(_uri(own_server)) as catalog:
        writer = _riding(catalog, 60, lease_seconds=120)
        term = writer.acquire()
        own_server.kill()
        back = threading.Thread(target=own_server.restart)
        back.start()
        watermark = writer.publish([pack(request="through")])
        back.join()
        # every failure was a connection refused before a statement: known not to have landed, the term kept
        assert writer.retries >= 1 and (watermark.term, writer.reacquired) == (term, 0)
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"through"}


@pytest.mark.slow
def test_a_server_away_past_the_deadline_fails_named_and_keeps_the_term(own_server):
    with open_catalog(_uri(own_server)) as catalog:
        writer = _riding(catalog, 1, lease_seconds=120)
        term = writer.acquire()
        own_server.kill()
        with pytest.raises(CatalogUnavailableError, match=r"cannot reach ClickHouse .* \[the publish was tried "
                                                          r"\d+ times over .* ride_out_seconds=1 ") as raised:
            writer.publish([pack(request="later")])
        assert raised.value.outcome_unknown is False
        assert writer.retries >= 2 and (writer.term, writer.quarantined) == (term, False)
        own_server.restart()
        writer.publish([pack(request="later")])
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"later"}


def _capture(model, ids, mask, cap, rounds: int) -> None:
    for _ in range(rounds):
        cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    cap.flush()


def _restart_once_retried(server, publisher, bound_seconds: float = 60.0) -> None:
    """Restart ``server`` once ``publisher`` has retried (bounded: never a timing assert)."""
    waited = threading.Event()
    for _ in range(int(bound_seconds / 0.05)):
        if publisher.retries:
            break
        waited.wait(0.05)
    server.restart()


@pytest.mark.slow
def test_a_capture_rides_out_a_server_restart(own_server, tmp_path):
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(_uri(own_server)) as catalog:
        with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m", lease_seconds=120,
                    writer_options={"max_records": 10}) as cap:
            publisher = cap._publisher.publisher
            assert publisher.ride_out_seconds == 10.0  # a session's own: min(10 s, lease_seconds / 3)
            _capture(model, ids, mask, cap, 1)
            own_server.kill()
            back = threading.Thread(target=_restart_once_retried, args=(own_server, publisher))
            back.start()
            _capture(model, ids, mask, cap, 2)
            back.join()
        assert publisher.retries >= 1 and cap.stats["catalog_retries"] == publisher.retries
        assert catalog.published_pack_ids() == set(store.list_packs())
        assert cap.stats["packs_published"] == len(store.list_packs())


@pytest.mark.slow
def test_a_capture_whose_server_stays_away_fails_named_and_loses_nothing(own_server, tmp_path):
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(_uri(own_server)) as catalog:
        with pytest.raises(DrainError, match="check that the server is running") as raised:
            with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m",
                        writer_options={"max_records": 10}) as cap:
                publisher = cap._publisher.publisher
                publisher.ride_out_seconds = 1
                _capture(model, ids, mask, cap, 1)
                published = catalog.published_pack_ids()
                own_server.kill()
                _capture(model, ids, mask, cap, 2)
        assert publisher.retries >= 2
        sealed = set(store.list_packs())
        counted = re.search(r"; (\d+) sealed pack\(s\) are not published: .*`dmi recover` publishes them",
                            str(raised.value))
        assert counted and int(counted.group(1)) == len(sealed - published)
        assert "tried" in str(raised.value) and "ride_out_seconds=1 " in str(raised.value)
        own_server.restart()
        assert catalog.published_pack_ids() == published
        assert set(catalog.recover(store)) == sealed - published
