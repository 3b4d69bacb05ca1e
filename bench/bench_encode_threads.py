"""The drain's encoding on a pool of threads: records appended to a real pack writer by N
threads at once, against one thread and against the machine's limits, one run.

Workload: ``bench_storage.activations`` (heavy-tailed activations with outlier channels),
``--records`` records of ``--tokens`` x ``--hidden`` in bf16, appended to a ``PackWriter``
(default codec, statistics on: what the drain's ``writer.append`` does per record) on a local
pack store in a temporary directory, then sealed. ``--threads`` lists the pool sizes; each
figure is the best of ``--rounds`` interleaved rounds, in GB/s of the records' raw bytes.
Nothing else runs: this is the drain's own ceiling, not capture with a model competing for
the cores (``bench/bench_capture.py``, row ``dmi all_but_patterns 2 encode threads``).

    python bench/bench_encode_threads.py
    python bench/bench_encode_threads.py --records 16 --rounds 1     # seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_storage import activations  # noqa: E402

from dmi.storage import PackStore, PackWriter, _native  # noqa: E402
from dmi.storage.records import RecordKey  # noqa: E402


def append_all(records: list[torch.Tensor], root: str, threads: int) -> float:
    """Seconds to append every record with ``threads`` threads and seal."""
    store = PackStore.local(root)
    keys = [RecordKey("bench", "run", f"req-{i:06d}", "resid_post", 0, 0, t.shape[0], phase="forward")
            for i, t in enumerate(records)]
    start = time.perf_counter()
    with PackWriter(store) as writer:
        if threads == 1:
            for key, t in zip(keys, records):
                writer.append(key, t)
        else:
            with ThreadPoolExecutor(threads) as pool:
                for future in [pool.submit(writer.append, key, t) for key, t in zip(keys, records)]:
                    future.result()
        writer.seal()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    records = list(activations(args.records, 1, args.tokens, args.hidden, torch.bfloat16).values())
    raw = sum(t.numel() * t.element_size() for t in records)
    pools = [int(n) for n in args.threads.split(",")]
    load_at_start = os.getloadavg()[0]
    best = {n: float("inf") for n in pools}
    with tempfile.TemporaryDirectory(prefix="dmi-bench-encode-") as tmp:
        append_all(records[:4], os.path.join(tmp, "warm-up"), max(pools))  # imports, codec contexts: untimed
        for r in range(args.rounds):
            for n in pools:
                best[n] = min(best[n], append_all(records, os.path.join(tmp, f"r{r}-t{n}"), n))
    print(f"# drain encoding on N threads: {args.records} bf16 records of {args.tokens} x {args.hidden} "
          f"({raw / 2**20:.0f} MiB), default codec, statistics on, best of {args.rounds}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"C loops {'on' if _native.ACTIVE else 'off'}, load average at the start {load_at_start:.2f}, "
          f"at the end {os.getloadavg()[0]:.2f}")
    print("| encoding threads | GB/s | vs 1 thread |")
    print("|---:|---:|---:|")
    for n in pools:
        print(f"| {n} | {raw / best[n] / 1e9:.2f} | {best[1] / best[n] if 1 in best else float('nan'):.2f}x |")


if __name__ == "__main__":
    main()
