"""Capture from a served vLLM engine: ``vllm serve MODEL --distributed-executor-backend
dmi.vllm.CaptureExecutor``.

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

__all__ = ["CaptureExecutor", "CAPTURE_ENV", "IDLE_PUBLISH_SECONDS"]

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
