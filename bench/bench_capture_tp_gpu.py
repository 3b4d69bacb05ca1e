"""The tensor-parallel capture comparison of ``bench_capture_tp.py`` on several CUDA GPUs.

Same three configurations (baseline, DMI ``resid_post``, DMI all hooks but patterns), one
rank per GPU over NCCL (``--ranks``, default: every GPU here), on a bigger Llama-style model
— 16 layers, hidden 2048, intermediate 5632, 16 heads (8 kv), vocab 32000, bf16 — batch 64,
prompt 512, 64 new tokens. Each rank's hook copies run on its own side stream into pinned
host memory; the replicated residual stream is written by TP rank 0 only.

    python bench/bench_capture_tp_gpu.py              # needs 2+ CUDA GPUs
    python bench/bench_capture_tp_gpu.py --quick
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_capture_tp  # noqa: E402

GPU_DEFAULTS = ["--device", "cuda", "--layers", "16", "--hidden", "2048", "--intermediate", "5632",
                "--heads", "16", "--kv-heads", "8", "--vocab", "32000", "--batch", "64", "--prompt", "512",
                "--new", "64", "--threads", "0"]


def main(argv=None) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"bench_capture_tp_gpu: tensor parallelism needs 2+ CUDA GPUs, found {gpus}; "
              "run it on a machine with several", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    ranks = [] if "--ranks" in argv else ["--ranks", str(gpus)]
    if "--quick" in argv:
        return bench_capture_tp.main(["--device", "cuda", "--threads", "0", *ranks, *argv])
    return bench_capture_tp.main(GPU_DEFAULTS + ranks + argv)


if __name__ == "__main__":
    sys.exit(main())
