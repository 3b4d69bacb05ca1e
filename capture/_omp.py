"""One OpenMP thread for the torch work of DMI's own threads, leaving the model's threads alone.

PyTorch's CPU kernels run their parallel regions on an OpenMP team that the calling thread
starts. GNU OpenMP counts the threads it manages in the whole process; when a model's team
already uses every CPU and a second thread (the drain) starts a team of its own, the count
exceeds the CPUs and libgomp cuts every team's spin at barriers to about a hundred
iterations: a model's OpenMP threads, which ran
from one parallel region to the next without sleeping, then sleep and wake at nearly every
barrier for as long as the drain thread lives. In vLLM on two CPUs the drain loop alone, a
tenth of a second of work a round, put the engine's two threads to sleep ~7,000 times a round
(``bench/bench_vllm_contention.py``); with the drain on one OpenMP thread, capturing
``resid_post`` went from 0.66 to 0.81–0.86 of the engine's throughput (docs/capture.md, "The
drain's torch threads").

The team size is a per-thread setting (``omp_set_num_threads`` sets the calling thread's
value), so each of DMI's threads sets its own to 1 in every OpenMP runtime loaded in the
process; the model's threads keep theirs. DMI's threads get their parallelism from
``encode_threads``, not from OpenMP.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

import torch

__all__ = ["one_openmp_thread"]

_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)\b[^/]*\.so[.\d]*$")


def one_openmp_thread() -> int:
    """Make the calling thread's torch CPU kernels run on one OpenMP thread; returns
    ``torch.get_num_threads()`` as this thread now sees it (1 where it took)."""
    torch.get_num_threads()  # torch's own per-thread OpenMP set-up first, or it would undo ours later
    for set_num_threads in _openmp_runtimes():
        set_num_threads(1)
    return torch.get_num_threads()


@functools.cache
def _openmp_runtimes() -> tuple:
    """``omp_set_num_threads`` of every OpenMP runtime mapped into this process (torch's and any
    other library's: the setting is per thread, so setting it in all of them is harmless).
    Found through ``/proc/self/maps``; none where the system has no such file."""
    try:
        with open("/proc/self/maps") as f:  # address, perms, offset, device, inode, path
            paths = {parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6}
    except OSError:
        return ()
    found = []
    for path in sorted(p for p in paths if _RUNTIME.match(os.path.basename(p))):
        try:
            found.append(ctypes.CDLL(path).omp_set_num_threads)
        except (OSError, AttributeError):
            continue
    return tuple(found)
