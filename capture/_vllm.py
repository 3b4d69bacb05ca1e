"""Capture inside a vLLM engine: ``attach_vllm(engine, ...)`` — the same selection, schedule,
ring, drain, packs and catalog as ``attach`` on a Hugging Face model.

The session lives in the process of the worker that runs the model: ``engine`` is a
``vllm.LLM`` or an executor whose one worker runs in this process (reached through vLLM's own
``collective_rpc``), or a worker itself, inside its own process (``dmi.vllm``'s worker
extension attaches there; under tensor parallelism each rank records its shard with its
geometry). It hooks the modules :mod:`dmi.capture._vllm_arch` names, and before each forward
reads the model runner's host-side batch (request ids, ``query_start_loc``, computed and prompt
token counts — no device synchronisation) to plan which rows belong to which request
(:mod:`dmi.capture._vllm_plan`). Records carry the request id vLLM returned to the caller.

**Refused before anything is installed** (:class:`VLLMConfigError`, saying what to pass):
an engine that could skip hooks silently — CUDA graphs or ``torch.compile`` (pass
``enforce_eager=True``), prefix caching (cached prompt tokens never run: pass
``enable_prefix_caching=False``), speculative decoding, pipeline stages, a model type whose
layers DMI has not mapped for vLLM (:data:`VLLM_MODEL_TYPES`) — and an ``LLM``
whose workers run in other processes given here directly (``dmi.capture_vllm`` reaches them
through the worker extension).

**Publishing.** When requests leave the runner (finished or aborted), the open slot is handed
to the drain, which stores their records and seals and publishes the open pack without the
model waiting — at once, or, if it last did so less than ``publish_interval`` seconds ago
(default :data:`PUBLISH_INTERVAL_SECONDS`), at that interval's end, together with every other
request that finished meanwhile: while the engine is busy, one pack and one catalog publish
per interval at most, not one per engine step. A served engine that goes idle publishes at
once (:meth:`VLLMCaptureSession.publish_buffered`), and the session's ``generate`` flushes
before it returns, so every request it returns can be read.

**A failing capture never breaks the engine.** DMI's hooks run inside vLLM's step, where an
exception would leave the interrupted requests in its scheduler (a later ``generate`` never
returns) or, served, kill the engine. So a failure there — the drain's (a publish that raised:
the catalog unreachable), a ring timeout (:class:`RingFullError`), any other — stops the capture
for the rest of the session instead: no slot is reserved and no tensor copied any more, the
engine runs on exactly as without capture, and what it no longer captures is counted
(``stats``: ``capture_stopped``, ``steps_not_captured``, ``requests_not_captured``,
``records_not_captured``; a drain still running also counts those records in
``records_lost`` and the catalog's losses, reason ``"capture stopped"``). The failure is logged once, and
raised where a caller can take it with the engine idle: by ``generate`` once vLLM returned (its
outputs on the error, as ``outputs``), by ``flush`` and at detach (a served engine's executor
logs it at shutdown).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from time import perf_counter

from dmi.storage.errors import (CaptureError, DMIError, DrainError, HookSelectionError, InvalidArgumentError,
                               RequestExistsError, VLLMConfigError)
from dmi.storage.records import GLOBAL_LAYER

from ._codec_choice import resolve_codecs
from ._drain import CAPTURE_STOPPED, KeyContext
from ._hooks import ModelGeometry
from ._schedule import Schedule
from ._selection import select
from ._session import (CaptureSession, _PipelineOptions, _validate_id, check_pipeline_arguments,
                       default_publish_scope, new_run_id, owned_session)
from ._tp_layout import TPLayout, emitted_hooks
from ._vllm_arch import MUTATED_IN_PLACE, VLLM_MODEL_TYPES, resolve_vllm_architecture
from ._vllm_plan import BatchView, VLLMPlanner

__all__ = ["attach_vllm", "VLLMCaptureSession", "check_engine_config", "engine_in_this_process", "VLLM_WRITER_PREFIX"]

logger = logging.getLogger(__name__)

VLLM_WRITER_PREFIX = "vllm-"
"""How the writer id of every pack a vLLM capture seals begins (``vllm-<run id>``)."""

PUBLISH_INTERVAL_SECONDS = 1.0
"""How long a finished request's records may wait to be sealed and published with the next
requests to finish (``attach_vllm(publish_interval=...)``; 0 publishes at every finish)."""


def _check_publish_interval(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise InvalidArgumentError(f"publish_interval must be a number of seconds >= 0, got {value!r}")


def check_engine_config(vllm_config, *, sharded_ok: bool = False) -> None:
    """Refuse an engine configuration under which hooks would miss steps or tokens silently.
    ``sharded_ok``: the session attaches inside one tensor-parallel worker (its own shard)."""
    model_config = vllm_config.model_config
    model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    if model_type not in VLLM_MODEL_TYPES:
        raise VLLMConfigError(
            f"this vLLM engine runs a model of type {model_type!r}; DMI's vLLM capture maps the layers of "
            f"{', '.join(VLLM_MODEL_TYPES)} only (another layout, such as GPT-NeoX's parallel residual, would "
            "be stored as the wrong values). Capture this model through transformers (dmi.capture, or dmi capture "
            "--model DIR)"
        )
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", None)
    compiled = mode is not None and int(getattr(mode, "value", mode)) != 0
    graphs = str(getattr(compilation, "cudagraph_mode", "NONE")).rsplit(".", 1)[-1] not in ("NONE", "None")
    if not model_config.enforce_eager or compiled or graphs:
        raise VLLMConfigError(
            "this vLLM engine runs the model through CUDA graphs or torch.compile, where PyTorch hooks do "
            f"not run on every step (enforce_eager={model_config.enforce_eager}, compilation mode {mode}, "
            f"cudagraph mode {getattr(compilation, 'cudagraph_mode', None)}); DMI will not capture a run that "
            "silently misses steps. Build the engine with LLM(..., enforce_eager=True)"
        )
    if vllm_config.cache_config.enable_prefix_caching:
        raise VLLMConfigError(
            "this vLLM engine has prefix caching on: prompt tokens found in the cache are never run, so their "
            "internals would be missing from the records. Build the engine with "
            "LLM(..., enable_prefix_caching=False) for captured requests"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise VLLMConfigError(
            f"this vLLM engine is split into pipeline stages (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}); DMI's vLLM capture follows whole models and tensor-parallel "
            "shards, not pipeline stages. Capture with pipeline_parallel_size=1"
        )
    if parallel.tensor_parallel_size != 1 and not sharded_ok:
        raise VLLMConfigError(
            f"this vLLM engine is sharded (tensor_parallel_size={parallel.tensor_parallel_size}): its workers run "
            "in processes of their own. Build the LLM with worker_extension_cls=\"dmi.vllm.CaptureWorkerExtension\" "
            "and capture with dmi.capture_vllm (each worker captures its shard; docs/vllm.md)"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise VLLMConfigError(
            "this vLLM engine uses speculative decoding; DMI's vLLM capture does not follow draft tokens. "
            "Build the engine without speculative_config"
        )


def _engine_parts(engine):
    """``(vllm_config, model runner, llm or None, tp rank, tp size)`` of what ``attach_vllm``
    was given: a ``vllm.LLM`` or an executor whose one worker runs in this process (reached
    through ``collective_rpc``), or a vLLM worker itself (inside its own process, one
    tensor-parallel shard: ``CaptureWorkerExtension``)."""
    if hasattr(engine, "model_runner") and hasattr(engine, "vllm_config"):  # a worker, in its process
        check_engine_config(engine.vllm_config, sharded_ok=True)
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        return engine.vllm_config, engine.model_runner, None, rank, size
    llm = engine if hasattr(engine, "llm_engine") else None
    config = llm.llm_engine.vllm_config if llm is not None else getattr(engine, "vllm_config", None)
    if config is None or not callable(getattr(engine, "collective_rpc", None)):
        raise InvalidArgumentError(f"attach_vllm needs a vllm.LLM, a vLLM executor or worker, got {type(engine).__name__}")
    check_engine_config(config)
    if not engine_in_this_process(engine):
        raise VLLMConfigError(
            "this vLLM engine runs its model in another process, where DMI's hooks cannot reach it; build the "
            "LLM with worker_extension_cls=\"dmi.vllm.CaptureWorkerExtension\" and capture with "
            "dmi.capture_vllm, or set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it (docs/vllm.md)"
        )
    runners = engine.collective_rpc(_worker_runner)
    if len(runners) != 1 or getattr(runners[0], "input_batch", None) is None:
        raise VLLMConfigError(
            f"this vLLM engine has {len(runners)} workers; attach_vllm attaches to an engine with one worker in "
            "this process; dmi.capture_vllm with CaptureWorkerExtension captures every worker (docs/vllm.md)"
        )
    return config, runners[0], llm, 0, 1


def engine_in_this_process(engine) -> bool:
    """Whether ``engine`` (a ``vllm.LLM`` or an executor) runs its one worker in this process."""
    llm_engine = getattr(engine, "llm_engine", None)
    config = llm_engine.vllm_config if llm_engine is not None else getattr(engine, "vllm_config", None)
    parallel = config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        return False
    # vLLM keeps the executor on the LLM's engine only when the engine core runs in this process
    return llm_engine is None or getattr(llm_engine, "model_executor", None) is not None


def _worker_runner(worker):
    return worker.model_runner


class VLLMCaptureSession(CaptureSession):
    """A vLLM engine under capture. Made by :func:`attach_vllm`; use it inside the ``with``."""

    keeps_published = False  # an engine's session may live for ever: it counts packs, keeps no descriptor

    def __init__(self, llm, runner, planner: VLLMPlanner, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.llm = llm
        self.runner = runner
        self.planner = planner
        self._step = None
        self._live: set[str] = set()
        self._logits_calls_ignored = 0
        self._logits_taken = False  # the current step's logits were seen (its first logits call)
        self._buffered = False  # a step ran since the last seal: its records (or losses) wait for one
        self._failure: Exception | None = None  # what stopped the capture inside a step (see _stop)
        self._step_lost = False  # the current step lost a record (counted in steps_not_captured)
        self._steps_not_captured = 0
        self._requests_not_captured = 0
        self._records_not_captured = 0
        self._losing: set[str] = set()  # requests in the engine that lost a record (counted once each)

    def generate(self, *args, **kwargs):
        """``llm.generate`` with capture; flushes before returning, so every request in its
        output is published (read it back by ``output.request_id``). Returns vLLM's output.
        A capture that failed while vLLM ran (it stopped: :meth:`_stop`), or whose flush failed,
        raises once vLLM returned, the engine idle and every request run to its end: vLLM's
        output is on the error, as ``outputs``. Once stopped, it raises before vLLM runs."""
        self.check()
        if self.llm is None:
            raise CaptureError("this session captures a served engine; send it requests (docs/vllm.md)")
        out = self.llm.generate(*args, **kwargs)
        try:
            self.flush()
        except DMIError as exc:
            exc.outputs = out
            raise
        return out

    def check(self) -> None:
        """Raise what keeps this session from capturing — closed, stopped (:meth:`_stop`), its
        drain failed — as ``generate`` does before vLLM runs; nothing if it can capture. (A
        worker's capture is asked this before its engine runs: ``dmi.vllm``.)"""
        self._refuse_closed()
        self._raise_if_stopped()
        self.drain.check()

    def flush(self, timeout: float | None = None) -> list:
        """``CaptureSession.flush``. Once the capture stopped (:meth:`_stop`), what it captured
        before is still published, then the stop is raised."""
        if self._failure is None:
            return super().flush(timeout)
        self._then_raise_stop(super().flush, timeout)

    @contextlib.contextmanager
    def stepping(self):
        """Held by a serving executor around each engine step, so that
        :meth:`publish_buffered` (from another thread) never runs inside one."""
        with self._lock:
            yield

    def publish_buffered(self) -> bool:
        """Between steps (an idle engine): hand what the ring holds to the drain and have the
        open pack sealed and published, without waiting — the last requests a server finished
        become readable although no further step will notice they left; at once, whatever
        ``publish_interval`` (an idle engine loses nothing to a publish). Returns whether
        anything was buffered."""
        with self._lock:
            if self._closed or not self._buffered:
                return False
            self._buffered = False
            self.ring.submit()
            self.drain.seal_soon(at_once=True)  # an idle engine: nothing to spare it from
            return True

    def forward(self, *args, **kwargs):
        raise CaptureError("a vLLM capture runs the engine: use session.generate(prompts, sampling_params)")

    @property
    def stats(self) -> dict:
        return {**super().stats, "requests": self.planner.requests_seen,
                "recomputed_tokens_skipped": self.planner.recomputed_tokens,
                "duplicate_request_ids": self.planner.duplicate_request_ids,
                "logits_calls_ignored": self._logits_calls_ignored,
                "capture_stopped": self._failure is not None,
                "steps_not_captured": self._steps_not_captured,
                "requests_not_captured": self._requests_not_captured,
                "records_not_captured": self._records_not_captured}

    # -- a failure inside the engine's step ------------------------------------------------------
    def _stop(self, exc: Exception) -> None:
        """Stop capturing for the rest of the session — raising inside vLLM's step would leave
        the interrupted requests in its scheduler, or kill a served engine: from now on no slot
        is reserved and no tensor copied, and every record a step would have made is counted
        (:meth:`_count_lost`). Logged once; raised by :meth:`_raise_if_stopped` where a caller
        can take it, outside the step. Only the first failure is kept: after it only planning
        and counting run."""
        if self._failure is not None:
            return
        self._failure = exc
        logger.error("DMI stopped capturing from this vLLM engine: %s. The engine goes on without capture; "
                     "what it does not capture is counted in the session's stats, and the error is raised "
                     "by generate, flush and the detach", exc, exc_info=exc)

    def _raise_if_stopped(self) -> None:
        """Raise what stopped the capture (:meth:`_stop`) — as its own class if a capture error
        (``DrainError``, ``RingFullError``, ...), else as ``CaptureError`` — saying what was not
        captured; nothing if it did not stop."""
        failure = self._failure
        if failure is None:
            return
        cls = type(failure) if isinstance(failure, CaptureError) else CaptureError
        raise cls(
            f"DMI stopped capturing inside the vLLM engine ({failure}); the engine ran on without capture, its "
            f"outputs whole: {self._steps_not_captured} step(s), {self._requests_not_captured} request(s) and "
            f"{self._records_not_captured} record(s) not captured (session stats). What was captured before is "
            "in the store (`dmi recover` publishes a pack sealed but left unpublished); remove the cause, then "
            "capture in a new session"
        ) from failure

    def _then_raise_stop(self, action, *args) -> None:
        """``action(*args)`` (a flush, the detach), then the stop raised — with the error
        ``action`` raised itself, if any, as its context."""
        try:
            action(*args)
        except DMIError:
            self._raise_if_stopped()
        self._raise_if_stopped()

    def _close_now(self) -> None:
        """Detach (drain, seal, publish, release the lease); then raise the stop, if any."""
        if self._closed or self._failure is None:
            super()._close_now()
            return
        self._then_raise_stop(super()._close_now)

    def _unfailing(self, hook):
        """``hook`` as it runs inside vLLM's step: an exception stops the capture (:meth:`_stop`)
        instead of leaving the hook."""

        @functools.wraps(hook)
        def run(*args):
            try:
                return hook(*args)
            except Exception as exc:  # noqa: BLE001 - kept, logged and raised outside the step (_stop)
                self._stop(exc)
                return None

        return run

    def _check_drain(self) -> None:
        """A failed drain stops the capture at the first step that sees it, before its copies
        (the open slot may have room: they would go to a drain that no longer takes them)."""
        if self._failure is None:
            try:
                self.drain.check()
            except DrainError as exc:
                self._stop(exc)

    def _emit_or_count(self, hook: str, layer: int, x, plan) -> None:
        """Copy ``x``'s rows of ``plan`` into the ring; once the capture stopped — or if this
        copy fails, which stops it — count its records as not captured instead."""
        if self._failure is None:
            try:
                self._emit(hook, layer, x, "flat", plan)
                return
            except Exception as exc:  # noqa: BLE001 - kept, logged and raised outside the step (_stop)
                self._stop(exc)
        self._count_lost(hook, layer, plan)

    def _count_lost(self, hook: str, layer: int, plan) -> None:
        """One record per request of ``plan`` not captured for ``hook`` at ``layer``: counted
        with its step and request, and handed to the drain, which — where it has not failed (a
        ring timeout stopped the capture) — counts it in ``records_lost`` and the catalog's losses."""
        if not self._step_lost:
            self._step_lost = True
            self._steps_not_captured += 1
        self._records_not_captured += len(plan.spans)
        for span in plan.spans:
            if span.request_id not in self._losing:
                self._losing.add(span.request_id)
                self._requests_not_captured += 1
        self.drain.note_loss(hook, layer, plan, CAPTURE_STOPPED)

    # -- hooks ----------------------------------------------------------------------------------
    def _install(self) -> None:
        m = self.arch.model
        self._handles.append(m.register_forward_pre_hook(self._unfailing(self._on_model_pre), with_kwargs=True))
        self._handles.append(m.register_forward_hook(self._unfailing(self._on_model_post), always_call=True))
        if "logits" in self._emitted:
            self._handles.append(m.logits_processor.register_forward_hook(self._unfailing(self._on_logits)))
        self._install_taps(self.arch.taps(self._emitted))

    def _emitter(self, tap):
        emissions = tap.emissions
        emit = self._emit_or_count

        def run(args, kwargs, output):
            step = self._step
            if step is None:
                return
            t0 = perf_counter()
            for em in emissions:
                x = None
                if self._failure is None:  # stopped: nothing read, nothing copied
                    x = em.extract(args, kwargs, output)
                    if x is not None and x.device.type == "cuda" and em.hook in MUTATED_IN_PLACE and not em.fresh:
                        x = x.clone()  # vLLM writes over this buffer in place before a side-stream copy could read it
                for plan in step.token_plans:
                    emit(em.hook, em.layer, x, plan)
            self._hook_seconds += perf_counter() - t0

        return self._unfailing(run)

    def _on_model_pre(self, module, args, kwargs):
        t0 = perf_counter()
        try:
            self._step = None
            self._logits_taken = False
            ids = kwargs.get("input_ids", args[0] if args else None)
            batch = self.runner.input_batch
            n = batch.num_reqs
            if n == 0 or ids is None:
                return None  # a dummy or profiling run: no request
            self._note_finished()
            if not self._capture_enabled:
                return None
            qsl = self.runner.query_start_loc.np
            view = BatchView(tuple(batch.req_ids[:n]), tuple(qsl[: n + 1].tolist()),
                             tuple(batch.num_computed_tokens_cpu[:n].tolist()),
                             tuple(batch.num_prompt_tokens[:n].tolist()), int(ids.shape[0]))
            step = self.planner.plan(view)
            self._forwards += 1
            if step is None:
                return None
            self._step, self._step_lost = step, False
            self._check_drain()
            self._buffered = True
            if "token_ids" in self._emitted:
                if self._failure is None and ids.device.type == "cuda":
                    ids = ids.clone()  # vLLM refills this input buffer for the next step before a side-stream copy
                for plan in step.token_plans:
                    self._emit_or_count("token_ids", GLOBAL_LAYER, ids, plan)
            return None
        finally:
            self._hook_seconds += perf_counter() - t0

    def _on_model_post(self, module, args, output):
        self.ring.end_step()
        return None

    def _on_logits(self, module, args, output):
        """The step's first logits computation, one row per scheduled request, is captured; any
        other call in the same step (prompt logprobs, after it) is not the step's logits and is
        counted, not captured."""
        step = self._step
        if step is None or not step.logits_plans:
            return None
        t0 = perf_counter()
        first, self._logits_taken = not self._logits_taken, True
        if not first or output is None or output.dim() != 2 or output.shape[0] != step.logits_plans[0].tokens:
            self._logits_calls_ignored += 1
        else:
            for plan in step.logits_plans:
                self._emit_or_count("logits", GLOBAL_LAYER, output, plan)
        self._hook_seconds += perf_counter() - t0
        return None

    def _note_finished(self) -> None:
        """Requests that left the runner since the last step (finished or aborted; a preempted
        request stays known to it): publish what is buffered, without waiting."""
        known = self.runner.requests
        gone = [rid for rid in self._live if rid not in known]
        self._live = set(known)
        if gone:
            finished = [self.planner.request_ids[rid] for rid in gone if rid in self.planner.request_ids]
            self.planner.forget(gone)
            self._losing.difference_update(finished)
            self._buffered = False
            self.ring.submit()
            self.drain.seal_soon(finished)


@contextlib.contextmanager
def attach_vllm(
    engine,
    *,
    hooks="resid_post",
    layers=None,
    store=None,
    catalog=None,
    model_id: str | None = None,
    run_id: str | None = None,
    schedule=None,
    ring_slots: int = 8,
    slot_bytes: int = 32 << 20,
    ring_timeout: float = 60.0,
    drop_policy: str = "wait",
    adaptive_codec: float | None = 0.5,
    writer_options: dict | None = None,
    codec=None,
    publish_scope: str | None = None,
    lease_seconds: float = 30.0,
    decode_chunk_steps: int = 32,
    writer=None,
    tp_replicas: str = "rank0",
    encode_threads: int = 1,
    drain_nice: int = 0,
    publish_interval: float = PUBLISH_INTERVAL_SECONDS,
):
    """Attach capture to ``engine`` — a ``vllm.LLM`` whose one worker runs in this process, the
    in-process executor of a served engine (``dmi.vllm.CaptureExecutor``), or a worker inside
    its own process (``dmi.vllm.CaptureWorkerExtension``); yields a :class:`VLLMCaptureSession`. The options are ``attach``'s; ``model_id`` defaults to the
    model vLLM was given (its name or absolute directory); ``publish_interval``: seconds a
    finished request's records may wait to be published with the next to finish (see
    Publishing above). See ``docs/vllm.md``."""
    vllm_config, runner, llm, tp_rank, tp_size = _engine_parts(engine)
    model = runner.model
    arch = resolve_vllm_architecture(model)
    selection = select(arch, hooks, layers, attn_implementation=None)
    schedule = Schedule.coerce(schedule)
    config = vllm_config.model_config
    model_id = _validate_id("model id", model_id if model_id is not None else _vllm_model_id(config.model))
    run_given = run_id is not None
    run_id = _validate_id("run id", run_id if run_given else new_run_id())
    check_pipeline_arguments("attach_vllm", store=store, catalog=catalog, writer=writer,
                             decode_chunk_steps=decode_chunk_steps, adaptive_codec=adaptive_codec,
                             encode_threads=encode_threads, drain_nice=drain_nice,
                             lease_seconds=lease_seconds)
    if run_given and catalog is not None:
        _refuse_a_run_holding_records(catalog, model_id, run_id, tp_rank)
    _check_publish_interval(publish_interval)
    geometry = ModelGeometry.from_config(model.config, config.dtype)
    _refuse_split_kv_heads(selection.hooks, geometry, tp_size)
    layout = TPLayout(geometry, tp_rank, tp_size, None)
    emitted = emitted_hooks(selection.hooks, layout, tp_replicas)
    writer_options, hook_codecs = resolve_codecs(codec, writer_options, tuple(selection.hooks), geometry, False)
    # checked above, before this merge (a writer_options that is no mapping would fail in it as a
    # TypeError); the producer, in every pack's writer id (and the catalog's packs table): an audit
    # re-runs a vLLM capture through Hugging Face under the vllm tolerance
    writer_options = {"writer_id": f"{VLLM_WRITER_PREFIX}{run_id}", **(writer_options or {})}
    ctx = KeyContext(model_id, run_id, tp_rank, tp_size, geometry, layout=layout)
    options = _PipelineOptions(
        ring_slots=ring_slots, slot_bytes=slot_bytes, ring_timeout=ring_timeout, drop_policy=drop_policy,
        catalog=catalog, publish_scope=publish_scope or default_publish_scope(model_id, run_id, tp_rank, tp_size),
        lease_seconds=lease_seconds, store=store, writer=writer, writer_options=writer_options,
        decode_chunk_steps=decode_chunk_steps, adaptive_codec=adaptive_codec, texts=None, hook_codecs=hook_codecs,
        encode_threads=encode_threads, drain_nice=drain_nice, publish_interval=float(publish_interval))
    planner = VLLMPlanner(geometry, dict(emitted), schedule)

    def make_session(ring, drain, publisher):
        return VLLMCaptureSession(llm, runner, planner, model, arch, selection, geometry, model_id=model_id,
                                  run_id=run_id, schedule=schedule, ring=ring, drain=drain, publisher=publisher,
                                  tp_rank=tp_rank, tp_size=tp_size, emitted_hooks=emitted)

    with owned_session(model, type(model).__name__, ctx, options, make_session) as session:
        yield session


def _refuse_split_kv_heads(hooks, geometry: ModelGeometry, tp_size: int) -> None:
    """Refuse ``attn_k``/``attn_v`` when a sharded vLLM engine has more than one key/value
    head but fewer than ranks: vLLM then gives each rank one of them (ranks 0-1 head 0, ranks
    2-3 head 1 for 2 heads on 4 ranks), a layout neither split in blocks nor replicated, which
    DMI cannot record as the model's whole tensor."""
    kv = geometry.n_kv_heads
    split = sorted(h for h in ("attn_k", "attn_v") if h in hooks)
    if split and 1 < kv < tp_size:
        raise HookSelectionError(
            f"{' and '.join(split)} cannot be captured from this vLLM engine: its {kv} key/value heads are fewer "
            f"than its {tp_size} tensor-parallel ranks, so vLLM gives each rank one copy of one head and no rank "
            f"holds them all. Capture them with tensor_parallel_size <= {kv} (each rank then holds its block of "
            "heads), or from a model with one key/value head; the other hooks are unaffected"
        )


def _refuse_a_run_holding_records(catalog, model_id: str, run_id: str, tp_rank: int) -> None:
    """vLLM numbers its requests itself, from 0 again in every new engine: a run that already
    holds records cannot be continued without writing some request ids twice."""
    held = catalog.rank_request_ids(model_id, run_id, shard_rank=tp_rank)
    if held:
        raise RequestExistsError(
            f"run {run_id!r} of model {model_id!r} already holds {len(held)} request(s) from an earlier "
            "capture; vLLM names its requests itself (from 0 again in a new engine), so capturing into "
            "this run could write a request's records twice: give a new run id (or none)"
        )


def _vllm_model_id(name: str) -> str:
    """The model vLLM was given: a directory that exists here by its resolved absolute path
    (as ``derive_model_id`` names a Hugging Face model), else the hub name."""
    return os.path.realpath(name) if os.path.isdir(name) else name.rstrip("/")
