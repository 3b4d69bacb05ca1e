"""vLLM offline throughput with DMI capture vs without vs vLLM's native hidden-states extractor.

Workload (issue 12): a Llama built from a config with random weights — 8 layers, hidden 512,
8 heads of 64, intermediate 1376, the vocabulary of DMI's byte tokenizer, float32 — saved as
a Hugging Face directory (``--model DIR`` takes a real one instead); ``--requests`` prompts of
token ids drawn from a seeded generator, lengths spread evenly from half ``--prompt`` to
``--prompt``; ``--max-tokens`` new tokens each (``ignore_eos``, no detokenization), sampled at
temperature 1 (``--sampling greedy`` for greedy: on a random-weight model greedy output repeats
itself, and the native extractor's speculative step then skips forwards — see below).
Every engine is eager (``enforce_eager=True``, which DMI requires) without prefix caching,
in this process's own child (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` inside it). Configurations,
interleaved round by round so that drift on a shared machine hits all of them alike:

* ``none``                    ``llm.generate``, nothing attached
* ``dmi resid_post``          ``dmi.capture_vllm(llm, hooks="resid_post")`` (every layer), then
                              ``cap.generate`` — which flushes: every request's records are
                              sealed, fsync'd and published in the catalog (embedded chDB)
                              when it returns, and the clock stops there
* ``dmi all_but_patterns``    the same with every hook but ``attn_pattern``
* ``dmi resid_post drain_nice=19``, ``dmi all_but_patterns drain_nice=19`` (only when named in
                              ``--configs``) the same with the drain 19 nice levels below the
                              engine's threads (``capture_vllm(drain_nice=19)``; its default is 0)
* ``dmi resid_post buffered writes``, ``dmi all_but_patterns buffered writes`` (only when
                              named) the same with packs written through the page cache
                              (the store's ``direct_writes`` off for the round) instead of around it
* ``native extract_hidden_states`` vLLM's own extractor (``speculative_config`` method
                              ``extract_hidden_states``, ``eagle_aux_hidden_state_layer_ids``
                              1..L: the output of every layer, DMI's ``resid_post``; prompt and
                              generated tokens, ``include_output_tokens``) through a
                              hidden-states KV connector, one safetensors file per request.
                              vLLM writes a request's file on the engine step after it
                              finished, which ``llm.generate`` does not run: the engine is
                              stepped until its scheduler holds no request and every file's
                              lock is released, inside the clock. On CPU the connector is
                              ``_vllm_native.CPUHiddenStatesConnector`` (the stock one needs
                              CUDA; what it changes is printed and stored with the results);
                              its files are not fsync'd. Checked once by hand on the tests'
                              3-layer model (float32): its rows equal DMI's ``resid_post``
                              records of the same requests (largest difference 4.5e-8).
                              Its "draft" token is the token just sampled, accepted whenever
                              the next token repeats it: such a step yields two tokens.
                              Its files are kept until the run ends, as DMI's packs are:
                              deleting each round's files let the next round write into
                              page-cache pages just freed, many times faster to write on a VM
                              that returns free memory to its host (``bench_page_cache.py``).

``none`` and the DMI rows share one engine (DMI attaches before, detaches after its timed
``cap.generate``; both reported, untimed); the native row has its own engine (speculative
decoding changes the engine), in its own process: vLLM's process-wide state allows one engine
a process. Only one engine runs at a time, each after an untimed warm-up (the whole batch with
4 new tokens). Every engine's model carries a forward pre-hook
that counts forwards and the tokens they ran (the same on every row), reported so that rows
whose engines did different work for the same output show it. Under ``--sampling greedy``
generated tokens are compared with ``none``'s.

Reported per configuration: generated tokens/s and total (prompt + generated) tokens/s, the
median over rounds and the spread (min–max), and the ratio to ``none`` of the same round
(median); the issue's targets beside them (resid_post ≥ 0.90 of ``none`` and ahead of the
native extractor; all_but_patterns ≥ 0.80). Machine limits measured in the same run: memcpy
of a buffer the size of one step's ``resid_post`` bytes (the largest step), zstd-1 compression
of float data of the model's dtype, an fsync'd write of one round's ``resid_post`` bytes.
Conditions (CPUs, versions, geometry, prompts, load average at start and end) go with them
into ``bench/out/bench_vllm-<UTC time>.json`` and ``.md``.

``--time-limit`` bounds the whole run: engines still running then are killed and the rows not
measured are reported as not run, with the reason.

    python bench/bench_vllm.py              # full (minutes on 2 cores)
    python bench/bench_vllm.py --quick      # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
NONE, RESID, ABP, NATIVE = "none", "dmi resid_post", "dmi all_but_patterns", "native extract_hidden_states"
RESID_NICE, ABP_NICE = f"{RESID} drain_nice=19", f"{ABP} drain_nice=19"
RESID_BUFFERED, ABP_BUFFERED = f"{RESID} buffered writes", f"{ABP} buffered writes"
CONFIGS = (NONE, RESID, ABP, NATIVE)
KNOWN = (*CONFIGS, RESID_NICE, ABP_NICE, RESID_BUFFERED, ABP_BUFFERED)
"""Every configuration ``--configs`` takes; the default runs ``CONFIGS``."""
DMI_HOOKS = {RESID: "resid_post", ABP: "all_but_patterns", RESID_NICE: "resid_post", ABP_NICE: "all_but_patterns",
             RESID_BUFFERED: "resid_post", ABP_BUFFERED: "all_but_patterns"}
BUFFERED = {RESID_BUFFERED, ABP_BUFFERED}
"""Configurations whose packs are written through the page cache (the store's ``direct_writes`` off)."""
DRAIN_NICE = {RESID_NICE: 19, ABP_NICE: 19}
"""The drain's nice level of a configuration (others: ``capture_vllm``'s default, 0)."""
TARGETS = {RESID: 0.90, ABP: 0.80}
"""The issue's throughput targets, as a fraction of ``none``."""


class BenchError(RuntimeError):
    """A configuration did not do what it is measured doing (missing records or files, an engine that died)."""


# --- model and workload ---------------------------------------------------------------------


def build_model_dir(args, root: str) -> str:
    """Save the random-weight Llama of ``args`` with DMI's byte tokenizer under ``root``; return its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmi._models import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=args.vocab or len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_model_len(args), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    path = os.path.join(root, "bench-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def model_geometry(model_dir: str) -> dict:
    """Layers, hidden size, heads, vocabulary and intermediate size from the directory's config."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    return {k: c.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "vocab_size", "model_type")}


def prompts(args, vocab: int) -> list[list[int]]:
    """``args.requests`` prompts of token ids (seeded), lengths evenly from ``prompt // 2`` to ``prompt``."""
    import random

    rng = random.Random(1)
    lo = max(1, args.prompt // 2)
    lengths = [lo + (args.prompt - lo) * i // max(1, args.requests - 1) for i in range(args.requests)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def max_model_len(args) -> int:
    """The engine's context: the longest prompt plus its new tokens, up to a multiple of 32."""
    if args.max_model_len:
        return args.max_model_len
    return -(-(args.prompt + args.max_tokens + 1) // 32) * 32


def engine_kwargs(args, native_layers: list[int] | None, native_dir: str | None) -> dict:
    """``vllm.LLM`` arguments: eager, no prefix cache, and for the native row its extractor."""
    kw = dict(enforce_eager=True, dtype=args.dtype, max_model_len=max_model_len(args),
              max_num_seqs=args.max_num_seqs or args.requests, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, seed=0)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if native_layers is not None:
        connector = {"kv_connector": args.native_connector, "kv_role": "kv_producer",
                     "kv_connector_extra_config": {"shared_storage_path": native_dir}}
        if args.native_connector_module:
            connector["kv_connector_module_path"] = args.native_connector_module
        draft = {"hf_config": {"eagle_aux_hidden_state_layer_ids": native_layers}}
        kw["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": draft}
        kw["kv_transfer_config"] = connector
    return kw


# --- engines, each in a child process -------------------------------------------------------


def engine_main(conn, spec: dict) -> None:
    """A child process: build one engine from ``spec``, then run rounds on demand until told to stop.

    Every request is answered with ``("ok", result)`` or ``("error", message)``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: DMI's hooks reach it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    sys.path.insert(0, BENCH_DIR)  # the native connector's module, by kv_connector_module_path
    try:
        engine = _Engine(spec)
        conn.send(("ok", engine.describe()))
    except Exception as e:  # reported to the parent, which names the row and the reason
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    with engine:
        while True:
            name = conn.recv()
            if name is None:
                return
            try:
                conn.send(("ok", engine.run(name)))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))


class _Engine:
    """One ``vllm.LLM`` and what a round of each of its configurations needs (a DMI store, the native files)."""

    def __init__(self, spec: dict):
        import torch
        import vllm

        import dmi

        self.spec = spec
        self.llm = vllm.LLM(model=spec["model_dir"], **spec["engine"])
        self.prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        self.sampling = self._sampling(spec["max_tokens"])
        self.counter = _ForwardCounter()
        self.llm.collective_rpc(self.counter.install)
        self.stack = contextlib.ExitStack()
        self.store = None if spec["native"] else self.stack.enter_context(dmi.open(home=spec["dmi_home"]))
        self.torch_threads = torch.get_num_threads()
        self._warm_up()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()
        return False

    def describe(self) -> dict:
        import torch
        import vllm

        return {"torch": torch.__version__, "vllm": vllm.__version__, "torch_threads": self.torch_threads}

    def _warm_up(self) -> None:
        """Untimed: the whole batch with 4 new tokens (every prefill shape of the rounds), and on the
        capture engine a short captured generate."""
        short = self._sampling(min(4, self.spec["max_tokens"]))
        outs = self.llm.generate(self.prompts, short, use_tqdm=False)
        if self.spec["native"]:
            self._wait_native(outs)
            self._native_files(outs)
        else:
            with self.store.capture_vllm(self.llm, hooks="resid_post", model_id="bench-warm-up") as cap:
                cap.generate(self.prompts[:2], self._sampling(2), use_tqdm=False)

    def _sampling(self, max_tokens: int):
        """Sampling at temperature 1 or greedy; ``ignore_eos``, no detokenizing; on the native engine
        the generated tokens' rows asked for too (``include_output_tokens``). Not seeded per request:
        vLLM's CPU sampler refuses it ("CPU Generator does not use offset")."""
        import vllm

        extra = {"kv_transfer_params": {"include_output_tokens": True}} if self.spec["native"] else None
        temperature = 0.0 if self.spec["sampling"] == "greedy" else 1.0
        return vllm.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, detokenize=False,
                                   extra_args=extra)

    def run(self, name: str) -> dict:
        """One round of configuration ``name``, with the model forwards and tokens it took."""
        runs = {NONE: self._run_none, NATIVE: self._run_native, **{dmi: self._run_dmi for dmi in DMI_HOOKS}}
        if name not in runs:
            raise BenchError(f"unknown configuration {name!r}")
        forwards, tokens = self.counter.forwards, self.counter.tokens
        result = runs[name](name) if name in DMI_HOOKS else runs[name]()
        result.update(forwards=self.counter.forwards - forwards, model_tokens=self.counter.tokens - tokens)
        return result

    def _sync(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _run_none(self) -> dict:
        self._sync()
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.sampling, use_tqdm=False)
        self._sync()
        return {"seconds": time.perf_counter() - t0, "tokens": _tokens(outs)}

    def _run_dmi(self, name: str) -> dict:
        self.store.packs.direct_writes = name not in BUFFERED
        try:
            return self._run_dmi_round(name)
        finally:
            self.store.packs.direct_writes = True

    def _run_dmi_round(self, name: str) -> dict:
        t0 = time.perf_counter()
        with self.store.capture_vllm(self.llm, hooks=DMI_HOOKS[name], model_id=_model_id(name),
                                     drain_nice=DRAIN_NICE.get(name, 0)) as cap:
            t1 = time.perf_counter()
            self._sync()
            outs = cap.generate(self.prompts, self.sampling, use_tqdm=False)  # flushes: records published
            self._sync()
            t2 = time.perf_counter()
            s = cap.stats
        t3 = time.perf_counter()
        published = {r.request_id for r in self.store.requests(_model_id(name), run_id=cap.run_id)}
        missing = {o.request_id for o in outs} - published
        if missing:
            raise BenchError(f"{name}: {len(missing)} request(s) not published when generate returned: "
                             f"{sorted(missing)[:5]}")
        if s["records_lost"] or s["tensors_dropped"]:
            raise BenchError(f"{name}: capture lost records ({s['records_lost']}) or dropped tensors "
                             f"({s['tensors_dropped']})")
        return {"seconds": t2 - t1, "tokens": _tokens(outs), "attach_s": t1 - t0, "detach_s": t3 - t2,
                "hook_s": s["hook_seconds"], "drain_busy_s": s["drain_busy_seconds"], "ring_waits": s["ring_waits"],
                "records": s["records"], "packs": s["packs_published"], "captured_bytes": s["reserved_bytes"]}

    def _run_native(self) -> dict:
        self._sync()
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.sampling, use_tqdm=False)
        extra_steps = self._wait_native(outs)
        t1 = time.perf_counter()
        files, size = self._native_files(outs)
        return {"seconds": t1 - t0, "tokens": _tokens(outs), "extra_steps": extra_steps, "files": files,
                "captured_bytes": size}

    def _wait_native(self, outs) -> int:
        """Step the engine until its scheduler holds no request (the finished requests' files are
        written on that step), then wait for each file's lock (the stock connector writes on a
        thread pool). Returns the steps it took."""
        import fcntl

        core = self.llm.llm_engine.engine_core.engine_core
        steps = 0
        while core.scheduler.has_requests():
            if steps >= 100:
                raise BenchError("native: the engine still holds finished requests after 100 extra steps")
            self.llm.llm_engine.step()
            steps += 1
        for out in outs:
            lock = _native_path(out) + ".lock"
            if os.path.exists(lock):
                with open(lock) as f:
                    fcntl.flock(f, fcntl.LOCK_SH)  # released once the write is done
        return steps

    def _native_files(self, outs) -> tuple[int, int]:
        """Check every request's file holds (tokens, layers, hidden) rows; return (files, bytes)."""
        from safetensors import safe_open

        size = 0
        layers = len(self.spec["native_layers"])
        for out in outs:
            path = _native_path(out)
            if not os.path.exists(path):
                raise BenchError(f"native: no hidden-states file for request {out.request_id} ({path})")
            with safe_open(path, "pt") as f:
                shape = tuple(f.get_slice("hidden_states").get_shape())
            fed = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
            if shape[:2] != (fed, layers):
                raise BenchError(f"native: request {out.request_id} file holds {shape}, "
                                 f"expected ({fed}, {layers}, hidden)")
            size += os.path.getsize(path)  # kept until the run ends, as DMI's packs are (module docstring)
        return len(outs), size


class _ForwardCounter:
    """A forward pre-hook on the engine's model counting forwards and the tokens they ran: the same
    on every engine and every row (a few microseconds a forward), so rows whose engines run
    different numbers of forwards for the same output (the native extractor's speculative decoding
    accepts its "draft" — the token just sampled — whenever the next token repeats it) show it."""

    def __init__(self):
        self.forwards = 0
        self.tokens = 0

    def install(self, worker):
        worker.model_runner.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.forwards += 1
            self.tokens += int(ids.shape[0])


def _native_path(out) -> str:
    params = out.kv_transfer_params or {}
    if "hidden_states_path" not in params:
        raise BenchError(f"native: request {out.request_id} came back without a hidden_states_path ({params})")
    return params["hidden_states_path"]


def _model_id(name: str) -> str:
    return "bench-" + DMI_HOOKS[name].replace("_", "-")


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


class EngineProcess:
    """The parent's handle on one engine child: every wait bounded by the run's deadline."""

    def __init__(self, spec: dict, deadline: float):
        ctx = mp.get_context("spawn")
        self.deadline = deadline
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.info: dict | None = None

    def started(self) -> dict:
        """Wait for the engine to be built and warmed up; return what it reports (versions, threads)."""
        if self.info is None:
            self.info = self._answer()
        return self.info

    def call(self, name: str):
        """Run one round of configuration ``name`` in the engine; return its result."""
        self.started()
        self.conn.send(name)
        return self._answer()

    def _answer(self):
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or not self.conn.poll(remaining):
            self.kill()
            raise TimeoutError("the run's --time-limit passed")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise BenchError(f"the engine process died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise BenchError(payload)
        return payload

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(None)
            self.proc.join(max(1.0, min(60.0, self.deadline - time.monotonic() + 30)))
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# --- machine limits -------------------------------------------------------------------------


def machine_limits(step_bytes: int, round_bytes: int, dtype: str, root: str) -> dict:
    """memcpy GB/s of one step's captured bytes, zstd-1 GB/s of float data, fsync'd write GB/s of a round's."""
    import numpy as np
    import torch
    import zstandard

    src = torch.randn(max(1, step_bytes // 4)).to(getattr(torch, dtype)).view(torch.uint8).numpy()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t_copy = _best(lambda: np.copyto(dst, src))
    sample = src[: min(src.size, 64 << 20)]
    comp = zstandard.ZstdCompressor(level=1)
    t_zstd = _best(lambda: comp.compress(sample))
    ratio = sample.size / len(comp.compress(sample))
    data = np.resize(src, min(round_bytes, 1 << 30))
    path = os.path.join(root, "limit-write.bin")

    def write_fsync():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view[: 8 << 20]):]
            os.fsync(fd)
        finally:
            os.close(fd)

    t_write = _best(write_fsync, repeats=2)
    os.unlink(path)
    return {"memcpy_GBps": src.size / t_copy / 1e9, "memcpy_bytes": int(src.size),
            "zstd1_compress_GBps": sample.size / t_zstd / 1e9, "zstd1_ratio": ratio,
            "write_fsync_GBps": data.size / t_write / 1e9, "write_bytes": int(data.size)}


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# --- the run --------------------------------------------------------------------------------


def parser(defaults: dict | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and workload, one round: a smoke test")
    p.add_argument("--model", default=None, help="a Hugging Face model directory (default: the random Llama below)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads (head size hidden/heads; vLLM's CPU attention needs 64-ish)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the byte tokenizer's)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256, help="longest prompt in tokens (shortest: half)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--sampling", default="random", choices=("random", "greedy"),
                   help="random: temperature 1 (default); greedy: temperature 0 — on a random-weight model the "
                        "output repeats, and the native extractor's speculative step then skips forwards")
    p.add_argument("--max-model-len", type=int, default=0, help="0: longest prompt + new tokens, to a multiple of 32")
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: --requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kv-cache-gib", type=float, default=1, help="VLLM_CPU_KVCACHE_SPACE of each CPU engine")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="each CUDA engine's share (two engines)")
    p.add_argument("--native-connector", default="CPUHiddenStatesConnector")
    p.add_argument("--native-connector-module", default="_vllm_native",
                   help="its kv_connector_module_path ('' for one of vLLM's own connectors)")
    p.add_argument("--serial-start", action="store_true",
                   help="build the engines one after the other (on a GPU: each profiles free memory)")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the engines (0: vLLM's default)")
    p.add_argument("--time-limit", type=float, default=3600,
                   help="seconds for the whole run; rows not done by then are not run")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "out"), help="where the JSON and markdown go")
    if defaults:
        p.set_defaults(**defaults)
    return p


def apply_quick(args) -> None:
    """The smoke-test sizes (seconds of engine time per round on 2 cores)."""
    args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 128, 256, 2, 1
    args.requests, args.prompt, args.max_tokens, args.rounds, args.max_num_batched_tokens = 3, 48, 8, 1, 64


def main(argv=None, defaults: dict | None = None) -> int:
    args = parser(defaults).parse_args(argv)
    if args.quick:
        apply_quick(args)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(names) - set(KNOWN)
    if unknown:
        raise SystemExit(f"bench_vllm: unknown configuration(s) {sorted(unknown)}; known: {', '.join(KNOWN)}")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that the engines are stopped on the way out
    start = time.monotonic()
    deadline = start + args.time_limit
    conditions = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "load_average_start": os.getloadavg(),
                  "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                  "python": platform.python_version(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model_dir = args.model or build_model_dir(args, tmp)
        geo = model_geometry(model_dir)
        batch = prompts(args, prompt_vocab(model_dir, geo))
        layers, hidden = geo["num_hidden_layers"], geo["hidden_size"]
        elsize = 4 if args.dtype == "float32" else 2
        fed = sum(len(p) + args.max_tokens - 1 for p in batch)
        limits = machine_limits(args.max_num_batched_tokens * layers * hidden * elsize,
                                fed * layers * hidden * elsize, args.dtype, tmp)
        conditions.update(model=model_dir if args.model else "random Llama (built from a config, seed 0)",
                          geometry=geo, dtype=args.dtype, prompt_lengths=[len(p) for p in batch],
                          prompt_tokens=sum(len(p) for p in batch), generated_tokens=args.requests * args.max_tokens,
                          fed_tokens=fed, resid_post_bytes_per_round=fed * layers * hidden * elsize)
        common = {"model_dir": model_dir, "prompts": batch, "max_tokens": args.max_tokens, "sampling": args.sampling,
                  "kv_cache_gib": args.kv_cache_gib}
        results, not_run, engines = run_rounds(args, names, common, layers, tmp, deadline, conditions)
    conditions["load_average_end"] = os.getloadavg()
    conditions["wall_seconds"] = time.monotonic() - start
    report = build_report(args, names, results, not_run, limits, conditions, engines)
    write_report(args, report)
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def prompt_vocab(model_dir: str, geo: dict) -> int:
    """Prompt token ids stay below both the model's vocabulary and its tokenizer's (vLLM refuses others)."""
    from transformers import AutoTokenizer

    return min(geo["vocab_size"], len(AutoTokenizer.from_pretrained(model_dir)))


def run_rounds(args, names, common, layers, tmp, deadline, conditions):
    """Start the engines the configurations need, run the rounds interleaved, stop the engines.

    Returns ``(results, not_run, engine_info)``: per configuration a list of round results, the
    configurations that could not run with the reason, and what each engine reported."""
    want_plain = any(n != NATIVE for n in names)
    specs = {}
    if want_plain:
        specs["plain"] = {**common, "native": False, "engine": engine_kwargs(args, None, None),
                          "dmi_home": os.path.join(tmp, "dmi-home")}
    if NATIVE in names:
        native_dir = os.path.join(tmp, "native")
        native_layers = list(range(1, layers + 1))
        specs["native"] = {**common, "native": True, "native_layers": native_layers,
                           "engine": engine_kwargs(args, native_layers, native_dir)}
        conditions["native_connector"] = {"name": args.native_connector, "module": args.native_connector_module or None,
                                          "changes": _native_changes(args)}
    results = {n: [] for n in names}
    not_run: dict[str, str] = {}
    engines: dict[str, EngineProcess] = {}
    info: dict[str, dict] = {}
    engine_of = {n: "native" if n == NATIVE else "plain" for n in names}
    try:
        for key, spec in specs.items():  # built at the same time unless --serial-start: only rounds are timed
            engines[key] = EngineProcess(spec, deadline)
            if args.serial_start:
                _start(engines[key], key, engine_of, not_run, info)
        for key in engines:
            if key not in info:
                _start(engines[key], key, engine_of, not_run, info)
        for r in range(args.rounds):
            for n in names:
                if n in not_run:
                    continue
                try:
                    res = engines[engine_of[n]].call(n)
                except BenchError as e:  # the engine may be wedged: nothing else runs on it
                    engines[engine_of[n]].kill()
                    for m, k in engine_of.items():
                        if k == engine_of[n]:
                            reason = f"round {r}: {e}" if m == n else f"round {r}: {n} failed on its engine"
                            not_run.setdefault(m, reason)
                    print(f"bench_vllm: {n} stopped: {e}", file=sys.stderr)
                    continue
                except TimeoutError as e:
                    for m in names:
                        not_run.setdefault(m, f"round {r}: {e}")
                    print(f"bench_vllm: stopped in round {r} ({n}): {e}", file=sys.stderr)
                    break
                results[n].append(res)
                print(f"round {r} {n:30s} {res['seconds']:7.2f}s", file=sys.stderr, flush=True)
    finally:
        for e in engines.values():
            e.close()
    return results, not_run, info


def _start(engine: EngineProcess, key: str, engine_of: dict, not_run: dict, info: dict) -> None:
    """Wait for engine ``key``; if it did not start, its configurations are not run, with the reason."""
    try:
        info[key] = engine.started()
    except (BenchError, TimeoutError) as e:
        for n, k in engine_of.items():
            if k == key:
                not_run[n] = f"engine did not start: {e}"
        print(f"bench_vllm: the {key} engine did not start: {e}", file=sys.stderr)


def _native_changes(args) -> str:
    if args.native_connector_module == "_vllm_native":
        sys.path.insert(0, BENCH_DIR)
        import _vllm_native

        return _vllm_native.CHANGES
    return "none: vLLM's connector as shipped"


def build_report(args, names, results, not_run, limits, conditions, engines) -> dict:
    """Rows (throughputs, ratios, spread, the DMI and native details) and everything they were measured under."""
    gen = conditions["generated_tokens"]
    total = gen + conditions["prompt_tokens"]
    base = [r["seconds"] for r in results.get(NONE, [])]
    ref_tokens = results[NONE][0]["tokens"] if results.get(NONE) else None
    rows = []
    for n in names:
        runs = results[n]
        if not runs:
            rows.append({"configuration": n, "not_run": not_run.get(n, "no round completed")})
            continue
        secs = [r["seconds"] for r in runs]
        row = {"configuration": n, "rounds": len(runs), "seconds": secs,
               "generated_tok_s": gen / statistics.median(secs), "total_tok_s": total / statistics.median(secs),
               "generated_tok_s_min": gen / max(secs), "generated_tok_s_max": gen / min(secs),
               "ratio_to_none": (statistics.median(b / s for b, s in zip(base, secs)) if base else None),
               "same_tokens_as_none": (all(r["tokens"] == ref_tokens for r in runs)
                                       if ref_tokens and args.sampling == "greedy" else None)}
        if n in not_run:
            row["stopped"] = not_run[n]
        for key in ("forwards", "model_tokens", "attach_s", "detach_s", "hook_s", "drain_busy_s", "ring_waits",
                    "records", "packs",
                    "captured_bytes", "extra_steps", "files"):
            vals = [r[key] for r in runs if key in r]
            if vals:
                row[key] = statistics.median(vals)
        if n in TARGETS and row["ratio_to_none"] is not None:
            row["target"] = TARGETS[n]
            row["meets_target"] = row["ratio_to_none"] >= TARGETS[n]
        rows.append(row)
    by_name = {r["configuration"]: r for r in rows}
    resid, native = by_name.get(RESID, {}), by_name.get(NATIVE, {})
    if "generated_tok_s" in resid and "generated_tok_s" in native:
        resid["ahead_of_native"] = resid["generated_tok_s"] > native["generated_tok_s"]
    return {"conditions": conditions, "engines": engines, "limits": limits, "rows": rows}


def write_report(args, report) -> None:
    """Print the markdown table and write it and the JSON to ``args.out``."""
    md = markdown(report)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "bench_vllm-" + report["conditions"]["started_utc"].replace(":", ""))
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(f"bench_vllm: wrote {stem}.json and {stem}.md", file=sys.stderr)


def _records_packs(row) -> str:
    """A DMI row's records and packs a round (median), or a native row's files."""
    if "records" in row:
        return f"{row['records']:,.0f} / {row['packs']:,.0f}"
    return f"{row['files']:,.0f} files" if "files" in row else ""


def markdown(report) -> str:
    c, lim = report["conditions"], report["limits"]
    g = c["geometry"]
    eng = next(iter(report["engines"].values()), {})
    lines = [
        f"# bench_vllm {c['started_utc']}", "",
        f"Model: {c['model']}: {g['model_type']}, {g['num_hidden_layers']} layers, hidden {g['hidden_size']}, "
        f"intermediate {g['intermediate_size']}, {g['num_attention_heads']} heads ({g['num_key_value_heads']} KV), "
        f"vocab {g['vocab_size']}, {c['dtype']}. {len(c['prompt_lengths'])} requests, prompts "
        f"{min(c['prompt_lengths'])}–{max(c['prompt_lengths'])} tokens ({c['prompt_tokens']} in all), "
        f"{c['args']['max_tokens']} new tokens each, {_sampling_words(c['args']['sampling'])}; "
        f"max_num_batched_tokens {c['args']['max_num_batched_tokens']}; "
        f"{c['args']['rounds']} round(s), interleaved; device {c['args']['device']}.",
        f"Machine: {c['machine']}, {c['cpus']} CPUs, torch {eng.get('torch')} ({eng.get('torch_threads')} engine "
        f"thread(s)), vLLM {eng.get('vllm')}, python {c['python']}; load average (1 min) "
        f"{c['load_average_start'][0]:.2f} at the start, {c['load_average_end'][0]:.2f} at the end; "
        f"{c['wall_seconds']:.0f} s in all.",
        f"Limits in this run: memcpy {lim['memcpy_GBps']:.2f} GB/s ({lim['memcpy_bytes']:,} B, one step's resid_post), "
        f"zstd-1 compress {lim['zstd1_compress_GBps']:.2f} GB/s (ratio {lim['zstd1_ratio']:.3f}, "
        f"{c['dtype']} normal data), "
        f"write+fsync {lim['write_fsync_GBps']:.2f} GB/s ({lim['write_bytes']:,} B).",
        "",
        "| configuration | generated tok/s (median; min–max) | total tok/s | × none (median) | target | "
        "same tokens | forwards / model tokens | attach / detach s | hook s | drain busy s | ring waits | "
        "captured bytes | records / packs |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if "not_run" in r:
            lines.append(f"| {r['configuration']} | not run: {r['not_run']} |" + "  |" * 12)
            continue
        lines.append(
            f"| {r['configuration']} | {r['generated_tok_s']:.1f} ({r['generated_tok_s_min']:.1f}–"
            f"{r['generated_tok_s_max']:.1f}) | {r['total_tok_s']:.1f} | {_fmt(r['ratio_to_none'], '{:.3f}')} | "
            f"{_target(r)} | {_fmt(r['same_tokens_as_none'])} | {r['forwards']:.0f} / {r['model_tokens']:.0f} | "
            f"{_fmt(r.get('attach_s'), '{:.2f}')} / "
            f"{_fmt(r.get('detach_s'), '{:.2f}')} | {_fmt(r.get('hook_s'), '{:.2f}')} | "
            f"{_fmt(r.get('drain_busy_s'), '{:.2f}')} | {_fmt(r.get('ring_waits'), '{:.0f}')} | "
            f"{_fmt(r.get('captured_bytes'), '{:,.0f}')} | {_records_packs(r)} |")
    stopped = [r for r in report["rows"] if "stopped" in r]
    for r in stopped:
        lines.append(f"\n{r['configuration']}: stopped after {r['rounds']} round(s): {r['stopped']}")
    if "native_connector" in c:
        nc = c["native_connector"]
        lines += ["", f"Native extractor: connector {nc['name']} (module {nc['module'] or 'vLLM'}); "
                      f"changes: {nc['changes']}"]
    return "\n".join(lines) + "\n"


def _sampling_words(sampling: str) -> str:
    return "greedy" if sampling == "greedy" else "sampled at temperature 1"


def _target(r) -> str:
    parts = []
    if "target" in r:
        parts.append(f"≥ {r['target']:.2f}: {'met' if r['meets_target'] else 'missed'}")
    if "ahead_of_native" in r:
        parts.append(f"ahead of native: {'yes' if r['ahead_of_native'] else 'no'}")
    return "; ".join(parts)


def _fmt(v, f="{}") -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f.format(v)


if __name__ == "__main__":
    sys.exit(main())
