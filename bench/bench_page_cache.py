"""How fast this machine writes data into memory it has not touched lately: the page cache of a
new file and fresh anonymous memory, against the same writes into pages just freed.

On a virtual machine whose guest returns free memory to its host (``virtio_balloon`` free page
reporting), the first touch of such a page waits for the host to back it again; pages freed a
moment ago are still backed. A pack writer allocates new page-cache pages for every byte it
writes, so on such a host its write rate is this first-touch rate, not the memcpy or disk rate
— and so is that of any other writer (``torch.save``, safetensors). Rows:

* ``new file``          ``--mib`` MiB written to a new file in 1 MiB ``write`` calls, no fsync
* ``new file again``    the same right after the previous file was deleted (its pages reused)
* ``fsync``             the fsync of the first file (its dirty pages to the disk)
* ``fresh memory``      a new ``--mib`` MiB numpy buffer filled (first touch of anonymous pages)
* ``fresh memory again`` the same right after the previous buffer was freed
* ``cold read``         a ``--mib`` MiB file (written, fsync'd) read back through the page
                        cache ``--wait`` seconds after its pages were dropped (``fadvise``
                        ``DONTNEED``): the page cache takes pages the host may have taken back
* ``cold read again``   the same file dropped and read again at once (the pages just freed)

With ``--read DIR`` the two cold reads read every file under ``DIR`` (a store's packs, which
the pack writer wrote around the page cache) instead of the bench's own file.

Each row also gives the process's CPU seconds (user + system) over it: the host's backing of
a page is spent in the kernel, on the CPU of the thread that touched it.

    python bench/bench_page_cache.py [--mib 800] [--dir DIR] [--wait 30] [--read DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_storage import drop_cache, files_under  # noqa: E402


def write_file(path: str, block: bytes, count: int) -> float:
    """Seconds to write ``count`` blocks to a new file at ``path`` (closed, not fsync'd)."""
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(count):
            f.write(block)
    return time.perf_counter() - t0


def fsync_file(path: str) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def fill_fresh(nbytes: int) -> float:
    """Seconds to fill a new buffer of ``nbytes`` (its pages touched for the first time)."""
    t0 = time.perf_counter()
    buf = np.empty(nbytes, np.uint8)
    buf.fill(1)
    seconds = time.perf_counter() - t0
    del buf
    return seconds


def read_through_cache(paths: list[str]) -> float:
    """Seconds to read ``paths`` through the page cache."""
    t0 = time.perf_counter()
    buf = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def timed(step) -> tuple[float, float]:
    """``step()``'s seconds, and the process's CPU seconds over it."""
    before = os.times()
    seconds = step()
    after = os.times()
    return seconds, max(0.0, after.user + after.system - before.user - before.system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=800)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds between dropping the file's pages and the cold read")
    parser.add_argument("--read", default=None,
                        help="the cold reads read every file under this directory (a store's packs), not the bench's file")
    args = parser.parse_args()
    block = np.random.default_rng(0).bytes(1 << 20)
    nbytes = args.mib << 20
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        first, second = os.path.join(root, "first"), os.path.join(root, "second")
        rows.append(("new file", *timed(lambda: write_file(first, block, args.mib))))
        rows.append(("fsync", *timed(lambda: fsync_file(first))))
        os.unlink(first)
        rows.append(("new file again", *timed(lambda: write_file(second, block, args.mib))))
        fsync_file(second)
        time.sleep(5)  # freed anonymous pages are reported to the host after a delay: start from cold ones
        rows.append(("fresh memory", *timed(lambda: fill_fresh(nbytes))))
        rows.append(("fresh memory again", *timed(lambda: fill_fresh(nbytes))))
        read = [second] if args.read is None else sorted(files_under(args.read))
        read_bytes = sum(os.path.getsize(p) for p in read)
        drop_cache(read)
        time.sleep(args.wait)
        rows.append((f"cold read, {args.wait:g} s after the drop", *timed(lambda: read_through_cache(read)), read_bytes))
        drop_cache(read)
        rows.append(("cold read again, right after the drop", *timed(lambda: read_through_cache(read)), read_bytes))
    print(f"{args.mib} MiB; {os.cpu_count()} CPUs; load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end; directory {args.dir or tempfile.gettempdir()}"
          + ("" if args.read is None else f"; cold reads of {len(read)} files under {args.read}"))
    print("| step | seconds | GB/s | CPU s |")
    print("|---|---:|---:|---:|")
    for name, seconds, cpu, *size in rows:
        print(f"| {name} | {seconds:.2f} | {(size[0] if size else nbytes) / seconds / 1e9:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
