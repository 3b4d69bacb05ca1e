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
  server that its term is still the confirmed one and that no later fence exists.

Any write whose outcome is unknown (the connection broke after the statement may have
reached the server) **quarantines** the publisher: it drops its term and refuses to
publish until :meth:`Publisher.acquire` succeeds again. A failure that certainly did not
land (could not connect, or ClickHouse refused the statement) does not quarantine.
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
    """

    max_attempts = 8

    def __init__(
        self,
        target: LeaseTables,
        scope: str,
        holder: str | None = None,
        lease_seconds: float = 30.0,
        *,
        clock: Callable[[], float] = time.time,
    ):
        self._target = target
        self.scope = validate_value_id(scope, "scope")
        self.holder = validate_value_id(holder if holder is not None else default_holder(), "holder")
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, (int, float)) or not lease_seconds > 0:
            raise InvalidArgumentError(f"lease_seconds must be a positive number of seconds, not {lease_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        self._clock = clock
        self._term: int | None = None
        self._nonce: str | None = None
        self._expires_at = 0.0
        self._seq = 0
        self._quarantined = False
        self._quarantine_cause: str | None = None
        self._lock = threading.RLock()

    # ----------------------------------------------------------------- state
    @property
    def term(self) -> int | None:
        """The term held now, or None (never acquired, released, lost or quarantined)."""
        return self._term

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
        return LeaseLostError(f"publisher {self.holder!r} lost term {term} of scope {self.scope!r}: {why}")

    # ----------------------------------------------------------------- protocol
    @_locked
    def acquire(self) -> int:
        """Claim the scope with a new term; returns the term.

        Raises LeaseHeldError while another holder's lease is live. The same holder name may
        take over its own live lease (e.g. after a restart or a quarantine); that fences its
        older term like any takeover.
        """
        for attempt in range(self.max_attempts):
            state = read_state(self._target, self.scope)
            now = self._clock()
            if state.live(now) and state.holder != self.holder:
                raise LeaseHeldError(
                    f"scope {self.scope!r} is held by {state.holder!r} (term {state.term}) for another "
                    f"{state.expires_at - now:.1f} s"
                )
            term = max(state.max_term, state.max_fence) + 1
            nonce = uuid.uuid4().hex
            expires = now + self.lease_seconds
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
        """Extend the lease by ``lease_seconds`` from now; returns the new expiry (Unix time)."""
        self._require_holding()
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
        see each record once.
        """
        descriptors = list(descriptors)
        for descriptor in descriptors:
            if not isinstance(descriptor, PackDescriptor):
                raise InvalidArgumentError(f"publish() takes PackDescriptor objects, not {type(descriptor).__name__}")
            validate_value_id(descriptor.pack_id, "pack id")
        self._require_holding()
        if self._clock() > self._expires_at - self.lease_seconds / 2:
            self.renew()  # also how an expired or superseded holder is stopped before writing
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
        term = self._term
        self._write("watermark", "watermarks", row)
        self._seq = seq
        return Watermark(self.scope, term, seq, pack_ids, self.holder, n_records, now)

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> Publisher:
        self.acquire()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()


def validate_record_ids(table: pa.Table) -> None:
    """Validate the distinct ids of an index batch (cheap: one pass per column in Arrow)."""
    for column, what in (("model_id", "model id"), ("run_id", "run id"), ("request_id", "request id"), ("hook", "hook")):
        for value in pc.unique(table.column(column)).to_pylist():
            validate_value_id(value, what)
