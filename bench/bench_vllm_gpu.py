"""The vLLM throughput comparison of ``bench_vllm.py`` on one CUDA GPU, bounded in time.

Same four configurations, interleaved, in one run (no capture, DMI ``resid_post`` of every
layer, DMI all hooks but patterns, vLLM's native ``extract_hidden_states``) on a Llama of
1B-class shapes built from a config with random weights (nothing is downloaded) — 16 layers,
hidden 2048, intermediate 8192, 32 heads of 64 (8 KV heads), vocab 32000, bf16 — 32 requests,
prompts of 128–256 tokens, 64 new tokens each, three rounds. Every engine is eager
(``enforce_eager=True``: DMI refuses CUDA graphs, so the rows compare like with like); the
native row uses vLLM's ``ExampleHiddenStatesConnector`` unmodified (pinned memory and its CUDA
copy stream work here). The two engines share the GPU (``--gpu-memory-utilization`` 0.4 each)
and are built one after the other, each profiling the memory left to it.

The run is bounded: ``--time-limit`` (default 420 s) covers building the model, both engines
and every round; what has not finished by then is killed and reported as not run. Results go
to ``bench/out/bench_vllm-<UTC time>.json`` and ``.md``, like the CPU benchmark.

    python bench/bench_vllm_gpu.py                  # needs a CUDA GPU and vLLM built for it
    python bench/bench_vllm_gpu.py --rounds 1       # any bench_vllm.py option overrides a default
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vllm  # noqa: E402

GPU_DEFAULTS = dict(
    device="cuda", layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000, dtype="bfloat16",
    requests=32, prompt=256, max_tokens=64, max_num_batched_tokens=2048, rounds=3, gpu_memory_utilization=0.4,
    native_connector="ExampleHiddenStatesConnector", native_connector_module="", serial_start=True, time_limit=420,
)
"""bench_vllm.py's options, changed for a GPU; the command line overrides each."""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" not in argv and "--help" not in argv and not _cuda():
        print("bench_vllm_gpu: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one, "
              "or run bench/bench_vllm.py on CPU", file=sys.stderr)
        return 2
    return bench_vllm.main(argv, defaults=GPU_DEFAULTS)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
