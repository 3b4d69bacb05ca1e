"""Publisher leases, fences and watermarks (the protocol is in docs/catalog-protocol.md).

ClickHouse has no transactions and no compare-and-set, so the protocol is built from
append-only rows and read-backs, and safety comes from terms and fences, not clocks:

* **claim**  — ``(scope, term = max seen + 1, holder, nonce)``. Then the claimer reads back
  every claim for its term and above. Only a claimer that finds itself *alone* proceeds;
  otherwise it withdraws and retries with a higher term. Two claimers of one term cannot
  both be alone (whoever reads back last sees the other's claim), so at most one holder
  per term.
* **fence**  — written by the winner *before* it confirms, computed on the server in one
  ``INSERT ... SELECT``: "watermarks of terms below mine are cut at the highest
  ``(term, seq)`` that exists now". Anything an older holder publishes afterwards sorts
  after the cut and is never visible.
* **confirm** — the lease is now held until ``expires_at``; **renew** extends it;
  **release** ends it early.
* **watermark** — ``(scope, term, seq, packs)``, written after the holder re-checked on the
  server that its term is still the confirmed one and that no later fence exists, then read
  back against the fences: a successor that fenced in between cut it, so :meth:`Publisher.publish`
  raises ``LeaseLostError`` rather than return a watermark no reader will ever see.

Any write whose outcome is unknown (the connection broke after the statement may have
reached the server) **quarantines** the publisher: it drops its term and refuses to
publish until :meth:`Publisher.acquire` succeeds again. A failure that certainly did not
land (could not connect, or ClickHouse refused the statement) does not quarantine.

**Riding out an outage**: :meth:`Publisher.acquire`, :meth:`Publisher.publish` and
:meth:`Publisher.renew` retry a call that met an unreachable catalog, with bounded backoff, for
up to ``ride_out_seconds`` (publish and renew never past the lease's expiry). An acquire simply
claims again: a claim, fence or confirm of its own whose landing was unknown is superseded by
the next claim's higher term, which fences it (the same holder taking over its own lease), so
one term is live. A quarantine a publish or renewal meets on the way is ended by acquiring a
new term only where no one but this publisher wrote to the scope since its term (then no other
writer can have held it); a watermark whose landing was unknown is not written again when
it turns out visible. ClickHouse's own errors, and a lease another holder holds, are never
retried.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from dmi.catalog import _schema
from dmi.catalog._catalog_backend import CatalogBackend
from dmi.catalog._sql import validate_value_id
from dmi.storage.errors import (
    CatalogUnavailableError,
    InvalidArgumentError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    QuarantinedError,
)
from dmi.storage.records import PackDescriptor

__all__ = ["Publisher", "Watermark", "LeaseState", "LeaseTables"]


@dataclass(frozen=True, slots=True)
class LeaseTables:
    """All a :class:`Publisher` needs of its catalog, passed in rather than reached for.

    ``backend`` runs the protocol's statements; ``tables`` maps table names (``leases``,
    ``fences``, ``watermarks``, ...) to quoted, qualified names; ``index`` is the catalog's
    one write path for index rows, ``index(descriptors, scope=..., term=...)`` returning the
    number of records described (rows it writes stay invisible until a watermark names them).
    """

    backend: CatalogBackend
    tables: Mapping[str, str]
    index: Callable[..., int]


@dataclass(frozen=True, slots=True)
class Watermark:
    """One published snapshot of a scope: everything up to it is a consistent prefix."""

    scope: str
    term: int
    seq: int
    pack_ids: tuple[str, ...]
    holder: str
    n_records: int
    published_at: float

    @property
    def position(self) -> tuple[int, int]:
        """Sort key within the scope: ``(term, seq)``."""
        return (self.term, self.seq)


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What the catalog says about a scope's lease right now."""

    scope: str
    max_term: int
    term: int
    holder: str | None
    nonce: str | None
    expires_at: float
    released: bool
    max_fence: int

    def live(self, now: float) -> bool:
        return (
            self.term > 0
            and not self.released
            and self.expires_at > now
            and self.max_fence <= self.term
        )


def _locked(method):
    """Run a Publisher method under the publisher's lock (one protocol step at a time)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def read_state(target: LeaseTables, scope: str) -> LeaseState:
    """What the catalog says about ``scope``'s lease now: the highest confirmed term, its
    holder and expiry, and the highest fence (a successor's fence ends a term at once)."""
    t = target.tables
    rows = target.backend.query(
        f"SELECT kind, term, holder, nonce, expires_at, "
        f"(SELECT max(fencing_term) FROM {t['fences']} WHERE scope = %(scope)s) AS max_fence "
        f"FROM {t['leases']} WHERE scope = %(scope)s AND term >= "
        f"(SELECT max(term) FROM {t['leases']} WHERE scope = %(scope)s AND kind = 'confirm')",
        {"scope": scope},
    ).to_pylist()
    if rows:
        max_fence = int(rows[0]["max_fence"] or 0)
    else:  # no lease rows at all: a fence can still exist (its writer's claim was withdrawn)
        fence = target.backend.query(
            f"SELECT max(fencing_term) AS f FROM {t['fences']} WHERE scope = %(scope)s", {"scope": scope}
        ).to_pylist()
        max_fence = int(fence[0]["f"] or 0) if fence else 0
    max_term = max((int(r["term"]) for r in rows), default=0)
    confirms = [r for r in rows if r["kind"] == "confirm"]
    if not confirms:
        return LeaseState(scope, max_term, 0, None, None, 0.0, False, max_fence)
    top = max(int(r["term"]) for r in confirms)
    confirm = next(r for r in confirms if int(r["term"]) == top)
    nonce = confirm["nonce"]
    mine = [r for r in rows if int(r["term"]) == top and r["nonce"] == nonce]
    released = any(r["kind"] == "release" for r in mine)
    expires = max(float(r["expires_at"]) for r in mine if r["kind"] in ("confirm", "renew"))
    return LeaseState(scope, max_term, top, confirm["holder"], nonce, expires, released, max_fence)


class Publisher:
    """The right to publish watermarks for one scope, one holder at a time.

    Use as a context manager (acquire on enter, release on exit) or call
    :meth:`acquire` / :meth:`renew` / :meth:`release` yourself. :meth:`publish` renews on
    its own once half the lease has passed. Thread-safe: calls run one at a time (e.g. a
    drain thread publishing and renewing while another thread releases).

    ``ride_out_seconds`` (default 0: every failure raised at once): how long :meth:`acquire`,
    :meth:`publish` and :meth:`renew` keep retrying while the catalog is unreachable (:meth:`_riding_out`);
    ``retries`` and ``reacquired`` count what riding out did. It may be set after
    construction too.
    """

    max_attempts = 8
    max_backoff_seconds = 1.0  # the longest wait between two tries of a call riding out an outage

    def __init__(
        self,
        target: LeaseTables,
        scope: str,
        holder: str | None = None,
        lease_seconds: float = 30.0,
        *,
        clock: Callable[[], float] = time.time,
        ride_out_seconds: float = 0.0,
    ):
        self._target = target
        self.scope = validate_value_id(scope, "scope")
        self.holder = validate_value_id(holder if holder is not None else default_holder(), "holder")
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) or not lease_seconds > 0:
            raise InvalidArgumentError(f"lease_seconds must be a positive number of seconds, not {lease_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        self.ride_out_seconds = ride_out_seconds
        self.retries = 0  # tries repeated because the catalog was unreachable (riding out an outage)
        self.reacquired = 0  # terms acquired to end a quarantine met while riding out an outage
        self._clock = clock
        self._term: int | None = None
        self._nonce: str | None = None
        self._expires_at = 0.0
        self._seq = 0
        self._quarantined = False
        self._quarantine_cause: str | None = None
        self._quarantined_term: int | None = None  # the term a quarantine dropped
        self._nonces: set[str] = set()  # every nonce this publisher claimed with
        self._unknown_watermark: Watermark | None = None  # written; landing or visibility unknown (this publish)
        self._lock = threading.RLock()

    # ----------------------------------------------------------------- state
    @property
    def term(self) -> int | None:
        """The term held now, or None (never acquired, released, lost or quarantined)."""
        return self._term

    @property
    def ride_out_seconds(self) -> float:
        """How long :meth:`acquire`, :meth:`publish` and :meth:`renew` retry an unreachable catalog (0: not at all)."""
        return self._ride_out_seconds

    @ride_out_seconds.setter
    def ride_out_seconds(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
            raise InvalidArgumentError(
                f"ride_out_seconds must be a finite number of seconds, 0 or more (0: no retry), not {seconds!r}"
            )
        self._ride_out_seconds = float(seconds)

    @property
    def quarantined(self) -> bool:
        return self._quarantined

    @property
    def expires_at(self) -> float:
        return self._expires_at if self._term is not None else 0.0

    def __repr__(self) -> str:
        status = "quarantined" if self._quarantined else (f"term {self._term}" if self._term else "not held")
        return f"<Publisher scope={self.scope!r} holder={self.holder!r} {status}>"

    def _drop(self) -> None:
        self._term = None
        self._nonce = None
        self._expires_at = 0.0
        self._seq = 0

    def _quarantine(self, what: str, exc: BaseException) -> QuarantinedError:
        if self._term is not None:
            self._quarantined_term = self._term
        self._drop()
        self._quarantined = True
        self._quarantine_cause = what
        return QuarantinedError(
            f"publisher {self.holder!r} for scope {self.scope!r}: the connection broke during the {what}, "
            "so whether it landed is unknown; this publisher dropped its lease and will not publish until "
            "acquire() succeeds again"
        )

    def _write(self, what: str, table: str, data: pa.Table) -> None:
        """A protocol write: an unknown outcome quarantines."""
        try:
            self._target.backend.insert(self._target.tables[table], data)
        except CatalogUnavailableError as exc:
            if getattr(exc, "outcome_unknown", True):
                raise self._quarantine(what, exc) from exc
            raise

    def _lease_row(self, term: int, kind: str, nonce: str, expires_at: float) -> pa.Table:
        return pa.Table.from_pylist(
            [
                {
                    "scope": self.scope,
                    "term": term,
                    "kind": kind,
                    "holder": self.holder,
                    "nonce": nonce,
                    "expires_at": expires_at,
                    "written_at": self._clock(),
                }
            ],
            schema=_schema.LEASE_SCHEMA,
        )

    def _require_holding(self) -> None:
        if self._quarantined:
            raise QuarantinedError(
                f"publisher {self.holder!r} for scope {self.scope!r} is quarantined (the outcome of its "
                f"{self._quarantine_cause} is unknown); call acquire() before publishing"
            )
        if self._term is None:
            raise LeaseError(
                f"publisher {self.holder!r} does not hold the lease for scope {self.scope!r}; call acquire() first"
            )

    def _still_mine(self, state: LeaseState, now: float) -> bool:
        return (
            state.term == self._term
            and state.nonce == self._nonce
            and state.max_fence <= (self._term or 0)
            and not state.released
            and state.expires_at > now
        )

    def _lost(self, state: LeaseState, now: float) -> LeaseLostError:
        term = self._term
        self._drop()
        if state.term != term or state.max_fence > (term or 0):
            why = f"a successor took over (now term {max(state.term, state.max_fence)}, held by {state.holder!r})"
        elif state.released:
            why = "it was released"
        else:
            why = f"it expired {now - state.expires_at:.1f} s ago"
        return LeaseLostError(
            f"publisher {self.holder!r} lost term {term} of scope {self.scope!r}: {why}; what it published "
            "before stays published, this call published nothing: acquire() again, then repeat the call"
        )

    # ----------------------------------------------------------------- protocol
    @_locked
    def acquire(self) -> int:
        """Claim the scope with a new term; returns the term.

        Raises LeaseHeldError while another holder's lease is live (at once, never retried).
        The same holder name may take over its own live lease (e.g. after a restart or a
        quarantine); that fences its older term like any takeover. Rides out an unreachable
        catalog (see :meth:`_riding_out`): a try whose claim, fence or confirm may have landed
        unseen is followed by a fresh claim of a higher term — a confirm that did land is this
        holder's own live lease, taken over and fenced like any other, so one term is live.
        """
        return self._riding_out("acquire", self._acquire_once, holding=False)

    def _acquire_once(self) -> int:
        """One try of :meth:`acquire` (rival claims met are retried here, up to ``max_attempts``)."""
        for attempt in range(self.max_attempts):
            state = read_state(self._target, self.scope)
            now = self._clock()
            if state.live(now) and state.holder != self.holder:
                raise LeaseHeldError(
                    f"scope {self.scope!r} is held by {state.holder!r} (term {state.term}) for another "
                    f"{state.expires_at - now:.1f} s; acquire() again once that holder has released it or "
                    "its lease has expired (a holder that died frees the scope when its lease expires)"
                )
            term = max(state.max_term, state.max_fence) + 1
            nonce = uuid.uuid4().hex
            expires = now + self.lease_seconds
            self._nonces.add(nonce)
            self._write("claim", "leases", self._lease_row(term, "claim", nonce, expires))
            rivals = self._target.backend.query(
                f"SELECT nonce FROM {self._target.tables['leases']} "
                "WHERE scope = %(scope)s AND kind = 'claim' AND term >= %(term)s AND nonce != %(nonce)s",
                {"scope": self.scope, "term": term, "nonce": nonce},
            )
            if rivals.num_rows:
                time.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
                continue
            self._fence(term, nonce)
            self._write("confirm", "leases", self._lease_row(term, "confirm", nonce, expires))
            self._quarantined = False
            self._quarantine_cause = None
            self._quarantined_term = None
            after = read_state(self._target, self.scope)
            if after.term != term or after.max_fence > term:
                # A claimer of a higher term, who read the state before our claim landed,
                # was also alone: its term supersedes ours at once.
                raise LeaseHeldError(
                    f"scope {self.scope!r}: term {term} was overtaken at once by term "
                    f"{max(after.term, after.max_fence)} ({after.holder!r})"
                )
            self._term, self._nonce, self._expires_at, self._seq = term, nonce, expires, 0
            return term
        raise LeaseHeldError(
            f"scope {self.scope!r}: {self.max_attempts} claims in a row met a rival claim; try again later"
        )

    def _fence(self, term: int, nonce: str) -> None:
        t = self._target.tables
        try:
            self._target.backend.command(
                f"INSERT INTO {t['fences']} (scope, fencing_term, cut_term, cut_seq, holder, nonce, written_at) "
                "SELECT %(scope)s, %(term)s, tupleElement(m, 1), tupleElement(m, 2), %(holder)s, %(nonce)s, %(now)s "
                f"FROM (SELECT max((term, seq)) AS m FROM {t['watermarks']} "
                "WHERE scope = %(scope)s AND term < %(term)s)",
                {"scope": self.scope, "term": term, "holder": self.holder, "nonce": nonce, "now": self._clock()},
            )
        except CatalogUnavailableError as exc:
            if getattr(exc, "outcome_unknown", True):
                raise self._quarantine("fence", exc) from exc
            raise

    @_locked
    def renew(self) -> float:
        """Extend the lease by ``lease_seconds`` from now; returns the new expiry (Unix time).
        Rides out an unreachable catalog (see :meth:`_riding_out`)."""
        self._require_holding()
        return self._riding_out("renewal", self._renew_once)

    def _renew_once(self) -> float:
        state = read_state(self._target, self.scope)
        now = self._clock()
        if not self._still_mine(state, now):
            raise self._lost(state, now)
        expires = now + self.lease_seconds
        self._write("renewal", "leases", self._lease_row(self._term, "renew", self._nonce, expires))
        self._expires_at = expires
        return expires

    @_locked
    def release(self) -> None:
        """End the lease now so a successor need not wait for expiry. Idempotent."""
        if self._term is None:
            return
        term, nonce = self._term, self._nonce
        self._drop()
        try:
            self._target.backend.insert(self._target.tables["leases"], self._lease_row(term, "release", nonce, 0.0))
        except CatalogUnavailableError:
            pass  # the lease simply runs out; publishing is already refused locally

    @_locked
    def publish(self, descriptors: Sequence[PackDescriptor]) -> Watermark:
        """Index the packs and publish one watermark that makes them visible; returns it.

        Index rows are written first (invisible on their own), then the lease is checked on
        the server, then the watermark row is written. Publishing a pack that is already
        indexed or published again is harmless: its rows are not written twice and readers
        see each record once. Rides out an unreachable catalog (see :meth:`_riding_out`).
        """
        descriptors = list(descriptors)
        for descriptor in descriptors:
            if not isinstance(descriptor, PackDescriptor):
                raise InvalidArgumentError(f"publish() takes PackDescriptor objects, not {type(descriptor).__name__}")
            validate_value_id(descriptor.pack_id, "pack id")
        self._require_holding()
        self._unknown_watermark = None
        return self._riding_out("publish", lambda: self._publish_once(descriptors))

    def _publish_once(self, descriptors: list[PackDescriptor]) -> Watermark:
        """One try of :meth:`publish`; after a quarantine of its own watermark write, the
        watermark itself where it turned out visible (it is not written twice)."""
        unknown, self._unknown_watermark = self._unknown_watermark, None
        if unknown is not None and self._visible(unknown):
            return unknown
        if self._clock() > self._expires_at - self.lease_seconds / 2:
            self._renew_once()  # also how an expired or superseded holder is stopped before writing
        n_records = self._target.index(descriptors, scope=self.scope, term=self._term)
        state = read_state(self._target, self.scope)
        now = self._clock()
        if not self._still_mine(state, now):
            raise self._lost(state, now)
        seq = self._seq + 1
        pack_ids = tuple(dict.fromkeys(d.pack_id for d in descriptors))
        row = pa.Table.from_pylist(
            [
                {
                    "scope": self.scope,
                    "term": self._term,
                    "seq": seq,
                    "holder": self.holder,
                    "nonce": self._nonce,
                    "pack_ids": list(pack_ids),
                    "n_records": n_records,
                    "published_at": now,
                }
            ],
            schema=_schema.WATERMARK_SCHEMA,
        )
        watermark = Watermark(self.scope, self._term, seq, pack_ids, self.holder, n_records, now)
        try:
            self._write("watermark", "watermarks", row)
        except QuarantinedError:
            self._unknown_watermark = watermark
            raise
        self._seq = seq
        self._unknown_watermark = watermark  # landed; a retry after a failed _cut asks _visible instead
        if self._cut(watermark):
            raise self._lost(read_state(self._target, self.scope), self._clock())
        self._unknown_watermark = None
        return watermark

    def _visible(self, watermark: Watermark) -> bool:
        """Whether ``watermark`` (of a term this publisher held) landed and is visible: no fence
        of a later term cuts below it. Asked once the answer can no longer change: a later term
        of this publisher has fenced its term, or the watermark landed (see :meth:`_cut`).
        (One holder per term: a row of its term and seq is this publisher's.)"""
        t = self._target.tables
        params = {"scope": self.scope, "term": watermark.term, "seq": watermark.seq}
        landed = self._target.backend.query(
            f"SELECT count() AS n FROM {t['watermarks']} WHERE scope = %(scope)s AND term = %(term)s "
            "AND seq = %(seq)s",
            params,
        ).to_pylist()[0]["n"]
        return bool(landed) and not self._cut(watermark)

    def _cut(self, watermark: Watermark) -> bool:
        """Whether a fence of a later term cuts below ``watermark``, so it can never be visible.

        Asked right after a watermark landed: the lease check before it cannot stop a successor
        fencing in between (no compare-and-set). A fence written after the watermark landed
        counts it below its cut, so once this says no, the watermark stays visible."""
        rows = self._target.backend.query(
            f"SELECT count() AS n FROM {self._target.tables['fences']} WHERE scope = %(scope)s "
            "AND fencing_term > %(term)s AND (cut_term < %(term)s OR (cut_term = %(term)s AND cut_seq < %(seq)s))",
            {"scope": self.scope, "term": watermark.term, "seq": watermark.seq},
        )
        return bool(rows.to_pylist()[0]["n"])

    # ----------------------------------------------------------------- riding out an outage
    def _riding_out(self, what: str, attempt: Callable[[], object], *, holding: bool = True):
        """``attempt()``, tried again while the catalog is unreachable (``CatalogUnavailableError``,
        or a quarantine it caused), with backoff from 50 ms doubling to ``max_backoff_seconds``,
        until ``ride_out_seconds`` have passed or — for a call made ``holding`` the lease — a
        tenth of the lease before the expiry the lease had when the call began (whichever comes
        first; then the last error is raised, saying so). A quarantine met on the way by a call
        ``holding`` the lease is ended by :meth:`_resume` before the next try (an acquire, not
        holding it, ends a quarantine itself). Anything else (ClickHouse's own errors, a lost or
        held lease) is raised at once. Every repeated try is counted in ``retries``."""
        started = time.monotonic()
        until = started + self.ride_out_seconds
        expiry_bound = self._expires_at - self.lease_seconds / 10 if holding else float("inf")
        backoff = 0.05
        tries = 0
        while True:
            try:
                if holding and self._quarantined:
                    self._resume()
                return attempt()
            except (CatalogUnavailableError, QuarantinedError) as exc:
                if not _outage(exc):
                    raise
                delay = min(backoff, until - time.monotonic())
                if delay <= 0 or self._clock() + delay >= expiry_bound:
                    if not tries:
                        raise
                    raise _gave_up(exc, what, tries, time.monotonic() - started, self.ride_out_seconds,
                                   holding) from exc
            time.sleep(delay)
            backoff = min(2 * backoff, self.max_backoff_seconds)
            tries += 1
            self.retries += 1

    def _resume(self) -> None:
        """End a quarantine met while riding out an outage by acquiring a new term — only where
        the protocol shows that is safe: no lease row and no fence of a term above the one the
        quarantine dropped carries a nonce other than this publisher's own. Then no one else
        claimed the scope since that term, so no other writer can have held it, and the new
        term's fence keeps visible everything that term landed before it (each watermark once).
        Otherwise ``QuarantinedError``, not retried. (One try: the ride-out around it retries.)"""
        term = self._quarantined_term
        t = self._target.tables
        params = {"scope": self.scope, "term": term}
        nonces = set(
            self._target.backend.query(
                f"SELECT nonce FROM {t['leases']} WHERE scope = %(scope)s AND term > %(term)s", params
            ).column("nonce").to_pylist()
        ) | set(
            self._target.backend.query(
                f"SELECT nonce FROM {t['fences']} WHERE scope = %(scope)s AND fencing_term > %(term)s", params
            ).column("nonce").to_pylist()
        )
        if nonces - self._nonces:
            raise QuarantinedError(
                f"publisher {self.holder!r} for scope {self.scope!r} is quarantined (the outcome of its "
                f"{self._quarantine_cause} is unknown) and another publisher has claimed the scope since "
                f"its term {term}, so it does not take the lease back on its own; call acquire() to take "
                "it over deliberately"
            )
        self._acquire_once()
        self.reacquired += 1

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> Publisher:
        self.acquire()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()


def _outage(exc: BaseException) -> bool:
    """Whether ``exc`` is the catalog being unreachable: the error itself, or a quarantine it caused."""
    if isinstance(exc, QuarantinedError):
        return isinstance(exc.__cause__, CatalogUnavailableError)
    return isinstance(exc, CatalogUnavailableError)


def _gave_up(exc: BaseException, what: str, tries: int, seconds: float, ride_out: float,
             holding: bool) -> BaseException:
    """``exc`` once riding it out failed: the same error (its attributes kept, e.g.
    ``outcome_unknown``), saying how long it was tried (``holding``: bounded by the lease's expiry too)."""
    bound = " and the lease's expiry" if holding else ""
    error = type(exc)(
        f"{exc} [the {what} was tried {tries + 1} times over {seconds:.1f} s: the catalog stayed unreachable "
        f"within ride_out_seconds={ride_out:g}{bound}]"
    )
    error.__dict__.update(exc.__dict__)
    return error


def validate_record_ids(table: pa.Table) -> None:
    """Validate the distinct ids of an index batch (cheap: one pass per column in Arrow)."""
    for column, what in (("model_id", "model id"), ("run_id", "run id"), ("request_id", "request id"), ("hook", "hook")):
        for value in pc.unique(table.column(column)).to_pylist():
            validate_value_id(value, what)
