"""The pack writer's own cost on a real model's records: CPU, page faults and wall time of a
durable write, configuration against configuration, many interleaved rounds.

``bench_storage.py`` compares DMI with what users do today, but each of its figures is one
best-of-3 among eight methods, and this VM's CPU and disk swing by ±20 % between runs — more
than a change to the writer's own work moves them. This bench runs only pack writers (and
safetensors, the fastest peer, for scale) on the same records, ``--rounds`` times in a random
order per round (seeded), and reports the median and the spread of each figure.

Workload: SmolLM2-135M-Instruct's activations as ``bench_storage.py --real smollm2`` captures
them (every hook but ``attn_pattern``, 8 requests x (112 prompt + 16 new tokens), bf16: 2,424
records of 48 KB–1.5 MB, 378 MB), captured before any clock starts; or with ``--synthetic``,
``bench_storage.activations`` (8 x 24 records of 512 x 2048, 2 MiB each in bf16).

Configurations (``--configs``, comma-separated):

* ``raw`` / ``split-zstd`` / ``fp8`` / ``int8``  ``PackWriter`` with that codec and its default batching
* ``raw batch=N`` ...             the same with ``batch_bytes=N`` MiB (records below it share
                                  record batches of at most that size; the default is 2)
* ``raw @REV`` ...                the writer as it was at git revision ``REV``
                                  (``storage/_writer.py`` and ``storage/_codecs.py`` loaded from
                                  ``git show`` into this process; everything else is today's code)
* ``raw buffered`` ...            the same writer into a store that writes through the page
                                  cache (``LocalPackStore(direct_writes=False)``) instead of
                                  around it
* ``raw unbuffered`` ...          direct writes without Arrow's buffer in front of the file
                                  (every piece of a record batch a Python ``write``, as
                                  before commit c11ee65)
* ``safetensors``                 one ``save_file`` per request, fsync'd (the peer's row of
                                  ``bench_storage.py``)

Each write goes to a fresh directory on ``--dir``'s disk and ends durable (DMI: sealed, that is
fsync'd and renamed; safetensors: fsync'd). Figures per configuration: process CPU seconds
(user + system, every thread), minor page faults (``getrusage``: memory touched for the first
time — this VM is slow at that, ``bench_page_cache.py``), and wall seconds.

With ``--breakdown CODEC`` it then writes ``--rounds`` more times with today's writer and
that codec, timing each piece of the writer (wall time around each call — the writer works on
one thread — so the pieces hold the timers' own cost, about a microsecond a call): statistics,
checksum, codec, the copy into a gathered batch, a record batch's columns built, a record
batch written (columns included), the seal.

    python bench/bench_pack_writer.py --rounds 15 --breakdown raw
    python bench/bench_pack_writer.py --configs "raw @3883440,raw,split-zstd @3883440,split-zstd,safetensors"
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _at_revision import module_at  # noqa: E402
from bench_storage import Safetensors, activations, key_of, real_activations  # noqa: E402

from dmi.storage import LocalPackStore  # noqa: E402
from dmi.storage import _writer  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent
_MIB = 1 << 20


def writer_at(rev: str):
    """``PackWriter`` of git revision ``rev``, loaded in this process: its ``storage/_writer.py``
    over its ``storage/_codecs.py`` (the rest of DMI as checked out)."""
    codecs = _module_at(rev, "_codecs", {})
    writer = _module_at(rev, "_writer", {"from dmi.storage._codecs import": f"from {codecs.__name__} import"})
    return writer.PackWriter


def _module_at(rev: str, stem: str, imports: dict[str, str]):
    """``storage/<stem>.py`` at ``rev`` as a module of its own, its ``imports`` lines renamed."""
    return module_at(rev, f"storage/{stem}.py", f"dmi.storage.{stem}_at_{rev}", imports)


def make_config(spec: str):
    """(name, write(root, data)) for one ``--configs`` entry."""
    if spec == "safetensors":
        return spec, Safetensors().write
    codec, *options = spec.split()
    cls, kwargs, direct_writes, arrow_buffer = _writer.PackWriter, {}, True, True
    for option in options:
        if option == "buffered":
            direct_writes = False
        elif option == "unbuffered":
            arrow_buffer = False
        elif option.startswith("@"):
            cls = writer_at(option[1:])
        elif option.startswith("batch="):
            kwargs["batch_bytes"] = int(float(option[len("batch="):]) * _MIB)
        else:
            raise SystemExit(f"unknown option {option!r} in {spec!r}")

    def write(root, data):
        with without_arrow_buffer(not arrow_buffer):
            with cls(LocalPackStore(root, direct_writes=direct_writes), codec=codec, **kwargs) as w:
                for (r, i), t in data.items():
                    w.append(key_of(r, i, t.shape[0]), t)

    return spec, write


@contextlib.contextmanager
def without_arrow_buffer(active: bool):
    """While ``active``: local packs opened for direct writes without Arrow's buffer in front."""
    if not active:
        yield
        return
    from dmi.storage import _store

    real = _store.open_direct

    def unbuffered(path):
        stream = real(path)
        return None if stream is None else stream.detach()

    _store.open_direct = unbuffered
    try:
        yield
    finally:
        _store.open_direct = real


def measure(write, root, data) -> tuple[float, int, float]:
    """(CPU seconds, minor page faults, wall seconds) of one durable write into ``root``."""
    os.makedirs(root)
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    write(root, data)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    shutil.rmtree(root)
    return cpu, after.ru_minflt - before.ru_minflt, wall


_PIECES = (  # (label, owner in _writer, attribute): today's writer, timed piece by piece
    ("statistics", "module", "_stats"),
    ("checksum", "module", "checksum"),
    ("codec", "module", "encode"),
    ("copy into the gathered batch", "pack", "_gather"),
    ("record batch: columns built", "module", "_record_batch"),
    ("record batch: written (incl. columns built)", "pack", "_write"),
    ("seal: index, fsync, rename", "pack", "seal"),
)


def breakdown(codec: str, root: str, data, rounds: int) -> dict[str, list[float]]:
    """Seconds of each piece of today's writer per write (wall time around each call, one
    thread), and of the whole write, over ``rounds`` writes."""
    owners = {"module": _writer, "pack": _writer._OpenPack}
    spent: dict[str, float] = {}
    originals = [(owners[owner], attribute, getattr(owners[owner], attribute)) for _, owner, attribute in _PIECES]

    def timed(label, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        return call

    per_write: dict[str, list[float]] = {label: [] for label, _, _ in _PIECES}
    per_write["whole write"] = []
    _, write = make_config(codec)
    try:
        for (label, _, _), (owner, attribute, fn) in zip(_PIECES, originals):
            setattr(owner, attribute, timed(label, fn))
        for _ in range(rounds):
            spent.clear()
            _, _, wall = measure(write, root, data)
            for label in per_write:
                per_write[label].append(wall if label == "whole write" else spent.get(label, 0.0))
    finally:
        for owner, attribute, fn in originals:
            setattr(owner, attribute, fn)
    return per_write


def spread(values) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="raw,raw batch=4,split-zstd,split-zstd batch=4,safetensors")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--synthetic", action="store_true", help="bench_storage's synthetic records instead of SmolLM2's")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp, as bench_storage.py)")
    ap.add_argument("--breakdown", default=None, metavar="CODEC",
                    help="then time each piece of today's writer with CODEC over --rounds more writes")
    args = ap.parse_args(argv)

    if args.synthetic:
        data = activations(8, 24, 512, 2048, torch.bfloat16)
        workload = "synthetic: 8 requests x 24 layers x 512 x 2048 bf16"
    else:
        data, _ = real_activations("smollm2", torch.bfloat16, 8, 112, 16)
        workload = "SmolLM2-135M-Instruct, every hook but attn_pattern, 8 requests x (112 prompt + 16 new tokens), bf16"
    raw = sum(t.nbytes for t in data.values())
    configs = dict(make_config(spec.strip()) for spec in args.configs.split(","))
    base = tempfile.mkdtemp(prefix="dmi-bench-writer-", dir=args.dir)
    load = os.getloadavg()[0]
    results = {name: [] for name in configs}
    order = random.Random(0)
    pieces = None
    try:
        for _ in range(args.rounds):
            names = list(configs)
            order.shuffle(names)
            for name in names:
                results[name].append(measure(configs[name], os.path.join(base, "out"), data))
        if args.breakdown:
            pieces = breakdown(args.breakdown, os.path.join(base, "out"), data, args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}, "
          f"torch {torch.__version__}; files under {base}; load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(f"Workload: {workload}: {len(data)} records, {raw / 1e6:.0f} MB; {args.rounds} rounds, "
          "configurations in a random order each round; median (min–max)\n")
    print("| configuration | CPU s | minor page faults (thousands) | wall s | durable write GB/s (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        cpu, faults, wall = zip(*runs)
        print(f"| {name} | {spread(cpu)} | {spread([f / 1e3 for f in faults])} | {spread(wall)} | "
              f"{raw / statistics.median(wall) / 1e9:.2f} |")

    if pieces is not None:
        print(f"\nToday's writer, {args.breakdown}, piece by piece ({args.rounds} more writes; wall seconds "
              "around each call, one thread; median (min–max)):\n")
        print("| piece | seconds a write |")
        print("|---|---:|")
        for label, values in pieces.items():
            print(f"| {label} | {spread(values)} |")


if __name__ == "__main__":
    main()
