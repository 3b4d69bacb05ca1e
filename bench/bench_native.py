"""The C loops of ``native/`` against the numpy loops they replace, piece by piece, one run.

Workload: ``bench_storage.activations`` (heavy-tailed activations with outlier channels),
``--requests`` x ``--layers`` records of ``--tokens`` x ``--hidden``, in bf16 and fp32. Each piece
runs over every record, with the C loops and with numpy's (``dmi.storage._native.ACTIVE``
switched in this process, which is what ``DMI_NATIVE=0`` does), in ``--rounds`` interleaved
rounds; each figure is its best round, in GB/s of the records' raw bytes:

* ``split planes``      the byte planes the default codec compresses
* ``join planes``       their inverse, on every read of a split-zstd record
* ``statistics``        a record's L2 norm / mean / absmax (one pass in C; numpy widens to float64)
* ``encode``            what the drain does per record: statistics + split-zstd + xxh3
* ``decode``            what a read does per record: split-zstd decode
* ``quantise fp8/int8`` a lossy codec's scales, codes and error per record (the "numpy" column is
                        torch's operations, the fallback, which use torch's intra-op threads)

Limits on the same bytes, same run: memcpy into an existing buffer and zstd-1 compress, both on
one thread; and, for scale, the capture hook's gather of a step's rows into a ring slot
(``torch.index_select(out=)``, every row: the one copy the hot path makes, left to torch). Prints conditions and a markdown table.

    python bench/bench_native.py
    python bench/bench_native.py --dtypes bf16 --layers 4      # seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_storage import activations  # noqa: E402

from dmi.storage import _codecs, _native, _writer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def pieces(records: list[torch.Tensor]) -> dict:
    """{name: fn()} over every record; each fn is timed as a whole."""
    raws = [t.contiguous().view(torch.uint8).numpy().reshape(-1) for t in records]
    itemsize = records[0].element_size()
    width = min(itemsize, 8)
    planes = [[p.copy() for p in _native.split_planes(raw, width)] for raw in raws]
    stored = [bytes(_codecs.encode("split-zstd", raw, itemsize)) for raw in raws]
    outs = [np.empty_like(raw) for raw in raws]

    def split():
        for raw in raws:
            _native.split_planes(raw, width)

    def join():
        for p, out in zip(planes, outs):
            _native.join_planes(p, out)

    def stats():
        for t in records:
            _writer._stats(t)

    def encode():
        for t, raw in zip(records, raws):
            _writer._stats(t)
            _codecs.checksum(_codecs.encode("split-zstd", raw, itemsize))

    def decode():
        for s, out in zip(stored, outs):
            _codecs.decode("split-zstd", s, out, itemsize)

    def quantiser(fp8: bool):
        def quantise():
            for t in records:
                _native.quantise(t.reshape(-1, t.shape[-1]), fp8=fp8)

        return quantise

    return {
        "split planes": split,
        "join planes": join,
        "statistics": stats,
        "encode": encode,
        "decode": decode,
        "quantise fp8": quantiser(True),
        "quantise int8": quantiser(False),
    }


def limits(records: list[torch.Tensor]) -> dict:
    raws = [t.contiguous().view(torch.uint8).numpy().reshape(-1) for t in records]
    outs = [np.empty_like(raw) for raw in raws]
    slots = [torch.empty_like(t) for t in records]
    rows = torch.arange(records[0].shape[0])
    compressor = zstandard.ZstdCompressor(level=1)

    def memcpy():
        for raw, out in zip(raws, outs):
            np.copyto(out, raw)

    def gather():  # the capture hook's copy of a step's planned rows into its ring slot
        for t, slot in zip(records, slots):
            torch.index_select(t, 0, rows, out=slot)

    def zstd1():
        for raw in raws:
            compressor.compress(raw)

    return {"memcpy": memcpy, "hook gather (index_select out=)": gather, "zstd-1 compress": zstd1}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(records: list[torch.Tensor], rounds: int) -> tuple[dict, dict]:
    """({piece: {"native": s, "numpy": s}}, {limit: s}), best round of each."""
    work, lim = pieces(records), limits(records)
    best: dict = {name: {"native": float("inf"), "numpy": float("inf")} for name in work}
    best_lim = {name: float("inf") for name in lim}
    for _ in range(rounds):
        for name, fn in lim.items():
            best_lim[name] = min(best_lim[name], timed(fn))
        for name, fn in work.items():
            for mode, active in (("native", True), ("numpy", False)):
                _native.ACTIVE = active
                best[name][mode] = min(best[name][mode], timed(fn))
    _native.ACTIVE = _native.BUILT
    return best, best_lim


def report(dtype_name: str, raw_bytes: int, best: dict, best_lim: dict) -> str:
    gbs = lambda seconds: raw_bytes / seconds / 1e9  # noqa: E731
    lines = [
        f"### {dtype_name}: {raw_bytes / 2**20:.0f} MiB of records",
        "",
        "| piece | numpy GB/s | native GB/s | native / numpy |",
        "|---|---:|---:|---:|",
    ]
    for name, t in best.items():
        lines.append(f"| {name} | {gbs(t['numpy']):.2f} | {gbs(t['native']):.2f} | {t['numpy'] / t['native']:.2f}x |")
    lines.append("")
    lines.append("Limits, same bytes, one thread: " + "; ".join(f"{n} {gbs(s):.2f} GB/s" for n, s in best_lim.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not _native.BUILT:
        print("the native extension is not built here (pip install -e . with a C compiler)", file=sys.stderr)
        return 2
    print(
        f"conditions: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, "
        f"Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
        f"zstandard {zstandard.__version__}; {args.requests} x {args.layers} records of {args.tokens} x {args.hidden}; "
        f"best of {args.rounds} interleaved rounds; one thread"
    )
    for name in args.dtypes.split(","):
        data = activations(args.requests, args.layers, args.tokens, args.hidden, DTYPES[name])
        records = list(data.values())
        best, best_lim = measure(records, args.rounds)
        print()
        print(report(name, sum(t.nbytes for t in records), best, best_lim))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
