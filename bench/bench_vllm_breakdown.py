"""Where DMI's cost goes inside vLLM: the same rounds as ``bench_vllm.py``'s ``resid_post`` row,
with the pipeline cut after each stage.

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the default workload of
``bench_vllm.py`` built by its own functions (8-layer hidden-512 Llama from a config,
float32, 16 requests of 128–256 prompt tokens, 64 sampled new tokens,
``max_num_batched_tokens`` 512), configurations interleaved round by round, the median of ``--rounds`` reported with the spread:

* ``none``          ``llm.generate``
* ``null writer``   capture with a writer that discards every record: hooks, step planning,
                    ring copies and the drain loop, nothing encoded, written or published
* ``no catalog``    capture into packs (zstd, checksums, statistics, fsync'd seals), nothing
                    published
* ``full, publish_interval=0``  published in the embedded catalog (chDB) at every request
                    finish: one seal and one publish per engine step that saw requests finish
* ``full``          capture published in the embedded catalog, as ``dmi.capture_vllm`` does by
                    default (finished requests published together, at most once a second)

Each DMI row's clock stops after ``cap.generate``'s flush (everything sealed; published for
``full``). Beside each DMI row, the CPU seconds its drain thread used in a round (median; from
``/proc``, Linux only): on a CPU engine that is time the model's cores did not get. Run in the
vLLM environment (``.venv-vllm``); ``--hooks`` to break down another selection.

    .venv-vllm/bin/python bench/bench_vllm_breakdown.py [--rounds 3] [--hooks resid_post]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import bench_vllm


_TICKS = os.sysconf("SC_CLK_TCK")


def drain_cpu(cap) -> float:
    """The CPU seconds the session's drain thread has used so far (Linux ``/proc``)."""
    with open(f"/proc/self/task/{cap.drain._thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class _NullWriter:
    """A pack writer that keeps nothing (the ``null writer`` row)."""

    def append(self, *args, **kwargs) -> None:
        return None

    def seal(self):
        return None

    def close(self) -> None:
        return None


def in_process_engine(prefix: str):
    """``bench_vllm.py``'s default workload, exactly, on one warmed-up engine in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``(llm, prompts, sampling params, scratch dir)``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    workload = bench_vllm.parser().parse_args([])
    root = tempfile.mkdtemp(prefix=prefix)
    model_dir = bench_vllm.build_model_dir(workload, root)
    llm = vllm.LLM(model=model_dir, enforce_eager=True, dtype=workload.dtype,
                   max_model_len=bench_vllm.max_model_len(workload), max_num_seqs=workload.requests,
                   max_num_batched_tokens=workload.max_num_batched_tokens, enable_prefix_caching=False, seed=0)
    vocab = bench_vllm.prompt_vocab(model_dir, bench_vllm.model_geometry(model_dir))
    prompts = [{"prompt_token_ids": ids} for ids in bench_vllm.prompts(workload, vocab)]
    params = vllm.SamplingParams(max_tokens=workload.max_tokens, temperature=1.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, vllm.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    return llm, prompts, params, root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hooks", default="resid_post")
    args = parser.parse_args()
    llm, prompts, params, root = in_process_engine("dmi-vllm-breakdown-")
    import vllm

    import dmi
    from dmi.capture import attach_vllm

    store = dmi.open(home=os.path.join(root, "home"))

    def capture(ctx) -> tuple[float, int, float]:
        """(seconds to the end of the flush, packs sealed, drain thread CPU seconds)."""
        with ctx as cap:
            t0 = time.perf_counter()
            cap.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t0, cap.stats["packs_sealed"], drain_cpu(cap)

    def none() -> tuple[float, None, None]:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, None, None

    rows = {
        "none": none,
        "null writer": lambda: capture(attach_vllm(llm, hooks=args.hooks, writer=_NullWriter())),
        "no catalog": lambda: capture(attach_vllm(llm, hooks=args.hooks, store=store.packs)),
        "full, publish_interval=0": lambda: capture(store.capture_vllm(llm, hooks=args.hooks, publish_interval=0)),
        "full": lambda: capture(store.capture_vllm(llm, hooks=args.hooks)),
    }
    load = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    packs: dict[str, list] = {name: [] for name in rows}
    drain: dict[str, list] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            elapsed, sealed, cpu = run()
            seconds[name].append(elapsed)
            packs[name].append(sealed)
            drain[name].append(cpu)
    base = statistics.median(seconds["none"])
    print(f"hooks {args.hooks}; {args.rounds} rounds; {os.cpu_count()} CPUs; vLLM {vllm.__version__}; "
          f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("| configuration | seconds a round (median; min–max) | × none (throughput) | packs sealed a round "
          "| drain thread CPU s a round |")
    print("|---|---:|---:|---:|---:|")
    for name, values in seconds.items():
        median = statistics.median(values)
        sealed = "" if packs[name][0] is None else f"{statistics.median(packs[name]):g}"
        cpu = "" if drain[name][0] is None else f"{statistics.median(drain[name]):.2f}"
        print(f"| {name} | {median:.2f} ({min(values):.2f}–{max(values):.2f}) | {base / median:.3f} | {sealed} | {cpu} |")


if __name__ == "__main__":
    main()
