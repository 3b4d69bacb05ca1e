"""The capture throughput comparison of ``bench_capture.py`` on a CUDA GPU.

Same five configurations in one run (baseline, DMI ``resid_post``, DMI all hooks but
patterns, naive hooks + ``torch.save`` for both), on a bigger Llama-style model — 16 layers,
hidden 2048, intermediate 5632, 16 heads, vocab 32000, bf16 — with batch 64, prompt 512,
64 new tokens. On CUDA the ring is pinned host memory, hook copies run on a side stream
(``wait_stream`` first, an event per slot) and the model's stream is never synchronised;
the naive approach's ``.to("cpu")`` synchronises on every hook.

The compiled rows (``compiled baseline``, ``compiled dmi resid_post``, see ``bench_capture``)
run here with ``--compile-mode reduce-overhead``: inductor plus CUDA graphs (cudagraph trees),
so the capture op replays inside the graph, writing into its fixed-address staging buffer.
UNTESTED: these rows were written without a GPU (no device was lent to the session that
added them); the first run on a GPU is their first run.

    python bench/bench_capture_gpu.py              # needs a CUDA GPU
    python bench/bench_capture_gpu.py --quick
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_capture  # noqa: E402

GPU_DEFAULTS = ["--device", "cuda", "--layers", "16", "--hidden", "2048", "--intermediate", "5632",
                "--heads", "16", "--vocab", "32000", "--batch", "64", "--prompt", "512", "--new", "64",
                "--ring-slots", "8", "--slot-mib", "256", "--compile-mode", "reduce-overhead"]


def main(argv=None):
    if not torch.cuda.is_available():
        print("bench_capture_gpu: no CUDA GPU here (torch.cuda.is_available() is False); "
              "run it on a machine with one", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv
    if quick:
        argv.remove("--quick")
        argv = ["--device", "cuda", "--layers", "4", "--hidden", "1024", "--intermediate", "2816", "--batch",
                "16", "--prompt", "128", "--new", "16", "--rounds", "1", "--compile-mode", "reduce-overhead"] + argv
        return bench_capture.main(argv)
    return bench_capture.main(GPU_DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main())
