"""Where DMI's cost goes inside vLLM: the same rounds as ``bench_vllm.py``'s ``resid_post`` row,
with the pipeline cut after each stage.

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the workload of
``bench_vllm.py`` (8-layer hidden-512 Llama from a config, float32, 16 requests of 128–256
prompt tokens, 64 sampled new tokens, ``max_num_batched_tokens`` 512), configurations
interleaved round by round, the median of ``--rounds`` reported with the spread:

* ``none``          ``llm.generate``
* ``null writer``   capture with a writer that discards every record: hooks, step planning,
                    ring copies and the drain loop, nothing encoded, written or published
* ``no catalog``    capture into packs (zstd, checksums, statistics, fsync'd seals), nothing
                    published
* ``full``          capture published in the embedded catalog (chDB), as ``dmi.capture_vllm``

Each DMI row's clock stops after ``cap.generate``'s flush (everything sealed; published for
``full``). Run in the vLLM environment (``.venv-vllm``); ``--hooks`` to break down another
selection.

    .venv-vllm/bin/python bench/bench_vllm_breakdown.py [--rounds 3] [--hooks resid_post]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time


class _NullWriter:
    """A pack writer that keeps nothing (the ``null writer`` row)."""

    def append(self, *args, **kwargs) -> None:
        return None

    def seal(self):
        return None

    def close(self) -> None:
        return None


def build_model(root: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmi._models import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=352,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    path = os.path.join(root, "breakdown-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hooks", default="resid_post")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    import dmi
    from dmi.capture import attach_vllm

    root = tempfile.mkdtemp(prefix="dmi-vllm-breakdown-")
    llm = vllm.LLM(model=build_model(root), enforce_eager=True, dtype="float32", max_model_len=352, max_num_seqs=16,
                   max_num_batched_tokens=512, enable_prefix_caching=False, seed=0)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(128 + 128 * i // 15)]} for i in range(16)]
    params = vllm.SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, vllm.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    store = dmi.open(home=os.path.join(root, "home"))

    def capture(ctx) -> float:
        with ctx as cap:
            t0 = time.perf_counter()
            cap.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t0

    def none() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    rows = {
        "none": none,
        "null writer": lambda: capture(attach_vllm(llm, hooks=args.hooks, writer=_NullWriter())),
        "no catalog": lambda: capture(attach_vllm(llm, hooks=args.hooks, store=store.packs)),
        "full": lambda: capture(store.capture_vllm(llm, hooks=args.hooks)),
    }
    load = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            seconds[name].append(run())
    base = statistics.median(seconds["none"])
    print(f"hooks {args.hooks}; {args.rounds} rounds; {os.cpu_count()} CPUs; vLLM {vllm.__version__}; "
          f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("| configuration | seconds a round (median; min–max) | × none (throughput) |")
    print("|---|---:|---:|")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} ({min(values):.2f}–{max(values):.2f}) | {base / median:.3f} |")


if __name__ == "__main__":
    main()
