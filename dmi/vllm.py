"""Capture from vLLM engines whose model runs in other processes: a served engine (``vllm
serve MODEL --distributed-executor-backend dmi.vllm.CaptureExecutor``), and an ``LLM`` whose
workers run apart — the default engine process, or one process per tensor-parallel rank
(``LLM(..., worker_extension_cls="dmi.vllm.CaptureWorkerExtension")``, then
``dmi.capture_vllm(llm)`` as usual).

vLLM builds its executor from a class named on its command line (a supported extension
point: no vLLM source is patched). :class:`CaptureExecutor` is vLLM's single-process executor
that, once the model is loaded, attaches ``dmi.capture.attach_vllm`` to its own worker and
keeps it attached until the server shuts down:

* **What to capture**: ``DMI_VLLM_CAPTURE``, a JSON object of ``attach_vllm`` keywords
  (``{"hooks": "resid_post", "layers": [0, 4, 8]}``; default: ``resid_post`` of every
  layer). **Where**: the store ``dmi.open()`` opens (``DMI_HOME``, ``DMI_CATALOG``,
  ``DMI_PACKS``) — the embedded catalog lets a reader in another process take turns with
  the server; a ClickHouse server is the choice at scale.
* **Refusals**: the engine must run eagerly without prefix caching (``--enforce-eager
  --no-enable-prefix-caching``); otherwise the server does not start and the log names the
  flag (:class:`~dmi.VLLMConfigError`). A bad ``DMI_VLLM_CAPTURE`` stops it the same way.
* **Publishing**: a finished request's records are sealed and published at the next engine
  step, or, when the engine goes idle, after :data:`IDLE_PUBLISH_SECONDS` — a client that got
  its response can read its records by the id the server returned (``cmpl-...-<prompt
  index>`` for ``/v1/completions``, the response ``id`` for ``/v1/chat/completions``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from vllm.v1.executor.uniproc_executor import UniProcExecutor

from dmi.storage.errors import InvalidArgumentError

__all__ = ["CaptureExecutor", "CaptureWorkerExtension", "WorkerCapture", "CAPTURE_ENV", "IDLE_PUBLISH_SECONDS"]

CAPTURE_ENV = "DMI_VLLM_CAPTURE"
"""The environment variable holding the served capture's ``attach_vllm`` keywords (JSON)."""

IDLE_PUBLISH_SECONDS = 0.25
"""How long an engine stays idle before what it captured is sealed and published."""

_ALLOWED = frozenset({
    "hooks", "layers", "model_id", "run_id", "schedule", "ring_slots", "slot_bytes", "ring_timeout",
    "drop_policy", "adaptive_codec", "writer_options", "codec", "publish_scope", "lease_seconds",
    "decode_chunk_steps",
})


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
    """vLLM's single-process executor with DMI capture attached for the engine's lifetime."""

    def _init_executor(self) -> None:
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
        self._dmi_idle = _IdlePublisher(self._dmi_session, IDLE_PUBLISH_SECONDS)

    def execute_model(self, scheduler_output, non_block: bool = False):
        with self._dmi_idle.step(), self._dmi_session.stepping():
            return super().execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        with self._dmi_idle.step(), self._dmi_session.stepping():
            return super().sample_tokens(grammar_output, non_block)

    def shutdown(self) -> None:
        try:
            if getattr(self, "_dmi_idle", None) is not None:
                self._dmi_idle.stop()
            if getattr(self, "_dmi_stack", None) is not None:
                self._dmi_stack.close()  # detach: drain, seal, publish, release the lease
        finally:
            super().shutdown()


class CaptureWorkerExtension:
    """Methods vLLM adds to every worker (``worker_extension_cls``, a supported extension point),
    called by name through ``collective_rpc`` with plain data — no function is pickled. Each
    worker attaches ``attach_vllm`` to itself in its own process, writing its tensor-parallel
    shard to the same store and run as the others (each rank under its own publisher lease)."""

    def dmi_attach(self, catalog: str, packs: str, options: dict) -> dict:
        import dmi

        stack = contextlib.ExitStack()
        try:
            store = stack.enter_context(dmi.open(catalog, packs))
            session = stack.enter_context(store.capture_vllm(self, **options))
        except BaseException:
            stack.close()
            raise
        self._dmi_capture = (stack, session)
        return {"model_id": session.model_id, "run_id": session.run_id, "tp_rank": session.tp_rank,
                "tp_size": session.tp_size}

    def dmi_flush(self) -> int:
        """Seal and publish what this worker captured; the number of packs published."""
        return len(self._dmi_capture[1].flush())

    def dmi_detach(self) -> dict | None:
        """Detach (drain, seal, publish, release the lease); this worker's statistics (None:
        it was not attached — its attach failed)."""
        attached = self.__dict__.pop("_dmi_capture", None)
        if attached is None:
            return None
        stack, session = attached
        stack.close()
        return session.stats


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
        """``llm.generate``; every request of its output is published when it returns."""
        out = self.llm.generate(*args, **kwargs)
        self.flush()
        return out

    def flush(self) -> int:
        return sum(self.llm.collective_rpc("dmi_flush"))

    @property
    def stats(self) -> dict:
        """The workers' statistics, available after the ``with`` block: counts of records,
        bytes and packs summed over the workers; ``forwards``, ``requests`` and
        ``recomputed_tokens_skipped`` (every rank sees every step) as one worker counted them."""
        if self.final_stats is None:
            raise InvalidArgumentError("a capture in other processes reports its statistics when it detaches")
        per_engine = {"forwards", "requests", "recomputed_tokens_skipped"}
        return {k: (max if k in per_engine else sum)(s[k] for s in self.final_stats) for k in self.final_stats[0]}

    def _detached(self, stats: list) -> None:
        self.final_stats = [s for s in stats if s is not None]


@contextlib.contextmanager
def capture_in_workers(llm, *, catalog: str, packs: str, options: dict):
    """Attach in every worker of ``llm`` (built with :class:`CaptureWorkerExtension`) for the
    ``with`` block; a worker that fails to attach detaches the others before the error is raised."""
    from dmi.capture import check_engine_config, new_run_id
    from dmi.storage.errors import VLLMConfigError

    config = llm.llm_engine.vllm_config
    check_engine_config(config, sharded_ok=True)  # refused here, with its own error, before any worker
    wanted = f"{CaptureWorkerExtension.__module__}.{CaptureWorkerExtension.__qualname__}"
    if config.parallel_config.worker_extension_cls != wanted:
        raise VLLMConfigError(
            "this vLLM engine runs its model in other processes; build the LLM with "
            f"worker_extension_cls={wanted!r} so that DMI can attach in each worker (or, with one worker, set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating it; docs/vllm.md)"
        )
    options = {"run_id": new_run_id(), **_plain(options)}  # one run across every rank
    try:
        attached = llm.collective_rpc("dmi_attach", args=(catalog, packs, options))
    except BaseException:
        with contextlib.suppress(Exception):
            llm.collective_rpc("dmi_detach")
        raise
    session = WorkerCapture(llm, attached)
    try:
        yield session
    finally:
        session._detached(llm.collective_rpc("dmi_detach"))


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
    """A thread that publishes what the session buffered once no step has run for ``idle`` seconds."""

    def __init__(self, session, idle: float):
        self._session = session
        self._idle = idle
        self._last_step = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dmi-vllm-idle", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self):
        self._last_step = float("inf")  # never idle while a step runs
        try:
            yield
        finally:
            self._last_step = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self._idle):
            if time.monotonic() - self._last_step >= self._idle:
                self._session.publish_buffered()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
