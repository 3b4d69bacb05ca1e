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
Llama only, random weights).

    python bench/bench_audit_noise.py            # tiny for every architecture, smol for llama
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
        }[kind]
        kw = dict(SMOL if geometry == "smol" else SMALL)
        if kind == "mixtral":
            kw.update(num_local_experts=4, num_experts_per_tok=2)
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


def measure(kind: str, geometry: str, dtype: torch.dtype, lengths, new_tokens: int) -> dict:
    import dmi

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
    args = parser.parse_args()
    kinds = ["llama", "gpt2"] if args.quick else ["llama", "qwen2", "qwen3", "mistral", "mixtral", "gpt2"]
    runs = [(k, "tiny", (7, 4, 6, 2), 6) for k in kinds]
    if not args.quick:
        runs.append(("llama", "smol", (24, 9, 17, 3), 8))
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("# batch of prompts (left-padded, lengths below), greedy generate, every hook but attn_pattern")
    print(f"{'dtype':9} {'arch':8} {'geometry':8} {'prompts':14} {'new':>3} {'worst per-position error':>25} "
          f"{'at':16} {'bit-exact checks':>16}")
    for dname, dtype in DTYPES.items():
        for kind, geometry, lengths, new in runs:
            r = measure(kind, geometry, dtype, lengths, new)
            print(f"{dname:9} {kind:8} {geometry:8} {','.join(map(str, lengths)):14} {new:>3} {r['worst']:>25.3e} "
                  f"{r['where']:16} {r['exact']:>7}/{r['checks']:<8}{'' if r['ints_equal'] else ' (integer hooks differ)'}")


if __name__ == "__main__":
    main()
