"""What the embedded catalog's inserts and one publish cost: chDB's ``Python()`` table function
against a streamed Arrow IPC insert, with ClickHouse's default thread team and on one thread.

A capture publishes every pack it seals: one ``Publisher.publish`` is a lookup of the packs
already indexed, an insert into the records table (a row per record, 32 columns), one into the
packs table, a read of the lease, and the watermark insert. On a CPU machine whose cores run the
model, every millisecond of it is taken from the model (``bench_vllm_breakdown.py``).

    python bench/bench_chdb_inserts.py [--repeats 30] [--records 16,512,4096,32768,262144]
                                       [--publish-records 16,512,4096]

Rows, for each ``--records`` count of index rows (the catalog's own rows,
``_schema.records_table``, of real packs sealed by ``PackWriter``; above 4096, one 4096-record
pack's rows repeated):

* ``Python() table function`` — ``INSERT ... SELECT ... FROM Python(table)``: the embedded
  backend's insert before stop 27;
* ``Python(), one thread`` — the same with ``max_threads = 1, max_insert_threads = 1``;
* ``ArrowStream`` — ``send_insert`` of the table as Arrow IPC stream bytes;
* ``ArrowStream, one thread``;
* ``DMI`` — ``ChdbBackend.insert``: streamed on one thread up to ``STREAM_INSERT_MAX_ROWS``
  rows, ``Python()`` on one thread above;
* for each ``--publish-records`` count, ``publish, Python() inserts`` / ``publish (DMI)`` —
  one whole ``Publisher.publish`` of one pack of that many records, with the old insert and
  the new.

Floors in the same run: ``SELECT 1`` (a statement that reads nothing) and an insert of the same
rows into a ``Memory`` table (no part written). CPU is the process's (every chDB thread
included), per statement; the median of ``--repeats``, rows interleaved repeat by repeat.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import pyarrow as pa
import torch

import dmi
from dmi.catalog import _schema
from dmi.catalog._chdb import (
    INSERT_SETTINGS,
    STREAM_INSERT_MAX_ROWS,
    ChdbBackend,
    _arrow_stream,
    server_error_from_message,
    stream_insert,
)
from dmi.catalog._sql import quote_identifier
from dmi.storage import PackStore, PackWriter, RecordKey


BIG_REPEATS = 5  # inserts of more than 4096 rows: enough for a median, without a table of tens of millions of rows


def sealed_pack(store: PackStore, n_records: int):
    """A real pack of ``n_records`` small records (8 tokens x 64 float32), sealed."""
    writer = PackWriter(store, writer_id="bench")
    for i in range(n_records):
        key = RecordKey("bench-model", "run", f"req-{i // 64}", "resid_post", i % 64, 0, 8, 0, "prefill")
        writer.append(key, torch.randn(8, 64))
    return writer.close()


def rows_of(store: PackStore, n: int) -> pa.Table:
    """``n`` index rows: a real pack's, repeated past 4096 records."""
    table = _schema.records_table([sealed_pack(store, min(n, 4096))])
    return pa.concat_tables([table] * (n // table.num_rows)) if n > table.num_rows else table


def python_insert(backend: ChdbBackend, table: str, data: pa.Table, settings: str = "") -> None:
    """The embedded backend's insert before stop 27: chDB reads ``data`` from this frame."""
    columns = ", ".join(quote_identifier(n, "column name") for n in data.column_names)
    dmi_arrow_input = data  # noqa: F841 - read by chDB's Python() table function
    with backend.session() as conn:
        try:
            conn.query(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM Python(dmi_arrow_input) {settings}",
                       "CSV", params={})
        except RuntimeError as exc:
            raise server_error_from_message(str(exc)) from None


def arrow_stream_insert(backend: ChdbBackend, table: str, data: pa.Table, settings: str = "") -> None:
    """``data`` sent as Arrow IPC stream bytes through the catalog's own streamed insert."""
    columns = ", ".join(quote_identifier(n, "column name") for n in data.column_names)
    with backend.session() as conn:
        stream_insert(conn, f"INSERT INTO {table} ({columns}) {settings}", _arrow_stream(data))


def timed(run) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return 1000 * (time.perf_counter() - wall), 1000 * (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--records", default="16,512,4096,32768,262144")
    parser.add_argument("--publish-records", default="16,512,4096")
    args = parser.parse_args()
    sizes = [int(n) for n in args.records.split(",")]
    publish_sizes = [int(n) for n in args.publish_records.split(",")]
    one = INSERT_SETTINGS
    root = tempfile.mkdtemp(prefix="dmi-bench-chdb-inserts-")
    store = dmi.open(home=root)
    catalog = store.catalog
    backend = catalog._backend
    records = catalog.tables["records"]
    backend.command(f"CREATE TABLE IF NOT EXISTS {backend.database}.memory_floor AS {records} ENGINE = Memory")
    memory = f"{backend.database}.memory_floor"
    packs = {n: [sealed_pack(store.packs, n) for _ in range(args.repeats)] for n in publish_sizes}
    tables = {n: rows_of(store.packs, n) for n in sizes}

    publisher = catalog.publisher("bench/publish")
    publisher.acquire()
    new_insert = backend.insert

    big_repeats = min(args.repeats, BIG_REPEATS)
    rows: dict[str, tuple] = {"SELECT 1": (lambda: backend.query("SELECT 1"), args.repeats)}
    for n in sizes:
        t, limit = tables[n], args.repeats if n <= 4096 else big_repeats
        rows[f"{n} rows: insert into a Memory table (floor)"] = (lambda t=t: arrow_stream_insert(backend, memory, t, one), limit)
        rows[f"{n} rows: Python() table function"] = (lambda t=t: python_insert(backend, records, t), limit)
        rows[f"{n} rows: Python(), one thread"] = (lambda t=t: python_insert(backend, records, t, one), limit)
        rows[f"{n} rows: ArrowStream"] = (lambda t=t: arrow_stream_insert(backend, records, t), limit)
        rows[f"{n} rows: ArrowStream, one thread"] = (lambda t=t: arrow_stream_insert(backend, records, t, one), limit)
        rows[f"{n} rows: DMI"] = (lambda t=t: new_insert(records, t), limit)
    publishes = {}
    for n in publish_sizes:  # each publish needs a fresh pack: the old and new halves share one iterator
        half = args.repeats // 2
        publishes[f"{n} records: publish, Python() inserts"] = (n, True, half)
        publishes[f"{n} records: publish (DMI)"] = (n, False, args.repeats - half)

    for run, _ in rows.values():
        run()  # warm-up
    load = os.getloadavg()[0]
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in [*rows, *publishes]}
    pack_iters = {n: iter(packs[n]) for n in publish_sizes}
    for r in range(args.repeats):
        for name, (run, limit) in rows.items():
            if r < limit:
                samples[name].append(timed(run))
        for name, (n, old, count) in publishes.items():
            if len(samples[name]) >= count:
                continue
            descriptor = next(pack_iters[n])

            def run_publish(d=descriptor, old=old):
                backend.insert = (lambda t, data: python_insert(backend, t, data)) if old else new_insert
                try:
                    publisher.publish([d])
                finally:
                    backend.insert = new_insert
            samples[name].append(timed(run_publish))
    publisher.release()

    import chdb

    print(f"chDB {chdb.__version__}; {platform.machine()}, {os.cpu_count()} CPUs; {args.repeats} repeats "
          f"({big_repeats} above 4096 rows; publishes: {args.repeats // 2} each); DMI streams up to "
          f"{STREAM_INSERT_MAX_ROWS} rows; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("| statement | wall ms (median) | CPU ms (median; all threads) | repeats |")
    print("|---|---:|---:|---:|")
    for name, values in samples.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {len(values)} |")


if __name__ == "__main__":
    main()
