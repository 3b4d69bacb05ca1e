"""Packs on object storage vs local disk, side by side in one run, with the machine's limits.

Workload: ``--requests`` x ``--layers`` records of ``--tokens`` x ``--hidden`` bf16
activations (``bench_storage.activations``: Gaussian with heavy tails and outlier channels;
512 x 2048 = 2 MiB a record), written with ``PackWriter`` (default codec) into packs sealed
at ``--pack-mib`` MiB (``max_bytes``). Default: 8 x 16 records = 256 MiB raw in packs of
64 MiB. Per backend, each round:

* **write**: append every record and close the writer (every pack sealed: on local disk
  fsync'd and renamed; on S3 one conditional PUT per pack) — raw bytes / time;
* **read**: every record back as torch tensors through ``read_records`` (the reader's
  coalesced range path: few large ranged reads per pack) — raw bytes / time; local disk
  with its page cache dropped first (``posix_fadvise DONTNEED``), so both are cold;
* **one record**: ``read_by_key`` of ``--sample`` records, p50 / p99: *cold* (an empty
  footer cache, so the footer is fetched too; local page cache dropped) and *warm* (every
  pack's footer already in the cache: one range read).

Every record read back is checked bit-exact against what was written (outside the clock).
The machine's limits, measured in the same rounds: memcpy, ``os.write`` + fsync of the raw
bytes, a cold read of those files and zstd-1 on one thread (``bench_storage.limits``,
imported), and the S3 endpoint's own speed: one PUT and one GET of a pack-sized object
through boto3. Rounds are interleaved (limits, local, S3, limits, ...) and each figure is its
best round, so that a slow spell lands on no single backend.

S3 is moto's server unless ``--s3-endpoint`` names another (credentials from the environment,
bucket ``--s3-bucket`` must exist). moto keeps objects in memory in a Python process and copies
a whole object for a ranged GET: its figures are for the ratio to local disk and to its own
PUT / GET limit only, not what S3 or MinIO would do.

    python bench/bench_packs_s3.py             # default: 256 MiB raw, 64 MiB packs, 3 rounds
    python bench/bench_packs_s3.py --quick     # 16 MiB raw, 4 MiB packs, 1 round: seconds
    python bench/bench_packs_s3.py --pack-mib 128 --layers 32
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import platform
import random
import shutil
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ and tests/ (moto) live at the root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_storage import _pct, activations, best_of, drop_cache, files_under, key_of, limits, timed  # noqa: E402
from dmi.reader import FooterCache, load_footer, read_by_key, read_records  # noqa: E402
from dmi.storage import PackStore, PackWriter  # noqa: E402

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Workload:
    """The records written per round and the size packs are sealed at."""

    requests: int
    layers: int
    tokens: int
    hidden: int
    pack_bytes: int

    def describe(self, raw_bytes: int) -> str:
        return (f"{self.requests} requests x {self.layers} layers = {self.requests * self.layers} bf16 records of "
                f"{self.tokens} x {self.hidden} ({raw_bytes / MIB:.0f} MiB raw), packs sealed at "
                f"{self.pack_bytes / MIB:.0f} MiB")


class LocalBackend:
    """Packs in a fresh directory per round; cold reads drop the page cache of its files."""

    name = "local disk"

    def __init__(self, base: str):
        self.base = base

    def fresh_store(self, label: str) -> PackStore:
        self.root = os.path.join(self.base, label)
        return PackStore.local(self.root)

    def evict(self) -> None:
        drop_cache(files_under(self.root))

    def discard(self, store: PackStore) -> None:
        shutil.rmtree(self.root)


class S3Backend:
    """Packs under a fresh prefix per round in one bucket; nothing to evict (no client cache)."""

    def __init__(self, name: str, endpoint: str, bucket: str):
        self.name, self.endpoint, self.bucket = name, endpoint, bucket

    def fresh_store(self, label: str) -> PackStore:
        return PackStore.from_uri(f"s3://{self.bucket}/{label}?endpoint_override={self.endpoint}")

    def evict(self) -> None:
        """Nothing: an S3 read always goes to the endpoint."""

    def discard(self, store: PackStore) -> None:
        for pack_id in store.list_packs():  # moto holds objects in memory: free them every round
            store.delete(pack_id)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)


# --- one round on one backend -------------------------------------------------------------


def write_packs(store: PackStore, data: dict, pack_bytes: int) -> list:
    """Append every record, sealing at ``pack_bytes``; the sealed packs' descriptors."""
    sealed = []
    with PackWriter(store, max_bytes=pack_bytes, on_seal=sealed.append) as writer:
        for (request, layer), tensor in data.items():
            writer.append(key_of(request, layer, tensor.shape[0]), tensor)
    return sealed


def measure(backend, label: str, data: dict, workload: Workload, sample: list) -> dict:
    """Write, read all, and one-record latencies on ``backend``; every read checked bit-exact."""
    raw_bytes = sum(t.numel() * t.element_size() for t in data.values())
    store = backend.fresh_store(label)
    t_write, sealed = timed(lambda: write_packs(store, data, workload.pack_bytes))
    entries = [e for d in sealed for e in d.records]
    where = {(int(e.meta.key.request_id[4:]), e.meta.key.layer): e for e in entries}
    backend.evict()
    t_read, got = timed(lambda: read_records(store, entries))
    check_exact(data, where, entries, got)
    del got
    cold = []
    for rl in sample:
        backend.evict()
        dt, tensor = timed(lambda: read_by_key(store, where[rl].pack_id, where[rl].meta.key, cache=FooterCache()))
        cold.append(dt)
        check_one(backend, rl, tensor, data[rl])
    cache = FooterCache()
    for pack_id in {e.pack_id for e in entries}:
        load_footer(store, pack_id, cache=cache)
    warm = []
    for rl in sample * 3:
        dt, tensor = timed(lambda: read_by_key(store, where[rl].pack_id, where[rl].meta.key, cache=cache))
        warm.append(dt)
        check_one(backend, rl, tensor, data[rl])
    stored = sum(d.size for d in sealed)
    backend.discard(store)
    return {
        "write": raw_bytes / t_write,
        "read": raw_bytes / t_read,
        "one cold p50": _pct(cold, 50),
        "one cold p99": _pct(cold, 99),
        "one warm p50": _pct(warm, 50),
        "one warm p99": _pct(warm, 99),
        "packs": len(sealed),
        "mean pack": stored / len(sealed),
    }


def check_one(backend, rl: tuple, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        raise AssertionError(f"{backend.name}: record {rl} read back different from what was written")


def check_exact(data: dict, where: dict, entries: list, got: list) -> None:
    position = {id(e): i for i, e in enumerate(entries)}
    for rl, tensor in data.items():
        if not torch.equal(got[position[id(where[rl])]], tensor):
            raise AssertionError(f"record {rl} read back different from what was written")


def s3_limits(backend: S3Backend, pack_bytes: int) -> dict:
    """The endpoint's own speed: one PUT and one whole GET of a pack-sized object (boto3)."""
    client, body, key = backend.client(), os.urandom(pack_bytes), "limits/one-object"
    t_put, _ = timed(lambda: client.put_object(Bucket=backend.bucket, Key=key, Body=body))
    t_get, got = timed(lambda: client.get_object(Bucket=backend.bucket, Key=key)["Body"].read())
    client.delete_object(Bucket=backend.bucket, Key=key)
    if got != body:
        raise AssertionError("the S3 endpoint gave back a different object")
    return {"S3 PUT (one object)": pack_bytes / t_put, "S3 GET (one object)": pack_bytes / t_get}


# --- the run ------------------------------------------------------------------------------


def report(workload_text: str, results: dict, lim: dict) -> str:
    lines = [f"## Packs: local disk vs S3 — {workload_text}", "",
             "| backend | write GB/s | read GB/s | one record cold p50 / p99 ms | one record warm p50 / p99 ms "
             "| packs (mean MiB) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['write'] / 1e9:.3f} | {r['read'] / 1e9:.3f} | "
                     f"{r['one cold p50'] * 1e3:.1f} / {r['one cold p99'] * 1e3:.1f} | "
                     f"{r['one warm p50'] * 1e3:.1f} / {r['one warm p99'] * 1e3:.1f} | "
                     f"{r['packs']} ({r['mean pack'] / MIB:.1f}) |")
    (local_name, local), (s3_name, s3) = results.items()
    lines.append(f"| {s3_name} / {local_name} | {s3['write'] / local['write']:.2f}x | {s3['read'] / local['read']:.2f}x "
                 f"| {s3['one cold p50'] / local['one cold p50']:.1f}x | {s3['one warm p50'] / local['one warm p50']:.1f}x "
                 "| |")
    lines += ["", "The last row is the S3 figure over the local one (for latencies: times, so above 1 is slower).",
              "", "Machine limits (same rounds, best of them):", ""]
    lines += [f"- {name}: {value:.2f}" if name.endswith("ratio") else f"- {name}: {value / 1e9:.3f} GB/s"
              for name, value in lim.items()]
    return "\n".join(lines)


def versions() -> str:
    import pyarrow

    found = [f"Python {platform.python_version()}", f"torch {torch.__version__}", f"pyarrow {pyarrow.__version__}"]
    for package in ("boto3", "moto"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def s3_backend(args: argparse.Namespace, stack: ExitStack) -> S3Backend:
    if args.s3_endpoint is not None:
        return S3Backend(f"S3 ({args.s3_endpoint})", args.s3_endpoint, args.s3_bucket)
    from tests._s3 import CREDENTIALS, MotoServer

    os.environ.update(CREDENTIALS)
    endpoint = stack.enter_context(MotoServer())
    return S3Backend("S3 (moto)", endpoint.url, endpoint.new_bucket())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="moto figures are for the ratio only (an in-memory Python server).")
    ap.add_argument("--quick", action="store_true", help="2 x 4 records, 4 MiB packs, 1 round, 5 samples")
    ap.add_argument("--requests", type=int, default=8, help="requests (default 8)")
    ap.add_argument("--layers", type=int, default=16, help="layers per request (default 16)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per record (default 512)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    ap.add_argument("--pack-mib", type=int, default=64, help="pack size the writer seals at, MiB (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each figure is its best (default 3)")
    ap.add_argument("--sample", type=int, default=20, help="records timed one at a time (default 20)")
    ap.add_argument("--dir", default=None, help="where local packs go (default: a temp dir under /tmp)")
    ap.add_argument("--s3-endpoint", help="an S3 endpoint URL to use instead of starting moto")
    ap.add_argument("--s3-bucket", default="dmi-bench", help="existing bucket (with --s3-endpoint)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.layers, args.pack_mib, args.rounds, args.sample = 2, 4, 4, 1, 5
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = Workload(args.requests, args.layers, args.tokens, args.hidden, args.pack_mib * MIB)
    load_before = os.getloadavg()
    with ExitStack() as stack:
        base = tempfile.mkdtemp(prefix="dmi-bench-packs-", dir=args.dir)
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        s3 = s3_backend(args, stack)
        backends = [LocalBackend(base), s3]
        print(f"# Packs on S3 vs local disk\n\nMachine: {platform.machine()}, {os.cpu_count()} CPUs, {versions()}, "
              f"torch threads {torch.get_num_threads()}; local packs under {base}; S3: {s3.name} {s3.endpoint}; "
              f"load average before {' '.join(f'{x:.2f}' for x in load_before)}\n", flush=True)
        data = activations(workload.requests, workload.layers, workload.tokens, workload.hidden, torch.bfloat16)
        raw_bytes = sum(t.numel() * t.element_size() for t in data.values())
        rng = random.Random(1)
        sample = [rng.choice(list(data)) for _ in range(args.sample)]
        first = dict(list(data.items())[:2])
        for backend in backends:  # imports, clients and first calls paid here, untimed
            measure(backend, f"warm-up-{backend.name.split()[0].lower()}", first, workload, list(first))
        measured, results = [], {}
        for round_no in range(args.rounds):
            measured.append(limits(base, data, raw_bytes) | s3_limits(s3, workload.pack_bytes))
            for backend in backends:
                label = f"round{round_no}-{backend.name.split()[0].lower()}"
                results[backend.name] = best_of(results.get(backend.name),
                                                measure(backend, label, data, workload, sample))
                print(f"  done: {backend.name} (round {round_no + 1})", file=sys.stderr, flush=True)
        measured.append(limits(base, data, raw_bytes) | s3_limits(s3, workload.pack_bytes))
        lim = functools.reduce(best_of, measured)
        text = (f"{workload.describe(raw_bytes)}; best of {args.rounds} interleaved rounds, one-record latency over "
                f"{args.sample} records (warm: each 3 times); load average after "
                f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(report(text, results, lim), flush=True)


if __name__ == "__main__":
    main()
