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

With ``--rev REV`` a third column times the C loops as git revision ``REV`` had them:
``native/dmi_native.c`` at ``REV``, compiled here as setuptools compiles the extension (Python's
``CFLAGS`` and ``REV``'s ``setup.py`` flags), swapped in for today's extension in the same rounds (a change to
the C measured against what it replaced, on the same CPU minute), and the split codec's encoder
and decoder as ``storage/_codecs.py`` had them at ``REV`` (a change to how a payload is built).

    python bench/bench_native.py
    python bench/bench_native.py --dtypes bf16 --layers 4      # seconds
    python bench/bench_native.py --rev HEAD~1                  # today's C beside HEAD~1's
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _at_revision import ROOT, module_at, source_at  # noqa: E402
from bench_storage import activations  # noqa: E402

from dmi.storage import _codecs, _native, _writer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _extra_compile_args(rev: str) -> list[str]:
    """The ``extra_compile_args`` of ``rev``'s ``setup.py``."""
    found = re.search(r"extra_compile_args=(\[[^\]]*\])", source_at(rev, "setup.py"))
    return ast.literal_eval(found.group(1)) if found else []


def native_at(rev: str):
    """The extension built from ``native/dmi_native.c`` as it was at git revision ``rev``, with the
    flags setuptools gives an extension here (Python's ``CFLAGS``) and ``rev``'s ``setup.py`` adds."""
    build = Path(tempfile.mkdtemp(prefix="dmi-native-at-"))
    (build / "dmi_native.c").write_text(source_at(rev, "native/dmi_native.c"))
    library = build / f"_native_ext{sysconfig.get_config_var('EXT_SUFFIX')}"
    flags = " ".join(sysconfig.get_config_var(name) or "" for name in ("LDSHARED", "CFLAGS", "CCSHARED")).split()
    subprocess.run([*flags, *_extra_compile_args(rev), f"-I{sysconfig.get_paths()['include']}",
                    str(build / "dmi_native.c"), "-o", str(library)], check=True)
    spec = importlib.util.spec_from_file_location(f"dmi_native_at_{rev}._native_ext", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def split_codec_at(rev: str) -> tuple:
    """(encoder, decoder) of the split codec as ``storage/_codecs.py`` had them at ``rev``."""
    module = module_at(rev, "storage/_codecs.py", f"dmi_codecs_at_{rev}", {})
    return module._encode_split, module._decode_split


def measure(records: list[torch.Tensor], rounds: int, at_rev=None, codec_at_rev=None) -> tuple[dict, dict]:
    """({piece: {"native": s, "numpy": s[, "rev": s]}}, {limit: s}), best round of each; "rev":
    the C loops of ``at_rev`` (an extension module from :func:`native_at`) and the split codec
    ``codec_at_rev`` (from :func:`split_codec_at`)."""
    work, lim = pieces(records), limits(records)
    today = _native._native_ext
    codec_today = _codecs._encode_split, _codecs._decode_split
    codecs = {"native": codec_today, "numpy": codec_today, "rev": codec_at_rev}
    modes = [("native", True, today), ("numpy", False, today)] + ([("rev", True, at_rev)] if at_rev else [])
    best: dict = {name: {mode: float("inf") for mode, _, _ in modes} for name in work}
    best_lim = {name: float("inf") for name in lim}
    try:
        for round_ in range(rounds):
            for name, fn in lim.items():
                best_lim[name] = min(best_lim[name], timed(fn))
            for name, fn in work.items():
                turn = round_ % len(modes)  # each mode first in turn: no mode always after the same one
                for mode, active, extension in modes[turn:] + modes[:turn]:
                    _native.ACTIVE, _native._native_ext = active, extension
                    _codecs._encode_split, _codecs._decode_split = codecs[mode]
                    best[name][mode] = min(best[name][mode], timed(fn))
    finally:
        _native.ACTIVE, _native._native_ext = _native.BUILT, today
        _codecs._encode_split, _codecs._decode_split = codec_today
    return best, best_lim


def report(dtype_name: str, raw_bytes: int, best: dict, best_lim: dict, rev: str | None = None) -> str:
    gbs = lambda seconds: raw_bytes / seconds / 1e9  # noqa: E731
    extra = f" native at {rev} GB/s | native / at {rev} |" if rev else ""
    lines = [
        f"### {dtype_name}: {raw_bytes / 2**20:.0f} MiB of records",
        "",
        "| piece | numpy GB/s | native GB/s | native / numpy |" + extra,
        "|---|---:|---:|---:|" + ("---:|---:|" if rev else ""),
    ]
    for name, t in best.items():
        row = f"| {name} | {gbs(t['numpy']):.2f} | {gbs(t['native']):.2f} | {t['numpy'] / t['native']:.2f}x |"
        if rev:
            row += f" {gbs(t['rev']):.2f} | {t['rev'] / t['native']:.2f}x |"
        lines.append(row)
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
    ap.add_argument("--rev", default=None, help="also time the C loops and the split codec as this git revision had them")
    args = ap.parse_args(argv)
    if not _native.BUILT:
        print("the native extension is not built here (pip install -e . with a C compiler)", file=sys.stderr)
        return 2
    print(
        f"conditions: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, "
        f"Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
        f"zstandard {zstandard.__version__}; {args.requests} x {args.layers} records of {args.tokens} x {args.hidden}; "
        f"best of {args.rounds} interleaved rounds; one thread"
        + (f"; native at {args.rev}: {_revision(args.rev)}" if args.rev else "")
    )
    at_rev = native_at(args.rev) if args.rev else None
    codec_at_rev = split_codec_at(args.rev) if args.rev else None
    for name in args.dtypes.split(","):
        data = activations(args.requests, args.layers, args.tokens, args.hidden, DTYPES[name])
        records = list(data.values())
        best, best_lim = measure(records, args.rounds, at_rev, codec_at_rev)
        print()
        print(report(name, sum(t.nbytes for t in records), best, best_lim, args.rev))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


def _revision(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
