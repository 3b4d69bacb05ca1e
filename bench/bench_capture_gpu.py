"""The capture throughput comparison of ``bench_capture.py`` on a CUDA GPU.

A Llama-style model with random weights — 16 layers, hidden 2048, intermediate 5632, 16 heads,
vocab 32000, bf16 — greedy generation, batch 16, prompt 128, 64 new tokens. On CUDA the ring
is pinned host memory, hook copies run on a side stream (``wait_stream`` first, an event per
slot) and the model's stream is never synchronised; the naive approach's ``.to("cpu")``
synchronises on every hook. Two sets of rows, run as two invocations so that a slow compile
cannot cost the eager figures:

* eager (default): baseline; DMI ``resid_post`` (a session per call, the same with the
  drain's work taken away — ``hooks only`` — and one session for the run against
  ``baseline copy``); DMI all hooks but patterns with one and with eight encode
  threads; naive hooks + ``torch.save`` for both selections;
* ``--compiled``: baseline, ``hf-compiled baseline`` and ``hf-compiled dmi resid_post``:
  transformers' ``generate`` compiles the decode steps itself (static cache, inductor with
  ``reduce-overhead``: CUDA graphs, cudagraph trees), and the session attached with
  ``compiled=True`` has the capture op replay inside them, writing into its fixed-address
  staging buffer. (The ``compiled ...`` rows, ``model.forward`` compiled by hand, failed on the
  first GPU run without DMI: docs/benchmarks.md, stop 38.)

``--no-catalog`` (packs sealed, nothing published) where chDB cannot be installed: the GPU
machines lent to this project take packages as wheels of at most 64 MiB in all, and chDB's
engine wheel is 181 MB.

    python bench/bench_capture_gpu.py [--no-catalog]              # needs a CUDA GPU
    python bench/bench_capture_gpu.py --compiled [--no-catalog]
    python bench/bench_capture_gpu.py --quick
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_capture  # noqa: E402

GPU_DEFAULTS = ["--device", "cuda", "--layers", "16", "--hidden", "2048", "--intermediate", "5632",
                "--heads", "16", "--vocab", "32000", "--batch", "16", "--prompt", "128", "--new", "64",
                "--ring-slots", "8", "--slot-mib", "256", "--compile-mode", "reduce-overhead"]
EAGER = ("baseline,dmi resid_post,dmi resid_post hooks only,naive resid_post,dmi all_but_patterns,dmi all_but_patterns 8 encode threads,"
         "naive all_but_patterns,baseline copy,dmi resid_post one session")
COMPILED = "baseline,hf-compiled baseline,hf-compiled dmi resid_post"


def main(argv=None):
    if not torch.cuda.is_available():
        print("bench_capture_gpu: no CUDA GPU here (torch.cuda.is_available() is False); "
              "run it on a machine with one", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    configs = EAGER
    if "--compiled" in argv:
        argv.remove("--compiled")
        configs = COMPILED
    argv = ["--configs", configs] + argv
    if "--quick" in argv:
        argv.remove("--quick")
        argv = ["--device", "cuda", "--layers", "4", "--hidden", "1024", "--intermediate", "2816", "--batch",
                "16", "--prompt", "128", "--new", "16", "--rounds", "1", "--compile-mode", "reduce-overhead"] + argv
        return bench_capture.main(argv)
    return bench_capture.main(GPU_DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main())
