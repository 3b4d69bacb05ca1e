"""Assembling one shuffled loader window from decoded records: fresh memory against reused
memory, and several features stacked afterwards against gathered in place. One run.

A window is ``--window`` token rows of ``--hidden`` values in a random order, picked from
records of ``--tokens`` rows (the training loader's shuffle buffer, ``dmi/_loader_read.py``).
Rows, each the best of ``--rounds`` interleaved rounds, in GB/s of window bytes:

* ``fresh``: the window in new memory (``torch.empty``), what the loader did before it lent
  window memory again; every 4 KiB page faults in as the gather first writes it.
* ``reused``: the window in memory lent by ``WindowMemory`` once the previous window is gone
  (what the loader did from stop 22 to stop 32; since stop 33 it gathers each batch out of the
  window's records instead, and only the read regions are lent again).
* ``2 features, stacked after``: each feature gathered into fresh memory, then
  ``torch.stack`` (the loader before); ``2 features, in place``: each feature gathered
  straight into its slot of one reused window (the loader since stop 22, per batch since stop 33).
* ``read ... fresh`` / ``read ... lent``: the window's records read back from raw-codec packs
  in the page cache (``read_records``, one thread, checksums verified) into new buffers, or
  into one region lent again (``Arena``, the loader since stop 22).
* ``read into one lent region, then gathered``: that read followed by the window's gather
  into reused memory (the loader's whole path for a window until stop 33, which gathers the same rows batch by batch); ``gathered from the packs
  mapped``: the same gather straight from the pack files mapped into memory (``mmap``,
  populated up front, no checksum), the copy of the read saved — the alternative the
  loader does not take, measured here.
* limits: ``memcpy`` into an existing buffer (one thread, as the gather), ``first write of fresh memory`` (``fill_`` of a
  new ``torch.empty``: the page faults alone).

    python bench/bench_loader_window.py
    python bench/bench_loader_window.py --window 16384 --rounds 3     # seconds
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import tempfile
import time

import numpy as np
import torch

from dmi._loader_memory import Arena, WindowMemory
from dmi.reader import read_records
from dmi.storage import PackStore, PackWriter, _native, gather_rows
from dmi.storage.records import RecordKey


def sources(n_records: int, tokens: int, hidden: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(n_records)]


def cases(feats: list[list[torch.Tensor]], window: int, hidden: int) -> dict:
    """{row name: fn()}; each fn assembles one window."""
    rng = np.random.default_rng(0)
    picks = np.stack([rng.integers(0, len(feats[0]), window), rng.integers(0, feats[0][0].shape[0], window)], axis=1)
    memory = WindowMemory(keep=2)
    one_bytes = window * hidden * 2

    def fresh():
        gather_rows(feats[0], picks, torch.empty(window, hidden, dtype=torch.bfloat16))

    def reused():
        gather_rows(feats[0], picks, memory.take(one_bytes).view(torch.bfloat16).view(window, hidden))

    def stacked_after():
        parts = []
        for sources_f in feats:
            out = torch.empty(window, hidden, dtype=torch.bfloat16)
            gather_rows(sources_f, picks, out)
            parts.append(out)
        torch.stack(parts, dim=1)

    def in_place():
        x = memory.take(len(feats) * one_bytes).view(torch.bfloat16).view(window, len(feats), hidden)
        for f, sources_f in enumerate(feats):
            gather_rows(sources_f, picks, x[:, f])

    target = np.zeros(window * hidden * 2, np.uint8)
    flat = torch.cat(feats[0])[:window].contiguous().view(torch.uint8).numpy().reshape(-1)

    def memcpy():
        np.copyto(target, flat)  # one thread, as the gather

    def first_write():
        torch.empty(window, hidden, dtype=torch.bfloat16).fill_(1)

    return {"fresh": (fresh, 1), "reused": (reused, 1), "2 features, stacked after": (stacked_after, 2),
            "2 features, in place": (in_place, 2), "limit: memcpy": (memcpy, 1),
            "limit: first write of fresh memory": (first_write, 1)}


def read_cases(records: list[torch.Tensor], root: str) -> dict:
    """{row name: fn()}: the records read back from raw packs of 16 records each (page cache warm)."""
    store = PackStore.local(root)
    entries = []
    with PackWriter(store, codec="raw", max_records=16, on_seal=lambda d: entries.extend(d.records)) as writer:
        for r, x in enumerate(records):
            writer.append(RecordKey("bench", "run", f"req-{r:06d}", "resid_post", 0, 0, x.shape[0], phase="forward"), x)
    memory = WindowMemory(keep=2)
    room = Arena.room_for([e.payload.length for e in entries])

    rows, hidden = records[0].shape
    picks = np.stack([np.random.default_rng(1).integers(0, len(records), len(records) * rows),
                      np.random.default_rng(2).integers(0, rows, len(records) * rows)], axis=1)
    window = torch.empty(len(picks), hidden, dtype=torch.bfloat16).fill_(0)

    def fresh():
        read_records(store, entries)

    def lent():
        read_records(store, entries, memory=Arena(memory.take(room)))

    def lent_and_gathered():
        gather_rows([t.view(rows, hidden) for t in read_records(store, entries, memory=Arena(memory.take(room)))],
                    picks, window)

    def mapped_and_gathered():
        gather_rows([mapped(store.location(e.pack_id), e.payload).view(torch.bfloat16).view(rows, hidden)
                     for e in entries], picks, window)

    fresh()  # the page cache holds every pack
    return {"read the records, fresh buffers": (fresh, 1), "read the records, one lent region": (lent, 1),
            "read into one lent region, then gathered": (lent_and_gathered, 1),
            "gathered from the packs mapped (mmap, populated)": (mapped_and_gathered, 1)}


def mapped(path: str, payload) -> torch.Tensor:
    """A record's payload bytes as a view of its pack file mapped copy-on-write and populated
    (what a reader that maps instead of reading would gather from); no checksum verified."""
    start = payload.offset - payload.offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), payload.offset + payload.length - start, offset=start,
                           flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(region, dtype=torch.uint8)[payload.offset - start:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=65536, help="rows per window (the loader's shuffle_buffer)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512, help="rows per record")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n_records = max(1, args.window // args.tokens)
    feats = [sources(n_records, args.tokens, args.hidden, seed) for seed in (1, 2)]
    work = tempfile.TemporaryDirectory(prefix="dmi-bench-window-")
    runs = {**cases(feats, args.window, args.hidden), **read_cases(feats[0], work.name)}
    load_at_start = os.getloadavg()[0]
    best = {name: float("inf") for name in runs}
    for _ in range(args.rounds):
        for name, (fn, _) in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    window_bytes = args.window * args.hidden * 2
    print(f"# loader window assembly: {args.window} rows x {args.hidden} bf16 ({window_bytes / 2**20:.0f} MiB per "
          f"feature) from {n_records} records of {args.tokens} rows, shuffled; best of {args.rounds}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"C loops {'on' if _native.ACTIVE else 'off'}, load average at the start {load_at_start:.2f}")
    print("| window | GB/s | ms |")
    print("|---|---:|---:|")
    for name, (_, features) in runs.items():
        print(f"| {name} | {features * window_bytes / best[name] / 1e9:.2f} | {best[name] * 1e3:.1f} |")
    work.cleanup()
    print(f"# load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
