"""Fault injection against the real ClickHouse server.

The server, clickhouse-driver and the catalog are all real. The only fake is the network
in between: a TCP proxy (tests/_proxy.py) that lets a statement reach the server and then
cuts the connection before the answer comes back, holds a writer's bytes mid-statement, or
refuses connections — failures nothing else reproduces on demand.
"""

from __future__ import annotations

import threading
import time

import pytest

from dmi.catalog import open_catalog
from dmi.storage import CatalogUnavailableError, LeaseError, LeaseHeldError, LeaseLostError, QuarantinedError
from tests.catalog_conformance import pack

pytestmark = pytest.mark.live

CLAIM = b"\x05claim"
CONFIRM = b"\x07confirm"
RENEWAL = b"\x05renew"
WATERMARK = b"\x08pack_ids\x0dArray(String)"  # the watermark block's column header




def lease_rows(catalog, kind):
    return catalog.sql(
        f"SELECT holder, term FROM {catalog.tables['leases']} WHERE kind = '{kind}' ORDER BY term"
    ).to_pylist()


def visible_requests(catalog):
    return {e.meta.key.request_id for e in catalog.find_records("gpt2")}


def test_cut_after_claim_lands_quarantines_until_reacquired(proxy, via_proxy, direct):
    writer = via_proxy.publisher("s", holder="A")
    proxy.cut_after(CLAIM)
    with pytest.raises(QuarantinedError, match="claim"):
        writer.acquire()
    assert proxy.cuts == 1
    assert lease_rows(direct, "claim") == [{"holder": "A", "term": 1}]  # it did land
    assert writer.quarantined and writer.term is None
    with pytest.raises(QuarantinedError):
        writer.publish([pack(request="while-quarantined")])
    with pytest.raises(QuarantinedError):
        writer.renew()
    assert visible_requests(direct) == set()
    assert writer.acquire() == 2
    writer.publish([pack(request="after")])
    assert visible_requests(direct) == {"after"}


def test_cut_after_confirm_lands_quarantines_and_holds_others_off(proxy, via_proxy, direct):
    writer = via_proxy.publisher("s", holder="A", lease_seconds=30)
    proxy.cut_after(CONFIRM)
    with pytest.raises(QuarantinedError, match="confirm"):
        writer.acquire()
    assert lease_rows(direct, "confirm") == [{"holder": "A", "term": 1}]
    with pytest.raises(LeaseHeldError):  # the landed lease is real for everyone else
        direct.publisher("s", holder="B").acquire()
    with pytest.raises(QuarantinedError):
        writer.publish([pack(request="lost")])
    assert writer.acquire() == 2  # the same holder takes over its own lease, fencing term 1
    writer.publish([pack(request="ok")])
    assert visible_requests(direct) == {"ok"}


def test_cut_after_renewal_lands_quarantines(proxy, via_proxy, direct):
    writer = via_proxy.publisher("s", holder="A")
    writer.acquire()
    writer.publish([pack(request="before")])
    proxy.cut_after(RENEWAL)
    with pytest.raises(QuarantinedError, match="renewal"):
        writer.renew()
    assert len(lease_rows(direct, "renew")) == 1
    with pytest.raises(QuarantinedError):
        writer.publish([pack(request="quarantined")])
    assert visible_requests(direct) == {"before"}
    writer.acquire()
    writer.publish([pack(request="after")])
    assert visible_requests(direct) == {"before", "after"}


def test_cut_after_watermark_lands_quarantines(proxy, via_proxy, direct):
    writer = via_proxy.publisher("s", holder="A")
    writer.acquire()
    proxy.cut_after(WATERMARK)
    with pytest.raises(QuarantinedError, match="watermark"):
        writer.publish([pack(request="landed")])
    assert visible_requests(direct) == {"landed"}  # it landed before any takeover: legitimately visible
    with pytest.raises(QuarantinedError):
        writer.publish([pack(request="afterwards")])
    assert visible_requests(direct) == {"landed"}
    writer.acquire()
    writer.publish([pack(request="reacquired")])
    assert visible_requests(direct) == {"landed", "reacquired"}


def test_refused_connection_is_certain_and_does_not_quarantine(proxy, via_proxy, direct):
    writer = via_proxy.publisher("s", holder="A")
    term = writer.acquire()
    proxy.cut_after(b"SELECT")  # break the idle connection so the next call must reconnect
    with pytest.raises(CatalogUnavailableError):
        via_proxy.models()
    proxy.refusing = True
    with pytest.raises(CatalogUnavailableError) as info:
        writer.renew()
    assert info.value.outcome_unknown is False
    assert not writer.quarantined and writer.term == term
    proxy.refusing = False
    writer.publish([pack(request="fine")])
    assert visible_requests(direct) == {"fine"}


def test_zombie_paused_mid_publish_is_invisible_after_takeover(proxy, via_proxy, direct):
    zombie = via_proxy.publisher("s", holder="A", lease_seconds=3.0)
    zombie.acquire()
    zombie.publish([pack(request="before")])
    zombie.renew()
    proxy.hold(WATERMARK)  # A passes its lease check, then stalls with its watermark in flight
    outcome: dict[str, object] = {}

    def publish():
        try:
            outcome["watermark"] = zombie.publish([pack(request="zombie")])
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=publish)
    thread.start()
    assert proxy.held_event.wait(20)
    time.sleep(max(0.0, zombie.expires_at - time.time()) + 0.2)  # A's lease runs out while it is stalled
    successor = direct.publisher("s", holder="B")
    assert successor.acquire() == 2
    successor.publish([pack(request="successor")])
    proxy.release()
    thread.join(30)
    assert isinstance(outcome.get("error"), LeaseLostError), outcome  # the zombie's insert landed behind the
    assert "a successor took over (now term 2" in str(outcome["error"])  # fence: refused, not reported published
    landed = direct.sql(f"SELECT term, seq FROM {direct.tables['watermarks']} WHERE term = 1").to_pylist()
    assert {"term": 1, "seq": 2} in landed
    assert visible_requests(direct) == {"before", "successor"}  # ... but readers never see it
    assert [(w.term, w.seq) for w in direct.watermarks("s")] == [(1, 1), (2, 1)]
    with pytest.raises(LeaseError, match="does not hold the lease"):
        zombie.publish([pack(request="again")])


def test_writers_racing_through_separate_connections_hold_distinct_terms(clickhouse_uri):
    catalogs = [open_catalog(clickhouse_uri) for _ in range(6)]
    won: list[tuple[int, str]] = []
    barrier = threading.Barrier(6)

    def race(i):
        pub = catalogs[i].publisher("contested", holder=f"w{i}", lease_seconds=0.5)
        for _ in range(4):
            barrier.wait(30)
            try:
                won.append((pub.acquire(), f"w{i}"))
            except LeaseHeldError:
                pass
            barrier.wait(30)
            time.sleep(0.6)  # every lease expires before the next round

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in catalogs:
        c.close()
    terms = [t for t, _ in won]
    assert len(won) >= 4
    assert len(terms) == len(set(terms)), sorted(won)
