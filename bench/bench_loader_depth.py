"""Reads in flight: the disk's shuffled-read rate and the loader's cold epoch at several read-thread counts.

The shuffled loader reads each window's records with one coalesced range read per pack
neighbourhood on ``read_threads`` threads, so its reads in flight are at most that many. This
bench asks how the disk answers more of them: for each count, interleaved round by round, a
cold shuffled read of record-sized ``O_DIRECT`` pieces (``bench_loader.shuffled_read_limit``,
nothing decoded) and a cold epoch of the shuffled loader (direct I/O, the default), each set
against the better of a cached and a direct sequential read of the same packs taken just
before and just after it (the disk's rate drifts within minutes on a VM).

    python bench/bench_loader_depth.py --threads 2,4,8,16 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_loader import (  # noqa: E402
    DTYPES,
    consume,
    dmi_batches,
    drop_cache,
    files_under,
    sequential_now,
    shuffled_read_limit,
    write_dmi,
)


def measure(args, store, packs_root: str, piece: int, dtype: torch.dtype, threads: int, limits: dict) -> dict:
    """One round at ``threads``: the disk's and the loader's cold rates, each over the sequential rate beside it."""
    nbytes = sum(os.path.getsize(path) for path in files_under(packs_root))
    before = sequential_now(packs_root, limits)
    total, seconds = shuffled_read_limit(packs_root, piece, threads)
    disk = total / seconds
    between = sequential_now(packs_root, limits)
    run = argparse.Namespace(**{**vars(args), "read_threads": threads})
    drop_cache(packs_root)
    rows, loader_s, cpu, _ = consume(dmi_batches(store, run, dtype, True)[1])
    if rows != args.requests * args.tokens:
        raise SystemExit(f"the loader delivered {rows} rows, not {args.requests * args.tokens}")
    after = sequential_now(packs_root, limits)
    delivered = rows * args.hidden * dtype.itemsize / loader_s
    return {"disk": disk, "disk x": disk / max(before, between), "loader": delivered,
            "loader x": delivered / max(between, after), "cpu": cpu, "packs GB": nbytes / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2,4,8,16", help="comma-separated read-thread counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per request (one record)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--shuffle-buffer", type=int, default=65536)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    args.requests = max(1, round(args.gb * 1e9 / (args.tokens * args.hidden * dtype.itemsize)))
    counts = [int(t) for t in args.threads.split(",")]
    work = tempfile.mkdtemp(prefix="dmi-bench-depth-", dir=args.dir)
    print(f"# bench_loader_depth: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, torch "
          f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}, work dir {work}")
    print(f"conditions: {args.requests} requests x {args.tokens} tokens, d = {args.hidden}, {args.dtype}, batch "
          f"{args.batch}, shuffle buffer {args.shuffle_buffer} rows, {args.prefetch} windows ahead, raw-codec packs, "
          f"{args.rounds} rounds interleaved, medians (min-max of the ratios)")
    try:
        store = write_dmi(os.path.join(work, "dmi"), args, dtype)
        packs_root = os.path.join(work, "dmi", "packs")
        piece = args.tokens * args.hidden * dtype.itemsize
        limits: dict = {}
        results: dict[int, list[dict]] = {t: [] for t in counts}
        for _ in range(args.rounds):
            for threads in counts:
                results[threads].append(measure(args, store, packs_root, piece, dtype, threads, limits))
        store.close()
        packs_gb = results[counts[0]][0]["packs GB"]
        print(f"\n{packs_gb:.2f} GB of packs, {len(files_under(packs_root))} files\n")
        print("| read threads | disk shuffled GB/s | x sequential beside | loader cold GB/s | x sequential beside "
              "| loader CPU s |")
        print("|---:|---:|---:|---:|---:|---:|")
        for threads, rounds in results.items():
            def med(key: str) -> float:
                return statistics.median(r[key] for r in rounds)

            def spread(key: str) -> str:
                values = [r[key] for r in rounds]
                return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

            print(f"| {threads} | {med('disk') / 1e9:.2f} | {spread('disk x')} | {med('loader') / 1e9:.2f} | "
                  f"{spread('loader x')} | {med('cpu'):.2f} |")
        print(f"\nbest sequential read of the run: cached {packs_gb / limits[False]:.2f} GB/s, "
              f"O_DIRECT {packs_gb / limits[True]:.2f} GB/s; load average {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
