"""Catalog on a 2-replica ClickHouse cluster vs one server vs chDB, side by side in one run.

Starts ZooKeeper and two ``clickhouse-server`` replicas on loopback (``tests/_cluster.py``: needs
Debian's ``zookeeper`` and ``clickhouse-server``), one plain ``clickhouse-server``, and chDB, then
runs the same workload as ``bench/bench_catalog.py`` on each: index ingest (Arrow -> records
table), publishing every pack under a lease, point queries, and one-pack watermark publishes
(index rows + lease check + watermark; on the cluster every insert waits for both replicas).
It also times opening a catalog: the first open creates the schema (``ON CLUSTER`` on the
cluster), a reopen finds it. Prints a markdown table with the conditions.

    python bench/bench_catalog_cluster.py                    # 100k records
    python bench/bench_catalog_cluster.py --records 20000 --publishes 20 --points 50
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_catalog import CHUNKS, HOOKS, LAYERS, bench_catalog, make_descriptors, pct  # noqa: E402

from dmi.catalog import open_catalog  # noqa: E402
from tests._clickhouse import LocalServerProcess, find_server_binary  # noqa: E402
from tests._cluster import LocalCluster  # noqa: E402


def open_times(uri: str, reopens: int) -> tuple[float, float]:
    """Seconds for the first open (creates the schema) and the median reopen."""
    t0 = time.perf_counter()
    open_catalog(uri).close()
    first = time.perf_counter() - t0
    again = []
    for _ in range(reopens):
        t0 = time.perf_counter()
        open_catalog(uri).close()
        again.append(time.perf_counter() - t0)
    return first, pct(again, 50)


def run_one(label: str, uri_for, descriptors, points, publishes: int, results: dict) -> None:
    """``uri_for(database)``: the URI of a catalog in ``database`` on the system under test."""
    first, reopen = open_times(uri_for("bench_open"), 5)
    result = bench_catalog(uri_for("bench"), descriptors, points, publishes)
    result["open_first_s"], result["open_again_s"] = first, reopen
    results[label] = result
    print("# " + row(label, result), flush=True)


HEADER = (
    "| catalog | ingest rows/s (Arrow → table) | publish-all rows/s (end to end) | point query p50 / p99 ms "
    "| watermark publish p50 / p99 ms | open: first / again s |\n|---|---|---|---|---|---|"
)


def row(label: str, r: dict) -> str:
    return (f"| {label} | {r['rows'] / r['arrow_ingest_s']:,.0f} | {r['rows'] / r['publish_all_s']:,.0f} "
            f"| {r['point_p50_ms']:.2f} / {r['point_p99_ms']:.2f} "
            f"| {r['publish_p50_ms']:.1f} / {r['publish_p99_ms']:.1f} "
            f"| {r['open_first_s']:.2f} / {r['open_again_s']:.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--points", type=int, default=200)
    parser.add_argument("--publishes", type=int, default=50)
    args = parser.parse_args(argv)
    binary = find_server_binary()
    if binary is None:
        sys.exit("needs clickhouse-server (apt-get install clickhouse-server zookeeper)")
    import clickhouse_driver

    print(f"# machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"clickhouse-driver {clickhouse_driver.__version__}, all servers on loopback", flush=True)
    descriptors = make_descriptors(args.records)
    n = sum(len(d.records) for d in descriptors)
    rng = random.Random(7)
    n_requests = n // (len(HOOKS) * LAYERS * CHUNKS)
    points = [(f"req-{rng.randrange(n_requests):06d}", rng.choice(HOOKS), rng.randrange(LAYERS))
              for _ in range(args.points)]
    results: dict[str, dict] = {}
    scratch = Path(tempfile.mkdtemp(prefix="catalog-cluster-bench-"))
    try:
        run_one("chDB (embedded)", lambda name: f"chdb://{scratch}/chdb/{name}", descriptors, points,
                args.publishes, results)
        server = LocalServerProcess(binary)
        try:
            live = server.start()
            with open_catalog(live.uri("default")) as probe:
                version = probe.sql("SELECT version() AS v").column("v")[0].as_py()
            run_one(f"one server {version}", live.uri, descriptors, points, args.publishes, results)
        finally:
            server.stop()
        with LocalCluster(scratch / "cluster") as cluster:
            entry = cluster.nodes[0]
            run_one(f"cluster {version}, 1 shard x 2 replicas, quorum 2", entry.uri, descriptors, points,
                    args.publishes, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(f"{n:,} index rows in packs of 10,000; point query = (model, request, hook, layer) -> {CHUNKS} records; "
          f"{args.points} point queries, {args.publishes} publishes of 1 pack x 10 records; "
          "open = open_catalog() then close(), first on an empty database, then the median of 5 reopens.")
    print()
    print(HEADER)
    for label, result in results.items():
        print(row(label, result))


if __name__ == "__main__":
    main()
