"""Tensor-parallel generation throughput with DMI capture vs without: N ranks, one process each.

Workload: a Llama-style model with random weights — 8 layers, hidden 1024, intermediate
2816, 16 heads, vocab 32000, bf16 — sharded by transformers' own tensor parallelism
(``dmi.capture.load_tensor_parallel``: ``DistributedConfig(tp_size=N)``), greedy
generation, batch 8, prompt 128, 32 new tokens. Ranks are spawned here (``torch.multiprocessing``,
process group through a file, no ports); on CPU with gloo and ``--threads`` torch threads per
rank (default 1), on CUDA with NCCL, one GPU per rank (``bench_capture_tp_gpu.py``).
Configurations, interleaved round by round so drift on a shared machine hits all alike:

* ``baseline``             ``model.generate`` on every rank, nothing attached
* ``dmi resid_post``       every layer's ``resid_post``: replicated, so written by TP rank 0
                           only; every rank attaches (one embedded chDB store, shared)
* ``dmi all_but_patterns`` every hook but ``attn_pattern``: q/k/v/z and ``mlp_post`` written
                           by every rank (its shard, with geometry), the rest by rank 0

A configuration's time is the slowest rank's, between two barriers, packs sealed and
published before the clock stops. Reported: tokens/s (batch × new tokens / time) and the
ratio to the baseline of the same round (median over rounds).

    python bench/bench_capture_tp.py               # full (do not run on a shared 2-core VM)
    python bench/bench_capture_tp.py --quick       # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

CONFIGS = {"baseline": None, "dmi resid_post": "resid_post", "dmi all_but_patterns": "all_but_patterns"}


def build(args, path: str) -> None:
    """Save the random-weight model once; every rank loads (and shards) it from ``path``."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new + 8)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def rank_main(rank: int, args, workdir: str, queue) -> None:
    import torch.distributed as dist

    import dmi
    from dmi.capture import load_tensor_parallel

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{workdir}/pg-init",
                            rank=rank, world_size=args.ranks)
    model = load_tensor_parallel(f"{workdir}/model", args.ranks, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    times: dict[str, list[float]] = {name: [] for name in args.configs}
    with dmi.open(home=f"{workdir}/home") as store, torch.no_grad():
        model.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, pad_token_id=0)  # warm-up
        for round_ in range(args.rounds):
            for name in args.configs:
                times[name].append(_timed(model, ids, mask, gen, CONFIGS[name], store, f"r{round_}-{name}", cuda))
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def _timed(model, ids, mask, gen, hooks, store, run_id, cuda) -> float:
    """Seconds of one generate (with capture when ``hooks``), the slowest rank's."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    if hooks is None:
        model.generate(input_ids=ids, attention_mask=mask, **gen)
    else:
        with store.capture(model, hooks=hooks, model_id="bench-tp", run_id=run_id.replace(" ", "-")) as cap:
            cap.generate(ids, attention_mask=mask, **gen)
    if cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke test")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 64, 128, 4, 4
        args.vocab, args.batch, args.prompt, args.new, args.rounds = 128, 2, 8, 4, 1
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"bench_capture_tp: {args.ranks} ranks need {args.ranks} CUDA GPUs, found {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dmi-bench-tp-") as workdir:
        build(args, f"{workdir}/model")
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, args, workdir, queue)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        times = queue.get()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            print(f"bench_capture_tp: a rank failed (exit codes {[proc.exitcode for proc in procs]})", file=sys.stderr)
            return 1
    report(args, times)
    return 0


def report(args, times: dict[str, list[float]]) -> None:
    tokens = args.batch * args.new
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.device}, {args.ranks} TP ranks, {args.threads} thread(s)/rank")
    print(f"# Llama {args.layers}L h{args.hidden} i{args.intermediate} {args.heads} heads ({args.kv_heads} kv) "
          f"vocab {args.vocab} bf16; batch {args.batch}, prompt {args.prompt}, {args.new} new; {args.rounds} round(s)")
    base = times.get("baseline")
    for name, seconds in times.items():
        ratio = "" if base is None else f"  x{statistics.median(t0 / t for t0, t in zip(base, seconds)):.2f} of baseline"
        print(f"{name:24s} {tokens / statistics.median(seconds):10.1f} tok/s{ratio}")


if __name__ == "__main__":
    sys.exit(main())
