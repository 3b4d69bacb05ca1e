"""What one chDB session open and close costs a process: time, threads and descriptors kept.

chDB (ClickHouse in-process) starts its embedded server when a session opens on a
directory and stops it when the session closes. On a directory that holds tables, each
start leaves threads behind that the stop never ends, and each of those threads keeps
descriptors on its own ``/proc`` entries. A process that opens and closes sessions over
and over therefore grows without bound, which is why the embedded catalog closes its
session only when another process waits, when the catalog is closed, or after a long idle
spell (``docs/catalog-protocol.md``), and why ``dmi ui`` keeps one store for its life.

    python bench/bench_chdb_sessions.py               # 40 cycles of each
    python bench/bench_chdb_sessions.py --cycles 200

Rows (each in a fresh child process, so one row's leftovers cannot inflate another's):

* ``raw chDB: open, count(), close`` — chDB alone, no DMI code.
* ``DMI: open_catalog, models(), close`` — what a caller that opens a catalog per request pays.
* ``DMI: one catalog, models() x N`` — one catalog kept open, the calls back to back.

Threads and descriptors are counted from ``/proc/self/task`` and ``/proc/self/fd`` after
the first cycle (warm) and after the last; the figure is the growth per cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, tempfile, time
kind, cycles = sys.argv[1], int(sys.argv[2])
directory = tempfile.mkdtemp(prefix="dmi-chdb-sessions-")

def counts():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

if kind == "raw":
    from chdb import session
    first = session.Session(directory)
    first.query("CREATE TABLE t (x UInt64) ENGINE = MergeTree ORDER BY x")
    first.query("INSERT INTO t SELECT number FROM numbers(1000)")
    first.close()
    def cycle():
        s = session.Session(directory)
        s.query("SELECT count() FROM t")
        s.close()
else:
    from dmi.catalog import open_catalog
    uri = "chdb://" + directory
    if kind == "dmi-open-close":
        def cycle():
            catalog = open_catalog(uri)
            catalog.models()
            catalog.close()
    else:
        held = open_catalog(uri)
        def cycle():
            held.models()

cycle()
threads0, fds0 = counts()
started = time.perf_counter()
for _ in range(cycles):
    cycle()
seconds = time.perf_counter() - started
threads1, fds1 = counts()
print(json.dumps({"ms_per_cycle": 1e3 * seconds / cycles, "threads_per_cycle": (threads1 - threads0) / cycles,
                  "fds_per_cycle": (fds1 - fds0) / cycles, "fds_warm": fds0}))
"""

ROWS = [
    ("raw", "raw chDB: open, count(), close"),
    ("dmi-open-close", "DMI: open_catalog, models(), close"),
    ("dmi-held", "DMI: one catalog, models() x N"),
]


def run_row(kind: str, cycles: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(cycles)], capture_output=True, text=True,
                         check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=40)
    args = parser.parse_args()
    import chdb

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"chdb {chdb.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, {args.cycles} cycles per row, "
          f"descriptor limit soft {soft} / hard {hard}")
    print()
    print("| cycle | ms per cycle | threads kept per cycle | descriptors kept per cycle | cycles to a 1024-descriptor limit |")
    print("|---|---:|---:|---:|---:|")
    for kind, label in ROWS:
        row = run_row(kind, args.cycles)
        per_fd = row["fds_per_cycle"]
        reach = f"{(1024 - row['fds_warm']) / per_fd:.0f}" if per_fd > 0 else "never"
        print(f"| {label} | {row['ms_per_cycle']:.1f} | {row['threads_per_cycle']:.2f} | {per_fd:.2f} | {reach} |")


if __name__ == "__main__":
    main()
