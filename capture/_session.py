"""Attach / detach: the context manager that owns a model while capturing.

``attach(model, ...)`` validates everything (hooks, layers, attention implementation,
identifiers, ownership) *before* it touches the model, then installs one PyTorch hook per
(module, kind) plus a pre- and post-hook on the model itself, and yields a
:class:`CaptureSession`. On exit — including on error — every hook is removed, the open
slot is drained, the open pack sealed and published, the publisher lease released, and the
model's ownership given back. A second attach while the model is owned raises
:class:`AttachError` and changes nothing.

A session runs one call at a time (:class:`_SessionGate`): its ``generate``/``forward``, a
``model.generate`` called directly, and every forward of the model hold it from start to end,
and closing waits for the holder, so no close removes hooks under a running forward or seals
half a call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import numbers
import os
import re
import secrets
import sys
import threading
import time
import weakref
from collections import Counter
from time import perf_counter
from dataclasses import dataclass, field

import torch
from torch import nn

from dmi.storage import PackStore
from dmi.storage.errors import (
    AttachError,
    AttentionImplementationError,
    CaptureError,
    DrainError,
    InvalidArgumentError,
    InvalidIdentifierError,
    RequestExistsError,
    UnsupportedGenerationError,
)
from dmi.storage.records import GLOBAL_LAYER

from ._arch import Architecture, resolve_architecture
from ._codec_choice import resolve_codecs
from ._compiled import (Staging, check_compiled_selection, compiled_form, guard_hooks, inner_model,
                        install_compiled_taps, outside_graph, traced_before, unguard_hooks)
from ._drain import STEP_INTERRUPTED, Drain, KeyContext, cuda_event_for_submission
from ._generate import (CaptureResult, SequenceEnds, cached_tokens, eos_token_ids, left_pads, prepare_batch,
                        refuse_past_vocabulary, sequences_per_prompt)
from ._hooks import HOOKS, ModelGeometry
from ._plan import StepPlan
from ._ring import Entry, Ring
from ._schedule import Schedule
from ._selection import Selection, select
from ._tp import resolve_parallel_ranks
from ._tp_layout import TPLayout, check_model_cut, emitted_hooks, whole_by_tp_plan
from ._token_text import TokenStrings, with_token_ids

__all__ = ["attach", "CaptureSession", "derive_model_id", "new_run_id"]

_OWNERS: "weakref.WeakKeyDictionary[nn.Module, CaptureSession | KeyContext]" = weakref.WeakKeyDictionary()
_SCOPES: dict[tuple[str, str], str] = {}  # (catalog, publish scope) → the run capturing under it in this process
_OWNERS_LOCK = threading.Lock()

def _validate_id(kind: str, value) -> str:
    """The catalog's rule (stored and read back verbatim): a non-empty str, no control
    characters, bounded length. Raises :class:`InvalidIdentifierError`."""
    from dmi.catalog import validate_value_id

    return validate_value_id(value, kind)


def derive_model_id(model: nn.Module) -> str:
    """The model's hub name or directory (``config._name_or_path``), else
    ``<model_type>-<12 hex of the config's hash>`` for models built from a config.

    A directory that exists here is named by its absolute path with symlinks resolved, so
    ``./m``, ``m/`` and ``/abs/m`` are one model, whatever the working directory."""
    config = model.config
    name = getattr(config, "_name_or_path", "") or ""
    name = os.path.realpath(name) if name and os.path.isdir(name) else name.rstrip("/")
    if name:
        try:
            return _validate_id("model id", name)
        except InvalidIdentifierError:  # a path with control characters: keep a cleaned tail + hash
            tail = re.sub(r"[^A-Za-z0-9._-]", "-", name.split("/")[-1]).strip("-.") or "model"
            return f"{tail}-{hashlib.sha1(name.encode('utf-8', 'replace')).hexdigest()[:8]}"
    try:
        blob = config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - any config still gets a stable-enough id
        blob = json.dumps(repr(config))
    return f"{config.model_type}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def new_run_id() -> str:
    """A fresh run id: the UTC time and 6 random hex digits (``20261201T101500Z-a1b2c3``)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass(slots=True)
class _Call:
    """State of one generate / forward call (or one implicit call seen through the hooks)."""

    request_ids: list[str]
    admitted: list[bool]
    first_phase: str  # "prefill" or "forward"
    pads: list[int] | None = None  # prompt left padding per row (known at the first step)
    n_real: list[int] = field(default_factory=list)
    step: int = -1
    call_id: int = 0
    ended: set[int] = field(default_factory=set)  # rows fed the token generate stopped them at: their sequence is over


CATALOG_RIDE_OUT_SECONDS = 10.0
"""How long a session's lease acquire, publishes and lease renewals retry an unreachable catalog
(at most a third of its lease): a blip is ridden out, the drain waiting meanwhile, and counted
in ``stats["catalog_retries"]`` (docs/catalog-protocol.md)."""

HOLDER_CHECK_SECONDS = 1.0
"""How often a thread waiting for the session checks that its holder's thread still runs."""


def _live_threads() -> set[int]:
    return {t.ident for t in threading.enumerate()}


class _SessionGate:
    """The session's lock: one thread at a time holds it, as often as it likes (a call, the
    forwards inside it, a flush from one of its hooks), ``with`` or ``acquire``/``release``.
    Unlike an ``RLock`` it can leave work to its holder: :meth:`run_alone` runs an action (the
    close) once no other thread holds it, and where that cannot happen now — the caller holds
    it itself, or the wait is interrupted — the holder runs the action as it lets go, so that
    the action is neither run under a holder's feet nor lost.

    A forward's hold is marked (:attr:`forward`) in the same step as it is taken and let go
    (:meth:`acquire_forward`, ``release(forward=True)``): a ``KeyboardInterrupt`` cannot fall
    between a hold and its mark and leave a hold that no one knows to let go."""

    def __init__(self):
        self._cond = threading.Condition()
        self._holder: int | None = None
        self._depth = 0
        self._then = None  # the action the holder runs as it lets go
        self.forward: int | None = None  # the thread whose forward holds the gate

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def acquire(self) -> None:
        """Hold the gate, once no other thread does."""
        self._take(forward=False)

    def acquire_forward(self) -> bool:
        """Hold the gate for a forward of this thread, marked as such. True when the mark it
        replaces is another thread's: a forward hold the gate took over from a thread that
        ended inside a forward, whose step the caller abandons."""
        return self._take(forward=True)

    def _take(self, *, forward: bool) -> bool:
        me = threading.get_ident()
        with self._cond:
            while self._holder not in (None, me):
                self._wait()
            mark = me if forward else self.forward
            orphaned = forward and self.forward not in (None, me)
            self._holder, self._depth, self.forward = me, self._depth + 1, mark
        return orphaned

    def _wait(self) -> None:
        """Wait for the holder to let go (under the condition). A holder whose thread has ended
        never will (its forward ended without its post-hook): the gate is then free, and an
        action left to it (a close) is left to the next holder."""
        if not self._cond.wait(HOLDER_CHECK_SECONDS) and self._holder not in _live_threads():
            self._holder, self._depth = None, 0

    def release(self, *, forward: bool = False) -> None:
        """Let go of one hold (``forward``: a forward's, its mark cleared with it); the last one
        first runs the action left to the holder, if any."""
        with self._cond:
            mark = None if forward else self.forward
            then = self._then if self._depth == 1 else None
            if then is None:
                depth = self._depth - 1
                self._depth, self._holder, self.forward = depth, self._holder if depth else None, mark
                if not depth:
                    self._cond.notify_all()
                return
            self._then, self.forward = None, mark
        try:
            then()  # still held: nothing else starts meanwhile
        finally:
            self.release()

    def run_alone(self, action) -> None:
        """Run ``action`` holding the gate, as soon as no other thread holds it. Where this thread
        holds it already (asked from inside its own call), ``action`` runs as that hold ends; where
        the wait is interrupted, as the other thread's hold ends (:meth:`_wait_free`)."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._then = action
                return
            interrupted = self._wait_free(action)
            self._holder, self._depth, self._then = me, 1, action
        self.release()
        if interrupted is not None:
            raise interrupted

    def _wait_free(self, action) -> BaseException | None:
        """Wait (under the condition) until no thread holds the gate; None. Interrupted
        (``KeyboardInterrupt``) while a thread holds it: leave ``action`` to that thread, which
        runs it as it lets go, and raise; interrupted as the gate came free: return the
        interruption, to raise once ``action`` ran."""
        try:
            while self._holder is not None:
                self._wait()
        except BaseException as exc:
            if self._holder is not None:
                self._then = action
                raise
            return exc
        return None


class CaptureSession:
    """A model under capture. Made by :func:`attach`; use its methods inside the ``with``."""

    keeps_published = True
    """Whether :attr:`published` and ``flush()`` hold the descriptors of the packs published (a
    descriptor holds an entry per record); a session that may live for ever (a vLLM engine's)
    keeps only their count, ``stats["packs_published"]``."""

    def __init__(self, model, arch: Architecture, selection: Selection, geometry: ModelGeometry,
                 *, model_id: str, run_id: str, schedule: Schedule, ring: Ring, drain: Drain,
                 publisher=None, tp_rank: int = 0, tp_size: int = 1, capture_enabled: bool = True,
                 emitted_hooks: dict[str, tuple[int, ...]] | None = None, compiled: bool = False,
                 taken_request_ids: set[str] | None = None):
        self.model = model
        self.arch = arch
        self.selection = selection
        self.geometry = geometry
        self.model_id = model_id
        self.run_id = run_id
        self.schedule = schedule
        self.ring = ring
        self.drain = drain
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._publisher = publisher
        self._capture_enabled = capture_enabled
        # the hooks this process writes: the selection, less replicated hooks another TP rank writes
        self._emitted = dict(selection.hooks if emitted_hooks is None else emitted_hooks)
        self._handles: list = []
        self._plan: StepPlan | None = None
        self._step_dropped: set[tuple[str, int, int]] = set()  # (hook, layer, span) the step in progress dropped
        self._call: _Call | None = None
        self._implicit: _Call | None = None
        self._ends: SequenceEnds | None = None  # which rows of the generate call running have ended, if any
        self._forwards = 0
        # request ids this run already holds (published earlier under this scope, or used here)
        self._used_request_ids = set(taken_request_ids or ())
        self._n_requests = _next_default_index(run_id, self._used_request_ids)
        self._n_calls = 0
        self._hook_seconds = 0.0  # model-thread time inside DMI's hooks (plan, reserve, copy)
        self._closed = False
        self._cuda_side_stream = None
        self._staging: Staging | None = None
        self._hooks_guarded = False  # this session turned dynamo's hook guards on (compiled, or traced before)
        self.compiled = compiled
        self._lock = _SessionGate()  # held by each call and forward, by flush and close
        self._calls = 0  # session calls the gate's holder is inside (only the holder changes it)
        self.published: list = []

    # -- public ---------------------------------------------------------------------------------
    @property
    def hooks(self) -> dict[str, tuple[int, ...]]:
        """The selected hooks and the layers each is captured at (``(-1,)``: global)."""
        return dict(self.selection.hooks)

    def generate(self, input_ids, attention_mask=None, *, request_ids=None, **generate_kwargs) -> CaptureResult:
        """``model.generate`` with capture. ``input_ids``: a ``[b, t]`` tensor (left-padded, with
        its ``attention_mask``) or a list of prompts' token ids (left-padded for you). Returns
        the request ids (one per returned sequence: ``b × num_return_sequences``, sequence ``j``
        of prompt ``i`` at ``i * n + j``) and ``model.generate``'s output unchanged. Beam search
        is refused before the model runs (:class:`UnsupportedGenerationError`). Holds the
        session for the call: one made on another thread meanwhile waits for it."""
        with self._calling():
            ids, mask = self._batch(input_ids, attention_mask)
            config = getattr(self.model, "generation_config", None)
            per_prompt = sequences_per_prompt(config, generate_kwargs)
            call = self._open_call(ids, mask, request_ids, "prefill", per_prompt)
            try:
                out = self.model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs)
            finally:
                self._close_call()
        return CaptureResult(tuple(call.request_ids), out)

    def forward(self, input_ids, attention_mask=None, *, request_ids=None, **forward_kwargs) -> CaptureResult:
        """One scoring pass (phase ``"forward"``) with capture; returns request ids and the
        model's output. Holds the session for the call, as ``generate`` does."""
        with self._calling():
            cached = cached_tokens(forward_kwargs)
            if cached:
                raise UnsupportedGenerationError(
                    f"a forward from a cache that already holds {cached} token(s) cannot be "
                    "captured: the tokens fed would be stored as the request's first positions. Pass the whole "
                    "sequence without a cache")
            ids, mask = self._batch(input_ids, attention_mask)
            call = self._open_call(ids, mask, request_ids, "forward")
            forward_kwargs.setdefault("use_cache", False)
            try:
                out = self.model(input_ids=ids, attention_mask=mask, **forward_kwargs)
            finally:
                self._close_call()
        return CaptureResult(tuple(call.request_ids), out)

    def flush(self, timeout: float | None = None) -> list:
        """Drain every copied tensor, seal the open pack, publish; re-raise any drain error.
        Returns the pack descriptors published since the previous flush. From another thread
        it waits for the call in progress (the ring has one producer: the thread holding the
        session). A forward of this thread that ended without its post-hook (``KeyboardInterrupt``)
        left its step incomplete: that step is abandoned (counted lost), not flushed."""
        self._drop_stale_forward()
        with self._lock:
            self._refuse_closed()  # before the drain: its thread ends with the session
            self._abandon_orphaned_step()
            self.ring.submit()
            out = self.drain.flush(timeout)
            self.published.extend(out)
        return out

    @property
    def stats(self) -> dict:
        r, d = self.ring.stats, self.drain.stats
        return {
            "forwards": self._forwards,
            "requests": self._n_requests,
            "reservations": r.reservations,
            "reserved_bytes": r.reserved_bytes,
            "copies": r.copies,
            "slots_submitted": r.submitted_slots,
            "ring_waits": r.waits,
            "ring_wait_seconds": r.wait_seconds,
            "tensors_dropped": r.dropped_tensors,
            "bytes_dropped": r.dropped_bytes,
            "steps_packed": r.steps_packed,
            "records": d.records,
            "records_lost": d.records_lost,
            "packs_sealed": d.packs_sealed,
            "packs_published": d.packs_published,
            "packs_not_durable": d.packs_not_durable,
            "seals_deferred": d.seals_deferred,
            "drain_busy_seconds": d.busy_seconds,
            "drain_cpu_seconds": d.thread_cpu_seconds + d.encoder_cpu_seconds,
            "lease_seconds": d.start_seconds,
            "catalog_retries": 0 if self._publisher is None else self._publisher.publisher.retries,
            "lease_reacquired": 0 if self._publisher is None else self._publisher.publisher.reacquired,
            "codec_switches": d.codec_switches,
            "records_fallback_codec": d.records_fallback,
            "hook_seconds": self._hook_seconds,
            "drain_nice": self.drain.nice,
            "drain_torch_threads": self.drain.torch_threads,
        }

    # -- one call at a time ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _calling(self):
        """Hold the session for one call (``generate``, ``forward``, a direct ``model.generate``):
        a close or flush on another thread waits until it ends, so its records are complete."""
        with self._lock:
            self._calls += 1
            try:
                yield
            finally:
                self._calls -= 1
                self._drop_stale_forward()

    def _enter_forward(self) -> bool:
        """At a forward's start (the model's pre-hook): hold the session until its post-hook, so
        that a close on another thread waits for the forward instead of removing hooks under
        it. False when the session closed while this forward waited: it runs uncaptured. The
        top module's forwards do not nest, so a hold this thread still has is one a forward left
        without its post-hook (PyTorch skips it on ``KeyboardInterrupt``, and when a compiled
        forward raises): it carries over to this forward."""
        if self._holds_forward():
            self._abandon_step()  # the forward that left the hold never completed its step
            return True
        orphaned = self._lock.acquire_forward()
        if self._closed:
            self._leave_forward()
            return False
        if orphaned:
            self._abandon_step()
        return True

    def _holds_forward(self) -> bool:
        return self._lock.forward == threading.get_ident()

    def _abandon_orphaned_step(self) -> None:
        """Holding the gate: a forward hold of another thread is one the gate took over from a
        thread that ended inside a forward (no post-hook): that forward's step is abandoned
        before anything else reaches the ring."""
        if self._lock.forward is not None and not self._holds_forward():
            self._abandon_step()
            self._lock.forward = None

    def _leave_forward(self) -> None:
        self._lock.release(forward=True)

    def _drop_stale_forward(self) -> None:
        """Outside every session call, a forward hold of this thread is one a forward left without
        its post-hook (or, for a close, the hold of the forward a hook of the user's closes
        from): let go of it, so that the session is not held for ever."""
        if not self._calls and self._holds_forward():
            self._abandon_step()
            self._leave_forward()

    # -- calls ----------------------------------------------------------------------------------
    def _batch(self, input_ids, attention_mask):
        self._check_open()
        pad = getattr(getattr(self.model, "generation_config", None), "pad_token_id", None)
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        ids, mask = prepare_batch(input_ids, attention_mask, pad_token_id=pad)
        refuse_past_vocabulary(ids, self.model)
        dev = _model_device(self.model)
        return ids.to(dev), mask.to(dev)

    def _check_open(self):
        self._refuse_closed()
        self.drain.check()

    def _refuse_closed(self) -> None:
        if self._closed:
            raise CaptureError("this capture session is closed (its `with` block has exited)")

    def _open_call(self, ids, mask, request_ids, first_phase, per_prompt: int = 1) -> _Call:
        """One request per row the model will run: each prompt row repeated ``per_prompt`` times."""
        b = ids.shape[0] * per_prompt
        pads = [pad for pad in left_pads(mask) for _ in range(per_prompt)]
        if request_ids is None:
            rids = self._default_request_ids(b)
        else:
            rids = [_validate_id("request id", r) for r in request_ids]
            if len(rids) != b or len(set(rids)) != b:
                raise InvalidArgumentError(f"need {b} distinct request ids (one per returned sequence), got {request_ids!r}")
            self._refuse_taken(rids)
        call = self._new_call(rids, first_phase)
        call.pads = pads
        self._call = call
        return call

    def _default_request_ids(self, b: int) -> list[str]:
        """``<run id>-NNNNNN`` from the session's counter on, skipping ids the run already holds."""
        rids, index = [], self._n_requests
        while len(rids) < b:
            rid = f"{self.run_id}-{index:06d}"
            if rid not in self._used_request_ids:
                rids.append(rid)
            index += 1
        return rids

    def _refuse_taken(self, rids: list[str]) -> None:
        taken = [r for r in rids if r in self._used_request_ids]
        if taken:
            raise RequestExistsError(
                f"request id(s) {', '.join(map(repr, taken[:5]))}{' ...' if len(taken) > 5 else ''} already "
                f"hold records in run {self.run_id!r} of model {self.model_id!r} (captured earlier under this "
                "run id, or earlier in this session); writing them again would show readers every record "
                "twice: give new request ids, or a new run id"
            )

    def _new_call(self, rids, first_phase) -> _Call:
        self._used_request_ids.update(rids)
        base = self._n_requests
        self._n_requests += len(rids)
        admitted = [self.schedule.admits_request(base + i) for i in range(len(rids))]
        self._n_calls += 1
        return _Call(list(rids), admitted, first_phase, None, [0] * len(rids), call_id=self._n_calls)

    def _close_call(self):
        """The call ended. A forward of it that holds the session still ended without its
        post-hook (``KeyboardInterrupt``): its step is abandoned, not left in the ring."""
        if self._holds_forward():
            self._abandon_step()
        self._call = None
        self._plan = None

    # -- hooks ----------------------------------------------------------------------------------
    def _install(self) -> None:
        """The model-level hooks, then the taps. Every hook that is Python (all of them but the
        compiled taps) runs outside any graph: a ``torch.compile`` DMI did not see at attach
        (one ``generate`` starts itself, a submodule compiled later) breaks its graph there
        and runs the hook eagerly, instead of tracing it (which fails to compile)."""
        m = self.arch.model  # under torch.compile(model): the module it wraps
        self._handles.append(m.register_forward_pre_hook(outside_graph(self._on_model_pre), with_kwargs=True))
        self._handles.append(m.register_forward_hook(outside_graph(self._on_model_post), always_call=True))
        if callable(getattr(m, "generate", None)):
            self._handles.append(_GenerateGuard(m, eager=not self.compiled, hold=self._calling,
                                                ending_at=self._ending_at))
        if self.compiled:
            self._install_compiled()
            return
        self._install_taps(self.arch.taps(self._emitted))
        if traced_before():  # a graph traced without these hooks would run instead of them
            guard_hooks()
            self._hooks_guarded = True

    def _install_compiled(self) -> None:
        """Taps that write through the ``dmi::ring_write`` op into a staging buffer (see
        ``_compiled``); ``logits`` is taken from the model's output after the forward."""
        if not self._capture_enabled:
            return
        inside = {h: ls for h, ls in self.selection.hooks.items() if h not in ("logits", "token_ids")}
        taps = self.arch.taps(inside)
        for tap in taps:
            if tap.module is None:
                raise AttachError(f"module for {[e.hook for e in tap.emissions]} not found")
        emissions = [(em.hook, em.layer) for tap in taps for em in tap.emissions]
        self._staging = Staging(emissions, self.geometry, _model_device(self.model))
        self._handles.extend(install_compiled_taps(taps, self._staging))
        guard_hooks()
        self._hooks_guarded = True

    def _install_taps(self, taps) -> None:
        for tap in taps:
            if tap.module is None:
                raise AttachError(f"module for {[e.hook for e in tap.emissions]} not found")
            if tap.kind == "pre":
                hook = outside_graph(self._pre_hook(tap))
                self._handles.append(tap.module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                hook = outside_graph(self._post_hook(tap))
                self._handles.append(tap.module.register_forward_hook(hook, with_kwargs=True))

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        if self._hooks_guarded:
            self._hooks_guarded = False
            unguard_hooks()

    def _emitter(self, tap):
        """Emit every tensor ``tap`` captures from one call of its module (nothing when no plan)."""
        emissions = tap.emissions
        emit = self._emit

        def run(args, kwargs, output):
            plan = self._plan
            if plan is None:
                return
            t0 = perf_counter()
            for em in emissions:
                emit(em.hook, em.layer, em.extract(args, kwargs, output), em.layout, plan)
            self._hook_seconds += perf_counter() - t0

        return run

    def _pre_hook(self, tap):
        run = self._emitter(tap)

        def hook(module, args, kwargs):
            run(args, kwargs, None)

        return hook

    def _post_hook(self, tap):
        run = self._emitter(tap)

        def hook(module, args, kwargs, output):
            run(args, kwargs, output)

        return hook

    def _on_model_pre(self, module, args, kwargs=None):
        """Hold the session for the forward, then plan its step. ``kwargs`` is None when PyTorch
        calls the hook after the session removed it (it reads the hook's kwargs flag after taking
        the list of hooks): the session closed as the forward started, which runs uncaptured."""
        if kwargs is None or not self._enter_forward():
            return None
        t0 = perf_counter()
        try:
            self._begin_step(args, kwargs)
            if self._staging is not None:
                self._wait_side_stream()
                self._staging.prepare(self._plan)
            return None
        finally:
            self._hook_seconds += perf_counter() - t0

    def _begin_step(self, args, kwargs):
        self._plan = None
        self._step_dropped = set()
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            return None
        b, t = ref.shape[0], ref.shape[1]
        call = self._call
        if call is None:
            call = self._implicit_call(b, kwargs)
        elif b != len(call.request_ids):
            raise CaptureError(
                f"the model ran {b} rows for a call of {len(call.request_ids)} requests; this generation "
                "mode changes the batch in a way capture cannot follow"
            )
        if call.step < 0:
            phase = call.first_phase
            if call.pads is None:
                mask = kwargs.get("attention_mask")
                call.pads = left_pads(mask) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else [0] * b
            first_cols = call.pads
        else:
            phase = "decode"
            first_cols = [0] * b
        call.step += 1
        starts = list(call.n_real)
        for i in range(b):
            call.n_real[i] += t - first_cols[i]
        forward_index = self._forwards
        self._forwards += 1
        ended = frozenset(call.ended)  # before this step: the step feeding a row its stopping token records it
        if phase == "decode" and self._ends is not None:
            call.ended.update(self._ends.ended_rows(ids))
        if not self._capture_enabled or not self.schedule.admits_step(forward_index, phase, call.step):
            return None  # refused: nothing dispatched, nothing reserved
        rows = [i for i in range(b) if call.admitted[i] and i not in ended]
        if not rows:
            return None
        self.drain.check()  # the open slot may have room: a failed drain must stop the copies here
        first_cols, starts = self.schedule.trim_prompt(phase, first_cols, starts, t)
        first_cols, starts, ends = self.schedule.window(first_cols, starts, t)
        plan = StepPlan.build(batch=b, tokens=t, phase=phase, step=call.step, first_cols=first_cols,
                              starts=starts, kv_pads=call.pads, rows=rows, request_ids=call.request_ids,
                              geometry=self.geometry, hooks=self._emitted, call_id=call.call_id, ends=ends,
                              kv_len=call.pads[0] + call.n_real[0])
        if plan is None:
            return None  # no token of this step is in the schedule's position window
        from_ids = [hook for hook in self._emitted if HOOKS[hook].source == "input_ids"]
        if from_ids and ids is None:
            _refuse_embeds(from_ids)
        self._plan = plan
        for hook in from_ids:
            self._emit(hook, GLOBAL_LAYER, ids, "bt", plan)
        return None

    def _on_model_post(self, module, args, output):
        """End the step, then let go of the session (nothing where this forward did not take it:
        a pre-hook before the session's raised, or the session closed as it started)."""
        if not self._holds_forward():
            return None
        try:
            t0 = perf_counter()
            if output is None:  # the forward raised: its step stops part-way (its staging too)
                self._abandon_step()
            else:
                if self._staging is not None and self._plan is not None:
                    self._commit_compiled(output)
                self._plan = None
                self.ring.end_step()
            self._hook_seconds += perf_counter() - t0
        finally:
            self._leave_forward()
        return None

    def _abandon_step(self) -> None:
        """End the step in progress, which will not complete (its forward raised, or ended
        without its post-hook, or a close cut it short): its regions are taken out of the ring,
        and every record it would have made is counted as lost (:data:`STEP_INTERRUPTED`) —
        except those already handed to the drain with a slot the step filled (stored) and those
        a dropping ring dropped (counted already). Nothing where no step is in progress."""
        plan, self._plan = self._plan, None
        handed = self.ring.abandon_step()
        if plan is None:
            return
        kept = {(e.hook, e.layer, e.span_index) for e in handed} | self._step_dropped
        self._step_dropped = set()
        for hook, layers in self._emitted.items():
            for layer in layers:
                self._lose_unkept(hook, layer, plan, kept)

    def _lose_unkept(self, hook: str, layer: int, plan: StepPlan, kept: set) -> None:
        """Count ``hook`` at ``layer`` of the abandoned step ``plan`` as lost, but for what ``kept``
        holds: per request for a hook emitted per request (attention patterns), else whole."""
        if HOOKS[hook].key_axis is None:
            if (hook, layer, -1) not in kept:
                self.drain.note_loss(hook, layer, plan, STEP_INTERRUPTED)
            return
        for i, span in enumerate(plan.spans):
            if (hook, layer, i) not in kept:
                self.drain.note_loss(hook, layer, _OneSpan(plan, span), STEP_INTERRUPTED)

    def _commit_compiled(self, output) -> None:
        """After a compiled forward: staged bytes into the ring, then ``logits`` from the
        model's output (the tensor its ``lm_head`` returned) through the eager copy."""
        plan = self._plan
        self._staging.commit(self.ring, self.drain, self._copy_staged)
        if "logits" in self.selection.hooks:
            logits = output.logits if hasattr(output, "logits") else output[0]
            self._emit("logits", GLOBAL_LAYER, logits, "bt", plan)

    def _copy_staged(self, dst, src) -> None:
        if src.device.type == "cuda":
            self._copy_cuda(dst, src, None)
        else:
            dst.copy_(src)

    def _wait_side_stream(self) -> None:
        """The next compiled forward overwrites the staging buffer: on CUDA its stream first
        waits for the side stream's copies of the previous step (no host synchronisation)."""
        side = self._cuda_side_stream
        if side is not None:
            torch.cuda.current_stream(side.device).wait_stream(side)

    @contextlib.contextmanager
    def _ending_at(self, eos_ids: frozenset[int]):
        """For one ``generate`` call (yields its :class:`SequenceEnds`): a decode step that feeds
        a row the token after which generate's stopping criteria marked it done (its end token,
        a stop string's last, ...) ends that row's sequence. transformers runs such a row on to
        the call's end, fed padding, and those steps are no part of its sequence: they are not
        recorded."""
        self._ends = SequenceEnds(eos_ids)
        try:
            yield self._ends
        finally:
            self._ends = None

    def _implicit_call(self, b: int, kwargs) -> _Call:
        """A forward that did not come through ``generate``/``forward`` (e.g. the user called
        ``model.generate`` directly): a non-empty cache continues the previous implicit call
        (decode), anything else starts a new one with fresh request ids."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen = 0
        if cache is not None and hasattr(cache, "get_seq_length"):
            seen = int(cache.get_seq_length())
        prev = self._implicit
        if seen > 0 and prev is not None and len(prev.request_ids) == b:
            return prev
        rids = self._default_request_ids(b)
        call = self._new_call(rids, "prefill" if cache is not None else "forward")
        self._implicit = call
        return call

    def _emit(self, hook: str, layer: int, x, layout: str, plan: StepPlan) -> None:
        if x is None:
            if HOOKS[hook].needs_eager:
                raise AttentionImplementationError(
                    f"the attention module returned no weights; {hook} needs eager attention "
                    "(model.set_attn_implementation('eager'))"
                )
            raise CaptureError(f"hook {hook!r} (layer {layer}) produced no tensor")
        x = x.detach()
        if layout == "pattern":
            self._emit_pattern(hook, layer, x, plan)
            return
        if layout == "bt":
            t = x.shape[1]
            if t != plan.tokens:
                plan = plan.tail(t)
                if not plan.spans:
                    return  # the positions materialised lie outside the schedule's window
            x2 = x.reshape(x.shape[0] * t, -1)
        else:
            x2 = x.reshape(x.shape[0], -1)
        n = plan.n_rows
        nbytes = n * x2.shape[1] * x2.element_size()
        res = self.ring.reserve(nbytes, check=self.drain.check)
        if res is None:
            self.drain.note_loss(hook, layer, plan)
            self._step_dropped.add((hook, layer, -1))
            return
        slot, off = res
        dst = slot.rows(off, x2.dtype, n, x2.shape[1])
        device = x2.device
        index = plan.index_on(device)
        if device.type == "cuda":
            self._copy_cuda(dst, x2, index)
        elif index is None:
            dst.copy_(x2)
        else:
            torch.index_select(x2, 0, index, out=dst)
        slot.entries.append(Entry(hook, layer, off, nbytes, x2.dtype, n, plan))
        self.ring.stats.copies += 1

    def _emit_pattern(self, hook, layer, x, plan: StepPlan) -> None:
        kv = x.shape[-1]
        for i, s in enumerate(plan.spans):
            pad = plan.key_pad(s, kv)
            src = x[s.row, :, s.first_col : s.first_col + s.n, pad:]
            nbytes = src.numel() * src.element_size()
            res = self.ring.reserve(nbytes, check=self.drain.check)
            if res is None:
                self.drain.note_loss(hook, layer, _OneSpan(plan, s))
                self._step_dropped.add((hook, layer, i))
                continue
            slot, off = res
            dst = slot.buffer[off : off + nbytes].view(src.dtype).view(src.shape)
            if src.device.type == "cuda":
                self._copy_cuda(dst, src, None)
            else:
                dst.copy_(src)
            slot.entries.append(Entry(hook, layer, off, nbytes, src.dtype, s.n, plan, kv - pad, i))
            self.ring.stats.copies += 1

    def _copy_cuda(self, dst, src, index) -> None:
        side = self._cuda_side_stream
        if side is None:
            side = self._cuda_side_stream = torch.cuda.Stream(device=src.device)
        side.wait_stream(torch.cuda.current_stream(src.device))
        src.record_stream(side)  # the allocator must not recycle it before the side stream read it
        with torch.cuda.stream(side):
            if index is not None:
                src = src.index_select(0, index)  # a temporary on the side stream
            dst.copy_(src, non_blocking=True)

    def _copies_done(self):
        """A CUDA event after every copy queued so far on the side stream (None without one):
        the ring stamps each slot it submits with it, and the drain waits on it."""
        side = self._cuda_side_stream
        return None if side is None else cuda_event_for_submission(side)

    # -- close ----------------------------------------------------------------------------------
    def _close(self, release) -> None:
        """Close the session, then ``release()`` (the model's ownership). A call or forward on
        another thread holds the session: the close waits for it to end, so its records are
        complete. Asked for inside one of the session's own calls on the thread running it (a
        hook, a stopping criterion), it runs as that call returns (waiting there would never
        end), as it does when the wait is interrupted (see :meth:`_SessionGate.run_alone`); its
        errors then raise from that call."""
        self._drop_stale_forward()
        self._lock.run_alone(functools.partial(self._close_then, release))

    def _close_then(self, release) -> None:
        try:
            self._close_now()
        finally:
            release()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._abandon_step()  # a forward whose thread ended without its post-hook, if any
        self._remove_hooks()
        try:
            self.ring.submit()
            self._close_drain()
        finally:
            try:
                if self._publisher is not None:
                    self._publisher.close()
            finally:
                self.ring.close()

    def _close_drain(self) -> None:
        """Seal and publish what the drain holds, then stop it. :attr:`published` gets every
        pack the drain published, also where this raises: the close hands back what it published
        only when it succeeds, so what the drain published on its way to a failure is taken from
        the drain's own list."""
        try:
            self.published.extend(self.drain.close())
        finally:
            self.published.extend(self.drain.published)
            self.drain.published = []


def _refuse_embeds(hooks: list[str]) -> None:
    """A step run on ``inputs_embeds`` has no token ids: refuse it rather than capture the
    step without the ``hooks`` read from ``input_ids`` (their records would be missing
    unnoticed, and uncounted)."""
    names = ", ".join(map(repr, hooks))
    raise CaptureError(
        f"the model ran on inputs_embeds, without input_ids, so hook(s) {names} have no token ids to "
        f"capture; pass input_ids, or leave {names} out of hooks= (and do not pass tokenizer=, which "
        "adds token_ids)"
    )


class _GenerateGuard:
    """Wraps ``model.generate`` while the session is attached (``cap.generate`` goes through
    it too). Refuses beam search before the model runs: seen only through its forwards, beam
    rows would be recorded as requests although beam search reorders and forks them every
    step. In an eager session (``eager``) it also turns off the compilation transformers
    starts by itself (``disable_compile=True``; it compiles the decode steps with CUDA graphs
    when a static cache is used on a GPU), unless the caller configured compilation: eager
    hooks must run as Python, between kernels launched one by one. It holds the session for
    the call (``hold()``), as the session's own ``generate`` does, and watches where its
    stopping criteria end each row (``ending_at``, :class:`SequenceEnds`). Installed as an instance
    attribute over the class's ``generate`` (or over one the user set on the instance);
    ``remove()`` restores what was there."""

    def __init__(self, model, *, eager: bool, hold, ending_at):
        self._model = model
        self._own = vars(model).get("generate", _NOT_SET)  # a generate set on the instance, kept
        original = model.generate

        @functools.wraps(original)
        def generate(*args, **kwargs):
            config = getattr(model, "generation_config", None)
            # the session, for the whole call: a close waits for its last step
            with hold(), ending_at(eos_token_ids(config, kwargs)) as ends, ends.watching(model):
                sequences_per_prompt(config, kwargs)
                if eager and not _compilation_configured(model, kwargs):
                    kwargs["disable_compile"] = True
                return original(*args, **kwargs)

        self._guard = generate
        model.generate = generate

    def remove(self) -> None:
        """Give back the instance's ``generate``: the one set on it before attach, or none (the
        class's). One set on it while attached (not the guard) is left as it is."""
        if vars(self._model).get("generate") is not self._guard:
            return
        if self._own is _NOT_SET:
            del self._model.generate
        else:
            self._model.generate = self._own


_NOT_SET = object()


def _compilation_configured(model, generate_kwargs: dict) -> bool:
    """Whether the caller chose how transformers' ``generate`` compiles (or that it does not):
    ``disable_compile`` or ``compile_config`` passed, or set on the generation config used.
    Also true where this transformers has no ``disable_compile`` (nothing to turn off)."""
    if "disable_compile" in generate_kwargs or "compile_config" in generate_kwargs:
        return True
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if config is None or not hasattr(config, "disable_compile"):
        return True
    return bool(config.disable_compile) or getattr(config, "compile_config", None) is not None


class _OneSpan:
    """A view of a plan restricted to one request (for counting dropped pattern records)."""

    __slots__ = ("spans", "step", "phase")

    def __init__(self, plan, span):
        self.spans = (span,)
        self.step = plan.step
        self.phase = plan.phase


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _model_dtype(model) -> torch.dtype:
    try:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    except StopIteration:
        return torch.float32


@contextlib.contextmanager
def attach(
    model: nn.Module,
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
    tp_rank: int | None = None,
    tp_size: int | None = None,
    tp_ranks=None,
    pp_rank: int | None = None,
    pp_ranks=None,
    writer=None,
    dp_rank: int | None = None,
    tp_layout=None,
    tp_replicas: str = "rank0",
    tokenizer=None,
    compiled: bool | None = None,
    encode_threads: int = 1,
    drain_nice: int | None = None,
):
    """Attach capture to ``model``; yields a :class:`CaptureSession`.

    * ``hooks``: names or group tokens (see ``HOOKS`` / ``GROUPS``); ``layers``: ``None`` (all),
      an int, ``range``, ``slice``, ``(start, stop)`` or a list.
    * ``store``: the ``PackStore`` packs are written to; ``catalog``: where they are published
      (under a publisher lease on ``publish_scope``, default ``"capture/<model_id>/<run_id>"``,
      plus ``"/tp<rank>"`` when ``tp_size > 1``, so the ranks of one run publish side by side);
      without a catalog, packs are sealed but not published. Anything else given as either (a
      path, a URI, a ``dmi.Store``) is refused with ``InvalidArgumentError`` saying what to pass.
    * ``lease_seconds``: the publisher lease's lifetime, renewed by the drain's lease thread; a
      finite number of seconds > 0 (else ``InvalidArgumentError``).
    * ``schedule``: a :class:`Schedule` (or a dict of its fields, or phases).
    * ``ring_slots`` × ``slot_bytes``: host memory between the model and the drain thread;
      ``ring_timeout``: how long the producer waits for a free slot before
      :class:`RingFullError`; ``drop_policy="drop"``: drop (and count in the catalog's losses)
      instead of waiting.
    * ``adaptive_codec``: the ring fill (bytes waiting for the drain / ring bytes) at or above
      which the drain stores records ``raw`` instead of the writer's codec, to catch up
      without stalling the model (lossless; counted in ``stats``); ``None``: never switch.
    * ``codec``: the codec of every record (``"fp8"``, ``"int8"``: lossy, opt-in; see
      ``docs/pack-format.md``), or ``{hook: codec}`` for some hooks; lossy codecs are refused
      for integer hooks with :class:`LossyCodecError` (see ``dmi.capture._codec_choice``).
    * ``decode_chunk_steps``: consecutive decode steps of a call are stored as one record per
      (request, hook, layer) covering up to this many tokens (``1``: one record per step).
    * ``encode_threads``: how many threads encode the drain's records (statistics,
      compression, checksum; each releases the GIL). ``1`` (default): the drain thread alone;
      more pays where the drain falls behind and cores are free (docs/capture.md, "Encoding
      threads", has the measurements).
    * ``drain_nice``: run the drain (and its encoding threads) this many nice levels below the
      model's threads (Linux; ``0``: the same priority). On a host where the model keeps every
      core busy (a model on the CPU) the drain then works in the cycles the model leaves idle
      instead of preempting one of its threads (docs/capture.md, "Drain priority"). ``None``
      (default): :data:`AUTO_DRAIN_NICE` for a model whose parameters are all on the CPU and
      that waits for the drain (``drop_policy="wait"``) on Linux, else ``0``.
    * ``tp_rank`` / ``tp_size``: this process's tensor-parallel shard; by default read from the
      TP device mesh of a model transformers sharded, else rank 0 of 1 — never the global
      ``torch.distributed`` rank (see ``dmi.capture._tp``).
    * ``dp_rank`` / ``pp_rank``: this process's data- and pipeline-parallel ranks, recorded in
      every record; by default read from the model's device mesh, else 0.
    * ``tp_layout``: for a model sharded by hand, ``{hook: TPShard(axis, offset, full) |
      TPReplicated()}`` (see ``dmi.capture._tp_layout``); hooks not named follow the model's TP
      plan where it leaves a hook whole on every rank (OLMoE's gathered q/k/v), else the catalogue.
    * ``tp_replicas``: ``"rank0"`` (default) writes a replicated hook (residual stream, logits,
      ...) once, from TP rank 0; ``"all"`` writes every rank's copy (the reader checks they
      agree and returns one).
    * ``tp_ranks`` / ``pp_ranks``: capture only on these ranks (others attach, capture nothing).
    * ``writer``: a ready pack writer (``append``/``seal``/``close``) instead of one made from
      ``store`` — for tests and custom sinks.
    * ``tokenizer``: the model's Hugging Face tokenizer. With it, ``token_ids`` is captured
      whatever ``hooks`` says, and each request keeps its token strings (``token_text``
      records) and its prompt text (``prompt_text``), decoded on the drain thread (see
      ``dmi.capture._token_text``). ``InvalidArgumentError`` if it is not a tokenizer.
    * ``compiled``: capture through the ``dmi::ring_write`` op that ``torch.compile`` keeps in
      its graph (see ``dmi.capture._compiled``). ``None`` (default): when ``model`` is
      compiled (``torch.compile(model)``, a compiled ``model.forward``, ``model.compile()``);
      ``True``: also for a model compiled after attaching; ``False``: eager hooks always.
    """
    # 1. everything that can be refused is checked before the model is touched
    compiled = _wants_compiled(model, compiled)
    arch = resolve_architecture(inner_model(model))
    impl = getattr(model.config, "_attn_implementation", None)
    selection = select(arch, hooks, layers, attn_implementation=impl)
    schedule = Schedule.coerce(schedule)
    model_id = _validate_id("model id", model_id if model_id is not None else derive_model_id(model))
    run_given = run_id is not None
    run_id = _validate_id("run id", run_id if run_given else new_run_id())
    ranks = resolve_parallel_ranks(model, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, pp_rank=pp_rank)
    tp_rank, tp_size, pp_rank = ranks.tp_rank, ranks.tp_size, ranks.pp_rank
    if compiled:
        check_compiled_selection(selection.hooks, tp_size)
    enabled = (tp_ranks is None or tp_rank in set(tp_ranks)) and (pp_ranks is None or pp_rank in set(pp_ranks))
    drain_nice = auto_drain_nice(model, drain_nice, drop_policy)
    check_pipeline_arguments("attach", store=store, catalog=catalog, writer=writer,
                             decode_chunk_steps=decode_chunk_steps, adaptive_codec=adaptive_codec,
                             encode_threads=encode_threads, drain_nice=drain_nice,
                             lease_seconds=lease_seconds)
    geometry = ModelGeometry.from_config(model.config, _model_dtype(model))
    texts = None if tokenizer is None else TokenStrings(tokenizer)
    if texts is not None:
        selection = with_token_ids(selection)
    layout = TPLayout(geometry, tp_rank, tp_size, tp_layout,
                      defaults=whole_by_tp_plan(getattr(model.config, "base_model_tp_plan", None)))
    check_model_cut(arch, selection.hooks, layout)
    emitted = emitted_hooks(selection.hooks, layout, tp_replicas)
    writer_options, hook_codecs = resolve_codecs(codec, writer_options, tuple(selection.hooks), geometry,
                                                 texts is not None)
    ctx = KeyContext(model_id, run_id, tp_rank, tp_size, geometry, layout=layout,
                     dp_rank=ranks.dp_rank, pp_rank=pp_rank)
    publish_scope = publish_scope or default_publish_scope(model_id, run_id, tp_rank, tp_size)
    # a fresh run id holds nothing yet; a given one may continue a run: its requests are not written twice
    taken = set()
    if run_given and catalog is not None:
        taken = catalog.rank_request_ids(model_id, run_id, shard_rank=tp_rank, dp_rank=ranks.dp_rank, pp_rank=pp_rank)
    pipeline = _PipelineOptions(
        ring_slots=ring_slots, slot_bytes=slot_bytes, ring_timeout=ring_timeout, drop_policy=drop_policy,
        catalog=catalog, publish_scope=publish_scope,
        lease_seconds=lease_seconds, store=store, writer=writer, writer_options=writer_options,
        decode_chunk_steps=decode_chunk_steps, adaptive_codec=adaptive_codec, texts=texts,
        hook_codecs=hook_codecs, encode_threads=encode_threads, drain_nice=drain_nice)

    def make_session(ring, drain, publisher):
        return CaptureSession(model, arch, selection, geometry, model_id=model_id, run_id=run_id,
                              schedule=schedule, ring=ring, drain=drain, publisher=publisher,
                              tp_rank=tp_rank, tp_size=tp_size, capture_enabled=enabled,
                              emitted_hooks=emitted, compiled=compiled, taken_request_ids=taken)

    # shared by a *ForCausalLM and its inner base model
    with owned_session(arch.layers, type(model).__name__, ctx, pipeline, make_session) as session:
        yield session


@dataclass(frozen=True, slots=True)
class _PipelineOptions:
    """Everything between a session's hooks and the catalog, resolved: ring, drain, writer, lease."""

    ring_slots: int
    slot_bytes: int
    ring_timeout: float
    drop_policy: str
    catalog: object
    publish_scope: str
    lease_seconds: float
    store: object
    writer: object
    writer_options: dict | None
    decode_chunk_steps: int
    adaptive_codec: float | None
    texts: object
    hook_codecs: dict | None
    encode_threads: int
    drain_nice: int
    publish_interval: float = 0.0


@contextlib.contextmanager
def owned_session(owner_key, model_name: str, ctx: KeyContext, options: _PipelineOptions, make_session):
    """Own ``owner_key`` (a module) for the ``with`` block: build the ring, the drain thread, the
    writer and the publisher lease, ``make_session(ring, drain, publisher)``, install its hooks,
    yield it; on exit (error included) remove the hooks, drain, seal, publish, release. A second
    session on an owned module, or under a publish scope a session of this process captures
    under (its lease would refuse it only once the model ran, and its request ids would clash
    with the first's), raises :class:`AttachError` and changes nothing."""
    o = options
    scope = None if o.catalog is None else (o.catalog.where, o.publish_scope)
    with _OWNERS_LOCK:
        _refuse_owned(owner_key, model_name, scope)
        ring = Ring(o.ring_slots, o.slot_bytes, timeout=o.ring_timeout, drop_policy=o.drop_policy)
        _OWNERS[owner_key] = ctx  # reserved while we build
        if scope is not None:
            _SCOPES[scope] = ctx.run_id
    session = publisher = writer = drain = None
    try:
        if o.catalog is not None:
            publisher = _Publishing(o.catalog, o.publish_scope, model_id=ctx.model_id, run_id=ctx.run_id,
                                    lease_seconds=o.lease_seconds)
        writer = o.writer if o.writer is not None else _make_writer(o.store, ctx, ctx.run_id, o.writer_options)
        drain = Drain(ring, writer, ctx,
                      publish=None if publisher is None else publisher.publish,
                      record_losses=None if publisher is None else publisher.record_losses,
                      tick=None if publisher is None else publisher.keep_alive,
                      start=None if publisher is None else publisher.start,
                      tick_seconds=o.lease_seconds / 4, decode_chunk_steps=o.decode_chunk_steps,
                      fallback_codec=None if o.adaptive_codec is None else "raw",
                      fallback_fill=1.0 if o.adaptive_codec is None else o.adaptive_codec,
                      texts=o.texts, hook_codecs=o.hook_codecs, encode_threads=o.encode_threads,
                      nice=o.drain_nice, publish_interval=o.publish_interval)
        session = make_session(ring, drain, publisher)
        drain.keep_published = session.keeps_published
        ring.connect(drain.submit, stamp=session._copies_done)
        with _OWNERS_LOCK:
            _OWNERS[owner_key] = session
        session._install()
    except BaseException:
        _undo_attach(session, drain, writer if writer is not o.writer else None, publisher)
        _disown(owner_key, scope)
        raise
    failed = None
    try:
        yield session
    except BaseException as exc:
        failed = exc
        raise
    finally:
        release = functools.partial(_disown, owner_key, scope)
        if failed is not None:
            _close_after(session, release, failed)
        else:
            session._close(release)


def _close_after(session, release, failed: BaseException) -> None:
    """Close ``session`` after its block raised ``failed``. The close's own errors are
    suppressed — the block's error is the one raised — except the same drain failure raised
    again once the drain has dealt with it: its message then also counts the packs the failure
    left unpublished, which the block's error, raised mid-step by the drain's check (``settled``
    false), could not know. A drain error raised otherwise (a vLLM session's, carrying the
    engine's outputs) stays the one raised."""
    try:
        session._close(release)
    except DrainError as settled:
        if getattr(failed, "settled", True) is False and settled.__cause__ is failed.__cause__:
            raise settled from failed.__cause__
    except Exception:  # noqa: BLE001, S110 - the block's own error is the one raised
        pass


def _refuse_owned(owner_key, model_name: str, scope: tuple[str, str] | None) -> None:
    """Raise :class:`AttachError` where ``owner_key`` is attached, or a session of this process
    captures under ``scope`` (catalog, publish scope). Called under ``_OWNERS_LOCK``."""
    if owner_key in _OWNERS:
        raise AttachError(
            f"{model_name} is already attached (run {_OWNERS[owner_key].run_id!r}); "
            "detach (leave its `with` block) before attaching again"
        )
    if scope in _SCOPES:
        where, publish_scope = scope
        raise AttachError(
            f"a session of this process is capturing under publish scope {publish_scope!r} of {where} "
            f"(run {_SCOPES[scope]!r}): two sessions under one scope would write clashing request ids and "
            "only one could publish; leave the other session's `with` block first, or give this one "
            "another run_id (or publish_scope)"
        )


def _disown(owner_key, scope: tuple[str, str] | None) -> None:
    """Give ``owner_key`` and ``scope`` back (its session closed): the model can be attached,
    and the scope captured under, again."""
    with _OWNERS_LOCK:
        _OWNERS.pop(owner_key, None)
        if scope is not None:
            _SCOPES.pop(scope, None)


def _undo_attach(session, drain, own_writer, publisher) -> None:
    """Undo an attach that failed part-way, whatever step failed: remove the session's hooks
    (if it was made), stop the drain thread (if it started: it may already hold the
    publisher lease) or else close the writer made for it, and release the lease. Without
    this, a failure after the drain started would leave its thread running and the scope's
    lease held for the rest of the process. Errors here are suppressed: the attach's own
    error is the one raised."""
    if session is not None:
        session._remove_hooks()
    if drain is not None:
        with contextlib.suppress(Exception):
            drain.close(timeout=10)
    elif own_writer is not None:
        with contextlib.suppress(Exception):
            own_writer.close()
    if publisher is not None:
        with contextlib.suppress(Exception):
            publisher.close()


AUTO_DRAIN_NICE = 19
"""The drain's nice level below a model on the CPU when ``drain_nice`` is not given: the lowest
priority, so the drain takes only the cycles the model leaves (docs/capture.md, "Drain priority")."""


def auto_drain_nice(model, drain_nice, drop_policy: str):
    """``drain_nice``, or when it is ``None``: :data:`AUTO_DRAIN_NICE` where the model computes
    on the CPU (every parameter there, so it competes with the drain for the same cores), waits
    for the drain rather than dropping records (a drain below the model would make a dropping
    ring drop more), and Linux sets per-thread levels; ``0`` elsewhere."""
    if drain_nice is not None:
        return drain_nice
    if drop_policy != "wait" or not sys.platform.startswith("linux"):
        return 0
    devices = {p.device.type for p in model.parameters()}
    return AUTO_DRAIN_NICE if devices == {"cpu"} else 0


def check_pipeline_arguments(who: str, *, store, catalog, writer, decode_chunk_steps, adaptive_codec,
                             encode_threads, drain_nice, lease_seconds) -> None:
    """The arguments every attach shares about the drain and the writer, checked before the
    model is touched (:class:`InvalidArgumentError`)."""
    _check_lease_seconds(lease_seconds)
    for name, value in (("decode_chunk_steps", decode_chunk_steps), ("encode_threads", encode_threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(drain_nice, bool) or not isinstance(drain_nice, int) or not 0 <= drain_nice <= 19:
        raise InvalidArgumentError(f"drain_nice must be an int in 0..19, got {drain_nice!r}")
    if drain_nice and not sys.platform.startswith("linux"):
        raise InvalidArgumentError("drain_nice needs Linux, which sets a nice level per thread; leave it 0 here")
    _check_fill("adaptive_codec", adaptive_codec)
    if writer is None and store is None:
        raise InvalidArgumentError(f"{who} needs a pack store (store=PackStore.local(path))")
    _check_pack_store(who, store)
    _check_catalog(who, catalog)


def _check_lease_seconds(value) -> None:
    """A real number of seconds, finite and > 0: the drain and its lease thread wait
    ``lease_seconds / 4`` between lease checks, so 0 would spin a core, a negative wait would
    kill their threads, and anything else would fail only there."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"lease_seconds must be a finite number of seconds > 0, got {value!r}")


def _check_pack_store(who: str, store) -> None:
    """``store`` is None or a ``PackStore``: anything else would fail only later, on the drain thread."""
    if store is None or isinstance(store, PackStore):
        return
    if _is_facade_store(store):
        raise InvalidArgumentError(
            f"{who} takes a PackStore as store=, and this is a dmi.Store: pass store=store.packs, "
            "catalog=store.catalog, or capture with dmi.capture(model, store=store)"
        )
    raise InvalidArgumentError(
        f"{who}: store must be a PackStore (e.g. PackStore.local(path)), not {type(store).__name__}"
    )


def _check_catalog(who: str, catalog) -> None:
    """``catalog`` is None or has what capture calls on one (its ``publisher``): a URI or a
    ``dmi.Store`` would fail only later, on the drain thread."""
    if catalog is None or callable(getattr(catalog, "publisher", None)):
        return
    if _is_facade_store(catalog):
        raise InvalidArgumentError(f"{who} takes a Catalog as catalog=, and this is a dmi.Store: pass "
                                   "catalog=store.catalog, or capture with dmi.capture(model, store=store)")
    hint = f": open it first, catalog=open_catalog({catalog!r})" if isinstance(catalog, str) else ""
    raise InvalidArgumentError(
        f"{who}: catalog must be a Catalog (dmi.catalog.open_catalog(...)), not {type(catalog).__name__}{hint}"
    )


def _is_facade_store(value) -> bool:
    """Whether ``value`` is the facade's ``dmi.Store`` (a pack store and a catalog together),
    known by shape: capture sits below the facade and does not import it."""
    return hasattr(value, "packs") and hasattr(value, "catalog")


def _check_fill(name: str, value) -> None:
    """``None`` or a number in (0, 1]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidArgumentError(f"{name} must be a fraction in (0, 1] or None, got {value!r}")


def _wants_compiled(model, compiled) -> bool:
    """``compiled`` as given, or (``None``) whether ``model`` was compiled."""
    if compiled is None:
        return compiled_form(model) is not None
    if not isinstance(compiled, bool):
        raise InvalidArgumentError(f"compiled must be True, False or None, got {compiled!r}")
    return compiled


def _next_default_index(run_id: str, taken: set[str]) -> int:
    """The first default request index (``<run id>-NNNNNN``) after those the run already holds."""
    prefix = f"{run_id}-"
    # ASCII digits only: str.isdigit() also takes '²' or '٣', which int() refuses or reads as another number
    held = [int(r[len(prefix):]) for r in taken
            if r.startswith(prefix) and re.fullmatch(r"[0-9]+", r[len(prefix):])]
    return max(held, default=-1) + 1


def default_publish_scope(model_id: str, run_id: str, tp_rank: int, tp_size: int) -> str:
    """One publishing scope per writer: the run, and the tensor-parallel rank when sharded
    (each rank's process holds its own lease; one scope for all would let only one publish)."""
    scope = f"capture/{model_id}/{run_id}"
    return f"{scope}/tp{tp_rank}" if tp_size > 1 else scope

def _make_writer(store, ctx: KeyContext, run_id: str, options: dict | None):
    from dmi.storage import PackWriter  # type: ignore[attr-defined]

    opts = dict(options or {})
    opts.setdefault("writer_id", f"capture-{run_id}")
    return PackWriter(store, on_seal=ctx.sealed.append, **opts)


class _Publishing:
    """The session's publisher lease: acquired beside the drain thread as it starts, kept alive
    by the drain's lease thread (which publishes too), released at detach. Packs are published
    as they seal; dropped records are counted in the catalog's losses."""

    def __init__(self, catalog, scope: str, *, model_id: str, run_id: str, lease_seconds: float = 30.0):
        self.catalog = catalog
        self.model_id = model_id
        self.run_id = run_id
        self.lease_seconds = lease_seconds
        self.publisher = catalog.publisher(scope, lease_seconds=lease_seconds,
                                           ride_out_seconds=min(CATALOG_RIDE_OUT_SECONDS, lease_seconds / 3))
        self._renewed = time.monotonic()

    def start(self) -> None:
        """Acquire the lease — on a thread beside the drain's, so neither attaching nor the
        drain's work waits on the catalog. A catalog unreachable for a moment is ridden out
        (:data:`CATALOG_RIDE_OUT_SECONDS`); a failure (e.g. ``LeaseHeldError``, or an outage
        longer than that) surfaces as ``DrainError`` at the next step, ``flush()`` or exit,
        before anything is published."""
        self.publisher.acquire()
        self._renewed = time.monotonic()

    def keep_alive(self) -> None:
        if time.monotonic() - self._renewed > self.lease_seconds / 3:
            self.publisher.renew()
            self._renewed = time.monotonic()

    def publish(self, descriptors) -> None:
        self.publisher.publish(list(descriptors))

    def record_losses(self, lost) -> None:
        """One losses row per request, hook, layer and reason of ``lost`` (``(key, reason)`` pairs)."""
        counts: Counter[tuple[str, str, int, str]] = Counter(
            (key.request_id, key.hook, key.layer, reason) for key, reason in lost)
        for (request_id, hook, layer, reason), count in counts.items():
            self.catalog.record_losses(self.model_id, self.run_id, request_id, hook, layer, count,
                                       reason, recorded_by="dmi.capture")

    def close(self) -> None:
        self.publisher.release()
