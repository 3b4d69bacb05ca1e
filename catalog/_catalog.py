"""The catalog: one ClickHouse index of sealed packs, behind one narrow backend contract.

Everything shared — schema, index writes, leases, watermarks, recovery, queries — lives
here, on top of :class:`~dmi.catalog._catalog_backend.CatalogBackend`'s four primitives.
There is one private write path for index rows (:meth:`Catalog._index`); only a
:class:`~dmi.catalog.Publisher` holding a lease makes them visible.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from dmi.catalog import _deletion, _schema
from dmi.catalog._audits import audit_rows_table
from dmi.catalog._catalog_backend import CatalogBackend
from dmi.catalog._deletion import Deletion
from dmi.catalog._leases import LeaseState, LeaseTables, Publisher, Watermark, read_state, validate_record_ids
from dmi.catalog._sql import (
    bind,
    no_output_clause,
    output_clause,
    quote_identifier,
    single_statement,
    utf8_text,
    validate_identifier,
    validate_optional_value_id,
    validate_value_id,
)
from dmi.storage.errors import (InvalidArgumentError, InvalidIdentifierError, RecoveryIncompleteError,
                               SchemaVersionError, ServerError)
from dmi.storage.records import PackDescriptor, RecordEntry

__all__ = ["Catalog", "HookContents", "ModelTotals", "RequestTotals"]

#: ClickHouse's error code for a statement refused under ``readonly``.
READONLY_CODE = 164


@dataclass(frozen=True, slots=True)
class HookContents:
    """What one request holds for one hook, over its published records.

    ``n_tokens`` is the request's token count for the hook (per layer and shard rank);
    ``feature_shape`` the per-token shape (of the whole tensor, for shards); ``stored_bytes``
    and ``raw_bytes`` the payload bytes as stored and as captured.
    """

    hook: str
    layers: tuple[int, ...]
    shard_ranks: tuple[int, ...]
    tp_sizes: tuple[int, ...]
    n_records: int
    n_tokens: int
    dtype: str
    feature_shape: tuple[int, ...]
    stored_bytes: int
    raw_bytes: int
    shard_axes: tuple[int, ...] = ()  # the recorded TP split axes; -1: records without geometry (replicated)


@dataclass(frozen=True, slots=True)
class ModelTotals:
    """One model id with totals over its published records."""

    model_id: str
    runs: int
    requests: int
    records: int
    stored_bytes: int
    raw_bytes: int


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """One published request: its token count, hooks (sorted by name), records and bytes."""

    run_id: str
    request_id: str
    n_tokens: int
    hooks: tuple[str, ...]
    records: int
    stored_bytes: int
    raw_bytes: int


MAX_SELECTED_VALUES = 1 << 20
"""The most values one selection argument (``layers``, ``run_ids``, ``hooks``, ...) may list: each
becomes a literal of the query, and a slip such as ``layers=range(0, 999999999)`` is refused at
once instead of listed (a billion Python ints: some 36 GB before any query)."""


def _as_tuple(value, what: str, kind: type) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or getattr(value, "ndim", None) == 0:
        raise InvalidArgumentError(f"{what} must be a {kind.__name__} or an iterable of them, not {value!r}")
    items = tuple(itertools.islice(value, MAX_SELECTED_VALUES + 1))
    if len(items) > MAX_SELECTED_VALUES:
        raise InvalidArgumentError(f"{what} {value!r:.100} lists more than {MAX_SELECTED_VALUES} values; select "
                                   "fewer")
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise InvalidArgumentError(f"{what} must contain {kind.__name__} values, not {item!r}")
    return items


class Catalog:
    """The ClickHouse index. Open one with :func:`dmi.catalog.open_catalog`.

    Thread-safe: one catalog may be shared by many threads. Use it as a context manager
    or call :meth:`close`.
    """

    def __init__(self, backend: CatalogBackend, *, table_prefix: str = "dmi_"):
        self._backend = backend
        self.table_prefix = validate_identifier(table_prefix + "x", "table prefix")[:-1]
        database = quote_identifier(backend.database, "database name")
        names = list(_schema.TABLES) + ["records_published"]
        self._tables = {
            name: f"{database}.{quote_identifier(self.table_prefix + name, 'table name')}" for name in names
        }
        self._closed = False
        self._visible_packs: tuple[tuple, pa.Array, pa.Array] | None = None
        self._ensure_schema()

    # ----------------------------------------------------------------- lifecycle
    @property
    def backend(self) -> str:
        """``"chdb"``, ``"server"`` or ``"cluster"``."""
        return self._backend.kind

    @property
    def where(self) -> str:
        return self._backend.where

    @property
    def tables(self) -> dict[str, str]:
        """Quoted, qualified names of the catalog's tables, for :meth:`sql` users."""
        return dict(self._tables)

    def __repr__(self) -> str:
        return f"<Catalog {self._backend.where}{' (closed)' if self._closed else ''}>"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ensure_schema(self) -> None:
        ddl = _schema.ddl_statements(self._tables)
        self._backend.command(ddl[0])  # the schema-version table first
        found = self.schema_version()
        if found is not None and found > _schema.SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the catalog at {self._backend.where} has schema version {found}, newer than the "
                f"{_schema.SCHEMA_VERSION} this DMI understands; upgrade DMI (pip install -U dmi-capture)"
            )
        if found is not None and found < _schema.SCHEMA_VERSION:
            self._upgrade_records_table()  # before the view is re-created over the records table
            for statement in _schema.upgrade_statements(found, self._tables):
                self._backend.command(statement)
        for statement in ddl[1:]:
            self._backend.command(statement)
        if found is None or found < _schema.SCHEMA_VERSION:  # new, or upgraded in place above
            self._backend.insert(
                self._tables["schema"],
                pa.Table.from_pylist(
                    [{"version": _schema.SCHEMA_VERSION, "written_at": time.time(), "written_by": "dmi"}],
                    schema=_schema.SCHEMA_ROW,
                ),
            )

    def _upgrade_records_table(self) -> None:
        """Add the record fields an older catalog lacks; their defaults give old rows the
        meaning old packs have. When two processes upgrade at once, the loser's ALTER
        fails on a column the winner added: only an ALTER whose column is still missing
        is an error."""
        for statement in _schema.record_column_upgrades(self._tables, self._record_columns()):
            try:
                self._backend.command(statement)
            except ServerError:
                if statement in _schema.record_column_upgrades(self._tables, self._record_columns()):
                    raise

    def _record_columns(self) -> list[str]:
        return self._backend.query(f"DESCRIBE TABLE {self._tables['records']}").column("name").to_pylist()

    def schema_version(self) -> int | None:
        """The highest schema version row, or None on an empty catalog."""
        rows = self._backend.query(f"SELECT max(version) AS v, count() AS n FROM {self._tables['schema']}").to_pylist()
        return int(rows[0]["v"]) if rows and rows[0]["n"] else None

    # ----------------------------------------------------------------- writing
    def publisher(
        self, scope: str, holder: str | None = None, lease_seconds: float = 30.0, *,
        clock: Callable[[], float] = time.time, ride_out_seconds: float = 0.0,
    ) -> Publisher:
        """A publisher for ``scope`` (not yet acquired). ``holder`` defaults to host:pid:random;
        ``clock`` (Unix seconds) is what lease expiry is measured by; ``ride_out_seconds``: how
        long its publish and renew retry an unreachable catalog (0: not at all; see
        :class:`Publisher`)."""
        return Publisher(
            LeaseTables(self._backend, self.tables, self._index), scope, holder, lease_seconds, clock=clock,
            ride_out_seconds=ride_out_seconds,
        )

    def lease_state(self, scope: str) -> LeaseState:
        """What the catalog says about ``scope``'s publisher lease right now (holder, term, expiry)."""
        return read_state(LeaseTables(self._backend, self.tables, self._index), validate_value_id(scope, "scope"))

    def _index(self, descriptors: Sequence[PackDescriptor], *, scope: str, term: int) -> int:
        """The one write path for index rows. Rows are invisible until a watermark names them.

        Packs already indexed are skipped (a concurrent duplicate is harmless: readers use
        ``LIMIT 1 BY pack_id, record_index``). Returns the number of records described.
        """
        total = sum(len(d.records) for d in descriptors)
        ids = tuple(dict.fromkeys(d.pack_id for d in descriptors))
        if not ids:
            return 0
        present = set(
            self._backend.query(
                f"SELECT DISTINCT pack_id FROM {self._tables['packs']} WHERE pack_id IN %(ids)s", {"ids": ids}
            ).column("pack_id").to_pylist()
            if ids
            else []
        )
        seen: set[str] = set()
        fresh = []
        for d in descriptors:
            if d.pack_id not in present and d.pack_id not in seen:
                seen.add(d.pack_id)
                fresh.append(d)
        if not fresh:
            return total
        try:
            records = _schema.records_table(fresh)
        except (UnicodeEncodeError, pa.ArrowInvalid) as exc:
            raise InvalidIdentifierError(f"a record key is not valid Unicode text: {exc}") from exc
        validate_record_ids(records)
        self._backend.insert(self._tables["records"], records)
        self._backend.insert(
            self._tables["packs"], _schema.packs_table(fresh, scope=scope, term=term, now=time.time())
        )
        return total

    def record_losses(
        self,
        model_id: str,
        run_id: str,
        request_id: str,
        hook: str,
        layer: int,
        count: int,
        reason: str,
        *,
        recorded_by: str = "",
    ) -> None:
        """Count records dropped under an explicit drop policy (never silently).

        One row per call: ``count`` records of (model_id, run_id, request_id, hook, layer)
        were dropped for ``reason`` (e.g. ``"ring full"``). Use ``layer=-1`` for global
        hooks. Losses are visible at once (they need no lease) and add up in :meth:`losses`.
        """
        validate_value_id(model_id, "model id")
        validate_value_id(run_id, "run id")
        validate_value_id(request_id, "request id")
        validate_value_id(hook, "hook")
        validate_value_id(reason, "reason")
        validate_optional_value_id(recorded_by, "recorded_by")
        if not isinstance(layer, int) or isinstance(layer, bool) or not -(2**31) <= layer < 2**31:
            raise InvalidArgumentError(f"layer must be an int that fits a 32-bit column, not {layer!r}")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count < 2**64:
            raise InvalidArgumentError(f"count must be a positive int below 2**64, not {count!r}")
        self._backend.insert(
            self._tables["losses"],
            pa.Table.from_pylist(
                [
                    {
                        "model_id": model_id,
                        "run_id": run_id,
                        "request_id": request_id,
                        "hook": hook,
                        "layer": layer,
                        "count": count,
                        "reason": reason,
                        "recorded_by": recorded_by,
                        "recorded_at": time.time(),
                    }
                ],
                schema=_schema.LOSS_SCHEMA,
            ),
        )

    def losses(self, model_id: str | None = None, run_id: str | None = None, request_id: str | None = None) -> pa.Table:
        """Dropped-record counts summed per (model_id, run_id, request_id, hook, layer, reason).

        Losses of a deleted run are hidden like its records: those recorded at or before its
        tombstone; a run captured again under the same id shows only the losses recorded since
        (:func:`dmi.catalog._deletion.undeleted_rows`).
        """
        where, params = self._filters(model_id=model_id, run_id=run_id, request_id=request_id)
        undeleted = _deletion.undeleted_rows(self, "losses", "recorded_at", where)
        return self._backend.query(
            "SELECT model_id, run_id, request_id, hook, layer, reason, sum(count) AS count "
            f"FROM ({undeleted}) "
            "GROUP BY model_id, run_id, request_id, hook, layer, reason "
            "ORDER BY model_id, run_id, request_id, hook, layer, reason",
            params,
        )

    # ----------------------------------------------------------------- deletion
    def delete_runs(self, model_id: str, run_id: str | None = None, *, deleted_by: str = "",
                    expected: Mapping[str, tuple[int, int]] | None = None) -> list[Deletion]:
        """Make ``model_id`` (one run of it if ``run_id``) invisible to every reader at once.

        Writes one tombstone per run in one INSERT (all runs vanish together, or none) and
        returns them; empty when nothing of the selection is visible. Its losses and audits go
        with it; a run that shows only losses (:meth:`loss_only_runs`) gets a tombstone naming no
        pack, which hides them. Pack files are not touched: :meth:`purge_deleted` removes those
        no other run needs. ``expected`` (``{run_id: (records, lost)}``): the runs the caller
        counted (``lost`` for runs that hold only losses, else 0); anything else now raises
        :class:`SelectionChangedError` and deletes nothing. See ``docs/catalog-protocol.md`` (Deletion).
        """
        return _deletion.delete_runs(self, model_id, run_id, deleted_by=deleted_by, expected=expected)

    def loss_only_runs(self, model_id: str, run_id: str | None = None) -> dict[str, int]:
        """``{run_id: records lost}`` for the runs of ``model_id`` (``run_id`` only, if given)
        that show losses but no visible record (capture dropped every one), in run order:
        the runs :meth:`delete_runs` deletes beside those with records."""
        return _deletion.loss_only_runs(self, model_id, run_id)

    def deletions(self, model_id: str | None = None, run_id: str | None = None) -> list[Deletion]:
        """Every tombstone written (of ``model_id``, of ``run_id``), oldest first."""
        return _deletion.deletions(self, model_id, run_id)

    def deleted_pack_ids(self) -> set[str]:
        """Packs deleted on purpose: every record indexed in them is hidden by a tombstone.

        Recovery must not re-publish these (re-publishing would not show their records
        either: tombstones name pack ids). Packs another run still needs are not here.
        """
        return _deletion.deleted_pack_ids(self)

    def purge_deleted(self, store) -> list[str]:
        """Remove from ``store`` the files of :meth:`deleted_pack_ids`; returns the ids removed.

        Idempotent; finishes a deletion that crashed between its tombstone and its files.
        """
        return _deletion.purge(self, store)

    # ----------------------------------------------------------------- audits
    def record_audit(self, rows: Sequence[dict]) -> None:
        """Append one audit's rows (one per request, hook and layer checked; fields as in
        ``dmi.catalog._audits.AUDIT_SCHEMA``). Written by ``Store.audit``."""
        if rows:
            for r in rows:
                validate_value_id(r.get("model_id"), "model id")
                validate_value_id(r.get("run_id"), "run id")
                validate_value_id(r.get("request_id"), "request id")
            self._backend.insert(self._tables["audits"], audit_rows_table(rows))

    def audits(self, model_id: str | None = None, run_id: str | None = None, request_id: str | None = None,
               audit_id: str | None = None) -> pa.Table:
        """One row per audit (and per run and request it checked), newest first: ``audit_id``,
        ``model_id``, ``run_id``, ``request_id``, ``audited_at``, ``model``, ``tolerance``,
        ``checks``, ``exact``, ``noise``, ``failed``, ``first_failure`` (the first failing
        ``hook@layer``, or empty). The per-hook rows are in the ``audits`` table (:attr:`tables`).

        An audit's rows of a deleted run are hidden with its records: those stamped at or before
        its tombstone (:func:`dmi.catalog._deletion.undeleted_rows`), so a run captured again
        under the same id shows only the audits of what it holds now."""
        where, params = self._filters(model_id=model_id, run_id=run_id, request_id=request_id, audit_id=audit_id)
        undeleted = _deletion.undeleted_rows(self, "audits", "audited_at", where)
        return self._backend.query(
            "SELECT audit_id, model_id, run_id, request_id, any(audited_at) AS audited_at, any(model) AS model, "
            "any(tolerance) AS tolerance, count() AS checks, countIf(verdict = 'exact') AS exact, "
            "countIf(verdict = 'noise') AS noise, countIf(verdict = 'fail') AS failed, "
            "arrayStringConcat(arraySlice(groupArrayIf(concat(hook, '@', toString(layer)), verdict = 'fail'), 1, 1), '') "
            "AS first_failure "
            f"FROM ({undeleted}) "
            "GROUP BY audit_id, model_id, run_id, request_id ORDER BY audited_at DESC, request_id",
            params,
        )

    # ----------------------------------------------------------------- recovery
    def recover(
        self,
        store,
        scope: str = "recovery",
        *,
        holder: str | None = None,
        lease_seconds: float = 30.0,
    ) -> list[str]:
        """Re-index and publish every sealed pack the catalog does not fully show; returns their ids.

        Packs carry their own index, so whatever happened to the catalog — a crash between
        seal and publish, tables dropped, its directory deleted, index rows lost — every
        pack in ``store.list_packs()`` that :meth:`packs_to_recover` names is read back
        (:func:`dmi.storage.read_pack_descriptor`), its missing index rows are written (only
        the missing ones: each record is published exactly once) and, if no visible
        watermark names it, it is published under a lease on ``scope`` (raises
        LeaseHeldError while a live writer holds it). Run it when no writer is running, or
        for a crashed writer's scope once its lease has expired: a pack a live writer sealed
        but has not published yet would be published by recovery (harmless — readers see
        each record once). An entry named like a pack that is not a regular file (a FIFO, a
        directory) holds no pack: it is skipped, every pack is recovered all the same, and then
        :class:`RecoveryIncompleteError` names the skipped entries (how many, where, what) and
        the packs recovered, and carries both (``skipped``, ``recovered``).

        The ids returned are those this call recovered under a lease it held to the end. A
        recovery whose term a successor took over while it worked raises LeaseLostError (from
        the publish, or, where every pack it found had been published meanwhile, from a
        renewal that checks the lease): the successor is the one that recovered them, and a
        second recovery returns ``[]``.
        """
        from dmi.storage import read_pack_descriptor  # the storage layer's reader

        on_disk = list(store.list_packs())
        if not self.packs_to_recover(on_disk):
            return []
        with self.publisher(scope, holder=holder, lease_seconds=lease_seconds) as publisher:
            candidates = self.packs_to_recover(on_disk)  # again, now that we hold the lease
            odd = store.not_regular_files(candidates)
            descriptors = [read_pack_descriptor(store, pid) for pid in candidates if pid not in odd]
            if descriptors:
                self._restore_index_rows(descriptors, scope=scope, term=publisher.term)
                published = self.published_pack_ids()
                unpublished = [d for d in descriptors if d.pack_id not in published]
                if unpublished:
                    publisher.publish(unpublished)
                else:  # a successor that took the scope over since may have published them
                    publisher.renew()
        recovered = [d.pack_id for d in descriptors]
        if odd:
            raise _odd_entries_error(store, odd, recovered)
        return recovered

    def packs_to_recover(self, pack_ids: Iterable[str]) -> list[str]:
        """Of ``pack_ids`` (the packs on disk), those the catalog does not fully show.

        A pack is fully shown when a visible watermark names it, its ``packs`` row exists
        and it has as many distinct index rows as that row says it holds records. Anything
        else (never published, tables dropped, catalog deleted, rows lost) is a pack that
        :meth:`recover` will re-index. Returned in the order given.
        """
        ids = tuple(dict.fromkeys(validate_value_id(p, "pack id") for p in pack_ids))
        if not ids:
            return []
        published = self.published_pack_ids()
        complete = self._fully_indexed(ids)
        return [p for p in ids if p not in published or p not in complete]

    def _fully_indexed(self, ids: tuple[str, ...]) -> set[str]:
        """Of ``ids``, the packs whose index is complete: a ``packs`` row exists and there are as
        many distinct index rows as it says the pack holds records. Recovery re-indexes the
        others; purging must keep their files (a lost row may be another run's record)."""
        expected = {
            r["pack_id"]: int(r["n"])
            for r in self._backend.query(
                f"SELECT pack_id, max(n_records) AS n FROM {self._tables['packs']} "
                "WHERE pack_id IN %(ids)s GROUP BY pack_id",
                {"ids": ids},
            ).to_pylist()
        }
        indexed = {
            r["pack_id"]: int(r["n"])
            for r in self._backend.query(
                f"SELECT pack_id, uniqExact(record_index) AS n FROM {self._tables['records']} "
                "WHERE pack_id IN %(ids)s GROUP BY pack_id",
                {"ids": ids},
            ).to_pylist()
        }
        return {p for p, n in expected.items() if indexed.get(p, 0) >= n}

    def _restore_index_rows(self, descriptors: Sequence[PackDescriptor], *, scope: str, term: int) -> None:
        """Write the index rows (records and packs) these packs are missing, and no others."""
        ids = tuple(d.pack_id for d in descriptors)
        present = {
            (r["pack_id"], int(r["record_index"]))
            for r in self._backend.query(
                f"SELECT DISTINCT pack_id, record_index FROM {self._tables['records']} WHERE pack_id IN %(ids)s",
                {"ids": ids},
            ).to_pylist()
        }
        indexed_packs = set(
            self._backend.query(
                f"SELECT DISTINCT pack_id FROM {self._tables['packs']} WHERE pack_id IN %(ids)s", {"ids": ids}
            ).column("pack_id").to_pylist()
        )
        records = _schema.records_table(descriptors)
        keys = zip(records.column("pack_id").to_pylist(), records.column("record_index").to_pylist())
        missing = pa.array([(pack_id, int(index)) not in present for pack_id, index in keys], type=pa.bool_())
        validate_record_ids(records)
        self._backend.insert(self._tables["records"], records.filter(missing))
        fresh = [d for d in descriptors if d.pack_id not in indexed_packs]
        if fresh:
            self._backend.insert(
                self._tables["packs"], _schema.packs_table(fresh, scope=scope, term=term, now=time.time())
            )

    # ----------------------------------------------------------------- visibility
    def _published_subquery(self, scope: str | None, upto: Watermark | None, params: dict) -> str:
        visible = _schema.VISIBLE_WATERMARKS.format(**self._tables)
        conditions = []
        if scope is not None:
            params["v_scope"] = validate_value_id(scope, "scope")
            conditions.append("scope = %(v_scope)s")
        if upto is not None:
            if not isinstance(upto, Watermark):
                raise InvalidArgumentError(f"upto must be a Watermark, not {type(upto).__name__}")
            if scope is not None and upto.scope != scope:
                raise InvalidArgumentError(
                    f"upto is a watermark of scope {upto.scope!r}, not of the scope {scope!r} asked for"
                )
            params["v_scope"] = upto.scope
            params["v_term"] = upto.term
            params["v_seq"] = upto.seq
            conditions.append("scope = %(v_scope)s AND (term < %(v_term)s OR (term = %(v_term)s AND seq <= %(v_seq)s))")
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        return f"SELECT arrayJoin(pack_ids) AS pack_id FROM ({visible}){where}"

    def watermarks(self, scope: str) -> list[Watermark]:
        """Every visible (published, unfenced) watermark of ``scope``, in order."""
        params = {"scope": validate_value_id(scope, "scope")}
        visible = _schema.VISIBLE_WATERMARKS.format(**self._tables)
        rows = self._backend.query(
            f"SELECT scope, term, seq, holder, pack_ids, n_records, published_at FROM ({visible}) "
            "WHERE scope = %(scope)s ORDER BY term, seq",
            params,
        ).to_pylist()
        return [
            Watermark(
                r["scope"], int(r["term"]), int(r["seq"]), tuple(r["pack_ids"]), r["holder"],
                int(r["n_records"]), float(r["published_at"]),
            )
            for r in rows
        ]

    def follow(
        self,
        scope: str,
        *,
        after: Watermark | None = None,
        poll_interval: float = 0.5,
        timeout: float | None = None,
    ) -> Iterator[Watermark]:
        """Yield each visible watermark of ``scope`` as it appears, in order.

        Starts after ``after`` (or from the beginning); polls every ``poll_interval``
        seconds; stops after ``timeout`` seconds without a new watermark (None: forever).
        """
        position = after.position if after is not None else (0, 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fresh = [w for w in self.watermarks(scope) if w.position > position]
            for watermark in fresh:
                position = watermark.position
                yield watermark
            if fresh and timeout is not None:
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(poll_interval if deadline is None else max(0.0, min(poll_interval, deadline - time.monotonic())))

    def published_pack_ids(self, scope: str | None = None) -> set[str]:
        """Pack ids named by any visible watermark (of ``scope``, or of every scope)."""
        params: dict = {}
        sub = self._published_subquery(scope, None, params)
        return set(self._backend.query(f"SELECT DISTINCT pack_id FROM ({sub})", params).column("pack_id").to_pylist())

    # ----------------------------------------------------------------- queries
    @staticmethod
    def _filters(**values) -> tuple[str, dict]:
        conditions, params = [], {}
        for column, value in values.items():
            if value is None:
                continue
            params[column] = validate_value_id(value, column.replace("_", " "))
            conditions.append(f"{column} = %({column})s")
        return (f"WHERE {' AND '.join(conditions)}" if conditions else ""), params

    def _published_records(self, where: str, params: dict, columns: str, tail: str = "") -> pa.Table:
        sub = self._published_subquery(params.pop("_scope", None), params.pop("_upto", None), params)
        joiner = " AND " if where else "WHERE "
        not_deleted = _schema.NOT_DELETED.format(**self._tables)
        return self._backend.query(
            f"SELECT {columns} FROM {self._tables['records']} {where}{joiner}pack_id IN ({sub}) "
            f"AND {not_deleted} {tail}",
            params,
        )

    def models(self) -> list[str]:
        """Model ids with at least one published record."""
        table = self._published_records("", {}, "DISTINCT model_id", "ORDER BY model_id")
        return table.column("model_id").to_pylist()

    def runs(self, model_id: str) -> list[str]:
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"))
        table = self._published_records(where, params, "DISTINCT run_id", "ORDER BY run_id")
        return table.column("run_id").to_pylist()

    def run_totals(self, model_id: str | None = None) -> pa.Table:
        """One row per visible run (of ``model_id``), ordered by model and run.

        Columns: ``model_id``, ``run_id``, ``requests``, ``records``, ``packs``,
        ``stored_bytes`` (payload bytes), ``raw_bytes``, ``first_sealed_at`` and
        ``last_sealed_at`` (Unix seconds: when its first and last pack were sealed).
        """
        where, params = self._filters(model_id=model_id)
        sub = self._published_subquery(None, None, params)
        joiner = " AND " if where else "WHERE "
        return self._backend.query(
            "SELECT model_id, run_id, uniqExact(request_id) AS requests, count() AS records, "
            "uniqExact(pack_id) AS packs, sum(payload_length) AS stored_bytes, sum(raw_size) AS raw_bytes, "
            "min(sealed_at) AS first_sealed_at, max(sealed_at) AS last_sealed_at FROM ("
            "SELECT model_id, run_id, request_id, pack_id, payload_length, raw_size "
            f"FROM {self._tables['records']} {where}{joiner}pack_id IN ({sub}) "
            f"AND {_schema.NOT_DELETED.format(**self._tables)} LIMIT 1 BY pack_id, record_index"
            ") AS visible_records ANY LEFT JOIN ("
            f"SELECT pack_id, any(sealed_at) AS sealed_at FROM {self._tables['packs']} GROUP BY pack_id"
            ") AS sealed USING pack_id "
            "GROUP BY model_id, run_id ORDER BY model_id, run_id",
            params,
        )

    def requests(self, model_id: str, run_id: str | None = None) -> list[str]:
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"), run_id=run_id)
        table = self._published_records(where, params, "DISTINCT request_id", "ORDER BY request_id")
        return table.column("request_id").to_pylist()

    def rank_request_ids(self, model_id: str, run_id: str, *, shard_rank: int = 0, dp_rank: int = 0,
                         pp_rank: int = 0) -> set[str]:
        """Request ids holding published records of ``model_id``/``run_id`` written by this rank
        (tensor-, data- and pipeline-parallel): what a capture continuing the run must not write
        again. Other ranks' requests of the same run are theirs to write."""
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"),
                                      run_id=validate_value_id(run_id, "run id"))
        for column, value in (("shard_rank", shard_rank), ("dp_rank", dp_rank), ("pp_rank", pp_rank)):
            if type(value) is not int or value < 0:
                raise InvalidArgumentError(f"{column} must be a non-negative int, not {value!r}")
            params[column] = value
            where += f" AND {column} = %({column})s"
        table = self._published_records(where, params, "DISTINCT request_id")
        return set(table.column("request_id").to_pylist())

    def request_contents(self, model_id: str, request_id: str, run_id: str | None = None) -> dict[str, HookContents]:
        """Hooks of one request (by name), each with its layers, shard ranks, tokens, dtype and bytes."""
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"),
                                      request_id=validate_value_id(request_id, "request id"), run_id=run_id)
        rows = self._backend.query(
            "SELECT hook, groupUniqArray(layer) AS layers, groupUniqArray(shard_rank) AS ranks, "
            "groupUniqArrayArray(tps) AS tps, sum(n) AS n, max(tokens) AS tokens, any(dtype) AS dtype, "
            "any(feature) AS feature, sum(stored) AS stored, sum(raw) AS raw, groupUniqArrayArray(axes) AS axes FROM ("
            "SELECT hook, layer, shard_rank, groupUniqArray(tp_size) AS tps, groupUniqArray(shard_axis) AS axes, "
            "count() AS n, sum(n_tokens) AS tokens, "
            "any(dtype) AS dtype, "
            # per token: the record's (full) shape without its recorded token axis; the last
            # chunk's, whose key axis (attention patterns) is the longest
            "argMax(arrayConcat(arraySlice(dims, 1, token_axis), arraySlice(dims, token_axis + 2)), start_token) "
            "AS feature, sum(payload_length) AS stored, sum(raw_size) AS raw "
            "FROM (SELECT *, if(length(full_shape) > 0, full_shape, shape) AS dims "
            f"FROM {self._tables['records_published']} {where}) GROUP BY hook, layer, shard_rank) "
            "GROUP BY hook ORDER BY hook",
            params,
        ).to_pylist()
        return {
            r["hook"]: HookContents(
                r["hook"], tuple(sorted(r["layers"])), tuple(sorted(r["ranks"])), tuple(sorted(r["tps"])),
                int(r["n"]), int(r["tokens"]), r["dtype"], tuple(int(d) for d in r["feature"]),
                int(r["stored"]), int(r["raw"]), tuple(sorted(int(a) for a in r["axes"])),
            )
            for r in rows
        }

    def model_totals(self) -> list[ModelTotals]:
        """Every model id with published records, with run, request, record and byte totals."""
        rows = self._backend.query(
            "SELECT model_id, uniqExact(run_id) AS runs, uniqExact(request_id) AS requests, count() AS records, "
            f"sum(payload_length) AS stored, sum(raw_size) AS raw FROM {self._tables['records_published']} "
            "GROUP BY model_id ORDER BY model_id",
            {},
        ).to_pylist()
        return [
            ModelTotals(r["model_id"], int(r["runs"]), int(r["requests"]), int(r["records"]), int(r["stored"]),
                        int(r["raw"]))
            for r in rows
        ]

    def request_totals(self, model_id: str, run_id: str | None = None) -> list[RequestTotals]:
        """The published requests of ``model_id`` (of one run), ordered by run then request.

        ``n_tokens`` is the request's stored token count: the most any (hook, layer, shard
        rank) holds for it.
        """
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"), run_id=run_id)
        rows = self._backend.query(
            "SELECT request_id, run_id, max(tokens) AS n_tokens, groupUniqArray(hook) AS hooks, sum(n) AS records, "
            "sum(stored) AS stored, sum(raw) AS raw FROM ("
            "SELECT request_id, run_id, hook, layer, shard_rank, sum(n_tokens) AS tokens, count() AS n, "
            f"sum(payload_length) AS stored, sum(raw_size) AS raw FROM {self._tables['records_published']} {where} "
            "GROUP BY request_id, run_id, hook, layer, shard_rank) "
            "GROUP BY request_id, run_id ORDER BY run_id, request_id",
            params,
        ).to_pylist()
        return [
            RequestTotals(r["run_id"], r["request_id"], int(r["n_tokens"]), tuple(sorted(r["hooks"])),
                          int(r["records"]), int(r["stored"]), int(r["raw"]))
            for r in rows
        ]

    def request_runs(self, model_id: str, request_id: str) -> list[str]:
        """The runs (sorted) that published records of ``request_id`` for ``model_id``."""
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"),
                                      request_id=validate_value_id(request_id, "request id"))
        table = self._published_records(where, params, "DISTINCT run_id", "ORDER BY run_id")
        return table.column("run_id").to_pylist()

    def request_phases(self, model_id: str, request_id: str, run_id: str) -> list[tuple[str, int, int]]:
        """Each phase of one request's published records as ``(phase, start, stop)`` over its
        token positions, in token order."""
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"),
                                      request_id=validate_value_id(request_id, "request id"),
                                      run_id=validate_value_id(run_id, "run id"))
        rows = self._published_records(
            where, params, "phase, min(start_token) AS start, max(start_token + n_tokens) AS stop",
            "GROUP BY phase ORDER BY start, stop",
        ).to_pylist()
        return [(r["phase"], int(r["start"]), int(r["stop"])) for r in rows]

    def pack_record_counts(self, pack_ids: Iterable[str]) -> dict[str, int]:
        """How many published records each of ``pack_ids`` holds (packs with none are left out)."""
        ids = tuple(dict.fromkeys(validate_value_id(p, "pack id") for p in pack_ids))
        if not ids:
            return {}
        rows = self._backend.query(
            f"SELECT pack_id, count() AS n FROM {self._tables['records_published']} "
            "WHERE pack_id IN %(ids)s GROUP BY pack_id",
            {"ids": ids},
        ).to_pylist()
        return {r["pack_id"]: int(r["n"]) for r in rows}

    def find_records(
        self,
        model_id: str,
        request_id: str | None = None,
        hook: str | Sequence[str] | None = None,
        layers: int | Iterable[int] | None = None,
        shard_rank: int | None = None,
        run_id: str | None = None,
        *,
        scope: str | None = None,
        upto: Watermark | None = None,
    ) -> list[RecordEntry]:
        """Published, unfenced records matching the selection, with their byte ranges.

        Ordered by request, hook, layer, shard rank, start token. ``layers`` is one layer or
        an iterable (a ``range`` works); ``upto`` restricts to the consistent prefix up to
        that watermark of its scope; ``scope`` to packs published in that scope (a ``scope``
        other than ``upto``'s raises InvalidArgumentError).
        """
        where, params = self._filters(model_id=validate_value_id(model_id, "model id"), request_id=request_id,
                                      run_id=run_id)
        hooks = _as_tuple(hook, "hook", str)
        if hooks is not None:
            if not hooks:
                return []
            for h in hooks:
                validate_value_id(h, "hook")
            params["hooks"] = hooks
            where += " AND hook IN %(hooks)s"
        layer_tuple = _as_tuple(layers, "layers", int)
        if layer_tuple is not None:
            if not layer_tuple:
                return []
            params["layers"] = layer_tuple
            where += " AND layer IN %(layers)s"
        if shard_rank is not None:
            if not isinstance(shard_rank, int) or isinstance(shard_rank, bool):
                raise InvalidArgumentError(f"shard_rank must be an int, not {shard_rank!r}")
            params["shard_rank"] = shard_rank
            where += " AND shard_rank = %(shard_rank)s"
        columns = ", ".join(_schema.RECORD_COLUMNS)
        tail = (
            "ORDER BY request_id, hook, layer, shard_rank, start_token, pack_id, record_index "
            "LIMIT 1 BY pack_id, record_index"
        )
        if scope is None and upto is None:
            visible, hidden = self._visible_pack_ids()
            table = self._backend.query(f"SELECT {columns} FROM {self._tables['records']} {where} {tail}", params)
            table = table.filter(pc.is_in(table.column("pack_id"), value_set=visible))
            if len(hidden) and table.num_rows:
                table = table.filter(pc.invert(pc.is_in(_deletion.record_keys(table), value_set=hidden)))
        else:
            params["_scope"], params["_upto"] = scope, upto
            table = self._published_records(where, params, columns, tail)
        return _schema.entries_from_table(table) if table.num_rows else []

    def select_records(
        self,
        model_id: str,
        *,
        run_ids: str | Iterable[str] | None = None,
        hooks: str | Iterable[str] | None = None,
        layers: int | Iterable[int] | None = None,
        phases: str | Iterable[str] | None = None,
        where: str | None = None,
        params: dict[str, object] | None = None,
    ) -> list[RecordEntry]:
        """Published, unfenced records of ``model_id`` for a training selection, with byte ranges.

        ``run_ids``, ``hooks``, ``phases`` (one or several) and ``layers`` narrow the selection;
        ``where`` adds the caller's own boolean SQL expression over the columns of
        ``records_published`` (``"l2_norm < %(cap)s AND request_id LIKE 'eval-%%'"``), whose
        values travel in ``params`` exactly as in :meth:`sql` (a literal ``%`` is ``%%``).
        The expression is checked to be one expression (no ``;``, no comments, parentheses
        balanced outside quotes, no ``INTO OUTFILE`` or ``FORMAT`` clause even in a subquery)
        so it cannot end or leave the ``SELECT`` it runs in: it can only read. Parameter names
        starting with ``dmi_`` are reserved; a binding problem (a stray ``%``, a missing
        parameter, a value with no SQL literal) is an ``InvalidArgumentError`` on both backends.
        Ordered by run, request, hook, layer, start token, shard rank. Raises
        ``InvalidArgumentError`` for a malformed selection or fragment, ``ServerError`` when
        ClickHouse refuses the filter (its message names the filter; ClickHouse's code kept).
        """
        conditions = ["model_id = %(dmi_model_id)s"]
        values: dict[str, object] = {"dmi_model_id": validate_value_id(model_id, "model id")}
        for column, given, kind in (("run_id", run_ids, str), ("hook", hooks, str), ("phase", phases, str),
                                    ("layer", layers, int)):
            items = _as_tuple(given, column + "s", kind)
            if items is None:
                continue
            if not items:
                return []
            if kind is str:
                items = tuple(validate_value_id(item, column.replace("_", " ")) for item in items)
            values[f"dmi_{column}s"] = items
            conditions.append(f"{column} IN %(dmi_{column}s)s")
        if where is not None:
            conditions.append(f"({_checked_filter(where)})")
        if params is not None:
            if not isinstance(params, dict):
                raise InvalidArgumentError(f"params must be a dict, not {type(params).__name__}")
            reserved = sorted(name for name in params if not isinstance(name, str) or name.startswith("dmi_"))
            if reserved:
                raise InvalidArgumentError(f"parameter names starting with dmi_ are reserved: {reserved}")
            values.update(params)
        if where is not None:
            # Every binding problem of the caller's filter (a stray '%', a parameter params lacks, a
            # value with no literal) surfaces here, at its place in ``where``, the same on both
            # backends: the server's driver raised a bare TypeError or KeyError, or sent bytes on
            # as broken SQL.
            bind(where, values)
        columns = ", ".join(_schema.RECORD_COLUMNS)
        try:
            table = self._backend.query(
                f"SELECT {columns} FROM {self._tables['records_published']} WHERE {' AND '.join(conditions)} "
                "ORDER BY run_id, request_id, hook, layer, start_token, shard_rank, pack_id, record_index",
                values,
                readonly=True,  # the caller's filter runs where ClickHouse itself refuses any write
            )
        except ServerError as exc:
            if where is None:
                raise
            raise ServerError(f"the selection with where={where!r} (--where on the command line) failed; check "
                              f"it names columns of {{records}} ({exc})", code=exc.code, name=exc.name) from exc
        return _schema.entries_from_table(table) if table.num_rows else []

    def _visible_pack_ids(self) -> tuple[pa.Array, pa.Array]:
        """Ids of every published, unfenced pack, and the keys of the records tombstones hide
        (see :func:`dmi.catalog._deletion.record_keys`); recomputed only when visibility may
        have changed.

        Watermarks, fences and deletions are append-only, so their row counts change
        whenever any does; one cheap query of the three counts decides whether the cached
        sets still hold. The point query then reads only the records' key range and
        filters by them, instead of evaluating the visibility join on every query.
        """
        counts = self._backend.query(
            f"SELECT 'watermarks' AS t, count() AS n FROM {self._tables['watermarks']} "
            f"UNION ALL SELECT 'fences' AS t, count() AS n FROM {self._tables['fences']} "
            f"UNION ALL SELECT 'deletions' AS t, count() AS n FROM {self._tables['deletions']}",
            {},
        ).to_pylist()
        version = tuple(sorted((row["t"], row["n"]) for row in counts))
        cached = self._visible_packs
        if cached is not None and cached[0] == version:
            return cached[1], cached[2]
        ids = self._backend.query(_schema.PUBLISHED_PACK_IDS.format(**self._tables), {}).column("pack_id")
        visible = _schema.string_array(ids)
        hidden = _deletion.hidden_record_keys(self)
        self._visible_packs = (version, visible, hidden)
        return visible, hidden

    def pack_locations(self, pack_ids: Iterable[str]) -> dict[str, str]:
        """Where each indexed pack lives (its location as the pack store reported it)."""
        ids = tuple(dict.fromkeys(validate_value_id(p, "pack id") for p in pack_ids))
        if not ids:
            return {}
        rows = self._backend.query(
            f"SELECT pack_id, any(location) AS location FROM {self._tables['packs']} "
            "WHERE pack_id IN %(ids)s GROUP BY pack_id",
            {"ids": ids},
        ).to_pylist()
        return {r["pack_id"]: r["location"] for r in rows}

    def sql(self, query: str, params: dict[str, object] | None = None) -> pa.Table:
        """Run raw SQL and return an Arrow table. Tables: :attr:`tables`.

        Values go in ``params`` and are named in the text as ``%(name)s``; the backend
        renders them (driver parameters on a server, one escaping routine on chDB), so a
        value never enters SQL text any other way. With ``params``, a literal ``%`` in the
        text is written ``%%`` (both backends); a missing parameter, a stray ``%`` or a value
        with no SQL literal raises InvalidArgumentError.

        Read-only and one statement per call: the statement runs under ClickHouse's own
        ``readonly=1`` setting (a write, DDL or ``SET`` fails with ServerError code 164,
        ``READONLY``); a second statement after a ``;``, ``INTO OUTFILE`` (chDB writes the
        file even under ``readonly=1``), a ``FORMAT`` clause (the result is always Arrow)
        and text that is not valid Unicode raise InvalidArgumentError.

        ``records_published`` holds one row per published, unfenced record, with its
        statistics, e.g. the mean L2 norm of ``resid_post`` per layer::

            catalog.sql(f"SELECT layer, avg(l2_norm) FROM {catalog.tables['records_published']} "
                        "WHERE model_id = 'gpt2' AND hook = 'resid_post' GROUP BY layer ORDER BY layer")
        """
        if not isinstance(query, str):
            raise InvalidArgumentError("sql() takes a str")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgumentError(f"sql() params must be a dict, not {type(params).__name__}")
        utf8_text(query, "the SQL text")
        single_statement(query)
        no_output_clause(query)
        bind(query, params)  # every binding problem surfaces here, the same on both backends
        try:
            return self._backend.query(query, params, readonly=True)
        except ServerError as exc:
            if exc.code != READONLY_CODE:
                raise
            raise ServerError(
                f"sql() is read-only: it runs with ClickHouse's readonly=1 setting, so it cannot change "
                f"the catalog ({exc})", code=exc.code, name=exc.name,
            ) from exc


def _odd_entries_error(store, odd: dict[str, str], recovered: list[str]) -> RecoveryIncompleteError:
    """The error naming the entries recovery skipped because they are not regular files (``odd``:
    pack id → what it is) and the packs it recovered all the same."""
    named = "; ".join(f"{store.location(pid)} is not a regular file (it is a {kind})" for pid, kind in odd.items())
    done = f"recovered {len(recovered)} {'pack' if len(recovered) == 1 else 'packs'} ({', '.join(recovered)})"
    what, them = ("entry named like a pack", "it") if len(odd) == 1 else ("entries named like packs", "them")
    return RecoveryIncompleteError(
        f"{done if recovered else 'recovered no pack'}, but skipped {len(odd)} {what}: {named}; move {them} out of "
        "the pack store (or restore the pack files there) and run recover again",
        recovered=recovered, skipped=odd,
    )


def _checked_filter(fragment: str) -> str:
    """``fragment`` if it is one SQL expression that cannot end or leave its parentheses.

    Scans outside quoted text (``'...'``, ``"..."``, backticks, with backslash and doubled
    quote escapes) and refuses ``;``, comments (``--``, ``#``, ``/*``), an unterminated quote
    and unbalanced parentheses; then ``INTO OUTFILE`` and ``FORMAT`` clauses, as
    :meth:`Catalog.sql` does (:func:`~dmi.catalog._sql.output_clause`).
    """
    if not isinstance(fragment, str) or not fragment.strip():
        raise InvalidArgumentError(f"where must be a non-empty SQL expression, not {fragment!r}")
    utf8_text(fragment, "where")
    depth, i, quote = 0, 0, None
    while i < len(fragment):
        char = fragment[i]
        if quote is not None:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = None
        elif char in "'\"`":
            quote = char
        elif char == ";" or fragment.startswith(("--", "/*"), i) or char == "#":
            raise InvalidArgumentError(f"where must be one expression, without ';' or comments: {fragment!r}")
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise InvalidArgumentError(f"where closes a parenthesis it did not open: {fragment!r}")
        i += 1
    if quote is not None or depth != 0:
        raise InvalidArgumentError(f"where has an unterminated quote or parenthesis: {fragment!r}")
    clause = output_clause(fragment)
    if clause is not None:
        raise InvalidArgumentError(
            f"where is a filter that only reads: {clause} is refused, in a subquery too (chDB would write "
            f"an OUTFILE even under readonly=1; a FORMAT clause has no place in an expression): {fragment!r}"
        )
    return fragment
