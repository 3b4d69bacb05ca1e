"""Tensor-parallel noise per dtype: how far a TP capture, merged, is from the request re-run alone, unsharded.

This measures what ``dmi audit``'s ``tp`` tolerance must allow (docs/audit.md). For each
dtype (float32, bfloat16, float16) and each model, a model with random weights is built from a config
and saved; two ranks (spawned here, gloo on CPU, one torch thread each, process group
through a file) load it sharded by transformers' own tensor parallelism
(``dmi.capture.load_tensor_parallel``) and generate greedily from a left-padded batch under
``dmi.capture`` (every hook but ``attn_pattern``, plus ``token_ids``) into one temporary
store. This process then audits every request against the full, unsharded model and
prints the worst per-position error (``max |captured - rerun| / max |rerun|`` over a
position's values) over every (request, hook, layer) — the merged TP capture against the
alone re-run — next to the same batch captured unsharded (``batched``: what batching alone
costs). Nothing here is timed.

Models: ``tiny`` Llama (3 layers, hidden 32, 4 heads / 4 kv heads), Qwen2 (2 kv heads) and
Mixtral (4 experts), and the SmolLM2-135M geometry with 8 of its 30 layers (``smol8``:
hidden 576, 9 heads are not divisible by 2 ranks, so 8 heads / 2 kv heads of 72 dims).

    python bench/bench_audit_tp_noise.py            # every model, every dtype
    python bench/bench_audit_tp_noise.py --dtype float16
    python bench/bench_audit_tp_noise.py --quick    # tiny llama, float32 only
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import torch
from bench_audit_noise import batch as left_padded_random_batch  # bench/ is the script's folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
SMOL8 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=72, max_position_embeddings=2048,
             tie_word_embeddings=True)
MODELS = {"llama": ("llama", TINY), "qwen2": ("qwen2", dict(TINY, num_key_value_heads=2)),
          "mixtral": ("mixtral", dict(TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
          "smol8": ("llama", SMOL8)}
LENGTHS = (7, 4, 6, 2)
NEW = 4
WORLD = 2


def build(name: str, dtype: torch.dtype, path: str) -> None:
    import transformers as tf

    kind, kw = MODELS[name]
    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[kind]
    torch.manual_seed(0)
    model_cls(cfg_cls(**kw)).to(dtype).save_pretrained(path)


def batch(vocab: int, seed: int = 1):
    """The left-padded batch of ``LENGTHS``, built as the batching-noise benchmark builds its own."""
    return left_padded_random_batch(LENGTHS, vocab, seed)


def rank_main(rank: int, init: str, home: str, path: str, dtype_name: str, model_id: str) -> None:
    import torch.distributed as dist

    import dmi
    from dmi.capture import load_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    model = load_tensor_parallel(path, WORLD, dtype=DTYPES[dtype_name]).eval()
    ids, mask = batch(model.config.vocab_size)
    with dmi.open(home=home) as store, torch.no_grad():
        with store.capture(model, hooks="all_but_patterns token_ids", model_id=model_id, run_id="tp") as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    dist.destroy_process_group()


def worst(report) -> tuple[float, str, bool]:
    floats = [c for c in report.checks if c.hook not in ("token_ids", "router_topk")]
    w = max(floats, key=lambda c: c.max_rel)
    ints = all(c.verdict == "exact" for c in report.checks if c.hook in ("token_ids", "router_topk"))
    return w.max_rel, f"{w.hook}@{w.layer}", ints


def measure(name: str, dtype_name: str) -> dict:
    import torch.multiprocessing as mp
    import transformers

    import dmi

    with tempfile.TemporaryDirectory() as tmp:
        path, home = os.path.join(tmp, "model"), os.path.join(tmp, "home")
        build(name, DTYPES[dtype_name], path)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, str(Path(tmp) / "pg"), home, path, dtype_name, "tp"))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"{name} {dtype_name}: a rank failed (exit codes {[p.exitcode for p in procs]})")
        full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype_name]).eval()
        ids, mask = batch(full.config.vocab_size)
        with dmi.open(home=home) as store:
            with torch.no_grad(), store.capture(full, hooks="all_but_patterns token_ids", model_id="tp1") as cap:
                cap.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            tp = worst(store.audit("tp", model=full, requests=len(LENGTHS), record=False))
            batched = worst(store.audit("tp1", model=full, requests=len(LENGTHS), record=False))
    return {"tp": tp, "batched": batched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny llama, float32 only")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="only this dtype (repeatable)")
    args = parser.parse_args()
    names = ["llama"] if args.quick else list(MODELS)
    dtypes = ["float32"] if args.quick else (args.dtype or list(DTYPES))
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {WORLD} ranks (gloo, "
          f"1 thread each); re-run: {torch.get_num_threads()} threads")
    print(f"# left-padded batch of prompts {','.join(map(str, LENGTHS))}, greedy generate {NEW} new tokens, "
          "every hook but attn_pattern")
    print(f"{'dtype':9} {'model':8} {'tp: worst per-position error':>29} {'at':14} {'batched, unsharded':>19} {'at':14}")
    for dname in dtypes:
        for name in names:
            r = measure(name, dname)
            (tp, tp_at, tp_ints), (b, b_at, b_ints) = r["tp"], r["batched"]
            note = "" if tp_ints and b_ints else " (integer hooks differ)"
            print(f"{dname:9} {name:8} {tp:>29.3e} {tp_at:14} {b:>19.3e} {b_at:14}{note}", flush=True)


if __name__ == "__main__":
    main()
