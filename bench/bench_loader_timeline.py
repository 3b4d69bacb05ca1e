"""Where a cold shuffled epoch's time goes: start-up, window reads, and the tail after them.

One selection of raw-codec packs (as ``bench_loader.py`` writes it: ``--requests`` requests x
``--tokens`` tokens x d ``--hidden``, bf16), read cold by the shuffled loader (``direct_io``
as chosen) ``--rounds`` times. Each window's read (``WindowReader.read``, timed from outside:
the loader is not changed) is logged with its start and end, and each epoch is split into

* **start-up**: from the iterator's creation until the first window read starts (catalog
  query, plan, threads);
* **reads**: from the first window read's start to the last one's end, with the bytes read
  in between (2 windows are read at once by default, so this is the loader's read rate);
* **tail**: from the last window read's end until the last batch was delivered (the last
  window's batches gathered and handed out).

Beside each epoch, the packs are read twice with no verifying, decoding or copying, once
before and once after it: ``O_DIRECT`` in record-sized pieces in a seeded random order over
``--read-threads`` threads (``bench_loader.shuffled_read_limit``), and the loader's own range
reads of an epoch replayed as it issues them (``bench_loader.replayed_read_limit``), into one
buffer per thread and, as the loader places them, into ``--prefetch`` + 2 window regions. The
epoch's read rate is set against the faster of each pair: a ratio near 1 to the replayed
reads says the disk, not the loader's own work, held the epoch.

    python bench/bench_loader_timeline.py                 # 2 GB, direct I/O, 3 rounds
    python bench/bench_loader_timeline.py --cached        # through the page cache
    python bench/bench_loader_timeline.py --one-loader    # successive epochs of one loader
    python bench/bench_loader_timeline.py --rev REV       # and REV's loader, epoch for epoch beside it
    python bench/bench_loader_timeline.py --quick

Each epoch also reports the process's CPU seconds and minor page faults (memory mapped
afresh): a new loader's first epoch maps its read regions and batches; a loader's later
epochs read into the memory of the one before.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_loader  # noqa: E402

from dmi import _loader_read  # noqa: E402


class WindowLog:
    """Records (start, end) of every ``reader.read`` (a ``WindowReader`` class) while installed."""

    def __init__(self, reader: type) -> None:
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._reader = reader
        self._original = reader.read

    def __enter__(self) -> WindowLog:
        original, log = self._original, self

        def read(reader, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(reader, *args, **kwargs)
            finally:
                with log._lock:
                    log.spans.append((start, time.perf_counter()))

        self._reader.read = read
        return self

    def __exit__(self, *exc) -> None:
        self._reader.read = self._original


@dataclass(frozen=True, slots=True)
class Contender:
    """A loader under test: its rows' mark, its ``open_loader`` (``None``: today's) and the
    ``WindowReader`` class its windows are read by."""

    mark: str
    opener: Callable | None
    reader: type


def contenders(rev: str | None) -> list[Contender]:
    """Today's loader, and ``rev``'s beside it when given (``bench_loader.loader_at``)."""
    today = [Contender("", None, _loader_read.WindowReader)]
    if rev is None:
        return today
    opener = bench_loader.loader_at(rev)
    return today + [Contender(f" @{rev}", opener, sys.modules[f"dmi._loader_read_at_{rev}"].WindowReader)]


def epoch(store, args, direct: bool, contender: Contender, loader=None) -> dict:
    """One cold shuffled epoch (of ``loader``'s next epoch, else of a new loader of
    ``contender``): its total, start-up, read span and tail, seconds; the process's CPU seconds
    and minor page faults."""
    bench_loader.drop_cache(args.home)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with WindowLog(contender.reader) as log:
        start = time.perf_counter()
        if loader is None:
            _, batches = bench_loader.dmi_batches(store, args, torch.bfloat16, True, direct_io=direct,
                                                  opener=contender.opener)
        else:
            batches = iter(loader)
        rows = 0
        for x in batches:
            rows += x.shape[0]
        end = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_SELF)
    if rows != args.requests * args.tokens:
        raise SystemExit(f"the loader delivered {rows} rows, not {args.requests * args.tokens}")
    first_read = min(s for s, _ in log.spans)
    last_read = max(e for _, e in log.spans)
    return {"total": end - start, "startup": first_read - start, "reads": last_read - first_read,
            "tail": end - last_read, "windows": len(log.spans),
            "cpu": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime,
            "faults": after.ru_minflt - usage.ru_minflt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 requests x 128 tokens x d 256")
    parser.add_argument("--requests", type=int, default=954)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--shuffle-buffer", type=int, default=65536)
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cached", action="store_true", help="read through the page cache, not O_DIRECT")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--one-loader", action="store_true",
                        help="the rounds are successive epochs of one loader, not each a new loader's first")
    parser.add_argument("--rev", default=None, help="also run the loader of this git revision, an epoch of it "
                        "after each of today's (its rows marked @REV)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.tokens, args.hidden, args.batch, args.shuffle_buffer, args.rounds = 64, 128, 256, 512, 2048, 1
    work = tempfile.mkdtemp(prefix="dmi-bench-timeline-", dir=args.dir)
    args.home = os.path.join(work, "dmi")
    try:
        store = bench_loader.write_dmi(args.home, args, torch.bfloat16)
        packs = os.path.join(args.home, "packs")
        piece = args.tokens * args.hidden * 2
        nbytes = args.requests * args.tokens * args.hidden * 2
        print(f"# bench_loader_timeline: {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"load average {os.getloadavg()[0]:.2f} at the start")
        print(f"\n{args.requests} requests x {args.tokens} tokens x d {args.hidden}, bf16, {nbytes / 1e9:.2f} GB of "
              f"raw-codec packs; batch {args.batch}, shuffle buffer {args.shuffle_buffer} rows, {args.read_threads} "
              f"read threads, {args.prefetch} windows read ahead; {'page cache' if args.cached else 'direct I/O'}, "
              f"cold; {args.rounds} round(s), "
              f"{'successive epochs of one loader' if args.one_loader else 'each the first epoch of a new loader'}\n")
        print("| round | epoch s | GB/s | start-up s | reads s | read GB/s | tail s | windows | CPU s | minor faults "
              "(thousands) | shuffled-read limit GB/s (before, after) | read rate / limit | replayed reads GB/s "
              "(before, after) | read rate / replayed | replayed into windows GB/s (before, after) | read rate / "
              "replayed into windows |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        tasks = bench_loader.loader_reads(store, args, torch.bfloat16)
        runners = contenders(args.rev)
        loaders = [bench_loader.dmi_batches(store, args, torch.bfloat16, True, direct_io=not args.cached,
                                            opener=c.opener)[0] if args.one_loader else None for c in runners]
        ratios = {c.mark: [[], [], []] for c in runners}

        def disk_rates() -> tuple[float, float, float]:
            shuffled = bench_loader.shuffled_read_limit(packs, piece, args.read_threads)[1]
            replays = [bench_loader.replayed_read_limit(packs, tasks, args.read_threads, regions=n)[1]
                       for n in (0, args.prefetch + 2)]
            return tuple(nbytes / seconds for seconds in (shuffled, *replays))

        after = disk_rates()
        for r in range(args.rounds):
            for contender, loader in zip(runners, loaders):
                before = after
                e = epoch(store, args, direct=not args.cached, contender=contender, loader=loader)
                after = disk_rates()
                read_rate = nbytes / e["reads"]
                beside = ""
                for k, ratio in enumerate(ratios[contender.mark]):
                    ratio.append(read_rate / max(before[k], after[k]))
                    beside += f" {before[k] / 1e9:.2f}, {after[k] / 1e9:.2f} | {ratio[-1]:.2f} |"
                print(f"| {r}{contender.mark} | {e['total']:.2f} | {nbytes / e['total'] / 1e9:.2f} | {e['startup']:.2f} | "
                      f"{e['reads']:.2f} | {read_rate / 1e9:.2f} | {e['tail']:.2f} | {e['windows']} | {e['cpu']:.2f} | "
                      f"{e['faults'] / 1e3:.0f} |" + beside)
        print()
        for mark, loader_ratios in ratios.items():
            medians = [statistics.median(ratio) for ratio in loader_ratios]
            print(f"median{mark} read rate / shuffled-read limit: {medians[0]:.2f}; / replayed reads: {medians[1]:.2f}; "
                  f"/ replayed into windows: {medians[2]:.2f}")
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
