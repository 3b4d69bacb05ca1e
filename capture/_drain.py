"""The drain thread: filled ring slots → records → pack writer → published packs.

For each submitted slot the thread waits the slot's CUDA event (if any), cuts every entry
into per-request records using the entry's step plan, appends them to the pack writer (which
copies, compresses and checksums them — zstd releases the GIL), frees the slot, and
publishes every pack the writer sealed meanwhile. ``flush()`` seals the open pack and
publishes it; any exception the thread hit is re-raised there (and on the model thread at
the start of the next step or the next slot taken) as :class:`DrainError` with the original as ``__cause__`` — an error
in the thread is never swallowed.

**Adaptive encoding**: as it takes each slot (and at each flush) the drain reads the ring's
fill — the bytes handed to it and not yet released, as a fraction of the ring. At or above
``fallback_fill`` it is behind the model, and the records it appends until the next reading
are stored with ``fallback_codec`` (``raw``: a copy and a checksum, no compression) instead
of the writer's own codec — lossless either way, and each record carries its codec. Every
switch into the fallback and every record stored with it is counted (:class:`DrainStats`).
A writer whose ``append`` takes no ``codec=`` (a custom sink) is never switched.

**Encoding threads**: with ``encode_threads=N > 1`` the records of a slot are appended by a
pool of N threads (the writer encodes outside its lock — statistics, compression, checksum,
each releasing the GIL — so N records encode at once); the drain thread waits for all of
them before it frees the slot or seals a pack. Records then reach a pack in the order their
encoding finished, not the order they were cut (each is found by its key, never by its place).

**Publishing at step edges**: packs are published after a slot that ends at a step's edge
(:attr:`Slot.ends_step`), never after one that a step filled in its middle, so that what
readers see holds each published step whole, for every hook and layer of it. A pack the
writer sealed in the middle of a step (it reached ``max_records`` or ``max_bytes``) holds
part of that step; the rest is in the open pack, which is sealed too once the step's edge is
reached, and both are published together. A seal that ``seal_soon`` asks for waits for a
step's edge the same way.

**Working before the lease is held**: ``start`` (the session's publisher lease) runs on a
thread of its own beside the drain's, at the drain's priority, so slots are cut, encoded and
written from the first step while the catalog answers: acquiring a lease is a few catalog
statements, and below a model on the CPU they can take the whole call (``stats.start_seconds``;
docs/capture.md, "The lease beside the drain", has the measurements). Only
publishing waits for it: packs sealed before it is held stay in ``ctx.sealed`` until it is; a
seal or flush waits for it. If it fails, the error surfaces like any other (nothing is
published); packs already sealed stay in the store, unpublished, for ``dmi recover``.

**Publishing at most every ``publish_interval`` seconds**: a seal asked for because requests
finished (:meth:`Drain.seal_soon`) stores those requests' rows at once, and seals and
publishes the pack at once only if the last such seal is at least ``publish_interval`` ago;
otherwise the seal waits for that moment, and every seal asked for meanwhile joins it. A
server that finishes requests at every step then writes one pack and one catalog publish a
``publish_interval``, not one per step (each publish is several catalog inserts, and
ClickHouse wants few, larger inserts). ``flush()`` and ``seal_soon(at_once=True)`` (an idle
engine) seal at once.

**Priority**: with ``nice=N > 0`` (Linux) the drain thread and its encoding threads run N nice
levels below the thread that made the drain (at most 19), that is below the model's threads:
where the model keeps every core busy (a model on the CPU), the drain takes the cycles it
leaves idle instead of preempting one of its threads, whose partners then wait for it at the
next synchronisation.

**One OpenMP thread**: the drain thread and its encoding threads run their torch CPU kernels on
one OpenMP thread each (:mod:`dmi.capture._omp`): a team of their own would make GNU OpenMP
cut the model's threads' spin at every barrier short.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import time
import warnings
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from dmi.storage.errors import DrainError, PackNotDurableError
from dmi.storage.records import RecordKey, ShardGeometry

from ._hooks import HOOKS, ModelGeometry
from ._omp import one_openmp_thread
from ._token_text import PROMPT_TEXT, TOKEN_TEXT

__all__ = ["CAPTURE_STOPPED", "DRAIN_FAILED", "Drain", "DrainStats", "LostRecords", "PACK_NOT_WRITTEN", "RING_FULL",
           "STEP_INTERRUPTED"]


@dataclass(slots=True)
class DrainStats:
    slots: int = 0
    records: int = 0
    bytes: int = 0
    packs_sealed: int = 0
    packs_published: int = 0
    seals_deferred: int = 0  # seals asked for (seal_soon) that waited for publish_interval
    records_lost: int = 0
    busy_seconds: float = 0.0
    thread_cpu_seconds: float = 0.0  # the drain thread's CPU time, as of the latest flush or seal it was asked for
    encoder_cpu_seconds: float = 0.0  # CPU time of the appends its encoding threads ran
    codec_switches: int = 0  # times the drain went from the writer's codec to the fallback
    records_fallback: int = 0  # records stored with the fallback codec instead of their own
    start_seconds: float | None = None  # how long ``start`` (the lease) took; None until it succeeded
    packs_not_durable: int = 0  # packs sealed whole whose directory fsync failed: published, with a warning


RING_FULL = "ring full"
"""The losses' reason for a tensor ``drop_policy="drop"`` dropped: its bytes fit in no slot."""
CAPTURE_STOPPED = "capture stopped"
"""The losses' reason for what a stopped capture (vLLM's, after a failure in the step) no longer copied."""
PACK_NOT_WRITTEN = "pack not written"
"""The losses' reason for the records a failed pack write discarded (a full disk)."""
DRAIN_FAILED = "drain failed"
"""The losses' reason for the records a failed drain had not handed to the writer: a record it
failed to prepare (its shard geometry, its token strings), decode rows it held staged, the rest
of the slot it failed in, and the slots handed to it afterwards."""
STEP_INTERRUPTED = "step interrupted"
"""The losses' reason for the records of a step whose forward raised (an out-of-memory error, a
``KeyboardInterrupt``, an error of the user's hook) or that a close cut short: none of the step is
stored where it can be helped (the session's ``_abandon_step``), so no request holds a step at
some layers and not others; what is not stored is counted."""


@dataclass(slots=True)
class LostRecords:
    """Records not captured (turned into keys on the drain thread), and why."""

    hook: str
    layer: int
    plan: object
    reason: str = RING_FULL


_IDLE = object()
_STOP = object()  # the lease thread's last job: the drain thread ended
_FAILED = object()  # what :meth:`Drain._prepare` returns where preparing a record failed
_POLL_SECONDS = 0.1  # how often a flush waiting for the thread checks that it still runs


class _Marker:
    __slots__ = ("done", "kind", "request_ids")

    def __init__(self, kind: str, request_ids=None):
        self.kind = kind
        self.request_ids = request_ids  # a seal for these requests: only their staged rows are stored first
        self.done = threading.Event()


@dataclass(slots=True)
class KeyContext:
    model_id: str
    run_id: str
    shard_rank: int = 0
    tp_size: int = 1
    geometry: ModelGeometry | None = None  # the model's sizes: per-token shapes, TP replication
    sealed: list = field(default_factory=list)
    layout: object = None  # a capture._tp_layout.TPLayout: each hook's shard geometry on this rank
    dp_rank: int = 0
    pp_rank: int = 0


class Drain:
    """One consumer thread between the ring and the pack writer."""

    def __init__(self, ring, writer, ctx: KeyContext, *, publish=None, record_losses=None,
                 tick=None, tick_seconds: float = 5.0, decode_chunk_steps: int = 32,
                 decode_chunk_bytes: int = 16 << 20, start=None, fallback_codec: str | None = None,
                 fallback_fill: float = 0.5, name: str = "dmi-drain", texts=None,
                 hook_codecs: dict[str, str] | None = None, encode_threads: int = 1, nice: int = 0,
                 publish_interval: float = 0.0):
        self.ring = ring
        self.texts = texts  # TokenStrings: token_ids records also become token_text / prompt_text records
        self.writer = writer
        self.ctx = ctx
        self._publish = publish  # callable(list[PackDescriptor]) or None
        self._record_losses = record_losses  # callable(list[(RecordKey, reason)]) or None
        self._tick = tick  # called every tick_seconds on the lease thread (publisher lease keep-alive)
        self._tick_seconds = tick_seconds
        self._tick_error: BaseException | None = None  # the lease thread's failed tick, for the drain thread
        self._lease_jobs: queue.SimpleQueue = queue.SimpleQueue()  # publishes for the lease thread, then _STOP
        self.stats = DrainStats()
        self._start = start  # called on a thread of its own as the drain starts (acquire the publisher lease)
        self._started: Future | None = None  # that call; publishing waits for it
        self.decode_chunk_steps = decode_chunk_steps
        self.decode_chunk_bytes = decode_chunk_bytes
        self._staged: dict[tuple[str, int], _Staged] = {}
        self._last_runs = None  # (steps, runs, plans): the runs last worked out, for the next hook and layer
        self._fallback = fallback_codec if fallback_codec and _switchable(writer, fallback_codec) else None
        self._fallback_fill = fallback_fill
        self._codec: str | None = None  # the fallback while behind, else None (the writer's codec)
        self._hook_codecs = dict(hook_codecs or {})  # attach(codec={hook: codec}): these hooks' codec
        self.error: BaseException | None = None
        self.published: list = []  # descriptors published since the last flush (when keep_published)
        self.keep_published = True  # False: a session living for ever (a vLLM engine) keeps only counts
        self.lost_keys: list[tuple[RecordKey, str]] = []  # each lost record's key and reason
        self._discarded_counted: list[BaseException] = []  # failures whose discarded records are counted
        self._not_written = 0  # records counted lost (DRAIN_FAILED) because the drain had failed
        self._discarded_after = 0  # records counted lost (PACK_NOT_WRITTEN) by failures after the drain's error
        self._sealed_counted = 0  # the first packs of ctx.sealed already counted in packs_sealed
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._publish_interval = publish_interval  # seal_soon seals at most this often (seconds)
        self._last_seal = float("-inf")  # when seal_soon last sealed (time.monotonic())
        self._seal_due: float | None = None  # when a seal asked for by seal_soon is to happen
        self._at_step_edge = True  # the last slot processed ended at a step's edge: a seal there splits no step
        self._split_step = False  # a pack sealed mid-step: the rest of its step is in the open pack
        self._closed = False
        self.nice = nice  # how many levels below the attaching thread the drain's threads run
        self._nice_level = None  # the nice level of the drain's threads; None: the attaching thread's
        if nice:
            own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self._nice_level = min(19, own + nice)
        # started by the drain thread as it hands them work, the encoders inherit its nice level
        self._encoders = None if encode_threads <= 1 else ThreadPoolExecutor(
            encode_threads, thread_name_prefix=f"{name}-encode", initializer=one_openmp_thread)
        self.torch_threads: int | None = None  # torch.get_num_threads() on the drain thread, once it runs
        self._writes: list = []  # appends handed to the encoders and not yet waited for
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._lease_thread = None if tick is None else threading.Thread(target=self._lease_loop,
                                                                        name=f"{name}-lease", daemon=True)
        if self._lease_thread is not None:
            self._lease_thread.start()

    # -- called from the model thread ---------------------------------------------------------
    def submit(self, slot) -> None:
        self._q.put(slot)

    def note_loss(self, hook: str, layer: int, plan, reason: str = RING_FULL) -> None:
        self._q.put(LostRecords(hook, layer, plan, reason))

    def check(self, *, settled: bool = False) -> None:
        """Raise :class:`DrainError` if the thread has failed. ``settled``: the thread has dealt
        with its failure (a flush reached it, or it ended), so the packs it left unpublished are
        known and counted in the message."""
        if self.error is not None:
            unpublished = len(self.ctx.sealed) if settled else 0
            tail = "" if not unpublished else (
                f"; {unpublished} sealed pack(s) are not published: they stay whole in the store, and "
                "`dmi recover` publishes them once the cause is fixed")
            if settled and self._discarded_after:
                tail += (f"; {self._discarded_after} more record(s) were lost with pack(s) whose write failed after "
                         "it (records_lost, and the catalog's losses where it answers: reason "
                         f"{PACK_NOT_WRITTEN!r})")
            if settled and self._not_written:
                tail += (f"; {self._not_written} record(s) it had not written yet are counted as lost "
                         f"(records_lost, and the catalog's losses where it answers: reason {DRAIN_FAILED!r})")
            error = DrainError(f"the capture drain thread failed: {self.error!r}{tail}")
            error.settled = settled  # a mid-flight one is raised again, settled, as the session closes
            raise error from self.error

    def flush(self, timeout: float | None = None) -> list:
        """Seal the open pack, publish everything, surface any thread error.

        Returns the descriptors published since the previous flush.
        """
        self._check_running()
        marker = _Marker("flush")
        self._q.put(marker)
        self._wait_done(marker, timeout)
        self.check(settled=True)
        out, self.published = self.published, []
        return out

    def _check_running(self) -> None:
        """Raise :class:`DrainError` (its cause: the thread's error) if the thread has ended."""
        if not self._thread.is_alive():
            self.check()
            raise DrainError("the capture drain thread is not running")

    def _wait_done(self, marker: _Marker, timeout: float | None) -> None:
        """Wait for the thread to reach ``marker`` — no longer than ``timeout``, and not at all
        once the thread has ended (it would never reach it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.done.wait(_POLL_SECONDS if deadline is None else
                                   max(0.0, min(_POLL_SECONDS, deadline - time.monotonic()))):
            self._check_running()
            if deadline is not None and time.monotonic() >= deadline:
                raise DrainError(f"flush did not finish within {timeout}s")

    def seal_soon(self, request_ids=None, *, at_once: bool = False) -> None:
        """Ask the thread to seal the open pack and publish it once it has processed what was
        submitted before — without waiting (a served request finished: its records should be
        readable soon, but the model must not stall for it) — and no sooner than
        ``publish_interval`` after the last such seal, unless ``at_once`` (an idle engine).
        Errors surface as for ``flush``.

        With ``request_ids`` (requests that finished), only their staged decode rows are stored
        before the seal; other requests' rows keep coalescing into later records."""
        self._q.put(_Marker("seal now" if at_once else "seal", None if request_ids is None else frozenset(request_ids)))

    def close(self, timeout: float | None = None) -> list:
        if self._closed:
            return []
        self._closed = True
        published: list = []
        try:
            published = self.flush(timeout)
        finally:
            self._q.put(None)
            self._thread.join(timeout)
            if self._lease_thread is not None:
                self._lease_thread.join(timeout)
            try:
                self.check(settled=not self._thread.is_alive())  # an error closing the writer
            except BaseException:
                self.published[:0] = published  # the flush's packs stay in ``published`` for the caller
                raise
        return published

    # -- the thread -----------------------------------------------------------------------------
    def _lower_priority(self) -> None:
        """This thread at the drain's nice level (Linux sets the level of each thread)."""
        if self._nice_level is not None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice_level)

    def _run(self) -> None:
        """The thread's body. Whatever escapes the loop (outside the guards around each piece of
        work) becomes ``self.error``, so the thread never ends unnoticed: the next step,
        ``flush()`` or exit raises it as :class:`DrainError`, and a model thread waiting for a
        free slot stops waiting."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - surfaced by check()
            if self.error is None:
                self.error = exc
            if self._encoders is not None:
                self._encoders.shutdown(wait=False)
        finally:
            self._lease_jobs.put(_STOP)

    def _lease_loop(self) -> None:
        """The lease thread's body: the publishes the drain thread hands it (:meth:`_published`),
        and ``tick`` (the lease keep-alive) every ``tick_seconds`` once ``start`` succeeded, until
        the drain fails or its thread ends. It runs at the attaching thread's priority, not the
        drain's nice level: a live capture whose drain is kept off the CPU (nice 19 below a busy
        machine) or held in a long write must not lose its lease, nor hold the publisher's lock
        in a publish while the scheduler leaves it waiting past the lease's expiry. A failed tick
        is handed to the drain thread, which makes it the drain's error."""
        ticking, next_tick = True, time.monotonic() + self._tick_seconds
        while True:
            try:
                job = self._lease_jobs.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            if job is not None:
                job()
                continue
            next_tick = time.monotonic() + self._tick_seconds
            ticking = ticking and self._tick_once()

    def _tick_once(self) -> bool:
        """One keep-alive on the lease thread; False once ticking is over (the drain or its start
        failed, or this tick did)."""
        started = self._started
        if started is not None and not started.done():
            return True
        if self.error is not None or (started is not None and started.exception() is not None):
            return False
        try:
            self._tick()
        except BaseException as exc:  # noqa: BLE001 - the drain thread takes it (_take_tick_error)
            self._tick_error = exc
            self._q.put(_IDLE)  # wake the drain thread to take it
            return False
        return True

    def _published(self, batch: list) -> None:
        """``publish(batch)`` on the lease thread, waited for here (its failure raised here)."""
        if self._lease_thread is None:
            self._publish(batch)
            return
        done: Future = Future()

        def job() -> None:
            try:
                done.set_result(self._publish(batch))
            except BaseException as exc:  # noqa: BLE001 - raised on the drain thread below
                done.set_exception(exc)
        self._lease_jobs.put(job)
        done.result()

    def _take_tick_error(self) -> None:
        """A failed tick of the lease thread becomes the drain's error (on the drain thread, as any failure)."""
        if self._tick_error is not None and self.error is None:
            self.error = self._tick_error

    def _loop(self) -> None:
        self.torch_threads = one_openmp_thread()
        try:
            self._lower_priority()
        except OSError as exc:  # surfaced by check()
            self.error = exc
        self._begin_start()
        while True:
            try:
                item = self._q.get(timeout=self._wait_seconds())
            except queue.Empty:
                item = _IDLE
            if self._seal_due is not None and time.monotonic() >= self._seal_due and self.error is None \
                    and self._at_step_edge:
                try:
                    self._seal_now()
                except BaseException as exc:  # noqa: BLE001 - surfaced by check()
                    self.error = exc
            self._check_started()
            self._take_tick_error()
            if item is _IDLE:
                continue
            if item is None:
                try:
                    self._wait_writes()
                    self.writer.close()
                except BaseException as exc:  # noqa: BLE001
                    if self.error is None:
                        self.error = exc
                finally:
                    self._join_start()
                    if self.error is not None:  # closing may have sealed a pack whole after the failure
                        self._after_failure()
                    if self._encoders is not None:
                        self._encoders.shutdown(wait=True)
                return
            if isinstance(item, _Marker):
                if self.error is None:
                    try:
                        if item.kind == "seal":
                            self._seal_soon(item.request_ids)
                        else:
                            self._seal_and_publish(item.request_ids)
                    except BaseException as exc:  # noqa: BLE001 - surfaced by check()
                        self.error = exc
                if self.error is not None:
                    self._seal_after_failure()
                    self._after_failure()
                self.stats.thread_cpu_seconds = time.thread_time()  # counted before the caller reads it
                item.done.set()
                continue
            if isinstance(item, LostRecords):
                try:
                    self._lose(item)  # also after a failure: a drop is counted whatever came after
                except BaseException as exc:  # noqa: BLE001
                    if self.error is None:
                        self.error = exc
                continue
            try:
                if self.error is None:
                    self._take(item)
                else:  # the drain has failed: the slot's records are counted as lost, not written
                    self._lose_entries(item.entries)
            except BaseException as exc:  # noqa: BLE001
                if self.error is None:
                    self.error = exc
            finally:
                self.ring.release(item)

    def _take(self, slot) -> None:
        """Cut ``slot`` into records and write them; at a step's edge, seal and publish. A write,
        a cut or a record's preparation that fails there makes its failure the drain's error, and
        the slot's other records are counted as lost (:meth:`_write`, :meth:`_process`,
        :meth:`_append`); nothing is then published after it."""
        t0 = time.perf_counter()
        sealed_before = len(self.ctx.sealed)
        try:
            self._process(slot)
        finally:
            self._wait_writes()  # the slot's memory is read until its last record is encoded
        if self.error is None:
            self._after_slot(slot.ends_step, len(self.ctx.sealed) > sealed_before)
        self.stats.busy_seconds += time.perf_counter() - t0

    def _begin_start(self) -> None:
        """Call ``start`` on a thread of its own, made here so that it runs at the drain's nice level."""
        if self._start is None:
            return
        starter = ThreadPoolExecutor(1, thread_name_prefix=f"{self._thread.name}-start")
        self._started = starter.submit(self._timed_start)
        starter.shutdown(wait=False)

    def _timed_start(self) -> None:
        t0 = time.perf_counter()
        self._start()
        self.stats.start_seconds = time.perf_counter() - t0

    def _has_started(self) -> bool:
        return self._started is None or self._started.done()

    def _check_started(self) -> None:
        """A failed ``start`` becomes the drain's error as soon as it is known."""
        started = self._started
        if self.error is None and started is not None and started.done() and started.exception() is not None:
            self.error = started.exception()

    def _join_start(self) -> None:
        """Wait for ``start`` to finish, whatever its outcome (already the drain's error if it failed)."""
        if self._started is not None:
            futures.wait([self._started])

    def _await_start(self) -> None:
        """Wait for ``start`` to finish (its failure raised): publishing needs what it acquires."""
        if self._started is not None:
            self._started.result()

    def _after_slot(self, ends_step: bool, sealed: bool) -> None:
        """After a slot (``sealed``: the writer sealed a pack while it was processed): at a step's
        edge, seal the open pack if a pack sealed since the last edge split a step, then publish;
        in the middle of a step, publish nothing yet."""
        self._split_step = self._split_step or sealed
        self._at_step_edge = ends_step
        if not ends_step:
            return
        if self._split_step:
            self._seal_open()
        self._publish_sealed()

    def _seal_open(self) -> None:
        """Seal the open pack (if it holds records) into ``ctx.sealed``: no step is split after it.
        A pack sealed whole but not durable goes there too (:meth:`_not_durable`)."""
        try:
            desc = self.writer.seal()
        except PackNotDurableError as exc:
            self._not_durable(exc)
            desc = exc.descriptor
        if desc is not None and all(d is not desc for d in self.ctx.sealed):
            self.ctx.sealed.append(desc)
        self._split_step = False

    def _not_durable(self, exc: PackNotDurableError) -> None:
        """A pack the writer sealed whole, but whose directory fsync failed: its records are stored
        and it is published like any other (``ctx.sealed`` holds it: the writer gave it to
        ``on_seal``, or :meth:`_seal_open` kept it), none of them counted as lost. It is counted
        in ``packs_not_durable`` and warned about, as it may not survive a power loss. The drain
        goes on: the disk's next failure fails it as usual."""
        self.stats.packs_not_durable += 1
        warnings.warn(f"{exc}; it is published with its records, none of them lost",
                      RuntimeWarning, stacklevel=2)

    def _wait_seconds(self) -> float:
        """How long the thread may wait for work: until the next lease tick or a seal due (one
        due in the middle of a step waits for the slot that ends it)."""
        if self._seal_due is None or not self._at_step_edge:
            return self._tick_seconds
        return min(self._tick_seconds, max(0.0, self._seal_due - time.monotonic()))

    def _seal_soon(self, request_ids) -> None:
        """Store the finished requests' rows now; seal now, or join the seal already due."""
        self._store_staged(request_ids)
        if self._seal_due is not None:
            self.stats.seals_deferred += 1
        elif time.monotonic() - self._last_seal >= self._publish_interval and self._at_step_edge:
            self._seal_now()
        else:  # due later, or at the edge of the step the last slot ended inside
            self._seal_due = max(self._last_seal + self._publish_interval, time.monotonic())
            self.stats.seals_deferred += 1

    def _seal_and_publish(self, request_ids=None) -> None:
        self._store_staged(request_ids)
        self._seal_now()

    def _store_staged(self, request_ids) -> None:
        """Write the staged rows (of ``request_ids``); a write that failed stops the seal here."""
        self._choose_codec()
        self._emit_all_staged(request_ids)
        self._wait_writes()
        if self.error is not None:
            raise self.error

    def _seal_now(self) -> None:
        self._seal_due = None
        self._await_start()
        self._flush_losses()
        self._seal_open()
        self._publish_sealed()
        self._last_seal = time.monotonic()

    def _publish_sealed(self) -> None:
        """Publish the packs sealed so far — once ``start`` has acquired the lease; until then
        they wait in ``ctx.sealed``. They leave it only once their publish succeeded: where it
        fails, the error counts them and :meth:`_publish_after_failure` tries them again."""
        sealed = self.ctx.sealed
        if not sealed or not self._has_started():
            return
        self._await_start()
        batch = list(sealed)
        self._count_sealed(len(batch))
        if self._publish is not None:
            self._published(batch)
            self.stats.packs_published += len(batch)
        self._forget_sealed(len(batch))
        if self.keep_published:
            self.published.extend(batch)

    def _count_sealed(self, n: int) -> None:
        """Count the first ``n`` packs of ``ctx.sealed`` in ``packs_sealed``, each once: a pack
        whose publish failed stays there, already counted, for the next try."""
        self.stats.packs_sealed += max(0, n - self._sealed_counted)
        self._sealed_counted = max(n, self._sealed_counted)

    def _forget_sealed(self, n: int) -> None:
        """The first ``n`` packs of ``ctx.sealed`` are published: they leave it."""
        del self.ctx.sealed[:n]
        self._sealed_counted -= n

    def _seal_after_failure(self) -> None:
        """Once the drain has failed, seal the open pack — the records appended before the
        failure — into ``ctx.sealed`` at the flush (or seal) that reached the failure, as the
        writer's close would later: the count of unpublished packs a settled error gives is
        then final, where a pack the close sealed after it went uncounted. A seal that fails
        too (the disk is full by now) discards the pack: its records are counted as lost
        (:meth:`_count_discarded`); the drain's first error is the one raised."""
        try:
            self._seal_open()
        except BaseException as exc:  # noqa: BLE001 - the drain's first error is the one raised
            self._count_discarded(exc)

    def _after_failure(self) -> None:
        """Once the drain has failed: count what the failure discarded and the decode rows still
        staged (never written now), then publish what it sealed whole before (each at most once,
        whenever a flush or the close comes)."""
        self._emit_all_staged()  # counted as lost: the drain has failed (:meth:`_append`)
        self._count_discarded(self.error)
        try:
            self._flush_losses()
        except BaseException:  # noqa: BLE001, S110 - the catalog failed too: records_lost and the error count them
            pass
        self._publish_after_failure()

    def _count_discarded(self, exc: BaseException) -> None:
        """The records a failed pack write (``exc``) discarded with its pack (its ``lost_keys``),
        counted as lost once: in ``records_lost`` and, where the catalog answers, its losses
        (reason :data:`PACK_NOT_WRITTEN`); the error's message says how many either way."""
        keys = getattr(exc, "lost_keys", ())
        if not keys or any(seen is exc for seen in self._discarded_counted):
            return
        self._discarded_counted.append(exc)
        self._lose_keys(keys, PACK_NOT_WRITTEN)
        if exc is not self.error:  # not in its cause's message: the error's own says how many
            self._discarded_after += len(keys)

    def _publish_after_failure(self) -> None:
        """Once the drain has failed, publish the packs it sealed whole before the failure, where
        its lease is held: they are complete, and readers should see them. Where that publish
        fails too (the catalog is what failed), they stay in ``ctx.sealed``, counted by the
        error's message, for ``dmi recover``; the drain's first error is the one raised."""
        sealed = self.ctx.sealed
        if not sealed or self._publish is None:
            return
        self._join_start()
        if self._started is not None and self._started.exception() is not None:
            return
        batch = list(sealed)
        self._count_sealed(len(batch))
        try:
            self._published(batch)
        except BaseException:  # noqa: BLE001 - the packs stay unpublished, counted in the error raised
            return
        self._forget_sealed(len(batch))
        self.stats.packs_published += len(batch)
        if self.keep_published:
            self.published.extend(batch)

    def _lose(self, lost: LostRecords) -> None:
        """Count the records a dropped tensor would have made: one per span."""
        self._lose_spans(lost.hook, lost.layer, lost.plan, lost.plan.spans, lost.reason)

    def _lose_entries(self, entries) -> None:
        """Count the records of a slot's ``entries`` as lost (:data:`DRAIN_FAILED`): the drain has
        failed, and they will not be written. One record per span and step, as uncoalesced."""
        for e in entries:
            spans = e.plan.spans if HOOKS[e.hook].key_axis is None else (e.plan.spans[e.span_index],)
            self._lose_spans(e.hook, e.layer, e.plan, spans, DRAIN_FAILED)

    def _lose_spans(self, hook, layer, plan, spans, reason: str) -> None:
        """Count one record per span of ``plan`` as lost for ``reason`` (with its text records)."""
        for s in spans:
            self._lose_keys(self._with_texts(self._key(hook, layer, plan, s)), reason)

    def _with_texts(self, key: RecordKey) -> list[RecordKey]:
        """``key``, and for a ``token_ids`` record with a tokenizer also the ``token_text`` /
        ``prompt_text`` records :meth:`_append_text` cuts beside it."""
        if self.texts is None or key.hook != "token_ids":
            return [key]
        return [key, *(replace(key, hook=hook) for hook in self._text_hooks(key))]

    def _lose_keys(self, keys, reason: str) -> None:
        """Count ``keys`` as lost for ``reason`` (flushed to the catalog's losses at the next seal)."""
        self.lost_keys.extend((key, reason) for key in keys)
        self.stats.records_lost += len(keys)
        if reason == DRAIN_FAILED:
            self._not_written += len(keys)

    @staticmethod
    def _text_hooks(key: RecordKey) -> tuple[str, ...]:
        """The text records made beside a ``token_ids`` record: its tokens' strings, and the
        prompt's text beside a prefill (or scoring forward) record."""
        return (TOKEN_TEXT,) if key.phase == "decode" else (TOKEN_TEXT, PROMPT_TEXT)

    def _flush_losses(self) -> None:
        if self._record_losses is not None and self.lost_keys:
            lost, self.lost_keys = self.lost_keys, []
            self._record_losses(lost)

    def _key(self, hook, layer, plan, span, n_tokens=None) -> RecordKey:
        """The record's key; ``n_tokens``: its length where it covers more than ``span``'s step."""
        c = self.ctx
        return RecordKey(c.model_id, c.run_id, span.request_id, hook, layer, span.start,
                         span.n if n_tokens is None else n_tokens,
                         plan.step, plan.phase, c.shard_rank, c.tp_size, c.dp_rank, c.pp_rank)

    def _shard(self, hook: str, shape: tuple[int, ...]) -> ShardGeometry | None:
        c = self.ctx
        if c.layout is not None:
            return c.layout.shard(hook, shape)
        spec = HOOKS[hook]
        if spec.replicated(c.geometry, c.tp_size):
            return None  # every rank holds the whole tensor: no geometry to merge by
        axis = spec.tp_axis
        local = shape[axis]
        full = list(shape)
        full[axis] = local * c.tp_size
        return ShardGeometry(axis, c.shard_rank * local, tuple(full))

    def _append(self, hook, layer, plan, span, rec, *, n_tokens=None) -> None:
        """Write one record (and its text records); once the drain has failed, count them as lost.
        A failure working out its shard geometry (a record that does not fit the TP layout) fails
        the drain, and the record is counted as lost with its text records: the caller goes on
        counting the rest of its slot or staged rows, none of it uncounted."""
        key = self._key(hook, layer, plan, span, n_tokens)
        shard = _FAILED if self.error is not None else self._prepare(self._shard, hook, tuple(rec.shape))
        if shard is _FAILED:
            self._lose_keys(self._with_texts(key), DRAIN_FAILED)
            return
        spec = HOOKS[hook]
        if self._codec is None and hook in self._hook_codecs:
            self._write(key, rec, shard=shard, token_axis=spec.token_axis, key_axis=spec.key_axis,
                        codec=self._hook_codecs[hook])
        elif self._codec is None:
            self._write(key, rec, shard=shard, token_axis=spec.token_axis, key_axis=spec.key_axis)
        elif self._write(key, rec, shard=shard, token_axis=spec.token_axis, key_axis=spec.key_axis,
                         codec=self._codec):
            own = self._hook_codecs.get(hook, getattr(self.writer, "codec", None))
            self.stats.records_fallback += own != self._codec  # a record already stored so is not counted
        if self.texts is not None and hook == "token_ids":
            self._append_text(key, rec)

    def _append_text(self, key: RecordKey, ids) -> None:
        """The strings of one ``token_ids`` record, under its key: its tokens' strings, and the
        prompt's text beside a prefill (or scoring forward) record. A payload that fails (a
        tokenizer whose ``decode`` raises on some ids) fails the drain: it and the text records
        after it are counted as lost, like those of a ``token_ids`` record whose write failed."""
        records = {TOKEN_TEXT: self.texts.token_record, PROMPT_TEXT: self.texts.prompt_record}
        for hook in self._text_hooks(key):
            payload = _FAILED if self.error is not None else self._prepare(records[hook], ids)
            if payload is _FAILED:
                self._lose_keys([replace(key, hook=hook)], DRAIN_FAILED)
            else:
                self._write(replace(key, hook=hook), payload)

    def _prepare(self, make, *args):
        """``make(*args)``: what a record needs before its write (its shard geometry, a text
        payload); :data:`_FAILED` where it raised, its failure then the drain's error."""
        try:
            return make(*args)
        except BaseException as exc:  # noqa: BLE001 - the drain's error; the caller counts the record as lost
            self._fail(exc)
            return _FAILED

    def _write(self, key: RecordKey, data, **options) -> bool:
        """``writer.append``, here or on an encoding thread (waited for by :meth:`_wait_writes`);
        False where it failed here (:meth:`_write_failed`)."""
        if self._encoders is not None:
            self._writes.append((key, self._encoders.submit(_timed_append, self.writer, key, data, options)))
            return True
        try:
            self.writer.append(key, data, **options)
        except PackNotDurableError as exc:  # the record is stored
            self._not_durable(exc)
        except BaseException as exc:  # noqa: BLE001 - the drain's error (_write_failed)
            self._write_failed(key, exc)
            return False
        self.stats.records += 1
        return True

    def _wait_writes(self) -> None:
        """Wait for every append handed to the encoders; each that failed is counted
        (:meth:`_write_failed`), the first failure becoming the drain's error."""
        writes, self._writes = self._writes, []
        for key, write in writes:
            try:
                self.stats.encoder_cpu_seconds += write.result()
            except PackNotDurableError as exc:  # the record is stored
                self._not_durable(exc)
            except BaseException as exc:  # noqa: BLE001 - the drain's error (_write_failed)
                self._write_failed(key, exc)
                continue
            self.stats.records += 1

    def _write_failed(self, key: RecordKey, exc: BaseException) -> None:
        """An append failed: the drain fails (its first failure is its error), the records the
        failure discarded are counted as lost (:data:`PACK_NOT_WRITTEN`), and ``key`` too where
        it is not among them (:data:`DRAIN_FAILED`). What the drain holds after it — the rest of
        the slot, the staged rows — is counted as lost, not written (:meth:`_append`)."""
        if self.error is None:
            self.error = exc
        self._count_discarded(exc)
        if key not in getattr(exc, "lost_keys", ()):
            self._lose_keys([key], DRAIN_FAILED)

    def _choose_codec(self) -> None:
        """The fallback codec while the ring is at least ``fallback_fill`` full, else the
        writer's own; a switch into the fallback is counted."""
        if self._fallback is None:
            return
        behind = self.ring.fill >= self._fallback_fill
        if behind and self._codec is None:
            self.stats.codec_switches += 1
        self._codec = self._fallback if behind else None

    def _process(self, slot) -> None:
        """Cut ``slot`` into records and hand them to the writer. A failure cutting it (on CUDA
        the wait for its event, a view that fails) fails the drain as a failed write does: what
        of the slot was not handed to the writer is counted as lost (:data:`DRAIN_FAILED`)."""
        try:
            if slot.event is not None:
                slot.event.synchronize()
        except BaseException as exc:  # noqa: BLE001 - the drain's error; the slot is counted as lost below
            self._fail(exc)
        self._choose_codec()
        for i, e in enumerate(slot.entries):
            records = None if self.error is not None else self._cut(slot.buffer, e)
            if records is None:  # a write or a cut of this slot failed: the rest is counted as lost
                self._lose_entries(slot.entries[i:])
                break
            for span, rec in records:
                self._append(e.hook, e.layer, e.plan, span, rec)
        self.stats.slots += 1

    def _cut(self, buf, e) -> list | None:
        """Entry ``e`` of a slot's buffer ``buf`` as ``[(span, record)]`` to append — none where
        its decode rows are staged — cut whole before any is appended; ``None`` where cutting
        failed (the failure is the drain's error, and none of the entry was appended)."""
        try:
            plan = e.plan
            data = buf[e.offset : e.offset + e.nbytes].view(e.dtype)
            self.stats.bytes += e.nbytes
            if HOOKS[e.hook].key_axis is not None:  # emitted per request, already [heads, q, kv]
                s = plan.spans[e.span_index]
                return [(s, data.view(-1, s.n, e.kv_tokens))]
            rows = data.view(e.rows, -1)
            if self.decode_chunk_steps > 1 and plan.phase == "decode":
                self._stage(e.hook, e.layer, plan, rows)
                return []
            tail = HOOKS[e.hook].token_shape(rows.shape[1], self.ctx.geometry)
            return [(s, rows[s.offset : s.offset + s.n].view(s.n, *tail)) for s in plan.spans]
        except BaseException as exc:  # noqa: BLE001 - the drain's error; the caller counts the entry as lost
            self._fail(exc)
            return None

    def _fail(self, exc: BaseException) -> None:
        """``exc`` fails the drain, unless it has already failed (its first failure is its error)."""
        if self.error is None:
            self.error = exc

    # -- decode coalescing: consecutive decode steps of one call become one record per request
    def _stage(self, hook, layer, plan, rows) -> None:
        st = self._staged.get((hook, layer))
        if st is not None and (st.call_id != plan.call_id or st.last_step + 1 != plan.step):
            self._emit_staged(hook, layer)
            st = None
        if st is None:
            st = self._staged[(hook, layer)] = _Staged(plan.call_id)
        st.add(rows, self.decode_chunk_steps, self.decode_chunk_bytes)  # copied: the slot is freed after this
        st.plans.append(plan)
        st.last_step = plan.step
        if len(st.plans) >= self.decode_chunk_steps or st.nbytes >= self.decode_chunk_bytes:
            self._emit_staged(hook, layer)

    def _emit_staged(self, hook, layer) -> None:
        st = self._staged.pop((hook, layer), None)
        if st is not None:
            self._emit_runs(hook, layer, st, None)

    def _emit_all_staged(self, request_ids=None) -> None:
        """Every staged row, or with ``request_ids`` only those requests' rows (requests that
        left the engine: their records complete; the others keep coalescing)."""
        for hook, layer in list(self._staged):
            if request_ids is None:
                self._emit_staged(hook, layer)
            else:
                self._emit_runs(hook, layer, self._staged[(hook, layer)], request_ids)

    def _emit_runs(self, hook, layer, st: "_Staged", only) -> None:
        """One record per run of ``st`` (a request's rows at consecutive steps and positions);
        with ``only``, just those requests' runs, marked as emitted. A failure cutting them
        fails the drain, and their rows are counted as lost (:meth:`_lose_staged`)."""
        try:
            records = self._staged_records(hook, st, only)
        except BaseException as exc:  # noqa: BLE001 - the drain's error; none of them was appended
            self._fail(exc)
            self._lose_staged(hook, layer, st, only)
            records = []
        for plan, span, rec, n in records:
            self._append(hook, layer, plan, span, rec, n_tokens=n)
        if only is not None:
            st.emitted |= only

    def _staged_records(self, hook, st: "_Staged", only) -> list[tuple]:
        """The records of :meth:`_emit_runs`, each ``(plan, span, record, tokens)``, cut whole
        before any is appended."""
        rows = st.rows()
        tail = HOOKS[hook].token_shape(rows.shape[1], self.ctx.geometry)
        if only is None and not st.emitted and _same_spans(st.plans):  # the batch kept its rows: cut the steps
            k = len(st.plans)
            steps = rows.view(k, -1, rows.shape[1])  # [steps, rows, features]
            return [(st.plans[0], s, steps[:, s.offset : s.offset + s.n].reshape(k * s.n, *tail), k * s.n)
                    for s in st.plans[0].spans]
        return [(run.plan, run.span, (rows[run.first : run.first + run.n] if run.index is None else
                                      rows.index_select(0, run.index)).reshape(run.n, *tail), run.n)
                for run in self._runs_of(st, only)]

    def _lose_staged(self, hook, layer, st: "_Staged", only) -> None:
        """Count the rows of ``st`` not yet stored (of ``only``'s requests) as lost
        (:data:`DRAIN_FAILED`): one record per span and step, as uncoalesced."""
        for plan in st.plans:
            spans = [s for s in plan.spans
                     if s.request_id not in st.emitted and (only is None or s.request_id in only)]
            self._lose_spans(hook, layer, plan, spans, DRAIN_FAILED)

    def _runs_of(self, st: "_Staged", only) -> list["_Run"]:
        """:func:`_runs`, worked out once for every hook and layer staged over the same steps."""
        key = (tuple(map(id, st.plans)), only, st.emitted)
        cached = self._last_runs
        if cached is None or cached[0] != key:
            cached = self._last_runs = (key, _runs(st, only), list(st.plans))  # the plans keep their ids
        return cached[1]


@dataclass(slots=True)
class _Staged:
    """One hook and layer's decode rows, step after step, in one buffer of their own."""

    call_id: int
    plans: list = field(default_factory=list)  # each step's plan
    part_rows: list = field(default_factory=list)  # each step's row count
    last_step: int = -1
    emitted: frozenset = frozenset()  # requests whose staged rows were already stored
    _buffer: torch.Tensor | None = None
    _used: int = 0  # rows staged

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._used * self._buffer.shape[1] * self._buffer.element_size()

    def add(self, rows: torch.Tensor, steps: int, max_bytes: int) -> None:
        """Copy one step's ``rows`` after the others. Where they do not fit, the buffer grows to
        what the chunk holds if each of its steps to come has as many rows (:meth:`_steps_to_come`):
        the reservation follows both of the drain's bounds on a chunk, ``steps`` steps and
        ``max_bytes``, so a huge ``decode_chunk_steps`` reserves no more than the bytes bound allows."""
        n = rows.shape[0]
        buf = self._buffer
        if buf is None or self._used + n > buf.shape[0]:
            room = self._used + n * self._steps_to_come(rows, steps, max_bytes)
            grown = torch.empty((room, rows.shape[1]), dtype=rows.dtype)
            if buf is not None:
                grown[: self._used].copy_(buf[: self._used])
            buf = self._buffer = grown
        buf[self._used : self._used + n].copy_(rows)
        self._used += n
        self.part_rows.append(n)

    def _steps_to_come(self, rows: torch.Tensor, steps: int, max_bytes: int) -> int:
        """How many steps of ``rows``' size the chunk can still take, this one included: those
        left of its ``steps``, and no more than take its staged bytes to ``max_bytes`` (the drain
        emits it at that step). The buffer thus never holds more than ``max_bytes`` and one step."""
        step_bytes = max(1, rows.numel() * rows.element_size())
        return max(1, min(steps - len(self.plans), -(-(max_bytes - self.nbytes) // step_bytes)))

    def rows(self) -> torch.Tensor:
        """Every staged row, ``[rows, features]`` (the steps' rows one after another)."""
        return self._buffer[: self._used]


@dataclass(frozen=True, slots=True)
class _Run:
    """A request's staged rows at consecutive steps and positions: one record."""

    plan: object  # the plan of its first step
    span: object  # its span in that step
    n: int  # tokens
    first: int  # its first row in the staged rows, stacked step after step
    index: torch.Tensor | None  # every row, when they are not contiguous


def _same_spans(plans) -> bool:
    """Whether every step holds the same requests in the same rows, each at its next position."""
    first = plans[0].spans
    for k, plan in enumerate(plans[1:], start=1):
        if len(plan.spans) != len(first):
            return False
        for a, b in zip(first, plan.spans):
            if (a.request_id, a.row, a.n, a.offset, a.start + k * a.n) != (b.request_id, b.row, b.n, b.offset, b.start):
                return False
    return True


def _runs(st: _Staged, only) -> list[_Run]:
    """The runs of the staged steps, in order of first row: a request continues its run when
    it is in the next step at the next position; otherwise a new run (a new record) starts."""
    open_runs: dict[str, _OpenRun] = {}
    closed: list[_OpenRun] = []
    base = 0
    for i, plan in enumerate(st.plans):
        for s in plan.spans:
            rid = s.request_id
            if rid in st.emitted or (only is not None and rid not in only):
                continue
            run = open_runs.get(rid)
            if run is None or run.last_part != i - 1 or run.next_position != s.start:
                if run is not None:
                    closed.append(run)
                run = open_runs[rid] = _OpenRun(plan, s)
            run.rows.extend(range(base + s.offset, base + s.offset + s.n))
            run.last_part, run.next_position = i, s.start + s.n
        base += st.part_rows[i]
    closed.extend(open_runs.values())
    return sorted((r.finished() for r in closed), key=lambda r: r.first)


@dataclass(slots=True)
class _OpenRun:
    plan: object
    span: object
    rows: list = field(default_factory=list)
    last_part: int = -1
    next_position: int = 0

    def finished(self) -> _Run:
        first, n = self.rows[0], len(self.rows)
        contiguous = self.rows[-1] - first == n - 1
        index = None if contiguous else torch.tensor(self.rows, dtype=torch.long)
        return _Run(self.plan, self.span, n, first, index)


def _timed_append(writer, key: RecordKey, data, options: dict) -> float:
    """``writer.append`` on an encoding thread; returns the CPU seconds it took there."""
    start = time.thread_time()
    writer.append(key, data, **options)
    return time.thread_time() - start


def _switchable(writer, codec: str) -> bool:
    """Whether ``writer.append`` takes a per-record ``codec=`` and its own codec is another."""
    if getattr(writer, "codec", None) == codec:
        return False
    try:
        params = inspect.signature(writer.append).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume it takes none
        return False
    return "codec" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def cuda_event_for_submission(stream) -> object:
    """Record an event on ``stream`` (the side stream) for the drain thread to wait on."""
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
