"""Deleting runs and models: tombstones first (invisible at once), pack files after.

A deletion is one append-only row per deleted run in the ``deletions`` table: the model,
the run, and the packs that held the run's visible records when the deletion was decided
(none for a run that shows only losses: capture dropped every record of it).
It hides exactly the records whose ``(pack_id, model_id, run_id)`` it names, wherever
records are read (point queries, the published view, summaries), so:

* **invisible at once, all or nothing**: the rows of one deletion (one per run, several for
  a whole model) go in one INSERT, which ClickHouse lands as one part; before it a reader
  sees the whole run, after it none of it;
* **nothing of other runs is touched**: a pack may hold records of several runs (the pack
  writer accepts any keys; capture writes one run per pack). Its other runs' records stay
  visible, and its file is removed only once its index is complete (no row lost, which
  could be another run's) and every record indexed in it is hidden;
* **sticky**: a tombstone names pack ids, so re-publishing a deleted pack (recovery finding
  its file still on disk) cannot bring its records back, and :func:`deleted_pack_ids` tells
  recovery which packs were deleted on purpose;
* **crash-safe**: files are removed only after the tombstone landed; a crash in between
  leaves files nobody can see, which :func:`purge` (run by every later delete)
  removes.

A deletion is a snapshot: packs of the run published after it was decided (a capture still
running into that run) stay visible; delete again to remove them.

Rows that name a run but no pack (losses, audit rows) cannot be hidden by pack id; a
tombstone hides those of its ``(model_id, run_id)`` stamped at or before its ``deleted_at``
(:func:`undeleted_rows`), so a run captured again under a deleted id shows only what was
recorded since. That is all a loss-only run's tombstone hides.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from dmi.catalog import _schema
from dmi.catalog._sql import validate_optional_value_id, validate_value_id
from dmi.storage.errors import PackNotFoundError, SelectionChangedError

# Every function takes the ``Catalog`` it works on as ``catalog`` (not imported here: the
# catalog module imports this one, and the contracts forbid an import circle).

__all__ = ["Deletion", "delete_runs", "deletions", "deleted_pack_ids", "purge", "hidden_record_keys", "record_keys",
           "loss_only_runs", "undeleted_rows"]

_KEY_SEPARATOR = "\x1f"
"""Joins a record's pack, model and run into one key; ids never hold control characters."""

_KEY_SEPARATOR_SCALAR = _schema.string_array([_KEY_SEPARATOR])[0]
"""The separator as the Arrow scalar :func:`record_keys` joins with: pyarrow turns a Python
``str`` into one by importing pandas."""


@dataclass(frozen=True, slots=True)
class Deletion:
    """One deleted run: which packs held its records, how many records it hid, when, by whom."""

    deletion_id: str
    model_id: str
    run_id: str
    pack_ids: tuple[str, ...]
    n_records: int
    deleted_by: str
    deleted_at: float


def delete_runs(catalog, model_id: str, run_id: str | None = None, *, deleted_by: str = "",
                expected: Mapping[str, tuple[int, int]] | None = None) -> list[Deletion]:
    """Hide every visible record of ``model_id`` (of one run if ``run_id``) in one INSERT,
    and every visible loss of its runs that hold only losses (:func:`loss_only_runs`).

    Returns one :class:`Deletion` per run hidden now, in run order (a loss-only run's names
    no pack and counts no record); empty when nothing of the selection is visible (unknown,
    or already deleted). ``expected`` (``{run_id: (records, lost)}``, ``lost`` counted for the
    runs that hold only losses, 0 for the others): what the caller counted, and asked about;
    when the selection holds anything else now, :class:`SelectionChangedError` and nothing is
    deleted, so a run published after the count is never deleted unasked.
    """
    params = {"model_id": validate_value_id(model_id, "model id")}
    validate_optional_value_id(deleted_by, "deleted_by")
    where = "model_id = %(model_id)s"
    if run_id is not None:
        params["run_id"] = validate_value_id(run_id, "run id")
        where += " AND run_id = %(run_id)s"
    tables = catalog._tables
    published = catalog._published_subquery(None, None, params)
    rows = catalog._backend.query(
        "SELECT run_id, groupUniqArray(pack_id) AS packs, count() AS n FROM ("
        f"SELECT run_id, pack_id FROM {tables['records']} WHERE {where} AND pack_id IN ({published}) "
        f"AND {_schema.NOT_DELETED.format(**tables)} LIMIT 1 BY pack_id, record_index"
        ") GROUP BY run_id ORDER BY run_id",
        params,
    ).to_pylist()
    held = {r["run_id"]: (tuple(sorted(r["packs"])), int(r["n"])) for r in rows}
    only_lost = loss_only_runs(catalog, model_id, run_id)
    if expected is not None:
        counted = {**{run: (n, 0) for run, (_, n) in held.items()}, **{run: (0, lost) for run, lost in only_lost.items()}}
        if counted != dict(expected):
            raise SelectionChangedError(now=counted)
    held.update((run, ((), 0)) for run in only_lost)
    if not held:
        return []
    deletion_id, now = uuid.uuid4().hex, time.time()
    found = [Deletion(deletion_id, model_id, run, packs, n, deleted_by, now)
             for run, (packs, n) in sorted(held.items())]
    catalog._backend.insert(
        tables["deletions"],
        pa.Table.from_pylist(
            [
                {
                    "deletion_id": d.deletion_id, "model_id": d.model_id, "run_id": d.run_id,
                    "pack_ids": list(d.pack_ids), "n_records": d.n_records, "deleted_by": d.deleted_by,
                    "deleted_at": d.deleted_at,
                }
                for d in found
            ],
            schema=_schema.DELETION_SCHEMA,
        ),
    )
    return found


def loss_only_runs(catalog, model_id: str, run_id: str | None = None) -> dict[str, int]:
    """The runs of ``model_id`` (``run_id`` only, if given) that show losses but no visible
    record (capture dropped every one), each with how many records it lost, in run order.

    :func:`delete_runs` tombstones these beside the runs with records: such a tombstone names
    no pack, and hides the run's losses by time (:func:`undeleted_rows`) like any other's.
    """
    where, params = catalog._filters(model_id=validate_value_id(model_id, "model id"), run_id=run_id)
    tables = catalog._tables
    published = catalog._published_subquery(None, None, params)
    rows = catalog._backend.query(
        f"SELECT run_id, sum(count) AS lost FROM ({undeleted_rows(catalog, 'losses', 'recorded_at', where)}) "
        f"WHERE run_id NOT IN (SELECT run_id FROM {tables['records']} {where} AND pack_id IN ({published}) "
        f"AND {_schema.NOT_DELETED.format(**tables)}) GROUP BY run_id ORDER BY run_id",
        params,
    ).to_pylist()
    return {r["run_id"]: int(r["lost"]) for r in rows}


def deletions(catalog, model_id: str | None = None, run_id: str | None = None) -> list[Deletion]:
    """Every tombstone (of ``model_id``, of ``run_id``), oldest first."""
    where, params = catalog._filters(model_id=model_id, run_id=run_id)
    rows = catalog._backend.query(
        "SELECT deletion_id, model_id, run_id, pack_ids, n_records, deleted_by, deleted_at "
        f"FROM {catalog._tables['deletions']} {where} ORDER BY deleted_at, model_id, run_id",
        params,
    ).to_pylist()
    return [
        Deletion(r["deletion_id"], r["model_id"], r["run_id"], tuple(r["pack_ids"]), int(r["n_records"]),
                 r["deleted_by"], float(r["deleted_at"]))
        for r in rows
    ]


def _deleted_triples(catalog) -> set[tuple[str, str, str]]:
    rows = catalog._backend.query(
        f"SELECT DISTINCT pack_id, model_id, run_id FROM ({_schema.DELETED_TRIPLES.format(**catalog._tables)})", {}
    ).to_pylist()
    return {(r["pack_id"], r["model_id"], r["run_id"]) for r in rows}


def deleted_pack_ids(catalog) -> set[str]:
    """Packs deleted on purpose: named by a tombstone, fully indexed, and every record hidden.

    A pack that still holds a record of a run nobody deleted is not here (its file must
    stay), nor is a pack whose index is incomplete, with no index rows at all or some lost
    (nothing proves the missing rows were of deleted runs; :meth:`Catalog.recover` re-indexes
    it). Recovery must not re-publish these; :func:`purge` removes their files.
    """
    triples = _deleted_triples(catalog)
    named = tuple(sorted({pack_id for pack_id, _, _ in triples}))
    if not named:
        return set()
    rows = catalog._backend.query(
        f"SELECT DISTINCT pack_id, model_id, run_id FROM {catalog._tables['records']} WHERE pack_id IN %(ids)s",
        {"ids": named},
    ).to_pylist()
    still_needed = {r["pack_id"] for r in rows if (r["pack_id"], r["model_id"], r["run_id"]) not in triples}
    return catalog._fully_indexed(named) - still_needed


def purge(catalog, store) -> list[str]:
    """Remove the files of deleted packs still in ``store``; returns their ids, sorted.

    Safe to run at any time and any number of times: it removes only what
    :func:`deleted_pack_ids` says every tombstone already hides.
    """
    removed = []
    for pack_id in sorted(deleted_pack_ids(catalog)):
        if not store.exists(pack_id):
            continue
        try:
            store.delete(pack_id)
        except PackNotFoundError:  # another purge removed it between the check and the delete
            continue
        removed.append(pack_id)
    return removed


def hidden_record_keys(catalog) -> pa.Array:
    """The :func:`record_keys` of every record a tombstone hides, for point-query filtering."""
    keys = sorted(_KEY_SEPARATOR.join(triple) for triple in _deleted_triples(catalog))
    return _schema.string_array(keys)


def record_keys(table: pa.Table) -> pa.Array:
    """One text key per row of a records table: its pack, model and run joined."""
    joined = pc.binary_join_element_wise(
        table.column("pack_id"), table.column("model_id"), table.column("run_id"), _KEY_SEPARATOR_SCALAR
    )
    return joined.combine_chunks() if isinstance(joined, pa.ChunkedArray) else joined


def undeleted_rows(catalog, table: str, stamped_at: str, where: str) -> str:
    """SQL for the rows of the catalog's ``table`` (narrowed by ``where``, a ``WHERE`` clause or
    empty) that no tombstone hides: those of a run never deleted, or stamped (``stamped_at``,
    Unix seconds) after the last tombstone of their ``(model_id, run_id)``.

    For rows that name a run but no pack (losses, audit rows): a tombstone names the packs it
    hides, so these are hidden by time instead. A row stamped at or before ``deleted_at`` was
    written before the deletion was decided (about records the deletion saw); one stamped
    after it belongs to a capture into the same run id since. Both stamps come from the
    writers' clocks. The subquery has every column of ``table`` (and the join's own).
    """
    tables = catalog._tables
    # ANY LEFT JOIN on a grouped subquery, filtered one level up: the forms 18.16 runs (as
    # VISIBLE_WATERMARKS). A run with no tombstone joins deleted_upto = 0 (NULL where a server
    # profile sets join_use_nulls), before any stamp.
    return (
        f"SELECT * FROM (SELECT *, {stamped_at} > ifNull(deleted_upto, 0) AS undeleted FROM "
        f"(SELECT * FROM {tables[table]} {where}) AS stamped ANY LEFT JOIN ("
        f"SELECT model_id, run_id, max(deleted_at) AS deleted_upto FROM {tables['deletions']} "
        "GROUP BY model_id, run_id) AS tombstones USING (model_id, run_id)) WHERE undeleted"
    )
