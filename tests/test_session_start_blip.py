"""Acquiring the publisher lease rides out a catalog unreachable for a moment, as publish and
renew do (``Publisher.ride_out_seconds``) — so a capture session whose catalog blips as it
starts does not fail. Before, ``acquire`` raised at the first failure and the session failed
with ``DrainError`` at its next step.

A retry after a claim or confirm whose landing was unknown claims a higher term, which fences
the one that landed: one live term, held by the same holder. Another holder's live lease is
``LeaseHeldError`` at once, never ridden out.

Two ways to break the catalog: against the real server, the cutting proxy (tests/_proxy.py)
lets a statement land and cuts the connection before the answer (``live``); on an embedded
catalog, a wrapper around its backend that refuses the first lease statements as a connection
that could not be made, or lets one land and then raises as a lost answer
(``tests.catalog_conformance.FaultyBackend``), where no server is at hand.
"""

from __future__ import annotations

import re

import pytest

from dmi.capture import attach
from dmi.catalog._catalog_backend import unavailable
from dmi.storage.errors import CatalogUnavailableError, DrainError, LeaseHeldError, QuarantinedError
from tests._models import left_padded_batch, tiny
from tests.catalog_conformance import FaultyBackend, pack

CLAIM = b"\x05claim"
CONFIRM = b"\x07confirm"


class RefusingLeases:
    """A backend whose first ``n`` statements on the leases table fail as a connection that
    could not be made (nothing sent: ``outcome_unknown=False``); counts them in ``refused``."""

    def __init__(self, inner, n: int):
        self._inner = inner
        self._left = n
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _refuse(self, text: str) -> None:
        if self._left and "leases" in text:
            self._left -= 1
            self.refused += 1
            raise unavailable("injected: connection refused", outcome_unknown=False)

    def query(self, sql, params=None, **kwargs):
        self._refuse(sql)
        return self._inner.query(sql, params, **kwargs)

    def command(self, sql, params=None):
        self._refuse(sql)
        return self._inner.command(sql, params)

    def insert(self, table, data):
        self._refuse(table)
        return self._inner.insert(table, data)


def _lease_rows(catalog) -> list[tuple[str, int, str]]:
    return [(r["kind"], r["term"], r["holder"]) for r in catalog.sql(
        f"SELECT kind, term, holder FROM {catalog.tables['leases']} ORDER BY term, kind").to_pylist()]


def _state(catalog, scope: str = "s") -> tuple:
    state = catalog.lease_state(scope)
    return state.term, state.holder, state.max_term, state.max_fence


def _riding(catalog, backend=None, holder: str = "A", ride_out_seconds: float = 30):
    """A publisher of scope ``s`` riding out outages, its statements through ``backend``."""
    original = catalog._backend
    catalog._backend = backend if backend is not None else original
    try:
        return catalog.publisher("s", holder=holder, ride_out_seconds=ride_out_seconds)
    finally:
        catalog._backend = original


# ------------------------------------------------------------------ the publisher, embedded catalog
def test_refused_statements_are_ridden_out_and_counted(store_and_catalog):
    _, catalog = store_and_catalog
    refusing = RefusingLeases(catalog._backend, 3)
    writer = _riding(catalog, refusing)
    assert writer.acquire() == 1
    assert (refusing.refused, writer.retries, writer.reacquired, writer.quarantined) == (3, 3, 0, False)
    assert _state(catalog) == (1, "A", 1, 1)
    assert writer.publish([pack(request="r")]).position == (1, 1)


def test_without_ride_out_a_refused_acquire_raises_at_once(store_and_catalog):
    _, catalog = store_and_catalog
    refusing = RefusingLeases(catalog._backend, 1)
    writer = _riding(catalog, refusing, ride_out_seconds=0)
    with pytest.raises(CatalogUnavailableError, match="^injected: connection refused$"):
        writer.acquire()
    assert (refusing.refused, writer.retries, writer.term) == (1, 0, None)


@pytest.mark.parametrize("kind", ["claim", "confirm"])
def test_a_write_landed_unseen_is_superseded_by_the_next_claim(store_and_catalog, kind):
    """The claim (or confirm) of term 1 lands and its answer is lost: the retry claims term 2,
    whose fence ends term 1 — also where term 1's confirm landed, this holder's own live lease."""
    _, catalog = store_and_catalog
    faulty = FaultyBackend(catalog._backend)
    writer = _riding(catalog, faulty)
    faulty.arm("leases", landed=True, kind=kind)
    assert writer.acquire() == 2
    assert (writer.retries, writer.reacquired, writer.quarantined, writer.term) == (1, 0, False, 2)
    confirmed_1 = [("confirm", 1, "A")] if kind == "confirm" else []
    assert _lease_rows(catalog) == [("claim", 1, "A"), *confirmed_1, ("claim", 2, "A"), ("confirm", 2, "A")]
    assert _state(catalog) == (2, "A", 2, 2)  # one live term: term 2's fence cuts term 1
    assert catalog.lease_state("s").live(writer._clock())
    assert writer.publish([pack(request="r")]).position == (2, 1)
    assert [(w.term, w.seq) for w in catalog.watermarks("s")] == [(2, 1)]


def test_another_holder_s_live_lease_is_not_ridden_out(store_and_catalog):
    _, catalog = store_and_catalog
    catalog.publisher("s", holder="B").acquire()
    writer = _riding(catalog)
    with pytest.raises(LeaseHeldError, match="held by 'B' \\(term 1\\)"):
        writer.acquire()
    assert (writer.retries, writer.term) == (0, None)
    assert _state(catalog) == (1, "B", 1, 1)


def test_an_acquire_takes_over_deliberately_from_a_quarantine(store_and_catalog):
    """A quarantined publisher's acquire, riding out, is the caller's deliberate takeover: it is
    not held back, as a publish's own re-acquire is, by another claim since its term."""
    _, catalog = store_and_catalog
    faulty = FaultyBackend(catalog._backend)
    writer = _riding(catalog, faulty, ride_out_seconds=0)
    assert writer.acquire() == 1
    faulty.arm("leases", landed=True, kind="renew")
    with pytest.raises(QuarantinedError, match="renewal"):
        writer.renew()
    assert catalog.publisher("s", holder="A").acquire() == 2  # the same holder name, another process
    writer.ride_out_seconds = 30
    assert writer.acquire() == 3
    assert (writer.retries, writer.reacquired, writer.quarantined) == (0, 0, False)
    assert _state(catalog) == (3, "A", 3, 3)


def test_an_outage_past_ride_out_seconds_fails_named(store_and_catalog):
    _, catalog = store_and_catalog
    refusing = RefusingLeases(catalog._backend, 10**6)
    writer = _riding(catalog, refusing, ride_out_seconds=0.2)
    with pytest.raises(CatalogUnavailableError) as raised:
        writer.acquire()
    message = str(raised.value)
    tried = re.fullmatch(r"injected: connection refused \[the acquire was tried (\d+) times over [\d.]+ s: "
                         r"the catalog stayed unreachable within ride_out_seconds=0.2\]", message)
    assert tried, message
    assert raised.value.outcome_unknown is False
    assert int(tried.group(1)) == refusing.refused == writer.retries + 1
    assert writer.term is None and not writer.quarantined


# ------------------------------------------------------------------ a capture session, embedded catalog
def _capture(store, catalog, **options):
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m",
                writer_options={"max_records": 10}, **options) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        cap.flush()
    return cap


def test_a_session_whose_catalog_refuses_at_start_rides_it_out(store_and_catalog):
    store, catalog = store_and_catalog
    refusing = catalog._backend = RefusingLeases(catalog._backend, 3)
    cap = _capture(store, catalog)
    sealed = set(store.list_packs())
    assert refusing.refused == 3
    assert (cap.stats["catalog_retries"], cap.stats["lease_reacquired"]) == (3, 0)
    assert cap.stats["packs_published"] == len(sealed) and catalog.published_pack_ids() == sealed
    assert len(catalog.find_records("m")) == cap.stats["records"] == 3 * 3 * 2  # prompts x layers x (prefill, decode)
    assert _state(catalog, cap._publisher.publisher.scope)[:2] == (1, cap._publisher.publisher.holder)


def test_a_session_whose_scope_another_holds_fails_at_once(store_and_catalog):
    store, catalog = store_and_catalog
    other = catalog.publisher("m/run-0", holder="B")
    assert other.acquire() == 1
    with pytest.raises(DrainError, match="LeaseHeldError.*held by 'B'"):
        _capture(store, catalog, run_id="run-0", publish_scope="m/run-0")
    assert catalog.published_pack_ids() == set()
    assert _state(catalog, "m/run-0") == (1, "B", 1, 1)


# ------------------------------------------------------------------ against the real server
@pytest.mark.live
@pytest.mark.parametrize("trigger", [CLAIM, CONFIRM])
def test_a_cut_claim_or_confirm_is_ridden_out_on_the_server(proxy, via_proxy, direct, trigger):
    writer = _riding(via_proxy)
    proxy.cut_after(trigger)
    assert writer.acquire() == 2
    assert proxy.cuts == 1
    assert (writer.retries, writer.reacquired, writer.quarantined) == (1, 0, False)
    confirmed_1 = [("confirm", 1, "A")] if trigger == CONFIRM else []
    assert _lease_rows(direct) == [("claim", 1, "A"), *confirmed_1, ("claim", 2, "A"), ("confirm", 2, "A")]
    assert _state(direct) == (2, "A", 2, 2)
    assert writer.publish([pack(request="r")]).position == (2, 1)
    assert {e.meta.key.request_id for e in direct.find_records("gpt2")} == {"r"}


@pytest.mark.live
def test_a_session_whose_claim_is_cut_at_start_rides_it_out_on_the_server(proxy, via_proxy, tmp_path):
    from dmi.storage import PackStore

    store = PackStore.local(tmp_path / "packs")
    proxy.cut_after(CLAIM)
    cap = _capture(store, via_proxy)
    publisher = cap._publisher.publisher
    sealed = set(store.list_packs())
    assert proxy.cuts == 1
    assert (cap.stats["catalog_retries"], cap.stats["lease_reacquired"]) == (1, 0)
    assert cap.stats["packs_published"] == len(sealed) and via_proxy.published_pack_ids() == sealed
    assert len(via_proxy.find_records("m")) == cap.stats["records"] == 3 * 3 * 2
    assert {w.term for w in via_proxy.watermarks(publisher.scope)} == {2}  # all under the term after the cut


@pytest.mark.live
def test_another_holder_on_the_server_is_not_ridden_out(proxy, via_proxy, direct):
    direct.publisher("s", holder="B").acquire()
    writer = _riding(via_proxy)
    with pytest.raises(LeaseHeldError, match="held by 'B'"):
        writer.acquire()
    assert (writer.retries, proxy.cuts) == (0, 0)
