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

    python bench/bench_page_cache.py [--mib 800] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=800)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    args = parser.parse_args()
    block = np.random.default_rng(0).bytes(1 << 20)
    nbytes = args.mib << 20
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        first, second = os.path.join(root, "first"), os.path.join(root, "second")
        rows.append(("new file", nbytes, write_file(first, block, args.mib)))
        rows.append(("fsync", nbytes, fsync_file(first)))
        os.unlink(first)
        rows.append(("new file again", nbytes, write_file(second, block, args.mib)))
        os.unlink(second)
    time.sleep(5)  # freed anonymous pages are reported to the host after a delay: start from cold ones
    rows.append(("fresh memory", nbytes, fill_fresh(nbytes)))
    rows.append(("fresh memory again", nbytes, fill_fresh(nbytes)))
    print(f"{args.mib} MiB; {os.cpu_count()} CPUs; load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end; directory {args.dir or tempfile.gettempdir()}")
    print("| write | seconds | GB/s |")
    print("|---|---:|---:|")
    for name, size, seconds in rows:
        print(f"| {name} | {seconds:.2f} | {size / seconds / 1e9:.2f} |")


if __name__ == "__main__":
    main()
