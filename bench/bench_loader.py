"""Loader benchmark: activations delivered to a training loop, DMI vs what SAE trainers use today.

Workload (issue 14): ``--requests`` requests of ``--tokens`` tokens of one hook/layer at hidden
size ``--hidden`` (default 2048), stored as ``--gb`` GB (default 2) of bf16 or fp32 activations.
Every method delivers every token row once, in batches of ``--batch`` rows, in the dtype of
the run, to a loop that touches each batch (a sum, so nothing is lazily skipped):

* ``dmi shuffled``: ``store.loader(...)`` over raw-codec packs with its defaults — global unit
  permutation plus a ``--shuffle-buffer``-row window shuffle, read in the training loop's
  process on the loader's own threads (``num_workers=0``), around the page cache
  (``O_DIRECT``; the default since stop 41)
* ``dmi shuffled in worker processes``: the same loader with ``num_workers=--workers``: DataLoader
  worker processes, each with its own read threads, every batch sent between processes
* ``dmi shuffled through the page cache``: ``dmi shuffled`` with ``direct_io=False`` (until
  stop 41 the default for a selection under half the machine's memory; docs/loader.md,
  "Direct I/O")
* ``dmi sequential``: ``dmi shuffled`` with ``shuffle=False``
* ``dmi shuffled @REV`` / ``dmi shuffled through the page cache @REV`` (with ``--rev REV``): those two rows
  with the loader as it was at git revision ``REV`` (its ``dmi/_loader.py``, ``_loader_read.py``
  and ``_loader_memory.py`` loaded with ``git show`` into this process; the rest is today's code)
* ``datasets + mixing buffer`` (SAELens-style): a Hugging Face ``datasets`` folder (Arrow,
  memory-mapped) read in order, ``--mixing-buffer`` rows at a time, each chunk shuffled into
  a buffer whose first half is emitted (as SAELens' mixing buffer does). Arrow has no
  bfloat16, so this cache holds float32 (as SAELens caches do) and converts
* ``safetensors chunks``: files of ``--chunk`` token rows in capture order (Activault-style
  megabatches), files in random order, rows shuffled inside each file, ``--workers``
  DataLoader workers
* ``cold-read limit``: the pack files read sequentially into one buffer, page cache dropped,
  through the page cache and (row ``cold-read limit, O_DIRECT``) around it, each twice before
  the first round and once more just before and just after every cold run; the ``x cold-read
  limit`` column is to the best of all these reads
* ``shuffled-read limit``: the packs read ``O_DIRECT`` in record-sized pieces, the pieces in a
  seeded random order over ``--read-threads`` threads (no decoding, no copying), with every
  cold-read limit measurement: what the disk gives a shuffled access pattern. The
  ratio columns stay to the sequential reads
* ``dmi shuffled's reads replayed``: the range reads of ``dmi shuffled``'s epoch exactly as its
  loader plans them (window by window, one task per pack of a window, coalesced ranges widened
  to whole blocks), read ``O_DIRECT`` over ``--read-threads`` threads into memory mapped
  beforehand, nothing verified, decoded or gathered, with every cold-read limit measurement:
  a loader near this rate is held by the disk, not by its own work. Row ``the same into N
  window regions``: each window's reads land one after another in a region of its own, as
  the loader's do (``N = --prefetch + 2`` regions taken in turn), instead of each thread
  reading into one buffer again and again
* ``x limit beside it``: each cold run's rate over the disk's rate at that moment — the faster
  of the cached and ``O_DIRECT`` reads just before it and just after it — median (and range)
  over the rounds. This VM's disk gave the same sequential read at 0.6 to 3.1 GB/s within
  minutes, so the best read of a run is a burst the loader may never have been offered; the
  reads beside each run are what the disk gave then

Each is timed cold (page cache of its files dropped with ``posix_fadvise(DONTNEED)``) and
warm (read once before; a loader reading around the page cache, the default, reads the disk
again, and its row says so), ``--rounds`` times with the methods interleaved (medians printed);
``CPU s`` is the processor time the process (and its reaped worker processes) spent
meanwhile, user + system — on a machine whose disk speed drifts, the steadier figure of what
a method costs. ``first batch s`` is the start-up, paid once an epoch (the
first reads, the first window or file, worker processes starting): at 2 GB it is a large
part of the epoch, so ``--gb 8`` shows a rate nearer what a long epoch sees. (A rate counted
from the first batch on is not that figure: the windows read ahead during the start-up
would be delivered in it for free.) Shuffle quality: mean distinct requests per batch over
the first ``--quality-batches`` batches, against uniform sampling of the whole selection. Finally a
tiny SAE (one linear encoder ``d -> 4d``, ReLU, linear decoder, Adam) trains for
``--sae-steps`` steps on the shuffled DMI loader and on one batch held in memory; the ratio of
the two step times says whether the loader keeps it compute-bound.

    python bench/bench_loader.py                    # full: 2 GB, d = 2048, bf16 and fp32
    python bench/bench_loader.py --quick            # 16 requests x 128 tokens x d 256: seconds
    python bench/bench_loader.py --dtypes bf16 --gb 4 --workers 8
    python bench/bench_loader.py --dtypes bf16 --methods "dmi shuffled,dmi shuffled direct I/O" --sae-steps 0
    python bench/bench_loader.py --dtypes bf16 --rev 55c38af --sae-steps 0          # before/after rows

Prints the conditions and one markdown table per dtype.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import math
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import dmi
from dmi._loader_memory import lent, map_region
from dmi._loader_plan import EpochOrder, n_windows, window_slices
from dmi.reader import plan_reads
from dmi.storage import DIRECT_ALIGNMENT, PackWriter, RecordKey

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _at_revision import module_at  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CACHED = "dmi shuffled through the page cache"
WORKERS = "dmi shuffled in worker processes"
METHODS = ("dmi shuffled", WORKERS, CACHED, "dmi sequential", "datasets + mixing buffer",
           "safetensors chunks")
AROUND_THE_CACHE = ("dmi shuffled", WORKERS, "dmi sequential")
"""Rows with the loader's default reads: where that is direct I/O, their warm run reads the disk as the cold one does."""


# ------------------------------------------------------------------------------ data


def request_rows(r: int, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """One request's activations: heavy-tailed rows, a few outlier channels (deterministic)."""
    g = torch.Generator().manual_seed(r)
    x = torch.randn(tokens, hidden, generator=g) * (1 + torch.rand(tokens, 1, generator=g) * 3)
    x[:, : max(1, hidden // 256)] *= 20
    return x.to(dtype)


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]


def drop_cache(root: str) -> None:
    for path in files_under(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages must be clean to be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_dmi(home: str, args, dtype: torch.dtype) -> dmi.Store:
    store = dmi.open(home=home)
    sealed = []
    with PackWriter(store.packs, codec="raw", on_seal=sealed.append) as writer:
        for r in range(args.requests):
            key = RecordKey("bench", "run", f"req-{r:06d}", "resid_post", 0, 0, args.tokens, phase="forward")
            writer.append(key, request_rows(r, args.tokens, args.hidden, dtype))
    with store.catalog.publisher("bench") as publisher:
        publisher.publish(sealed)
    return store


def write_datasets(root: str, args) -> None:
    import datasets

    features = datasets.Features({"x": datasets.Sequence(datasets.Value("float32"), length=args.hidden),
                                  "request": datasets.Value("int32")})

    def rows():
        for r in range(args.requests):
            x = request_rows(r, args.tokens, args.hidden, torch.float32).numpy()
            for row in x:
                yield {"x": row, "request": r}

    datasets.Dataset.from_generator(rows, features=features, cache_dir=os.path.join(root, "cache")).save_to_disk(
        os.path.join(root, "ds"))
    shutil.rmtree(os.path.join(root, "cache"), ignore_errors=True)


def write_safetensors(root: str, args, dtype: torch.dtype) -> None:
    import safetensors.torch as st

    rows = torch.cat([request_rows(r, args.tokens, args.hidden, dtype) for r in range(args.requests)])
    request = torch.arange(args.requests, dtype=torch.int32).repeat_interleave(args.tokens)
    for i, start in enumerate(range(0, rows.shape[0], args.chunk)):
        st.save_file({"x": rows[start : start + args.chunk].contiguous(), "request": request[start : start + args.chunk]},
                     os.path.join(root, f"chunk-{i:05d}.safetensors"))


# ------------------------------------------------------------------------------ methods


def dmi_batches(store: dmi.Store, args, dtype: torch.dtype, shuffle: bool, workers: int = 0,
                direct_io: bool | None = None, opener=None):
    """(loader, its iterator); ``direct_io``: ``None`` leaves the loader's default; ``opener``: a
    revision's ``open_loader`` (``loader_at``) instead of today's, given the store's model check
    where that revision takes one (since ea21442)."""
    if opener is None:
        open_loader = store.loader
    else:
        takes_check = "require_model" in inspect.signature(opener).parameters
        checks = {"require_model": store._require_model} if takes_check else {}
        open_loader = functools.partial(opener, store.catalog, store.packs, **checks)
    chosen = {} if direct_io is None else {"direct_io": direct_io}
    loader = open_loader("bench", hooks="resid_post", layers=[0], batch_size=args.batch, dtype=dtype,
                          shuffle=shuffle, shuffle_buffer=args.shuffle_buffer,
                          num_workers=workers,
                          with_tokens=False, read_threads=args.read_threads, prefetch=args.prefetch, **chosen)
    return loader, iter(loader)


def loader_at(rev: str):
    """``open_loader`` of git revision ``rev``, loaded in this process: its ``dmi/_loader.py``
    over its ``_loader_read.py`` and ``_loader_memory.py`` (the rest of DMI as checked out)."""
    memory = _module_at(rev, "_loader_memory", {})
    read = _module_at(rev, "_loader_read", {"from dmi._loader_memory import": f"from {memory.__name__} import"})
    loader = _module_at(rev, "_loader", {"from dmi._loader_memory import": f"from {memory.__name__} import",
                                          "from dmi._loader_read import": f"from {read.__name__} import"})
    return loader.open_loader


def _module_at(rev: str, stem: str, imports: dict[str, str]):
    """``dmi/<stem>.py`` at ``rev`` as a module of its own, its ``imports`` lines renamed."""
    return module_at(rev, f"dmi/{stem}.py", f"dmi.{stem}_at_{rev}", imports)


def mixing_buffer_batches(root: str, args, dtype: torch.dtype, requests_out: list | None) -> Iterator[torch.Tensor]:
    """SAELens-style: in-order chunks, each mixed into a buffer whose first half is emitted."""
    import datasets

    ds = datasets.load_from_disk(os.path.join(root, "ds")).with_format("torch")
    g = torch.Generator().manual_seed(0)
    buffer = torch.empty(0, args.hidden)
    owners = torch.empty(0, dtype=torch.int32)
    half = args.mixing_buffer // 2

    def emit(rows, who):
        for start in range(0, rows.shape[0], args.batch):
            if requests_out is not None:
                requests_out.append(who[start : start + args.batch])
            yield rows[start : start + args.batch].to(dtype)

    for start in range(0, len(ds), half):
        chunk = ds[start : start + half]
        buffer, owners = torch.cat([buffer, chunk["x"]]), torch.cat([owners, chunk["request"]])
        if buffer.shape[0] >= args.mixing_buffer:
            perm = torch.randperm(buffer.shape[0], generator=g)
            buffer, owners = buffer[perm], owners[perm]
            yield from emit(buffer[:half], owners[:half])
            buffer, owners = buffer[half:], owners[half:]
    perm = torch.randperm(buffer.shape[0], generator=g)
    yield from emit(buffer[perm], owners[perm])


class ChunkFiles(torch.utils.data.IterableDataset):
    """safetensors chunk files in random order, rows shuffled within a file, split over workers."""

    def __init__(self, root: str, batch: int, dtype: torch.dtype, with_requests: bool):
        self.paths = sorted(files_under(root))
        random.Random(0).shuffle(self.paths)
        self.batch, self.dtype, self.with_requests = batch, dtype, with_requests

    def __iter__(self):
        import safetensors.torch as st

        info = torch.utils.data.get_worker_info()
        mine = self.paths if info is None else self.paths[info.id :: info.num_workers]
        for path in mine:
            data = st.load_file(path)
            perm = torch.randperm(data["x"].shape[0], generator=torch.Generator().manual_seed(len(path)))
            x, who = data["x"][perm].to(self.dtype), data["request"][perm]
            for start in range(0, x.shape[0], self.batch):
                yield (x[start : start + self.batch], who[start : start + self.batch]) if self.with_requests \
                    else x[start : start + self.batch]


def chunk_batches(root: str, args, dtype: torch.dtype, with_requests: bool = False):
    return iter(torch.utils.data.DataLoader(ChunkFiles(root, args.batch, dtype, with_requests), batch_size=None,
                                            num_workers=args.workers))


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def consume(batches) -> tuple[int, float, float, float]:
    """Rows delivered, seconds taken, CPU seconds spent, and seconds until the first batch
    (the start-up: first reads, first window); each batch is touched (summed)."""
    rows, check, first = 0, 0.0, None
    cpu, start = cpu_seconds(), time.perf_counter()
    for x in batches:
        rows += x.shape[0]
        check += float(x[:, :1].float().sum())
        if first is None:
            first = time.perf_counter() - start
    return rows, time.perf_counter() - start, cpu_seconds() - cpu, first or 0.0


def cold_read_limit(packs_root: str, direct: bool = False) -> tuple[int, float]:
    """Bytes of every pack file read sequentially (8 MiB reads into one page-aligned buffer),
    cache dropped; ``direct``: opened ``O_DIRECT``, around the page cache.

    Everything written before is flushed first (``os.sync``): the peers' files are written just
    before, and their writeback would otherwise compete with this read and understate the limit."""
    os.sync()
    drop_cache(packs_root)
    buffer = mmap.mmap(-1, 8 << 20)
    view = memoryview(buffer)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    total = 0
    start = time.perf_counter()
    for path in sorted(files_under(packs_root)):
        fd = os.open(path, flags)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    seconds = time.perf_counter() - start
    view.release()
    buffer.close()
    return total, seconds


def shuffled_read_limit(packs_root: str, piece: int, threads: int) -> tuple[int, float]:
    """Bytes of every pack file read ``O_DIRECT`` in ``piece``-byte pieces (a record's size,
    whole blocks), the pieces in a seeded random order over ``threads`` threads: what the disk
    gives a reader that must fetch records in shuffled order, with no decoding or copying."""
    os.sync()
    drop_cache(packs_root)
    piece += -piece % 4096
    paths = sorted(files_under(packs_root))
    pieces = [(i, offset) for i, path in enumerate(paths) for offset in range(0, os.path.getsize(path), piece)]
    random.Random(0).shuffle(pieces)
    fds = [os.open(path, os.O_RDONLY | os.O_DIRECT) for path in paths]
    buffers = [mmap.mmap(-1, piece) for _ in range(threads)]
    try:
        def read_share(t: int) -> int:
            return sum(os.preadv(fds[i], [buffers[t]], offset) for i, offset in pieces[t::threads])

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read_share, range(threads)))
        seconds = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
        for buffer in buffers:
            buffer.close()
    return total, seconds


def loader_reads(store: dmi.Store, args, dtype: torch.dtype) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """The range reads of ``dmi shuffled``'s first epoch, as its loader issues them: window by
    window, one task per pack of the window (that pack's coalesced ranges, in offset order),
    each range widened to whole blocks; each task (its window, [(pack id, offset, length)])."""
    loader = dmi_batches(store, args, dtype, True)[0]
    cfg, plan = loader.config, loader.plan
    order = EpochOrder(plan, seed=cfg.seed, epoch=0, shuffle=True)
    whole = cfg.batch_size if cfg.drop_last else None
    tasks = []
    for w in range(n_windows(order.total, 0, 1, cfg.shuffle_buffer, whole_batches=whole)):
        by_pack = defaultdict(list)
        for s in window_slices(order, 0, 1, cfg.shuffle_buffer, w, whole_batches=whole):
            for e in (e for group in plan.units[s.unit].records for e in group):
                by_pack[e.pack_id].append(e)
        for entries in by_pack.values():
            reads = []
            for planned in plan_reads(entries, max_gap=cfg.max_gap):
                start = planned.range.offset - planned.range.offset % DIRECT_ALIGNMENT
                end = planned.range.end + -planned.range.end % DIRECT_ALIGNMENT
                reads.append((planned.pack_id, start, end - start))
            tasks.append((w, reads))
    return tasks


def replayed_read_limit(packs_root: str, tasks: list[tuple[int, list[tuple[str, int, int]]]], threads: int,
                        regions: int = 0) -> tuple[int, float]:
    """Bytes of ``tasks`` (:func:`loader_reads`) read ``O_DIRECT`` over ``threads`` threads in
    their order, cache dropped, with nothing verified, decoded or copied: what the disk gives
    the shuffled loader's own access pattern. A loader near this rate is held by the disk.

    Where the bytes land: ``regions=0``, one buffer per thread, each read into it again;
    ``regions=N``, as the loader puts them, each window's reads one after another in a region
    of its own, the windows taking ``N`` regions in turn (the loader keeps ``prefetch + 2``).
    The memory is mapped as the loader maps its own (:func:`dmi._loader_memory.map_region`) and
    touched before the clock starts, as a loader's is in its later epochs."""
    os.sync()
    drop_cache(packs_root)
    fds = {os.path.basename(path).split(".")[0]: os.open(path, os.O_RDONLY | os.O_DIRECT)
           for path in files_under(packs_root)}
    places, sizes = [], defaultdict(int)  # each task's (memory, offset in it)
    for w, reads in tasks:
        places.append((w % regions, sizes[w]) if regions else (None, 0))
        sizes[w] += sum(length for _, _, length in reads)
    largest = max(length for _, reads in tasks for _, _, length in reads)
    memory = [memoryview(lent(map_region(max(sizes.values()) if regions else largest)).zero_().numpy())
              for _ in range(regions or threads)]  # the loader's memory, touched before the clock starts
    free = list(range(threads))

    def read_task(i: int) -> int:
        region, at = places[i]
        b = free.pop() if region is None else region
        try:
            total = 0
            for pack_id, offset, length in tasks[i][1]:
                total += os.preadv(fds[pack_id], [memoryview(memory[b])[at : at + length]], offset)
                at += 0 if region is None else length
            return total
        finally:
            if region is None:
                free.append(b)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read_task, range(len(tasks))))
        seconds = time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)
    return total, seconds


def sequential_now(packs_root: str, limits: dict) -> float:
    """The disk's sequential rate now, bytes/s: the faster of a cold cached and a cold
    ``O_DIRECT`` read of the packs; each read's seconds also join ``limits`` (the best of each
    kind in the run)."""
    best = 0.0
    for direct in (False, True):
        nbytes, seconds = cold_read_limit(packs_root, direct)
        limits[direct] = min(limits.get(direct, seconds), seconds)
        best = max(best, nbytes / seconds)
    return best


def limit_now(packs_root: str, limits: dict, piece: int, threads: int, tasks=None, regions: int = 0) -> float:
    """:func:`sequential_now`, then a shuffled read of record-sized pieces and (given the loader's
    ``tasks``) its own reads replayed into per-thread buffers and into ``regions`` window
    regions, whose seconds also join ``limits``."""
    best = sequential_now(packs_root, limits)
    seconds = shuffled_read_limit(packs_root, piece, threads)[1]
    limits["shuffled"] = min(limits.get("shuffled", seconds), seconds)
    if tasks is not None:
        for kind, n in (("replayed", 0), ("replayed into windows", regions)):
            seconds = replayed_read_limit(packs_root, tasks, threads, regions=n)[1]
            limits[kind] = min(limits.get(kind, seconds), seconds)
    return best


# ------------------------------------------------------------------------------ quality


def ideal_distinct(sizes: list[int], total: int, batch: int) -> float:
    log_all = math.lgamma(total + 1) - math.lgamma(total - batch + 1)
    return sum(1.0 if total - n < batch else
               1.0 - math.exp(math.lgamma(total - n + 1) - math.lgamma(total - n - batch + 1) - log_all)
               for n in sizes)


def distinct_per_batch(owner_batches: list[torch.Tensor], n: int) -> float:
    full = [b for b in owner_batches[:n]]
    return float(np.mean([len(torch.unique(b)) for b in full])) if full else float("nan")


# ------------------------------------------------------------------------------ SAE


def sae_step_seconds(batches, hidden: int, steps: int) -> float:
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-4)
    start, done = None, 0
    for x in batches:
        x = x.float()
        loss = (dec(torch.relu(enc(x))) - x).pow(2).mean() + 1e-3 * torch.relu(enc(x)).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if done == 2:
            start = time.perf_counter()  # first steps warm up allocators
        if done == steps + 2:
            break
    return (time.perf_counter() - start) / max(1, done - 2)


# ------------------------------------------------------------------------------ run


def run_dtype(name: str, dtype: torch.dtype, args, work: str) -> None:
    itemsize = dtype.itemsize
    total_rows = args.requests * args.tokens
    root = os.path.join(work, name)
    dmi_home, ds_root, st_root = (os.path.join(root, d) for d in ("dmi", "datasets", "safetensors"))
    for d in (ds_root, st_root):
        os.makedirs(d, exist_ok=True)
    store = write_dmi(dmi_home, args, dtype)
    if "datasets + mixing buffer" in args.methods:
        write_datasets(ds_root, args)
    if "safetensors chunks" in args.methods:
        write_safetensors(st_root, args, dtype)
    packs_root = os.path.join(dmi_home, "packs")
    limits: dict = {}  # best seconds of each kind of read; each twice: the disk's speed drifts on a VM
    piece = args.tokens * args.hidden * itemsize  # one record's bytes
    tasks = loader_reads(store, args, dtype)
    for _ in range(2):
        limit_now(packs_root, limits, piece, args.read_threads, tasks, args.prefetch + 2)
    limit_bytes = sum(os.path.getsize(path) for path in files_under(packs_root))

    sizes = [args.tokens] * args.requests
    ideal = ideal_distinct(sizes, total_rows, args.batch)
    methods = {
        "dmi shuffled": (dmi_home, lambda: dmi_batches(store, args, dtype, True)[1]),
        WORKERS: (dmi_home, lambda: dmi_batches(store, args, dtype, True, workers=args.workers)[1]),
        CACHED: (dmi_home, lambda: dmi_batches(store, args, dtype, True, direct_io=False)[1]),
        "dmi sequential": (dmi_home, lambda: dmi_batches(store, args, dtype, False)[1]),
        **({} if args.rev is None else {
            f"dmi shuffled @{args.rev}": (dmi_home, lambda: dmi_batches(store, args, dtype, True,
                                                                       opener=args.opener)[1]),
            f"{CACHED} @{args.rev}": (dmi_home, lambda: dmi_batches(store, args, dtype, True, direct_io=False,
                                                                   opener=args.opener)[1])}),
        "datasets + mixing buffer": (ds_root, lambda: mixing_buffer_batches(ds_root, args, dtype, None)),
        "safetensors chunks": (st_root, lambda: chunk_batches(st_root, args, dtype)),
    }
    quality = {method: measure() for method, measure in shuffle_quality(store, args, dtype, ds_root, st_root).items()
               if method in {m.split(' @')[0] for m in args.methods}}
    methods = {method: how for method, how in methods.items() if method in args.methods}
    methods = dict(sorted(methods.items(), key=lambda item: METHODS.index(item[0].split(" @")[0])))  # @REV beside its row

    default_direct = dmi_batches(store, args, dtype, True)[0].config.direct_io
    print(f"\nthe loader's default for this selection: {'direct I/O' if default_direct else 'through the page cache'}")
    runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    beside: dict[str, list[float]] = {}  # each cold run's rate over the limit read just before and after it
    for _ in range(args.rounds):  # methods interleaved round by round: the disk's speed drifts
        for method, (files, make) in methods.items():
            for cache in ("cold", "warm"):
                if cache == "cold":
                    before = limit_now(packs_root, limits, piece, args.read_threads, tasks, args.prefetch + 2)
                    drop_cache(files)
                else:
                    consume(make())
                rows, seconds, cpu, first_s = consume(make())
                if rows != total_rows:
                    raise SystemExit(f"{method} delivered {rows} rows, not {total_rows}")
                runs.setdefault((method, cache), []).append((seconds, cpu, first_s))
                if cache == "cold":
                    rate = total_rows * args.hidden * itemsize / seconds
                    after = limit_now(packs_root, limits, piece, args.read_threads, tasks, args.prefetch + 2)
                    beside.setdefault(method, []).append(rate / max(before, after))
    limit_s = min(limits[False], limits[True])
    limit = limit_bytes / limit_s
    rounds = f"; median of {args.rounds} rounds, methods interleaved" if args.rounds > 1 else ""
    print(f"\n### {name}: {total_rows} token rows x {args.hidden} = {total_rows * args.hidden * itemsize / 1e9:.2f} GB "
          f"delivered; cold-read limit {limit / 1e9:.2f} GB/s ({limit_bytes / 1e9:.2f} GB of packs){rounds}\n")
    print("| method | cache | tokens/s | GB/s | x cold-read limit | x limit beside it (min-max) | first batch s "
          f"| CPU s | requests/batch (ideal {ideal:.1f}) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (method, cache), measured in runs.items():
        seconds, cpu, first_s = (statistics.median(values) for values in zip(*measured))
        rate = total_rows * args.hidden * itemsize / seconds
        ratios = beside[method] if cache == "cold" else None
        paired = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        if cache == "warm" and default_direct and method.split(" @")[0] in AROUND_THE_CACHE:
            cache = "warm (direct I/O: the disk again)"
        print(f"| {method} | {cache} | {total_rows / seconds:,.0f} | {rate / 1e9:.2f} | {rate / limit:.2f} | "
              f"{paired} | {first_s:.2f} | {cpu:.2f} | {quality[method.split(' @')[0]]:.1f} |")
    for kind, name in ((False, "cold-read limit"), (True, "cold-read limit, O_DIRECT"),
                       ("shuffled", f"shuffled-read limit, O_DIRECT, {args.read_threads} threads"),
                       ("replayed", f"dmi shuffled's reads replayed, O_DIRECT, {args.read_threads} threads"),
                       ("replayed into windows", f"the same into {args.prefetch + 2} window regions")):
        rate = limit_bytes / limits[kind]
        print(f"| {name} | cold | {total_rows / limits[kind]:,.0f} | {rate / 1e9:.2f} | {rate / limit:.2f} "
              "| - | - | - | - |")

    if args.sae_steps:
        sae_row(store, args, dtype)
    store.close()
    shutil.rmtree(root, ignore_errors=True)


def shuffle_quality(store: dmi.Store, args, dtype: torch.dtype, ds_root: str, st_root: str) -> dict:
    """{method: () -> mean distinct requests in each of the first --quality-batches batches}."""
    def mixing() -> float:
        owners: list = []
        for _ in mixing_buffer_batches(ds_root, args, dtype, owners):
            if len(owners) >= args.quality_batches:
                break
        return distinct_per_batch(owners, args.quality_batches)

    def chunks() -> float:
        owners = [who for i, (_, who) in zip(range(args.quality_batches), chunk_batches(st_root, args, dtype, True))]
        return distinct_per_batch(owners, args.quality_batches)

    def dmi_quality(shuffle: bool, workers: int = 0):
        return lambda: dmi_batches(store, args, dtype, shuffle, workers)[0].shuffle_quality(
            args.quality_batches).requests_per_batch

    return {"dmi shuffled": dmi_quality(True), WORKERS: dmi_quality(True, args.workers), CACHED: dmi_quality(True),
            "dmi sequential": dmi_quality(False), "datasets + mixing buffer": mixing, "safetensors chunks": chunks}


def sae_row(store: dmi.Store, args, dtype: torch.dtype) -> None:
    held = next(iter(dmi_batches(store, args, dtype, True)[1]))
    fed = sae_step_seconds(dmi_batches(store, args, dtype, True)[1], args.hidden, args.sae_steps)
    compute = sae_step_seconds(iter([held] * (args.sae_steps + 2)), args.hidden, args.sae_steps)
    print(f"\nSAE d={args.hidden}->{4 * args.hidden}, batch {args.batch}: {fed * 1e3:.1f} ms/step fed by the shuffled "
          f"DMI loader, {compute * 1e3:.1f} ms/step on one batch in memory (ratio {fed / compute:.2f}; "
          "1.0 = compute-bound)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 requests x 128 tokens x d 256, seconds")
    parser.add_argument("--gb", type=float, default=2.0, help="GB of activations per dtype (sets --requests)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per request")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--shuffle-buffer", type=int, default=65536)
    parser.add_argument("--mixing-buffer", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=16384, help="token rows per safetensors file")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=2, help="windows the DMI loader reads ahead")
    parser.add_argument("--quality-batches", type=int, default=16)
    parser.add_argument("--sae-steps", type=int, default=20)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=1, help="measure every method this many times, round by "
                        "round, and print medians (the disk's speed drifts within minutes on a VM)")
    parser.add_argument("--rev", default=None, help="also run the shuffled and direct I/O rows with the loader "
                        "of this git revision")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of: " + ", ".join(METHODS) + " (peers not named are not written)")
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",")]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if "datasets + mixing buffer" in args.methods and importlib.util.find_spec("datasets") is None:
        raise SystemExit("the SAELens-style peer needs Hugging Face datasets: pip install datasets")
    args.opener = None if args.rev is None else loader_at(args.rev)
    if args.rev is not None:
        args.methods += [f"dmi shuffled @{args.rev}", f"{CACHED} @{args.rev}"]
    if args.quick:
        args.requests, args.tokens, args.hidden, args.batch = 16, 128, 256, 256
        args.shuffle_buffer = args.mixing_buffer = 1024
        args.chunk, args.sae_steps, args.quality_batches = 512, 5, 4
    work = tempfile.mkdtemp(prefix="dmi-bench-loader-", dir=args.dir)
    print(f"# bench_loader: {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}, torch "
          f"{torch.__version__}, work dir {work}")
    try:
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            requests = args.requests or max(1, round(args.gb * 1e9 / (args.tokens * args.hidden * dtype.itemsize)))
            run = argparse.Namespace(**{**vars(args), "requests": requests})
            print(f"\nconditions: {run.requests} requests x {run.tokens} tokens, d = {run.hidden}, batch "
                  f"{run.batch}, DMI shuffle buffer {run.shuffle_buffer} rows, {run.read_threads} read threads, "
                  f"{run.prefetch} windows read ahead, {run.workers} worker processes in its worker row, mixing buffer "
                  f"{run.mixing_buffer} rows, safetensors chunks of {run.chunk} rows and {run.workers} workers, "
                  "raw-codec packs")
            run_dtype(name, dtype, run, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
