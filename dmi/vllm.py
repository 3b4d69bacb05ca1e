"""Capture from vLLM engines whose model runs in other processes: a served engine (``vllm
serve MODEL --distributed-executor-backend dmi.vllm.CaptureMultiprocExecutor``, any
``--tensor-parallel-size``; or ``dmi.vllm.CaptureExecutor`` for one worker in the engine process;
both with ``--enforce-eager --no-enable-prefix-caching --shutdown-timeout N``),
and an ``LLM`` whose workers run apart — the default engine process, or one process per
tensor-parallel rank (``LLM(..., worker_extension_cls="dmi.vllm.CaptureWorkerExtension")``, then
``dmi.capture_vllm(llm)`` as usual).

vLLM builds its executor from a class named on its command line (a supported extension
point: no vLLM source is patched). Two executors attach ``dmi.capture.attach_vllm`` once the
model is loaded and keep it attached until the server shuts down:

* :class:`CaptureExecutor`, vLLM's single-process executor: its one worker runs in the engine
  process, which attaches to it directly.
* :class:`CaptureMultiprocExecutor`, vLLM's multiprocess executor: one worker process per
  tensor-parallel rank. It names :class:`CaptureWorkerExtension` as the workers' extension
  before they start (no extra flag), then every worker attaches in its own process — one run id
  for all ranks, each rank writing its shard under its own publisher lease — and detaches at
  shutdown (drained, sealed, published, lease released) before the workers stop.

Common to both:

* **What to capture**: ``DMI_VLLM_CAPTURE``, a JSON object of ``attach_vllm`` keywords
  (``{"hooks": "resid_post", "layers": [0, 4, 8]}``; default: ``resid_post`` of every
  layer). **Where**: the store ``dmi.open()`` opens (``DMI_HOME``, ``DMI_CATALOG``,
  ``DMI_PACKS``; the workers inherit the engine's environment) — the embedded catalog lets a
  reader in another process take turns with the server; a ClickHouse server is the choice at scale.
* **Refusals**: the engine must run eagerly without prefix caching or pipeline stages
  (``--enforce-eager --no-enable-prefix-caching``), and stop gracefully (``--shutdown-timeout
  N``, N > 0: vLLM's default kills the engine and its workers at once, before DMI could seal,
  publish and release its leases); otherwise the server does not start and the log names the
  flag (:class:`~dmi.VLLMConfigError`), before any worker is started. A bad
  ``DMI_VLLM_CAPTURE`` stops it the same way.
* **Publishing**: a finished request's records are sealed and published when the next engine
  step notices it left, or, when the engine goes idle, after :data:`IDLE_PUBLISH_SECONDS` — at
  most one publish per ``publish_interval`` (``attach_vllm``'s, default 1 s), which the
  requests finishing within it share — a client that got
  its response can read its records by the id the server returned (``cmpl-...-<prompt
  index>`` for ``/v1/completions``, the response ``id`` for ``/v1/chat/completions``). With
  workers in other processes the idle publish is a ``dmi_publish_buffered`` call to every
  worker, queued behind the steps already sent: each worker runs its calls one at a time, in
  order, so the publish never runs inside a step.
* **Failures**: a capture that fails inside a step stops and lets the engine serve on
  (``dmi.capture._vllm``); an idle publish that fails is logged and the publisher goes on. Both
  are logged again at shutdown, which no caller receives: the executor's ``shutdown`` logs what
  DMI's part of it raised and goes on with vLLM's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

# the workers' error replies are made and read in a module that needs no vLLM (tested without it)
from dmi._worker_errors import error_reply as _error_reply
from dmi._worker_errors import raise_replied as _raise_replied
from dmi.storage.errors import AttachError, CaptureError, DMIError, InvalidArgumentError, VLLMConfigError

__all__ = ["CaptureExecutor", "CaptureMultiprocExecutor", "CaptureWorkerExtension", "WorkerCapture", "CAPTURE_ENV",
           "IDLE_PUBLISH_SECONDS"]

logger = logging.getLogger(__name__)

CAPTURE_ENV = "DMI_VLLM_CAPTURE"
"""The environment variable holding the served capture's ``attach_vllm`` keywords (JSON)."""

IDLE_PUBLISH_SECONDS = 0.25
"""How long an engine stays idle before what it captured is sealed and published."""

_ALLOWED = frozenset({
    "hooks", "layers", "model_id", "run_id", "schedule", "ring_slots", "slot_bytes", "ring_timeout",
    "drop_policy", "adaptive_codec", "writer_options", "codec", "publish_scope", "lease_seconds",
    "decode_chunk_steps", "encode_threads", "drain_nice", "publish_interval", "tp_replicas",
})
"""Every keyword of ``attach_vllm`` but those the executor gives itself (the engine, store,
catalog and writer)."""


def capture_options(environ=os.environ) -> dict:
    """``attach_vllm`` keywords from :data:`CAPTURE_ENV`; :class:`InvalidArgumentError` for
    text that is not a JSON object of known keywords."""
    text = environ.get(CAPTURE_ENV, "").strip()
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{CAPTURE_ENV} is not JSON ({exc}): {text!r}") from exc
    if not isinstance(options, dict):
        raise InvalidArgumentError(f"{CAPTURE_ENV} must be a JSON object of attach_vllm keywords, got {text!r}")
    unknown = sorted(set(options) - _ALLOWED)
    if unknown:
        raise InvalidArgumentError(f"{CAPTURE_ENV}: unknown keyword(s) {', '.join(unknown)}; "
                                   f"allowed: {', '.join(sorted(_ALLOWED))}")
    return options


class CaptureExecutor(UniProcExecutor):
    """vLLM's single-process executor with DMI capture attached for the engine's lifetime (one
    worker, in the engine process; a sharded engine: :class:`CaptureMultiprocExecutor`)."""

    def _init_executor(self) -> None:
        _require_a_graceful_shutdown(self.vllm_config)
        tp = self.parallel_config.tensor_parallel_size
        if tp != 1:
            raise VLLMConfigError(
                f"dmi.vllm.CaptureExecutor runs one worker in the engine process, but this engine is sharded "
                f"(--tensor-parallel-size {tp}); serve it with --distributed-executor-backend "
                f"{_qualname(CaptureMultiprocExecutor)} (one worker process per rank, each capturing its shard)"
            )
        super()._init_executor()
        import dmi

        self._dmi_stack = contextlib.ExitStack()
        try:
            options = capture_options()
            store = self._dmi_stack.enter_context(dmi.open())
            self._dmi_session = self._dmi_stack.enter_context(store.capture_vllm(self, **options))
        except BaseException:
            self._dmi_stack.close()
            raise
        self._dmi_idle = _IdlePublisher(self._dmi_session.publish_buffered, IDLE_PUBLISH_SECONDS)

    def execute_model(self, scheduler_output, non_block: bool = False):
        with self._dmi_idle.step(), self._dmi_session.stepping():
            return super().execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        with self._dmi_idle.step(), self._dmi_session.stepping():
            return super().sample_tokens(grammar_output, non_block)

    def shutdown(self) -> None:
        try:
            if getattr(self, "_dmi_idle", None) is not None:
                _logged("stopping the idle publisher", self._dmi_idle.stop)
            if getattr(self, "_dmi_stack", None) is not None:  # detach: drain, seal, publish, release the lease
                _logged("detaching the capture", self._dmi_stack.close)
        finally:
            super().shutdown()


class CaptureMultiprocExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor (one worker process per tensor-parallel rank) with DMI capture
    attached in every worker for the engine's lifetime.

    Before the workers start it refuses an engine that would skip hooks (as ``attach_vllm``
    does) and names :class:`CaptureWorkerExtension` as their extension; once the model is
    loaded every worker attaches (``dmi_attach``: the store from the environment, one run id).
    Calls into the workers go through vLLM's message queue, which has one writer: every call is
    made under one lock, so the idle publisher's thread and the engine's never interleave.
    """

    def _init_executor(self) -> None:
        from dmi.capture import check_engine_config, new_run_id

        check_engine_config(self.vllm_config, sharded_ok=True)  # refused before any worker starts
        _require_a_graceful_shutdown(self.vllm_config)
        _name_the_extension(self.parallel_config)
        options = {"run_id": new_run_id(), **capture_options()}  # one run across every rank
        self._dmi_rpc_lock = threading.RLock()
        super()._init_executor()
        try:
            _attached_or_raise(self.collective_rpc("dmi_attach", args=(None, None, options)))
        except (RuntimeError, DMIError) as exc:  # RuntimeError: vLLM's report of a worker's crash (see its log)
            with contextlib.suppress(Exception):
                self.collective_rpc("dmi_detach")
            if isinstance(exc, DMIError):
                raise
            raise AttachError(f"DMI could not attach in every vLLM worker: {exc}") from exc
        self._dmi_attached = True
        self._dmi_idle = _IdlePublisher(self._dmi_publish_buffered, IDLE_PUBLISH_SECONDS)

    def collective_rpc(self, *args, **kwargs):
        with self._dmi_rpc_lock:
            return super().collective_rpc(*args, **kwargs)

    def execute_model(self, scheduler_output, non_block: bool = False):
        with self._dmi_idle.step():
            return super().execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        with self._dmi_idle.step():
            return super().sample_tokens(grammar_output, non_block)

    def _dmi_publish_buffered(self) -> None:
        """Queue a publish in every worker, behind the steps already sent, without waiting: the
        engine's thread reads the answers, in order, with its next call's. A worker logs a failed
        call with its traceback; a failed drain also fails that worker's next step and its detach."""
        if not self.is_failed and not getattr(self, "shutting_down", False):
            self.collective_rpc("dmi_publish_buffered", non_block=True)

    def _dmi_detach_workers(self) -> None:
        """Every worker: drain, seal, publish, release its lease; then the first DMI error a
        worker's detach raised, raised (:func:`_raise_replied`) for the shutdown to log."""
        _raise_replied(self.collective_rpc("dmi_detach"))

    def shutdown(self) -> None:
        try:
            if getattr(self, "_dmi_idle", None) is not None:
                _logged("stopping the idle publisher", self._dmi_idle.stop)
            if self.__dict__.pop("_dmi_attached", False) and not self.is_failed:
                _logged("detaching the workers' capture", self._dmi_detach_workers)
        finally:
            super().shutdown()


def _logged(what: str, action) -> None:
    """``action()``, DMI's part of a served engine's shutdown: what it raises is logged with its
    traceback, not raised — no caller receives it there, and vLLM's own teardown, which an
    exception from the executor's ``shutdown`` would skip, must still run."""
    try:
        action()
    except Exception:  # noqa: BLE001 - logged: see above
        logger.exception("DMI: %s failed as the vLLM engine shut down", what)


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _require_a_graceful_shutdown(vllm_config) -> None:
    """Refuse a server that vLLM stops by killing its engine and workers at once (its default,
    ``--shutdown-timeout 0``): the executor's shutdown, where what the workers hold is sealed and
    published and the leases released, would never run."""
    if not vllm_config.shutdown_timeout:
        raise VLLMConfigError(
            "this server would be stopped by killing its engine and worker processes at once "
            "(--shutdown-timeout 0, vLLM's default): DMI could not seal and publish the last records nor release "
            "its leases. Serve with --shutdown-timeout N (seconds to finish requests and detach, e.g. 30)"
        )


def _name_the_extension(parallel_config) -> None:
    """Name :class:`CaptureWorkerExtension` as the workers' extension (the configuration is sent
    to each worker as it starts); refuse an engine that names another one."""
    wanted = _qualname(CaptureWorkerExtension)
    given = parallel_config.worker_extension_cls
    if given and given != wanted:
        raise VLLMConfigError(
            f"this engine names its own worker extension (--worker-extension-cls {given}); DMI's served capture "
            f"attaches in each worker through {wanted}: drop that flag, or pass --worker-extension-cls {wanted}"
        )
    parallel_config.worker_extension_cls = wanted


class CaptureWorkerExtension:
    """Methods vLLM adds to every worker (``worker_extension_cls``, a supported extension point),
    called by name through ``collective_rpc`` with plain data — no function is pickled. Each
    worker attaches ``attach_vllm`` to itself in its own process, writing its tensor-parallel
    shard to the same store and run as the others (each rank under its own publisher lease)."""

    def dmi_attach(self, catalog: str | None, packs: str | None, options: dict) -> dict:
        """Attach in this worker's process, to the store at ``catalog``/``packs`` (``None``: as
        ``dmi.open()`` resolves it from the environment). A DMI error is returned as an error
        reply (:func:`_error_reply`; :func:`_attached_or_raise` raises it again in the caller's
        process): vLLM would turn it into a bare ``Exception``."""
        import dmi

        stack = contextlib.ExitStack()
        try:
            store = stack.enter_context(dmi.open(catalog, packs))
            session = stack.enter_context(store.capture_vllm(self, **options))
        except DMIError as exc:
            stack.close()
            return _error_reply(exc)
        except BaseException:
            stack.close()
            raise
        self._dmi_capture = (stack, session)
        return {"model_id": session.model_id, "run_id": session.run_id, "tp_rank": session.tp_rank,
                "tp_size": session.tp_size}

    def dmi_check(self) -> dict:
        """``{}``, or what stopped this worker's capture as an error reply (:func:`_error_reply`):
        asked before an engine runs, as the in-process session's ``generate`` refuses to run it
        once stopped."""
        return _replied(self._dmi_capture[1].check)

    def dmi_flush(self) -> dict:
        """Seal and publish what this worker captured: ``{"published": packs}``, or the DMI
        error the flush raised as an error reply (:func:`_error_reply`) — raised here, vLLM
        would report it as its generic worker error, and leave the other workers' replies unread."""
        return _replied(lambda: {"published": len(self._dmi_capture[1].flush())})

    def dmi_publish_buffered(self) -> bool:
        """Between steps (an idle engine): have what this worker buffered sealed and published,
        without waiting; whether anything was buffered."""
        return self._dmi_capture[1].publish_buffered()

    def dmi_detach(self) -> dict | None:
        """Detach (drain, seal, publish, release the lease): ``{"stats": this worker's
        statistics}``, with the DMI error the detach raised as an error reply
        (:func:`_error_reply`) — the statistics count what a failed capture did not capture.
        None: it was not attached (its attach failed)."""
        attached = self.__dict__.pop("_dmi_capture", None)
        if attached is None:
            return None
        stack, session = attached

        def close() -> dict:
            stack.close()
            return {}

        return {**_replied(close), "stats": session.stats}


def _replied(call) -> dict:
    """``call()``'s reply, or the DMI error it raised as an error reply (:func:`_error_reply`)."""
    try:
        return call()
    except DMIError as exc:
        return _error_reply(exc)


class WorkerCapture:
    """The session ``dmi.capture_vllm`` yields for an engine whose workers run in other
    processes: the same ``generate``, ``flush``, ``stats``, ``model_id``, ``run_id``."""

    def __init__(self, llm, attached: list[dict]):
        self.llm = llm
        self.model_id = attached[0]["model_id"]
        self.run_id = attached[0]["run_id"]
        self.tp_size = attached[0]["tp_size"]
        self.final_stats: list[dict] | None = None

    def generate(self, *args, **kwargs):
        """``llm.generate``; every request of its output is published when it returns. A
        worker's capture that failed raises here as the in-process session's does, as the DMI
        error the worker raised (:func:`_raise_replied`): before vLLM runs if it had stopped
        already, else once vLLM returned — its output on the error, as ``outputs``."""
        _raise_replied(self.llm.collective_rpc("dmi_check"))
        out = self.llm.generate(*args, **kwargs)
        try:
            self.flush()
        except DMIError as exc:
            exc.outputs = out
            raise
        return out

    def flush(self) -> int:
        """Seal and publish what every worker captured; the number of packs published. A
        worker's failure is raised as the DMI error it raised (:func:`_raise_replied`)."""
        return sum(reply["published"] for reply in _raise_replied(self.llm.collective_rpc("dmi_flush")))

    @property
    def stats(self) -> dict:
        """The workers' statistics, available after the ``with`` block: counts of records,
        bytes and packs summed over the workers; ``forwards``, ``requests``,
        ``recomputed_tokens_skipped`` and ``duplicate_request_ids`` (every rank sees every step)
        as one worker counted them."""
        if self.final_stats is None:
            raise InvalidArgumentError("a capture in other processes reports its statistics when it detaches")
        per_engine = {"forwards", "requests", "recomputed_tokens_skipped", "duplicate_request_ids"}
        return {k: (max if k in per_engine else sum)(s[k] for s in self.final_stats) for k in self.final_stats[0]}

    def _detached(self, replies: list, failed: BaseException | None) -> None:
        """Keep the workers' statistics from their ``dmi_detach`` replies, then raise the first
        DMI error a worker's detach raised — unless the ``with`` block raised ``failed``: that
        stays the error raised, as in one process, and a detach error that says more than it
        is added to it as a note."""
        self.final_stats = [reply["stats"] for reply in replies if reply is not None]
        try:
            _raise_replied(replies)
        except DMIError as exc:
            if failed is None:
                raise
            if str(exc) != str(failed):
                failed.add_note(f"detaching the vLLM workers' capture then raised {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def capture_in_workers(llm, *, catalog: str, packs: str, options: dict):
    """Attach in every worker of ``llm`` (built with :class:`CaptureWorkerExtension`) for the
    ``with`` block; a worker that fails to attach detaches the others before the error is raised."""
    from dmi.capture import check_engine_config, new_run_id

    config = llm.llm_engine.vllm_config
    check_engine_config(config, sharded_ok=True)  # refused here, with its own error, before any worker
    wanted = _qualname(CaptureWorkerExtension)
    if config.parallel_config.worker_extension_cls != wanted:
        raise VLLMConfigError(
            "this vLLM engine runs its model in other processes; build the LLM with "
            f"worker_extension_cls={wanted!r} so that DMI can attach in each worker (or, with one worker, set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it; docs/vllm.md)"
        )
    options = {"run_id": new_run_id(), **_plain(options)}  # one run across every rank
    try:
        attached = _attached_or_raise(llm.collective_rpc("dmi_attach", args=(catalog, packs, options)))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            llm.collective_rpc("dmi_detach")
        if isinstance(exc, DMIError) or not isinstance(exc, Exception):
            raise
        raise AttachError(f"DMI could not attach in every vLLM worker: {exc}") from exc
    session = WorkerCapture(llm, attached)
    failed = None
    try:
        yield session
    except BaseException as exc:
        failed = exc
        raise
    finally:
        session._detached(llm.collective_rpc("dmi_detach"), failed)


def _attached_or_raise(replies: list[dict]) -> list[dict]:
    """The workers' ``dmi_attach`` replies, or the first refusal among them raised as the DMI
    error the worker raised, its message and attributes (``PlanError``'s ``field``, ...) with it
    (an error that is no DMI error: :class:`AttachError` naming it)."""
    return _raise_replied(replies, attaching=True)


def _plain(options: dict) -> dict:
    """``attach_vllm`` keywords as the plain data vLLM sends to its workers (a ``range`` of
    layers as a list, a ``Schedule`` as its fields)."""
    import dataclasses

    out = dict(options)
    if isinstance(out.get("layers"), (range, tuple)):
        out["layers"] = list(out["layers"])
    if dataclasses.is_dataclass(out.get("schedule")):
        out["schedule"] = dataclasses.asdict(out["schedule"])
    return out


class _IdlePublisher:
    """A thread that calls ``publish()`` once no step has run for ``idle`` seconds, once per
    stretch of steps (an idle engine is not published again and again). A publish that fails is
    logged and the thread goes on, so that the requests finished later are still published while
    the engine idles; the first failure is raised by :meth:`stop`."""

    def __init__(self, publish, idle: float):
        self._publish = publish
        self._idle = idle
        self._last_step = time.monotonic()
        self._stepped = False  # a step ran since the last publish
        self.failures = 0  # publishes that raised
        self._first_failure: Exception | None = None  # raised by stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dmi-vllm-idle", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self):
        self._last_step = float("inf")  # never idle while a step runs
        try:
            yield
        finally:
            self._stepped = True
            self._last_step = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self._idle):
            if self._stepped and time.monotonic() - self._last_step >= self._idle:
                self._stepped = False
                self._publish_or_log()

    def _publish_or_log(self) -> None:
        """``publish()``; what it raises is logged and kept (the first), not raised: it would end
        the thread for good. A publish only asks for a seal, so what was buffered stays buffered,
        for a later publish or the detach."""
        try:
            self._publish()
        except Exception as exc:  # noqa: BLE001 - logged here, raised by stop()
            self.failures += 1
            self._first_failure = self._first_failure or exc
            logger.exception("DMI: the idle publish of this vLLM engine's capture failed (%d time(s) so far); what "
                             "it would have published stays buffered for the next publish or the detach",
                             self.failures)

    def stop(self) -> None:
        """Stop the thread; then raise the first publish that failed, if any (once), as
        :class:`CaptureError` with that failure as its cause."""
        self._stop.set()
        self._thread.join()
        failure, self._first_failure = self._first_failure, None
        if failure is not None:
            raise CaptureError(
                f"the idle publish of this vLLM engine's capture failed {self.failures} time(s), first with "
                f"{failure!r} (each was logged); what it would have published stayed buffered for a later "
                "publish or the detach"
            ) from failure
