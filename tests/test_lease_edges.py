"""Publisher leases at their edges (embedded chDB): a watermark a successor fenced between the
holder's lease check and its write is not reported published, and lease errors say what to do."""

from __future__ import annotations

import pytest

from dmi.catalog import open_catalog
from dmi.storage import LeaseHeldError, LeaseLostError
from tests.catalog_conformance import ManualClock, pack


@pytest.fixture
def catalog(tmp_path):
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as cat:
        yield cat


def test_a_watermark_fenced_between_the_lease_check_and_its_write_is_refused_not_returned(catalog, monkeypatch):
    """A holds term 1 and passes its lease check; then (a pause) its lease runs out, B takes the
    scope over and fences term 1 at (0, 0); only then does A's watermark land. It sorts after the
    cut and is never visible, so publish() must raise, not return a watermark."""
    clock = ManualClock()
    a = catalog.publisher("s", holder="A", lease_seconds=30, clock=clock)
    b = catalog.publisher("s", holder="B", lease_seconds=30, clock=clock)
    assert a.acquire() == 1
    backend, real_insert = catalog._backend, catalog._backend.insert

    def insert(table, data):  # stands in for A pausing right before its watermark write
        if table == catalog.tables["watermarks"] and data.column("holder")[0].as_py() == "A":
            clock.advance(31)
            assert b.acquire() == 2
        return real_insert(table, data)

    monkeypatch.setattr(backend, "insert", insert)
    doomed = pack(run="r1")
    with pytest.raises(LeaseLostError) as raised:
        a.publish([doomed])
    monkeypatch.setattr(backend, "insert", real_insert)
    assert str(raised.value) == (
        "publisher 'A' lost term 1 of scope 's': a successor took over (now term 2, held by 'B'); what it "
        "published before stays published, this call published nothing: acquire() again, then repeat the call"
    )
    assert a.term is None
    assert catalog.published_pack_ids("s") == set()
    assert [(w.term, w.seq, w.holder) for w in catalog.watermarks("s")] == []
    kept = pack(run="r2")
    assert (b.publish([kept]).term, catalog.published_pack_ids("s")) == (2, {kept.pack_id})


def test_a_watermark_that_landed_before_the_successor_fenced_stays_returned_and_visible(catalog):
    clock = ManualClock()
    a = catalog.publisher("s", holder="A", lease_seconds=30, clock=clock)
    a.acquire()
    first = pack(run="r1")
    assert (a.publish([first]).term, a.publish([pack(run="r1")]).seq) == (1, 2)
    clock.advance(31)
    catalog.publisher("s", holder="B", lease_seconds=30, clock=clock).acquire()
    assert first.pack_id in catalog.published_pack_ids("s")
    assert [(w.term, w.seq) for w in catalog.watermarks("s")] == [(1, 1), (1, 2)]


def test_a_held_lease_says_how_long_and_what_to_do(catalog):
    clock = ManualClock()
    catalog.publisher("L", holder="dead", lease_seconds=30, clock=clock).acquire()
    clock.advance(10)
    with pytest.raises(LeaseHeldError) as raised:
        catalog.publisher("L", holder="new", lease_seconds=30, clock=clock).acquire()
    assert str(raised.value) == (
        "scope 'L' is held by 'dead' (term 1) for another 20.0 s; acquire() again once that holder has "
        "released it or its lease has expired (a holder that died frees the scope when its lease expires)"
    )


def test_an_expired_lease_says_what_to_do(catalog):
    clock = ManualClock()
    a = catalog.publisher("L", holder="slow", lease_seconds=30, clock=clock)
    a.acquire()
    clock.advance(32)
    with pytest.raises(LeaseLostError) as raised:
        a.publish([pack()])
    assert str(raised.value) == (
        "publisher 'slow' lost term 1 of scope 'L': it expired 2.0 s ago; what it published before stays "
        "published, this call published nothing: acquire() again, then repeat the call"
    )
    assert catalog.published_pack_ids("L") == set()


def test_a_read_back_that_met_an_outage_is_retried_without_writing_the_watermark_twice(catalog, monkeypatch):
    """The watermark landed, then the catalog was unreachable for the fence read-back: the
    ride-out retry finds the landed watermark visible and returns it, not a second (1, 1) row."""
    from dmi.catalog._catalog_backend import unavailable
    from dmi.catalog._leases import Publisher

    pub = catalog.publisher("s", holder="A", lease_seconds=30, ride_out_seconds=5)
    pub.acquire()
    real_cut, failures = Publisher._cut, []

    def cut_once_unreachable(self, watermark):
        if not failures:
            failures.append(watermark.seq)
            raise unavailable("connection refused", outcome_unknown=False)
        return real_cut(self, watermark)

    monkeypatch.setattr(Publisher, "_cut", cut_once_unreachable)
    published = pack(run="r1")
    watermark = pub.publish([published])
    assert (watermark.term, watermark.seq, watermark.pack_ids, failures, pub.retries) == (
        1, 1, (published.pack_id,), [1], 1
    )
    rows = catalog.sql(f"SELECT term, seq FROM {catalog.tables['watermarks']}").to_pylist()
    assert rows == [{"term": 1, "seq": 1}]
    assert pub.publish([pack(run="r1")]).seq == 2
