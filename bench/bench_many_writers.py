"""Many writers: 1, 2, 4 capture processes publishing at once, on a 2-replica cluster + S3 (moto)
and on one clickhouse-server + local disk, side by side in one run.

Starts ZooKeeper and two ``clickhouse-server`` replicas on loopback (``tests/_cluster.py``: needs
Debian's ``zookeeper`` and ``clickhouse-server``), a moto S3 server (``tests/_s3.py``:
``pip install -e '.[test]'``) and one plain ``clickhouse-server``. For each system and each
writer count N it starts N capture processes (``tests/_writers.py``: a tiny random-weight
Llama, real hooks, ring, drain, pack writer and publisher lease), each capturing ``--runs`` runs
of one model id with its own run ids, writers entering the cluster through replica 1 and 2 in
turn; every configuration gets a fresh database and a fresh bucket prefix / directory. The
writers start capturing at one moment (a go file, after every process has imported torch and
opened its catalog); the wall time runs from that moment to the end of the last publish.

Reported per configuration: aggregate records/s and MB/s of payload (the tensors' bytes as
captured, before compression) over that wall time; every ``publish`` call's latency in the
children (index rows + lease check + watermark; on the cluster each insert waits for both
replicas), p50 and p99; and the records the catalog shows published against those appended.
Prints the conditions (cores, load average before and after, versions, model, tokens).

    python bench/bench_many_writers.py                                  # 1, 2, 4 writers, both systems
    python bench/bench_many_writers.py --writers 1 2 --runs 1 --tokens 4 --no-server   # a quick check

moto is for correctness, not speed (its ranged GET copies the whole object): the S3 figures are
ratios against local disk on the same machine, not what a real object store does.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dmi  # noqa: E402
from tests._clickhouse import LocalServerProcess, find_server_binary  # noqa: E402
from tests._cluster import LocalCluster  # noqa: E402
from tests._models import SMALL  # noqa: E402
from tests._s3 import CREDENTIALS, MotoServer  # noqa: E402
from tests._writers import HOOKS, Writer, run_writers  # noqa: E402

MODEL_ID = "bench-llama"
PROMPTS = 3  # tests._models.left_padded_batch: prompts of 7, 4 and 6 tokens, left-padded


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def one_configuration(label: str, n: int, catalog_uris: list[str], packs: str, workdir: Path,
                      args: argparse.Namespace) -> dict:
    """N writers into ``packs`` and the catalog (writer i enters through ``catalog_uris[i % len]``)."""
    writers = [Writer(f"w{i}", MODEL_ID, tuple(f"w{i}-run{j}" for j in range(args.runs)),
                      catalog_uris[i % len(catalog_uris)], packs, seed=i + 1) for i in range(n)]
    outcomes = run_writers(writers, workdir, tokens=args.tokens, max_records=args.max_records,
                           chunk_steps=args.chunk_steps, digest=False)
    for outcome in outcomes:
        if outcome.returncode != 0:
            raise SystemExit(f"{label}, {n} writers: {outcome.writer.name} exited {outcome.returncode}:\n"
                             f"{outcome.output}")
    publishes = [p for o in outcomes for p in o.events.publishes]
    start = min(o.events.go_at for o in outcomes)
    wall = max(p.end for p in publishes) - start
    with dmi.open(catalog=catalog_uris[-1], packs=packs) as store:
        published = len(store.catalog.find_records(MODEL_ID))
    result = {
        "label": label, "writers": n, "wall_s": wall,
        "records": sum(len(o.events.appended) for o in outcomes),
        "payload_bytes": sum(o.events.payload_bytes for o in outcomes),
        "publishes": len(publishes), "packs": sum(len(p.pack_ids) for p in publishes),
        "publish_p50_ms": pct([p.seconds for p in publishes], 50) * 1e3,
        "publish_p99_ms": pct([p.seconds for p in publishes], 99) * 1e3,
        "publish_mean_ms": statistics.fmean(p.seconds for p in publishes) * 1e3,
        "published": published,
    }
    print("# " + row(result), flush=True)
    return result


HEADER = ("| catalog + packs | writers | records | payload MB | wall s | records/s | payload MB/s | publishes "
          "(packs) | publish p50 / p99 ms | published / appended |\n|---|---|---|---|---|---|---|---|---|---|")


def row(r: dict) -> str:
    return (f"| {r['label']} | {r['writers']} | {r['records']:,} | {r['payload_bytes'] / 1e6:.2f} | {r['wall_s']:.2f} "
            f"| {r['records'] / r['wall_s']:,.0f} | {r['payload_bytes'] / 1e6 / r['wall_s']:.3f} "
            f"| {r['publishes']} ({r['packs']}) | {r['publish_p50_ms']:.0f} / {r['publish_p99_ms']:.0f} "
            f"| {r['published']:,} / {r['records']:,} |")


def versions(server_version: str) -> str:
    names = ("torch", "transformers", "pyarrow", "boto3", "moto", "clickhouse-driver")
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"Python {platform.python_version()}, " + ", ".join(found) + f", clickhouse-server {server_version}"


def server_version(uri: str) -> str:
    from dmi.catalog import open_catalog

    with open_catalog(uri) as catalog:
        return catalog.sql("SELECT version() AS v").column("v")[0].as_py()


def conditions(args: argparse.Namespace, load_before: tuple[float, ...], server: str) -> str:
    load_after = os.getloadavg()
    geometry = (f"tiny Llama, random weights, float32: {SMALL['num_hidden_layers']} layers, hidden "
                f"{SMALL['hidden_size']}, {SMALL['num_attention_heads']} heads ({SMALL['num_key_value_heads']} KV), "
                f"vocab {SMALL['vocab_size']}")
    return "\n".join([
        f"# machine: {platform.platform()}, {os.cpu_count()} CPUs; load average (1, 5, 15 min) "
        f"before {', '.join(f'{x:.2f}' for x in load_before)}, after {', '.join(f'{x:.2f}' for x in load_after)}",
        f"# versions: {versions(server)}; every server on loopback; S3 = moto's server",
        f"# model: {geometry}; hooks {HOOKS}",
        f"# workload per writer: {args.runs} runs (one generate call each) of {PROMPTS} prompts (7, 4, 6 tokens), "
        f"{args.tokens} new tokens, greedy; published every {args.chunk_steps} decode steps; packs of at most "
        f"{args.max_records} records; every writer the same model id, its own run ids",
        "# wall = first writer told to start -> last publish returned; records/s and MB/s over it; "
        "payload = tensor bytes as captured (before compression); publish = one Publisher.publish call "
        "in a child (index rows, lease check, watermark; quorum 2 on the cluster)",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=3, help="runs (generate calls) per writer")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per generate call")
    parser.add_argument("--chunk-steps", type=int, default=4, help="decode steps per published chunk")
    parser.add_argument("--max-records", type=int, default=64, help="records per pack at most")
    parser.add_argument("--no-server", action="store_true", help="only the cluster + S3, not one server + disk")
    args = parser.parse_args(argv)
    binary = find_server_binary()
    if binary is None:
        sys.exit("needs clickhouse-server and zookeeper (apt-get install clickhouse-server zookeeper)")
    load_before = os.getloadavg()
    os.environ.update(CREDENTIALS)
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="many-writers-bench-"))
    try:
        with LocalCluster(scratch / "cluster") as cluster, MotoServer() as s3:
            bucket = s3.new_bucket()
            version_seen = server_version(cluster.nodes[0].uri("default"))
            for n in args.writers:
                uris = [node.uri(f"bench_writers_{n}") for node in cluster.nodes]
                results.append(one_configuration("cluster (2 replicas, quorum 2) + S3 (moto)", n, uris,
                                                 s3.uri(bucket, f"n{n}"), scratch / f"cluster-{n}", args))
        if not args.no_server:
            server = LocalServerProcess(binary)
            try:
                live = server.start()
                for n in args.writers:
                    results.append(one_configuration("one server + local disk", n, [live.uri(f"bench_writers_{n}")],
                                                     str(scratch / f"disk-{n}" / "packs"), scratch / f"server-{n}",
                                                     args))
            finally:
                server.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(conditions(args, load_before, version_seen))
    print()
    print(HEADER)
    for result in results:
        print(row(result))


if __name__ == "__main__":
    main()
