"""vLLM vs Hugging Face noise per dtype and hook: how far a vLLM capture is from the audit's re-run.

This measures what ``dmi audit``'s ``vllm`` tolerance must allow (docs/audit.md). For each
geometry and dtype, a Llama with random weights is saved as a Hugging Face directory (DMI's
byte tokenizer), served by an in-process ``vllm.LLM`` (eager, no prefix cache,
``max_num_batched_tokens=64`` so the long prompts are split by chunked prefill and share
forwards with the others' decode steps), and requests of different lengths are generated
greedily under ``store.capture_vllm`` (every hook but ``attn_pattern``, plus ``token_ids``).
Then ``store.audit`` re-runs every request alone through transformers loading the same
directory in the same dtype — the audit's own re-run and comparison, with the ``vllm`` bound
lifted so that nothing is refused — and the worst per-position error (``max |captured -
rerun| / max |rerun|`` over a position's values) is printed per dtype, geometry and hook,
with the layer where it was. Nothing here is timed.

Each (geometry, dtype) runs in a fresh process (a vLLM engine per process).

Geometries: ``tiny`` (the test model of ``tests/_vllm.py``: 3 layers, hidden 128, 2 heads of
64, 1 KV head) and ``smol`` (the SmolLM2-135M geometry: 30 layers, hidden 576, 9 heads / 3
KV heads of 64, intermediate 1536; the byte tokenizer's vocabulary).

    python bench/bench_audit_vllm_noise.py            # tiny and smol, float32 and bfloat16
    python bench/bench_audit_vllm_noise.py --quick    # tiny, float32 and bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

GEOMETRIES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1),
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
}
PROMPTS = [
    "x",
    "hello there",
    "the quick brown fox jumps over the lazy dog",
    "a much longer prompt that the scheduler has to split into chunks " * 2,
    "and another one, long enough for three chunks of sixty-four tokens each " * 3,
]
NEW_TOKENS = 6


def model_dir(root: str, geometry: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmi._models import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                         **GEOMETRIES[geometry])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    path = os.path.join(root, f"llama-{geometry}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def measure(geometry: str, dtype: str) -> dict:
    """One (geometry, dtype) in this process: capture in vLLM, audit against transformers."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from transformers import AutoModelForCausalLM

    import dmi
    from dmi import _audit_compare

    with tempfile.TemporaryDirectory() as root:
        path = model_dir(root, geometry)
        llm = vllm.LLM(model=path, enforce_eager=True, dtype=dtype, max_num_seqs=8, enable_prefix_caching=False,
                       max_model_len=512, max_num_batched_tokens=64)
        params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        with dmi.open(home=os.path.join(root, "home")) as store:
            with store.capture_vllm(llm, hooks="all_but_patterns token_ids") as cap:
                outs = cap.generate(PROMPTS, params)
                model_id = cap.model_id
            del llm
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
            _audit_compare.VLLM_NOISE = {k: float("inf") for k in _audit_compare.VLLM_NOISE}
            report = store.audit(model_id, model=hf, request_ids=[o.request_id for o in outs], record=False)
    worst: dict[str, tuple[float, int]] = {}
    for c in report.checks:
        if c.hook in ("token_ids", "router_topk"):
            assert c.verdict == "exact", c.describe()
            continue
        if c.hook not in worst or c.max_rel > worst[c.hook][0]:
            worst[c.hook] = (c.max_rel, c.layer)
    return {"tolerance": report.tolerance, "failed": [c.describe() for c in report.failures],
            "prompt_lengths": [len(o.prompt_token_ids) for o in outs], "worst": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny geometry only")
    parser.add_argument("--one", nargs=2, metavar=("GEOMETRY", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(*args.one)))
        return
    import vllm

    geometries = ["tiny"] if args.quick else ["tiny", "smol"]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"vllm {vllm.__version__}; load average at start {os.getloadavg()[0]:.1f}")
    print(f"# {len(PROMPTS)} prompts, chunked prefill (64 tokens a forward), {NEW_TOKENS} greedy tokens each")
    print(f"{'dtype':9} {'geometry':8} {'hook':14} {'worst per-position error':>25} {'at layer':>8}")
    overall: dict[str, float] = {}
    for dtype in ("float32", "bfloat16"):
        for geometry in geometries:
            child = subprocess.run([sys.executable, __file__, "--one", geometry, dtype], capture_output=True,
                                   text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            line = next((ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if child.returncode or line is None:
                print(f"{dtype:9} {geometry:8} failed: {(child.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            r = json.loads(line.removeprefix("RESULT "))
            assert r["tolerance"] == "vllm" and not r["failed"], r
            for hook, (err, layer) in sorted(r["worst"].items(), key=lambda kv: -kv[1][0]):
                print(f"{dtype:9} {geometry:8} {hook:14} {err:>25.3e} {layer:>8}")
                overall[dtype] = max(overall.get(dtype, 0.0), err)
    print("# worst per dtype: " + ", ".join(f"{d} {e:.3e}" for d, e in overall.items())
          + f"; load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
