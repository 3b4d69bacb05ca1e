"""Catalog benchmark: index ingest, point queries and watermark publish latency.

Runs on the embedded chDB catalog and on a ClickHouse server (one started from the local
``clickhouse-server`` binary, or ``--server clickhouse://user:pw@host:port``), and, for
comparison, on what a user might do instead: SQLite with an index, and a pyarrow filter
over the index held in memory. Prints a markdown table.

    python bench/bench_catalog.py                     # 1M records, chDB + local server
    python bench/bench_catalog.py --records 200000 --no-server

Workload: ``--records`` index rows in packs of 10,000 records; keys are 1 model,
``records / 500`` requests x 2 hooks x 25 layers x 10 token chunks. A point query is one
(model, request, hook, layer) → 10 records, through ``Catalog.find_records`` (published,
unfenced, with byte ranges). Publish latency is one ``Publisher.publish`` of one pack of
10 records (index rows, lease check, watermark). A capture session's catalog work is what
one ``attach`` costs the catalog: its lease acquired on a scope of its own, one pack of 10
records published, the lease released; timed end to end, with the statements it sends.

chDB sessions: the embedded catalog holds a session per unit of catalog work, so several
processes share one directory. The same point query and publish are timed with one held
session, back to back (consecutive calls share a session until it is idle), and cold (a
fresh session each: what a CLI call pays), and a publish loop runs while another process
runs point queries in a loop (``--session-packs`` packs are indexed first).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dmi.catalog import open_catalog  # noqa: E402
from dmi.storage import (  # noqa: E402
    ByteRange,
    PackDescriptor,
    RecordEntry,
    RecordKey,
    RecordMeta,
    RecordStats,
)
from dmi.catalog import _schema  # noqa: E402

HOOKS = ("resid_post", "attn_out")
LAYERS = 25
CHUNKS = 10
PACK = 10_000


def make_descriptors(n_records: int, prefix: str = "p") -> list[PackDescriptor]:
    per_request = len(HOOKS) * LAYERS * CHUNKS
    n_requests = max(1, n_records // per_request)
    entries = []
    pack_index = 0
    descriptors = []

    def flush():
        nonlocal entries, pack_index
        pid = f"{prefix}{pack_index:06d}"
        descriptors.append(
            PackDescriptor(pid, f"/packs/{pid}.dmipack", 1 << 26, "bench", 1, time.time(),
                           tuple(RecordEntry(e.meta, pid, e.payload) for e in entries))
        )
        entries = []
        pack_index += 1

    for r in range(n_requests):
        request = f"req-{r:06d}"
        for hook in HOOKS:
            for layer in range(LAYERS):
                for chunk in range(CHUNKS):
                    key = RecordKey("bench-model", "run-1", request, hook, layer, chunk * 16, 16, chunk, "decode")
                    meta = RecordMeta(key, "bfloat16", (16, 2048), "zstd-shuffle", 65536, 1234567 + len(entries),
                                      None, RecordStats(1.5, 0.0, 7.0))
                    entries.append(RecordEntry(meta, "", ByteRange(len(entries) * 40000, 40000)))
                    if len(entries) == PACK:
                        flush()
    if entries:
        flush()
    return descriptors


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def bench_catalog(uri: str, descriptors, points, publishes: int) -> dict:
    out = {}
    n = sum(len(d.records) for d in descriptors)
    with open_catalog(uri) as catalog:
        t0 = time.perf_counter()
        table = _schema.records_table(descriptors)
        out["convert_s"] = time.perf_counter() - t0
        # Raw index ingest: the Arrow table into the records table (a scratch prefix).
        with open_catalog(uri, table_prefix="scratch_") as scratch:
            t0 = time.perf_counter()
            scratch._backend.insert(scratch.tables["records"], table)
            out["arrow_ingest_s"] = time.perf_counter() - t0
            for name in scratch.tables.values():
                scratch._backend.command(f"DROP TABLE IF EXISTS {name}")  # sql() is read-only
        # End to end: publish every descriptor under a lease (convert + ingest + watermark).
        publisher = catalog.publisher("bench", holder="bench", lease_seconds=600)
        publisher.acquire()
        t0 = time.perf_counter()
        for i in range(0, len(descriptors), 10):
            publisher.publish(descriptors[i : i + 10])
        out["publish_all_s"] = time.perf_counter() - t0
        count = catalog.sql(f"SELECT count() AS n FROM {catalog.tables['records']}").column("n")[0].as_py()
        assert count == n, (count, n)
        # Point queries.
        lat = []
        for request, hook, layer in points:
            t0 = time.perf_counter()
            found = catalog.find_records("bench-model", request, hook, layers=layer)
            lat.append(time.perf_counter() - t0)
            assert len(found) == CHUNKS, len(found)
        out["point_p50_ms"] = pct(lat, 50) * 1e3
        out["point_p99_ms"] = pct(lat, 99) * 1e3
        # Watermark publish latency: one pack of 10 records each.
        small = make_descriptors(publishes * CHUNKS * len(HOOKS) * LAYERS, prefix="small")[0].records
        lat = []
        for i in range(publishes):
            recs = small[i * 10 : i * 10 + 10]
            pid = f"w{i:05d}"
            desc = PackDescriptor(pid, f"/packs/{pid}", 1, "bench", 1, time.time(),
                                  tuple(RecordEntry(e.meta, pid, e.payload) for e in recs))
            t0 = time.perf_counter()
            publisher.publish([desc])
            lat.append(time.perf_counter() - t0)
        out["publish_p50_ms"] = pct(lat, 50) * 1e3
        out["publish_p99_ms"] = pct(lat, 99) * 1e3
        publisher.release()
        lat, out["session_statements"] = capture_sessions(catalog, small, publishes)
        out["session_p50_ms"] = pct(lat, 50) * 1e3
        out["session_p99_ms"] = pct(lat, 99) * 1e3
    out["rows"] = n
    return out


def capture_sessions(catalog, records, n: int) -> tuple[list[float], int]:
    """``n`` capture sessions' catalog work (acquire a new scope, publish one pack of 10
    records, release): each one's seconds, and how many statements the last one sent."""
    backend = catalog._backend
    sent = []

    def counted(method):
        def call(*args, **kwargs):
            sent.append(method.__name__)
            return method(*args, **kwargs)
        return call

    names = ("query", "command", "insert")
    for name in names:
        setattr(backend, name, counted(getattr(backend, name)))
    lat = []
    try:
        for i in range(n):
            recs = records[(n + i) * 10 : (n + i) * 10 + 10]  # after those the publish latency used
            pid = f"c{i:05d}"
            desc = PackDescriptor(pid, f"/packs/{pid}", 1, "bench", 1, time.time(),
                                  tuple(RecordEntry(e.meta, pid, e.payload) for e in recs))
            sent.clear()
            t0 = time.perf_counter()
            with catalog.publisher(f"capture/bench/run-{i:05d}", holder="bench", lease_seconds=30) as publisher:
                publisher.publish([desc])
            lat.append(time.perf_counter() - t0)
    finally:
        for name in names:
            delattr(backend, name)
    return lat, len(sent)


READER_LOOP = """
import sys, time
from dmi.catalog import open_catalog
catalog = open_catalog(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < deadline:
    catalog.find_records("bench-model", "req-000000", "resid_post", layers=0)
    n += 1
print(n)
"""


def _timed(op, n: int, before=None) -> list[float]:
    lat = []
    for i in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t0)
    return lat


def bench_sessions(descriptors, points, publishes: int) -> dict:
    """chDB: point query and publish latency per session mode, and a reader process in a loop.

    Modes: ``held`` (one session around every operation: one process owns the directory),
    ``back-to-back`` (the default: sessions close after the idle time, so consecutive calls
    share one), ``cold`` (the session closed before each operation: a CLI call, a notebook
    cell after a pause). Contention: this process publishes while another process runs
    point queries in a loop; the reader's completed queries are counted.
    """
    from dmi.catalog import _chdb

    out: dict = {}
    directory = tempfile.mkdtemp(prefix="catalog-bench-sessions-")
    uri = f"chdb://{directory}/catalog"
    small = make_descriptors(publishes * 4 * CHUNKS * len(HOOKS) * LAYERS, prefix="s")[0].records
    counter = iter(range(10**9))

    def one_pack(_):
        i = next(counter)
        pid = f"s{i:06d}"
        recs = small[(i * 10) % len(small):][:10]
        return PackDescriptor(pid, f"/packs/{pid}", 1, "bench", 1, time.time(),
                              tuple(RecordEntry(e.meta, pid, e.payload) for e in recs))

    try:
        with open_catalog(uri) as catalog:
            with catalog.publisher("bench", holder="bench", lease_seconds=600) as publisher:
                for i in range(0, len(descriptors), 10):
                    publisher.publish(descriptors[i : i + 10])

                def query(i):
                    request, hook, layer = points[i % len(points)]
                    catalog.find_records("bench-model", request, hook, layers=layer)

                def publish(i):
                    publisher.publish([one_pack(i)])

                with catalog._backend.session():
                    out["held"] = (_timed(query, len(points)), _timed(publish, publishes))
                out["back-to-back"] = (_timed(query, len(points)), _timed(publish, publishes))
                cold = _chdb._SESSION.close_now
                out["cold"] = (_timed(query, len(points), cold), _timed(publish, publishes, cold))
                seconds = 3.0
                reader = subprocess.Popen([sys.executable, "-c", READER_LOOP, uri, str(seconds)],
                                          stdout=subprocess.PIPE, text=True,
                                          cwd=str(Path(__file__).resolve().parent.parent))
                time.sleep(1.0)  # let the reader start and enter its loop
                lat, started = [], time.monotonic()
                while time.monotonic() - started < seconds - 1.5:
                    lat += _timed(publish, 1)
                reads = int(reader.communicate(timeout=120)[0].strip() or 0)
                out["contention"] = (lat, reads / seconds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def print_sessions(result: dict) -> None:
    print()
    print("chDB sessions: latency in ms (p50 / p99) by how the session is held")
    print()
    print("| session | point query | publish (1 pack x 10 records) |\n|---|---|---|")
    for mode in ("held", "back-to-back", "cold"):
        q, p = result[mode]
        print(f"| {mode} | {pct(q, 50) * 1e3:.2f} / {pct(q, 99) * 1e3:.2f} | {pct(p, 50) * 1e3:.1f} / {pct(p, 99) * 1e3:.1f} |")
    lat, reads = result["contention"]
    print(f"| publish while another process runs point queries in a loop ({reads:.0f} queries/s there) "
          f"| — | {pct(lat, 50) * 1e3:.1f} / {pct(lat, 99) * 1e3:.1f} ({len(lat)} publishes) |")


def bench_sqlite(table: pa.Table, points) -> dict:
    out = {}
    directory = tempfile.mkdtemp(prefix="catalog-bench-sqlite-")
    try:
        db = sqlite3.connect(os.path.join(directory, "index.db"))
        cols = ["model_id", "request_id", "hook", "layer", "start_token", "pack_id", "payload_offset", "payload_length"]
        db.execute(f"CREATE TABLE records ({', '.join(cols)})")
        db.execute("CREATE INDEX k ON records (model_id, request_id, hook, layer)")
        rows = list(zip(*[table.column(c).to_pylist() for c in cols]))
        t0 = time.perf_counter()
        db.executemany(f"INSERT INTO records VALUES ({', '.join('?' * len(cols))})", rows)
        db.commit()
        out["ingest_s"] = time.perf_counter() - t0
        lat = []
        for request, hook, layer in points:
            t0 = time.perf_counter()
            got = db.execute(
                "SELECT * FROM records WHERE model_id = ? AND request_id = ? AND hook = ? AND layer = ? "
                "ORDER BY start_token", ("bench-model", request, hook, layer)).fetchall()
            lat.append(time.perf_counter() - t0)
            assert len(got) == CHUNKS
        out["point_p50_ms"] = pct(lat, 50) * 1e3
        out["point_p99_ms"] = pct(lat, 99) * 1e3
        db.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def bench_arrow_filter(table: pa.Table, points) -> dict:
    lat = []
    for request, hook, layer in points[:50]:
        t0 = time.perf_counter()
        mask = pc.and_(pc.and_(pc.equal(table["request_id"], request), pc.equal(table["hook"], hook)),
                       pc.equal(table["layer"], layer))
        got = table.filter(mask)
        lat.append(time.perf_counter() - t0)
        assert got.num_rows == CHUNKS
    return {"point_p50_ms": pct(lat, 50) * 1e3, "point_p99_ms": pct(lat, 99) * 1e3}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--points", type=int, default=300)
    parser.add_argument("--publishes", type=int, default=100)
    parser.add_argument("--server", help="clickhouse://user:pw@host:port (default: start the local binary)")
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--session-packs", type=int, default=20,
                        help="packs of 10,000 records in the chDB session benchmark (default 20)")
    args = parser.parse_args(argv)

    import chdb
    import clickhouse_driver

    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, pyarrow {pa.__version__}, chdb {chdb.__version__}, "
          f"clickhouse-driver {clickhouse_driver.__version__}", flush=True)
    t0 = time.perf_counter()
    descriptors = make_descriptors(args.records)
    n = sum(len(d.records) for d in descriptors)
    print(f"# workload: {n} records in {len(descriptors)} packs (built in {time.perf_counter() - t0:.1f} s)", flush=True)
    rng = random.Random(7)
    n_requests = n // (len(HOOKS) * LAYERS * CHUNKS)
    points = [(f"req-{rng.randrange(n_requests):06d}", rng.choice(HOOKS), rng.randrange(LAYERS)) for _ in range(args.points)]

    results = {}
    directory = tempfile.mkdtemp(prefix="catalog-bench-chdb-")
    try:
        results["chDB (embedded)"] = bench_catalog(f"chdb://{directory}/catalog", descriptors, points, args.publishes)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("# " + row("chDB (embedded)", results["chDB (embedded)"]), flush=True)
    sessions = bench_sessions(descriptors[: args.session_packs], points, args.publishes)

    server_label = None
    if not args.no_server:
        process = None
        uri = args.server
        try:
            if uri is None:
                from tests._clickhouse import LocalServerProcess, find_server_binary

                binary = find_server_binary()
                if binary is None:
                    print("# no clickhouse-server binary; skipping the server", flush=True)
                else:
                    process = LocalServerProcess(binary)
                    server = process.start()
                    uri = server.uri("dmi_bench")
            if uri is not None:
                with open_catalog(uri) as probe:
                    version = probe.sql("SELECT version() AS v").column("v")[0].as_py()
                    db = probe._backend.database
                    probe._backend.command(f"DROP DATABASE IF EXISTS `{db}`")
                server_label = f"server {version} (native protocol, loopback)"
                results[server_label] = bench_catalog(uri, descriptors, points, args.publishes)
                print("# " + row(server_label, results[server_label]), flush=True)
        finally:
            if process is not None:
                process.stop()

    table = _schema.records_table(descriptors)
    try:
        sqlite = bench_sqlite(table, points)
    except sqlite3.Error as exc:
        print(f"# sqlite failed: {exc}")
        sqlite = None
    arrow = bench_arrow_filter(table, points)

    print()
    print(f"{n:,} index rows; point query = (model, request, hook, layer) -> {CHUNKS} records; "
          f"{args.points} point queries, {args.publishes} publishes of 1 pack x 10 records.")
    print()
    print(HEADER)
    for label, r in results.items():
        print(row(label, r))
    if sqlite is not None:
        print(f"| SQLite (stdlib, B-tree index, one file) | {n / sqlite['ingest_s']:,.0f} | — | — "
              f"| {sqlite['point_p50_ms']:.2f} / {sqlite['point_p99_ms']:.2f} | — | — |")
    print(f"| pyarrow filter, index in memory (no persistence) | — | — | — "
          f"| {arrow['point_p50_ms']:.2f} / {arrow['point_p99_ms']:.2f} | — | — |")
    print_sessions(sessions)


HEADER = (
    "| catalog | ingest rows/s (Arrow → table) | publish-all rows/s (end to end) | descriptor → Arrow rows/s "
    "| point query p50 / p99 ms | watermark publish p50 / p99 ms | capture session's catalog work p50 / p99 ms "
    "(statements) |\n|---|---|---|---|---|---|---|"
)


def row(label, r) -> str:
    return (f"| {label} | {r['rows'] / r['arrow_ingest_s']:,.0f} | {r['rows'] / r['publish_all_s']:,.0f} "
            f"| {r['rows'] / r['convert_s']:,.0f} | {r['point_p50_ms']:.2f} / {r['point_p99_ms']:.2f} "
            f"| {r['publish_p50_ms']:.1f} / {r['publish_p99_ms']:.1f} "
            f"| {r['session_p50_ms']:.1f} / {r['session_p99_ms']:.1f} ({r['session_statements']}) |")


if __name__ == "__main__":
    main()
