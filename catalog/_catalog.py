"""The catalog: one ClickHouse index of sealed packs, behind one narrow backend contract.

Everything shared — schema, index writes, leases, watermarks, recovery, queries — lives
here, on top of :class:`~dmi.catalog._catalog_backend.CatalogBackend`'s four primitives.
There is one private write path for index rows (:meth:`Catalog._index`); only a
:class:`~dmi.catalog.Publisher` holding a lease makes them visible.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from dmi.catalog import _schema
from dmi.catalog._audits import audit_rows_table
from dmi.catalog._catalog_backend import CatalogBackend
from dmi.catalog._leases import Publisher, Watermark, validate_record_ids
from dmi.catalog._sql import quote_identifier, validate_identifier, validate_value_id
from dmi.storage.errors import InvalidArgumentError, InvalidIdentifierError, SchemaVersionError
from dmi.storage.records import PackDescriptor, RecordEntry

__all__ = ["Catalog", "HookContents"]


@dataclass(frozen=True, slots=True)
class HookContents:
    """What one request holds for one hook: its layers, shard ranks and record count."""

    hook: str
    layers: tuple[int, ...]
    shard_ranks: tuple[int, ...]
    tp_sizes: tuple[int, ...]
    n_records: int
    n_tokens: int


def _as_tuple(value, what: str, kind: type) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{what} must be a {kind.__name__} or an iterable of them, not {value!r}")
    items = tuple(value)
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
        self._visible_packs: tuple[tuple, pa.Array] | None = None
        self._ensure_schema()

    # ----------------------------------------------------------------- lifecycle
    @property
    def backend(self) -> str:
        """``"chdb"`` or ``"server"``."""
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

    def schema_version(self) -> int | None:
        """The highest schema version row, or None on an empty catalog."""
        rows = self._backend.query(f"SELECT max(version) AS v, count() AS n FROM {self._tables['schema']}").to_pylist()
        return int(rows[0]["v"]) if rows and rows[0]["n"] else None

    # ----------------------------------------------------------------- writing
    def publisher(self, scope: str, holder: str | None = None, lease_seconds: float = 30.0) -> Publisher:
        """A publisher for ``scope`` (not yet acquired). ``holder`` defaults to host:pid:random."""
        return Publisher(self, scope, holder, lease_seconds)

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
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise InvalidArgumentError(f"layer must be an int, not {layer!r}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidArgumentError(f"count must be a positive int, not {count!r}")
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
        """Dropped-record counts summed per (model_id, run_id, request_id, hook, layer, reason)."""
        where, params = self._filters(model_id=model_id, run_id=run_id, request_id=request_id)
        return self._backend.query(
            "SELECT model_id, run_id, request_id, hook, layer, reason, sum(count) AS count "
            f"FROM {self._tables['losses']} {where} "
            "GROUP BY model_id, run_id, request_id, hook, layer, reason "
            "ORDER BY model_id, run_id, request_id, hook, layer, reason",
            params,
        )

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
        ``hook@layer``, or empty). The per-hook rows are in the ``audits`` table (:attr:`tables`)."""
        where, params = self._filters(model_id=model_id, run_id=run_id, request_id=request_id)
        if audit_id is not None:
            params["audit_id"] = validate_value_id(audit_id, "audit id")
            where += " AND audit_id = %(audit_id)s"
        return self._backend.query(
            "SELECT audit_id, model_id, run_id, request_id, any(audited_at) AS audited_at, any(model) AS model, "
            "any(tolerance) AS tolerance, count() AS checks, countIf(verdict = 'exact') AS exact, "
            "countIf(verdict = 'noise') AS noise, countIf(verdict = 'fail') AS failed, "
            "arrayStringConcat(arraySlice(groupArrayIf(concat(hook, '@', toString(layer)), verdict = 'fail'), 1, 1), '') "
            "AS first_failure "
            f"FROM {self._tables['audits']} {where} "
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
        """Publish sealed packs that no visible watermark names; returns their pack ids.

        Lists ``store.list_packs()``, reads each unpublished pack's descriptor with
        :func:`dmi.catalog.read_pack_descriptor` and publishes them under a lease on
        ``scope`` (raises LeaseHeldError while a live writer holds it). Run it for a crashed
        writer's scope once its lease has expired, or when no writer is running: a pack a
        live writer sealed but has not published yet would be published by recovery (which
        is harmless — publishing twice shows each record once).
        """
        from dmi.storage import read_pack_descriptor  # the storage layer's reader

        published = self.published_pack_ids()
        candidates = [pack_id for pack_id in store.list_packs() if pack_id not in published]
        if not candidates:
            return []
        with self.publisher(scope, holder=holder, lease_seconds=lease_seconds) as publisher:
            published = self.published_pack_ids()  # again, now that we hold the lease
            descriptors = [read_pack_descriptor(store, pid) for pid in candidates if pid not in published]
            if not descriptors:
                return []
            publisher.publish(descriptors)
        return [d.pack_id for d in descriptors]

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
        return self._backend.query(
            f"SELECT {columns} FROM {self._tables['records']} {where}{joiner}pack_id IN ({sub}) {tail}", params
        )

    def models(self) -> list[str]:
        """Model ids with at least one published record."""
        table = self._published_records("", {}, "DISTINCT model_id", "ORDER BY model_id")
        return table.column("model_id").to_pylist()

    def runs(self, model_id: str) -> list[str]:
        where, params = self._filters(model_id=model_id)
        table = self._published_records(where, params, "DISTINCT run_id", "ORDER BY run_id")
        return table.column("run_id").to_pylist()

    def requests(self, model_id: str, run_id: str | None = None) -> list[str]:
        where, params = self._filters(model_id=model_id, run_id=run_id)
        table = self._published_records(where, params, "DISTINCT request_id", "ORDER BY request_id")
        return table.column("request_id").to_pylist()

    def request_contents(self, model_id: str, request_id: str, run_id: str | None = None) -> dict[str, HookContents]:
        """Hooks of one request, each with its layers, shard ranks and sizes."""
        where, params = self._filters(model_id=model_id, request_id=request_id, run_id=run_id)
        sub = self._published_subquery(None, None, params)
        rows = self._backend.query(
            "SELECT hook, groupUniqArray(layer) AS layers, groupUniqArray(shard_rank) AS ranks, "
            "groupUniqArray(tp_size) AS tps, count() AS n, sum(n_tokens) AS tokens FROM ("
            f"SELECT hook, layer, shard_rank, tp_size, n_tokens FROM {self._tables['records']} {where} "
            f"AND pack_id IN ({sub}) LIMIT 1 BY pack_id, record_index) GROUP BY hook ORDER BY hook",
            params,
        ).to_pylist()
        return {
            r["hook"]: HookContents(
                r["hook"], tuple(sorted(r["layers"])), tuple(sorted(r["ranks"])), tuple(sorted(r["tps"])),
                int(r["n"]), int(r["tokens"]),
            )
            for r in rows
        }

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
        that watermark of its scope; ``scope`` to packs published in that scope.
        """
        where, params = self._filters(model_id=model_id, request_id=request_id, run_id=run_id)
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
            visible = self._visible_pack_ids()
            table = self._backend.query(f"SELECT {columns} FROM {self._tables['records']} {where} {tail}", params)
            table = table.filter(pc.is_in(table.column("pack_id"), value_set=visible))
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
        balanced outside quotes) so it cannot end or leave the ``SELECT`` it runs in: it can
        only read. Parameter names starting with ``dmi_`` are reserved. Ordered by run,
        request, hook, layer, start token, shard rank. Raises ``InvalidArgumentError`` for a
        malformed selection or fragment, ``ServerError`` when ClickHouse refuses the filter.
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
        columns = ", ".join(_schema.RECORD_COLUMNS)
        table = self._backend.query(
            f"SELECT {columns} FROM {self._tables['records_published']} WHERE {' AND '.join(conditions)} "
            "ORDER BY run_id, request_id, hook, layer, start_token, shard_rank, pack_id, record_index",
            values,
        )
        return _schema.entries_from_table(table) if table.num_rows else []

    def _visible_pack_ids(self) -> pa.Array:
        """Ids of every published, unfenced pack, recomputed only when visibility may have changed.

        Watermarks and fences are append-only, so their row counts change whenever either
        does; one cheap query of both counts decides whether the cached set still holds. The
        point query then reads only the records' key range and filters by this set, instead
        of evaluating the visibility join on every query.
        """
        counts = self._backend.query(
            f"SELECT 'watermarks' AS t, count() AS n FROM {self._tables['watermarks']} "
            f"UNION ALL SELECT 'fences' AS t, count() AS n FROM {self._tables['fences']}",
            {},
        ).to_pylist()
        version = tuple(sorted((row["t"], row["n"]) for row in counts))
        cached = self._visible_packs
        if cached is not None and cached[0] == version:
            return cached[1]
        ids = self._backend.query(_schema.PUBLISHED_PACK_IDS.format(**self._tables), {}).column("pack_id")
        visible = pa.array(ids.to_pylist(), type=pa.string())
        self._visible_packs = (version, visible)
        return visible

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
        text is written ``%%``.

        ``records_published`` holds one row per published, unfenced record, with its
        statistics, e.g. the mean L2 norm of ``resid_post`` per layer::

            catalog.sql(f"SELECT layer, avg(l2_norm) FROM {catalog.tables['records_published']} "
                        "WHERE model_id = 'gpt2' AND hook = 'resid_post' GROUP BY layer ORDER BY layer")
        """
        if not isinstance(query, str):
            raise InvalidArgumentError("sql() takes a str")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgumentError(f"sql() params must be a dict, not {type(params).__name__}")
        return self._backend.query(query, params)


def _checked_filter(fragment: str) -> str:
    """``fragment`` if it is one SQL expression that cannot end or leave its parentheses.

    Scans outside quoted text (``'...'``, ``"..."``, backticks, with backslash and doubled
    quote escapes) and refuses ``;``, comments (``--``, ``#``, ``/*``), an unterminated quote
    and unbalanced parentheses.
    """
    if not isinstance(fragment, str) or not fragment.strip():
        raise InvalidArgumentError(f"where must be a non-empty SQL expression, not {fragment!r}")
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
    return fragment
