"""What a second thread costs vLLM's CPU engine: the engine's own slowdown against the CPU time
the other thread used, and how often the engine's threads went to sleep.

``bench_vllm_breakdown.py`` found DMI's hooks, ring and drain loop alone (a writer that keeps
nothing) slowing vLLM on CPU by 10–15 % although they use a few hundredths of a second of the
model thread and about a tenth of a second of the drain thread a round. This bench shows where
that goes: one engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``bench_vllm.py``'s
default workload built by its own functions, configurations interleaved round by round:

* ``none``                     ``llm.generate``
* ``copies 4 MiB every 10 ms``  beside it, a thread copying a 4 MiB array (``numpy.copyto``,
                               which releases the GIL) then sleeping 10 ms, until the round ends
* ``hashing 5 ms every 40 ms``  beside it, a thread hashing 1 MiB buffers (``hashlib``, which
                               releases the GIL) for 5 ms of its own CPU time, then sleeping 40 ms
* ``dmi null writer``          ``attach_vllm(hooks=--hooks)`` with a writer that keeps nothing
                               (``bench_vllm_breakdown.py``'s): hooks, ring and the drain loop
                               (decode coalescing, record cutting), nothing encoded or written
* ``dmi null writer, drain idle`` the same, but every slot the model fills goes straight back
                               to the ring (the session's ring hands it to ``ring.release``
                               instead of the drain — a diagnostic cut, not a DMI option): the
                               hooks and ring copies without the drain thread's work

Reported per configuration, the median over ``--rounds`` (spread beside it): seconds a round
and × none; ``other thread CPU s``, the CPU time of the side thread (the drain thread for the
DMI rows) — what the engine would lose if that work simply took its share of the two cores;
and ``engine sleeps``, the voluntary context switches of the model's thread and of the busiest
other thread of the process (vLLM's second compute thread), from ``/proc`` (Linux only).

    .venv-vllm/bin/python bench/bench_vllm_contention.py [--rounds 3] [--hooks resid_post]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import threading
import time

import numpy as np

from bench_vllm_breakdown import _TICKS, _NullWriter, drain_cpu, in_process_engine


def thread_stats() -> dict[int, tuple[float, int]]:
    """``{thread id: (CPU seconds, voluntary context switches)}`` of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                voluntary = next(int(line.split(":")[1]) for line in f if line.startswith("voluntary_ctxt"))
        except (OSError, StopIteration):
            continue
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / _TICKS, voluntary)
    return out


def engine_sleeps(before: dict, after: dict) -> int:
    """Voluntary switches of the model's thread and of the busiest other thread over a round."""
    main = os.getpid()
    busiest = max((t for t in after if t != main and t in before),
                  key=lambda t: after[t][0] - before[t][0])
    return sum(after[t][1] - before[t][1] for t in (main, busiest))


def beside(llm_run, work) -> float:
    """``llm_run()`` with a thread looping ``work()`` beside it; the thread's CPU seconds."""
    stop = threading.Event()
    used = []

    def loop():
        start = time.thread_time()
        while not stop.is_set():
            work()
        used.append(time.thread_time() - start)

    t = threading.Thread(target=loop, name="bench-side")
    t.start()
    try:
        llm_run()
    finally:
        stop.set()
        t.join()
    return used[0]


def copier():
    src, dst = np.ones(1 << 20, np.float32), np.empty(1 << 20, np.float32)

    def work():
        np.copyto(dst, src)
        time.sleep(0.010)

    return work


def hasher():
    buf = os.urandom(1 << 20)

    def work():
        start = time.thread_time()
        while time.thread_time() - start < 0.005:
            hashlib.sha256(buf).digest()
        time.sleep(0.040)

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hooks", default="resid_post")
    args = parser.parse_args()
    llm, prompts, params, _ = in_process_engine("dmi-vllm-contention-")
    import vllm

    from dmi.capture import attach_vllm

    def generate():
        llm.generate(prompts, params, use_tqdm=False)

    def null_writer(drain_idle: bool):
        def run() -> float:
            with attach_vllm(llm, hooks=args.hooks, writer=_NullWriter()) as cap:
                if drain_idle:
                    cap.ring._on_submit = cap.ring.release
                cap.generate(prompts, params, use_tqdm=False)
                return drain_cpu(cap)
        return run

    rows = {
        "none": lambda: (generate(), 0.0)[1],
        "copies 4 MiB every 10 ms": lambda: beside(generate, copier()),
        "hashing 5 ms every 40 ms": lambda: beside(generate, hasher()),
        "dmi null writer": null_writer(False),
        "dmi null writer, drain idle": null_writer(True),
    }
    load = os.getloadavg()[0]
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            before = thread_stats()
            t0 = time.perf_counter()
            side = run()
            seconds = time.perf_counter() - t0
            results[name].append((seconds, side, engine_sleeps(before, thread_stats())))
    base = statistics.median(s for s, _, _ in results["none"])
    print(f"hooks {args.hooks}; {args.rounds} rounds; {os.cpu_count()} CPUs; vLLM {vllm.__version__}; "
          f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("| configuration | seconds a round (median; min–max) | × none | other thread CPU s | engine sleeps |")
    print("|---|---:|---:|---:|---:|")
    for name, values in results.items():
        seconds = [s for s, _, _ in values]
        median = statistics.median(seconds)
        side = statistics.median(c for _, c, _ in values)
        sleeps = statistics.median(n for _, _, n in values)
        print(f"| {name} | {median:.2f} ({min(seconds):.2f}–{max(seconds):.2f}) | {base / median:.3f} | "
              f"{side:.2f} | {sleeps:.0f} |")


if __name__ == "__main__":
    main()
