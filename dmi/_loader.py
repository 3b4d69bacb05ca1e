"""``store.loader(...)``: shuffled, resumable, sharded batches of token rows for training.

The catalog answers which records a selection holds (:meth:`dmi.catalog.Catalog.select_records`);
:mod:`dmi._loader_plan` groups them into aligned token units and orders each epoch (a seeded
permutation of units, each consumer's contiguous share cut into permuted windows of
``shuffle_buffer`` rows); :mod:`dmi._loader_read` reads each window's records through
coalesced range reads on background threads while the previous window is consumed. Every
batch is a pure function of (seed, epoch, consumer, position), which is what makes
exactly-once, determinism and resume hold. See ``docs/loader.md``.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import multiprocessing
import sys
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dmi._loader_memory import LoaderMemory, WindowMemory
from dmi._loader_plan import (
    EpochOrder,
    Plan,
    build_plan,
    n_windows,
    slot_range,
    window_permutation,
    window_slices,
)
from dmi._loader_quality import ShuffleQuality, shuffle_quality
from dmi._loader_read import LAYOUTS, ON_ERROR, RowFormat, Window, WindowReader, new_batch
from dmi.reader import DEFAULT_MAX_GAP
from dmi.storage import PackStore
from dmi.storage.errors import InvalidArgumentError, RecordNotFoundError, StaleLoaderStateError

__all__ = ["TokenLoader", "ActivationDataset", "ShuffleQuality", "open_loader"]

STATE_VERSION = 4
"""2: with ``drop_last``, every share keeps as many whole batches as the smallest share holds
(equal step counts across DDP ranks). A version-1 state resumes a loader without
``drop_last`` (nothing else changed) and is refused for one with it: its cursors point into
the older cut. 3: the fingerprint holds a digest of the selection's units and records, and a
cursor ``(windows + 1, 0)`` marks a share whose end was reported; a version-1 or 2 state
(no digest) still resumes, with a warning that its selection cannot be checked. 4: a
cursor's row counts every position of its window, rows skipped as damaged included (they
keep their places since commit 6e5debd, which kept version 3); before, it counted the kept
rows alone, of a window permuted over them alone. An older state whose cursor stops inside
a window that holds damage is refused by a loader that skips damage (see
:class:`StaleLoaderStateError`); elsewhere both counts agree and it resumes exactly."""


@dataclass(frozen=True, slots=True)
class LoaderConfig:
    """Everything that decides which rows a batch holds, and how they are read."""

    batch_size: int
    shuffle: bool
    seed: int
    shuffle_buffer: int
    drop_last: bool
    with_tokens: bool
    fmt: RowFormat
    on_error: str
    prefetch: int
    read_threads: int
    max_gap: int
    direct_io: bool


@dataclass(frozen=True, slots=True)
class _Item:
    """What a consumer hands the loader: a batch and the bookkeeping that makes resume exact.

    ``x is None``: a report without rows, handed over at the end of a share when rows were
    left out (damage, ``drop_last``) after its last batch, so that no count waits for a batch
    that never comes; the loader counts it and yields nothing for it."""

    x: torch.Tensor | None
    tokens: tuple[tuple[str, str, int], ...] | None
    slot: int
    cursor: tuple[int, int]
    damaged: tuple[str, ...]
    skipped_rows: int
    dropped_rows: int = 0


@dataclass(frozen=True, slots=True)
class _Position:
    """Where a loader stands: its epoch, each worker's cursor and the next worker in turn.

    One immutable value, replaced whole in one assignment, so that ``state_dict()`` called
    from another thread (a checkpointing thread, a signal handler) sees one position or the
    next, never a new epoch with the old epoch's cursors or one worker's new cursor with the
    old turn."""

    epoch: int
    cursors: tuple[tuple[int, int], ...]
    turn: int

    @classmethod
    def start(cls, epoch: int, slots: int) -> _Position:
        """The beginning of ``epoch`` for ``slots`` workers."""
        return cls(epoch, ((0, 0),) * slots, 0)

    def after(self, item: _Item, slots: int) -> _Position:
        """The position once ``item`` (of worker ``item.slot``) is consumed: that worker's
        cursor moves, the turn passes to the next worker."""
        cursors = self.cursors[:item.slot] + (item.cursor,) + self.cursors[item.slot + 1:]
        return _Position(self.epoch, cursors, (item.slot + 1) % slots)


class ActivationDataset(IterableDataset):
    """The batches of one DDP rank, split over DataLoader workers (``batch_size=None``).

    Worker ``w`` of ``num_workers`` serves consumer slot ``rank * num_workers + w`` of the
    epoch's order. Used directly (no DataLoader worker), it yields what the loader yields:
    every worker's share, in the DataLoader's round robin; :class:`TokenLoader`
    wraps it in a DataLoader and keeps the resume state. ``memory``: the pools to read into
    (the loader's own, kept between epochs, when it reads in its own process); ``None``, new
    pools for this iteration.
    """

    def __init__(self, plan: Plan, packs: PackStore, config: LoaderConfig, *, epoch: int, rank: int,
                 world_size: int, num_workers: int, cursors: tuple[tuple[int, int], ...] | None = None,
                 rotation: int = 0, bookkeeping: bool = False, memory: LoaderMemory | None = None):
        super().__init__()
        self.plan, self.packs, self.config = plan, packs, config
        self.epoch, self.rank, self.world_size = epoch, rank, world_size
        self.slots_per_rank = max(1, num_workers)
        self.cursors = cursors or ((0, 0),) * self.slots_per_rank
        self.rotation = rotation
        self.bookkeeping = bookkeeping
        self.memory = memory

    def __iter__(self) -> Iterator[Any]:
        items = _in_turn([_slot_batches(self, local) for local in self._local_slots()])
        _UNFINISHED.add(items)
        for item in items:
            if self.bookkeeping:
                yield item
            elif item.x is not None:
                yield _public(item, self.config.with_tokens)

    def _local_slots(self) -> list[int]:
        """The local slots this process serves: its worker's, or, outside a DataLoader worker,
        all of them in the order the DataLoader's round robin takes them (worker ``w`` serves
        ``(w + rotation) % slots_per_rank``)."""
        info = get_worker_info()
        if info is None:
            return [(w + self.rotation) % self.slots_per_rank for w in range(self.slots_per_rank)]
        if info.num_workers != self.slots_per_rank:
            raise InvalidArgumentError(f"this dataset was planned for {self.slots_per_rank} workers, "
                                       f"the DataLoader runs {info.num_workers}")
        return [(info.id + self.rotation) % self.slots_per_rank]


def _in_turn(streams: list[Iterator[_Item]]) -> Iterator[_Item]:
    """One item of each stream in turn, an exhausted stream left out: the order in which a
    DataLoader hands out its workers' items. Closing it closes every stream."""
    live = deque(streams)
    try:
        while live:
            stream = live.popleft()
            item = next(stream, None)
            if item is not None:
                yield item
                live.append(stream)
    finally:
        for stream in streams:
            stream.close()


_UNFINISHED: weakref.WeakSet = weakref.WeakSet()
"""Epochs being read in this process. One still open when the interpreter exits (an iterator
left in a global) is closed first, while its threads can still be shut down; left to the
interpreter's last collection, its clean-up would fail on modules already torn down."""


@atexit.register
def _close_unfinished() -> None:
    for batches in list(_UNFINISHED):
        batches.close()


def _public(item: _Item, with_tokens: bool) -> Any:
    return (item.x, item.tokens) if with_tokens else item.x


def _slot_batches(ds: ActivationDataset, local: int) -> Iterator[_Item]:
    """The batches of one consumer slot from its cursor on, windows read ahead on threads.

    Every window's damage is counted once: with the batch cut after it, or, when no batch
    follows, in the share's end report (see :class:`_Item`), which also counts the rows
    ``drop_last`` leaves out. A window resumed inside (cursor ``(w, pos > 0)``) had its damage
    counted with the batch that ended there. Cursor ``(last + 1, 0)``: the end is reported."""
    cfg = ds.config
    slot, n_slots = ds.rank * ds.slots_per_rank + local, ds.world_size * ds.slots_per_rank
    order = EpochOrder(ds.plan, seed=cfg.seed, epoch=ds.epoch, shuffle=cfg.shuffle)
    first, consumed = ds.cursors[local]
    whole = cfg.batch_size if cfg.drop_last else None
    last = n_windows(order.total, slot, n_slots, cfg.shuffle_buffer, whole_batches=whole)
    io_pool = ThreadPoolExecutor(cfg.read_threads, thread_name_prefix="dmi-loader-io")
    ahead = ThreadPoolExecutor(cfg.prefetch, thread_name_prefix="dmi-loader-window")
    memory = ds.memory if ds.memory is not None else LoaderMemory(cfg.prefetch)
    reader = WindowReader(ds.plan, ds.packs, cfg.fmt, max_gap=cfg.max_gap, on_error=cfg.on_error, io_pool=io_pool,
                          memory=memory, direct_io=cfg.direct_io)

    def read(w: int) -> Window:
        def permutation(n: int):
            return window_permutation(n, seed=cfg.seed, epoch=ds.epoch, slot=slot, w=w, shuffle=True)

        return reader.read(window_slices(order, slot, n_slots, cfg.shuffle_buffer, w, whole_batches=whole),
                           permutation if cfg.shuffle else None, opens_share=w == 0)

    pending = deque(ahead.submit(read, w) for w in range(first, min(last, first + cfg.prefetch)))
    gathers = ThreadPoolExecutor(1, thread_name_prefix="dmi-loader-batch")
    built: deque = deque()  # batches being gathered, oldest first
    batch = _BatchBuilder(ds.plan, cfg, local, memory.batches)
    try:
        for w in range(first, last):
            next_window = pending.popleft()
            if not next_window.done():  # hand out what is gathered while the window is still read
                while built:
                    yield built.popleft().result()
            window = next_window.result()
            if w + cfg.prefetch < last:
                pending.append(ahead.submit(read, w + cfg.prefetch))
            if w > first or consumed == 0:
                batch.note_damage(window)
            pos = consumed if w == first else 0
            while pos < len(window):
                pos = batch.take(window, pos)
                if batch.full:
                    built.append(gathers.submit(batch.cut(_cursor(w, pos, len(window)))))
                    if len(built) > BATCHES_AHEAD:
                        yield built.popleft().result()
        if batch.rows:  # a partial batch: only without drop_last, whose shares hold whole batches
            built.append(gathers.submit(batch.cut((last, 0))))
        while built:
            yield built.popleft().result()
        if first <= last:
            report = batch.end_report((last + 1, 0), beyond=_rows_past_whole_batches(order.total, slot, n_slots, whole))
            if report is not None:
                yield report
    finally:
        for future in pending:
            future.cancel()
        gathers.shutdown(wait=True, cancel_futures=True)
        ahead.shutdown(wait=True, cancel_futures=True)
        io_pool.shutdown(wait=True, cancel_futures=True)


BATCHES_AHEAD = 1
"""Batches gathered on the loader's own thread beyond the one the training loop holds: the
next batch is copied out of its window while the loop works on the current one."""


def _cursor(w: int, pos: int, size: int) -> tuple[int, int]:
    return (w + 1, 0) if pos >= size else (w, pos)


def _rows_past_whole_batches(total: int, slot: int, n_slots: int, whole: int | None) -> int:
    """Rows of ``slot``'s share that ``drop_last`` (``whole``: the batch size) never reads."""
    if whole is None:
        return 0
    return slot_range(total, slot, n_slots)[1] - slot_range(total, slot, n_slots, whole_batches=whole)[1]


class _BatchBuilder:
    """Collects positions from consecutive windows into batches of ``batch_size`` positions;
    each batch is cut (its rows fixed) in order and gathered later, on the loader's batch
    thread. A batch holds the kept rows of its positions: fewer where ``on_error="skip"`` left
    rows out, so that a share yields as many batches whatever its damage (equal step counts
    across DDP ranks with ``drop_last``); one whose rows were all damaged comes with none."""

    def __init__(self, plan: Plan, cfg: LoaderConfig, local: int, memory: WindowMemory):
        self.plan, self.cfg, self.local, self.memory = plan, cfg, local, memory
        self.parts: list[tuple[Window, int, int]] = []
        self.rows = 0  # positions taken, skipped rows included
        self.damaged: list[str] = []
        self.skipped = 0

    @property
    def full(self) -> bool:
        return self.rows == self.cfg.batch_size

    def note_damage(self, window: Window) -> None:
        self.damaged.extend(window.damaged)
        self.skipped += window.skipped_rows

    def take(self, window: Window, pos: int) -> int:
        end = min(len(window), pos + self.cfg.batch_size - self.rows)
        self.parts.append((window, pos, end))
        self.rows += end - pos
        return end

    def end_report(self, cursor: tuple[int, int], *, beyond: int) -> _Item | None:
        """The share's end: the ``beyond`` rows ``drop_last`` never read count as dropped (its
        share is cut to whole batches of positions, so no batch is left partial); with the
        damage no batch carried, a report without rows, or ``None`` when nothing is left out."""
        if not (beyond or self.damaged or self.skipped):
            return None
        item = _Item(None, None, self.local, cursor, tuple(self.damaged), self.skipped, beyond)
        self.damaged, self.skipped = [], 0
        return item

    def cut(self, cursor: tuple[int, int]) -> Callable[[], _Item]:
        """Close the batch of the rows taken so far; returns what gathers it (on any thread)."""
        parts, damaged, skipped = self.parts, tuple(self.damaged), self.skipped
        self.parts, self.rows, self.damaged, self.skipped = [], 0, [], 0
        counts = [w.count(a, b) for w, a, b in parts]

        def gather() -> _Item:
            x, places = new_batch(self.plan.features, self.cfg.fmt, sum(counts), self.memory)
            at = 0
            for (w, a, b), n in zip(parts, counts):
                w.fill(a, b, [place[at : at + n] for place in places], self.cfg.fmt)
                at += n
            tokens = None
            if self.cfg.with_tokens:
                units = self.plan.units
                tokens = tuple((units[u].run_id, units[u].request_id, units[u].start + int(r))
                               for w, a, b in parts
                               for u, r in zip(w.units[w.kept_rows(a, b)], w.rows[w.kept_rows(a, b)]))
            return _Item(x, tokens, self.local, cursor, damaged, skipped)

        return gather


class TokenLoader:
    """Batches of token rows over a catalog selection. Made by ``Store.loader``.

    Iterate it for one epoch (the next iteration is the next epoch, reshuffled; an
    iteration broken off resumes where it stopped). ``state_dict()`` / ``load_state_dict()``
    resume exactly; ``len()`` is this rank's batch count per epoch (skipped damage shortens
    batches, never removes one);
    ``features`` names the feature axis; ``scales`` holds the normalisation factors;
    ``damaged_records`` / ``skipped_rows`` count what ``on_error="skip"`` left out, and
    ``dropped_rows`` what ``drop_last`` left out (each share's rows past its whole batches):
    per epoch and rank, yielded rows + ``skipped_rows`` + ``dropped_rows`` = the rank's share
    of ``n_tokens``.
    """

    def __init__(self, plan: Plan, packs: PackStore, config: LoaderConfig, *, rank: int, world_size: int,
                 num_workers: int, multiprocessing_context: Any = None):
        self.plan, self.packs, self.config = plan, packs, config
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.multiprocessing_context = multiprocessing_context
        self.features = tuple(f.name for f in plan.features)
        self.scales = None if config.fmt.scales is None else dict(zip(self.features, config.fmt.scales))
        self.damaged_records: list[str] = []
        self.skipped_rows = 0
        self.dropped_rows = 0
        self._digest: str | None = None
        # read in this process: its memory is kept from one epoch to the next (workers are processes of an epoch)
        self._memory = LoaderMemory(config.prefetch) if num_workers == 0 else None
        self.set_epoch(0)

    @property
    def slots_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def n_tokens(self) -> int:
        """Token rows in the whole selection (every rank, one epoch)."""
        return self.plan.n_tokens

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise InvalidArgumentError(f"epoch must be an int >= 0, not {epoch!r}")
        self._position = _Position.start(epoch, self.slots_per_rank)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs (or continues)."""
        return self._position.epoch

    @epoch.setter
    def epoch(self, value: Any) -> None:
        """Refused: assigning the epoch alone would keep the old epoch's positions."""
        raise InvalidArgumentError(f"epoch is read-only (not set to {value!r}): set_epoch(n) starts epoch n "
                                   "from its beginning, load_state_dict(state) continues a saved position")

    @property
    def dataset(self) -> ActivationDataset:
        """The IterableDataset under this loader, from its current position, for your own
        ``DataLoader(dataset, batch_size=None, num_workers=loader.num_workers)``; positions
        consumed that way are not tracked by ``state_dict()``."""
        at = self._position
        return ActivationDataset(self.plan, self.packs, self.config, epoch=at.epoch, rank=self.rank,
                                 world_size=self.world_size, num_workers=self.num_workers,
                                 cursors=at.cursors, rotation=at.turn)

    def __len__(self) -> int:
        n_slots, batch = self.world_size * self.slots_per_rank, self.config.batch_size
        whole = batch if self.config.drop_last else None
        shares = (slot_range(self.plan.n_tokens, self.rank * self.slots_per_rank + s, n_slots, whole_batches=whole)
                  for s in range(self.slots_per_rank))
        return sum(-(-(hi - lo) // batch) for lo, hi in shares)

    def __iter__(self) -> Iterator[Any]:
        at = self._position
        dataset = ActivationDataset(self.plan, self.packs, self.config, epoch=at.epoch, rank=self.rank,
                                    world_size=self.world_size, num_workers=self.num_workers,
                                    cursors=at.cursors, rotation=at.turn, bookkeeping=True,
                                    memory=self._memory)
        if self.num_workers == 0:
            items = iter(dataset)
        else:
            items = iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                    multiprocessing_context=self.multiprocessing_context))
        for item in items:
            self._position = self._position.after(item, self.slots_per_rank)
            self.damaged_records.extend(item.damaged)
            self.skipped_rows += item.skipped_rows
            self.dropped_rows += item.dropped_rows
            if item.x is not None:
                yield _public(item, self.config.with_tokens)
        self.set_epoch(self.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch, each worker's position, the next worker in turn.

        Safe to call from another thread while the loader is iterated: the three are read
        from one position (see ``_Position``), never from one half-updated."""
        at = self._position
        return {"version": STATE_VERSION, "epoch": at.epoch, "cursors": [list(c) for c in at.cursors],
                "next": at.turn, "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next batches are those the saving run would have yielded.

        Raises ``InvalidArgumentError`` when the state comes from a loader with another
        selection, seed, shuffle setting, batch size, shuffle buffer, ``drop_last``, worker
        count or rank layout, and ``StaleLoaderStateError`` (an ``InvalidArgumentError``)
        when, saved before version 4, it stops inside a window that holds damage this loader
        skips (``STATE_VERSION``).
        """
        if not isinstance(state, dict) or state.get("version") not in (1, 2, 3, STATE_VERSION):
            raise InvalidArgumentError(f"not a DMI loader state (version {STATE_VERSION}): {state!r:.200}")
        if state["version"] == 1 and self.config.drop_last:
            raise InvalidArgumentError("this state was saved by a loader whose drop_last cut each share on its own "
                                       "(state version 1); its positions do not apply to this loader's cut: "
                                       "start the epoch again (set_epoch) instead of loading it")
        self._check_fingerprint(state.get("fingerprint"), state["version"])
        epoch, cursors, turn = _state_int(state, "epoch"), self._state_cursors(state), _state_int(state, "next")
        if turn >= self.slots_per_rank:
            raise InvalidArgumentError(f"state next={turn} names no worker of {self.slots_per_rank}")
        if state["version"] < 4 and self.config.on_error == "skip":
            self._refuse_shifted_cursors(state["version"], epoch, cursors)
        self._position = _Position(epoch, tuple(cursors), turn)

    def _refuse_shifted_cursors(self, version: int, epoch: int, cursors: list[tuple[int, int]]) -> None:
        """Refuse a state older than version 4 (cursor rows counting kept rows only) that stops
        a worker inside a window holding damage: only there do kept rows and positions differ.
        The window is read to find out; a loader that raises on damage needs no check (such a
        window raises its ``PackError`` when read)."""
        for local, (w, row) in enumerate(cursors):
            skipped = self._skipped_in_window(epoch, local, w) if row > 0 else 0
            if skipped:
                raise StaleLoaderStateError(
                    f"this loader state (version {version}) stops worker {local} at row {row} of window {w}, which "
                    f"holds {skipped} rows skipped as damaged: a state before version {STATE_VERSION} counted a "
                    "window's rows without the skipped ones, in an order drawn over the kept rows alone, and does "
                    "not record the damage it met, so which rows it had yielded cannot be told; resumed, rows "
                    f"would come twice or never. Start the epoch again (set_epoch({epoch})) or go on with the next "
                    f"(set_epoch({epoch + 1})); states saved from now on (version {STATE_VERSION}) resume exactly")

    def _skipped_in_window(self, epoch: int, local: int, w: int) -> int:
        """How many rows of window ``w`` of local slot ``local``'s share in ``epoch`` are
        skipped as damaged now (its records read, in stream order, into memory of its own)."""
        c = self.config
        slot, n_slots = self.rank * self.slots_per_rank + local, self.world_size * self.slots_per_rank
        order = EpochOrder(self.plan, seed=c.seed, epoch=epoch, shuffle=c.shuffle)
        slices = window_slices(order, slot, n_slots, c.shuffle_buffer, w,
                               whole_batches=c.batch_size if c.drop_last else None)
        with ThreadPoolExecutor(c.read_threads, thread_name_prefix="dmi-loader-io") as io_pool:
            reader = WindowReader(self.plan, self.packs, c.fmt, max_gap=c.max_gap, on_error="skip",
                                  io_pool=io_pool, memory=LoaderMemory(1), direct_io=c.direct_io)
            return reader.read(slices, None).skipped_rows

    def _check_fingerprint(self, theirs: Any, version: int) -> None:
        """Refuse a state of another loader; warn for one too old to hold the selection's digest."""
        mine = self._fingerprint()
        if version < 3 and isinstance(theirs, dict) and "selection" not in theirs:  # the digest came with 3
            mine.pop("selection")
            warnings.warn(f"this loader state (version {version}) predates the selection digest: that it "
                          "comes from the same selection cannot be checked", RuntimeWarning, stacklevel=3)
        if theirs != mine:
            differ = sorted(k for k in mine if not isinstance(theirs, dict) or theirs.get(k) != mine[k])
            raise InvalidArgumentError(f"this state belongs to a different loader (differs in: {', '.join(differ)})"
                                       + _selection_change(theirs, mine, differ))

    def _state_cursors(self, state: dict[str, Any]) -> list[tuple[int, int]]:
        """The state's cursors, one (window, row) per worker, each inside its share: window
        ``w`` of the share's ``n`` windows and a row before the window's end, ``(n, 0)`` (every
        window read) or ``(n + 1, 0)`` (the share's end reported)."""
        cursors = state.get("cursors")
        if not isinstance(cursors, (list, tuple)) or len(cursors) != self.slots_per_rank:
            raise InvalidArgumentError(f"state cursors must be {self.slots_per_rank} [window, row] pairs "
                                       f"(one per worker), not {cursors!r:.200}")
        checked = []
        for local, cursor in enumerate(cursors):
            if (not isinstance(cursor, (list, tuple)) or len(cursor) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in cursor)):
                raise InvalidArgumentError(f"state cursor {local} must be a [window, row] pair of ints, "
                                           f"not {cursor!r:.200}")
            w, row = cursor
            rows = self._window_rows(local)
            if not (0 <= w < len(rows) and 0 <= row < rows[w]) and not (len(rows) <= w <= len(rows) + 1 and row == 0):
                raise InvalidArgumentError(f"state cursor {local} {[w, row]} lies outside its share "
                                           f"({len(rows)} windows of at most {self.config.shuffle_buffer} rows)")
            checked.append((w, row))
        return checked

    def _window_rows(self, local: int) -> list[int]:
        """The row count of each window of local slot ``local``'s share (before any damage)."""
        c = self.config
        lo, hi = slot_range(self.plan.n_tokens, self.rank * self.slots_per_rank + local,
                            self.world_size * self.slots_per_rank,
                            whole_batches=c.batch_size if c.drop_last else None)
        return [min(c.shuffle_buffer, hi - start) for start in range(lo, hi, c.shuffle_buffer)]

    def _fingerprint(self) -> dict[str, Any]:
        c = self.config
        return {"n_units": len(self.plan.units), "n_tokens": self.plan.n_tokens, "features": list(self.features),
                "selection": self._selection_digest(), "seed": c.seed, "shuffle": c.shuffle,
                "batch_size": c.batch_size, "shuffle_buffer": c.shuffle_buffer, "drop_last": c.drop_last,
                "rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers}

    def _selection_digest(self) -> str:
        """SHA-256 over every unit's identity (run, request, start, tokens) and its records'
        places (pack, payload offset): equal counts from another selection differ here.
        Computed once (the plan does not change)."""
        if self._digest is None:
            digest = hashlib.sha256()
            for unit in self.plan.units:
                places = [[(e.pack_id, e.payload.offset) for e in group] for group in unit.records]
                digest.update(repr((unit.run_id, unit.request_id, unit.start, unit.n_tokens, places)).encode())
            self._digest = digest.hexdigest()
        return self._digest

    def export(self, directory: Any, *, suffix: str = ".safetensors", on_shard: Any = None) -> Any:
        """Write the next epoch as one shard file per batch (``.safetensors``, ``.npy``, ``.pt``)
        plus ``manifest.json`` (and ``tokens.parquet`` with ``with_tokens=True``) under
        ``directory``; returns the manifest's path. ``on_shard(entry)`` is called as each shard
        is written. Raises ``InvalidArgumentError`` (unknown suffix, a directory that cannot be
        made or is not empty, a dtype the format cannot hold) and what iteration raises."""
        from dmi._loader_export import export_epoch

        return export_epoch(self, directory, suffix=suffix, on_shard=on_shard)

    def shuffle_quality(self, batches: int = 64, *, epoch: int | None = None) -> ShuffleQuality:
        """How well mixed this loader's batches are, from the plan alone (no payload read):
        distinct requests and packs per batch against uniform sampling (see ``ShuffleQuality``).
        ``batches``: an int >= 1; ``epoch``: an int >= 0 (``None``: the loader's epoch)."""
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
            raise InvalidArgumentError(f"batches must be an int >= 1, not {batches!r}")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0):
            raise InvalidArgumentError(f"epoch must be an int >= 0 or None (the loader's epoch), not {epoch!r}")
        return shuffle_quality(self.plan, self.config.batch_size, self.config.shuffle_buffer, seed=self.config.seed,
                               epoch=self.epoch if epoch is None else epoch, shuffle=self.config.shuffle,
                               slot=self.rank * self.slots_per_rank, n_slots=self.world_size * self.slots_per_rank,
                               batches=batches, drop_last=self.config.drop_last)

    def __repr__(self) -> str:
        return (f"<dmi.TokenLoader {self.plan.n_tokens} tokens x {len(self.features)} features, "
                f"batch {self.config.batch_size}, epoch {self.epoch}, rank {self.rank}/{self.world_size}>")


def _selection_change(theirs: Any, mine: dict[str, Any], differ: list[str]) -> str:
    """How the selection moved since the state was saved, when it is the selection's size that
    differs (a capture published into it, or a delete took from it): a loader's selection is
    fixed when it is made, so a state resumes only a loader made on the same records."""
    if "selection" not in differ or "features" in differ or theirs.get("n_tokens") == mine["n_tokens"]:
        return ""
    return (f"; its selection held {theirs.get('n_tokens')!r:.40} tokens in {theirs.get('n_units')!r:.40} units, "
            f"this one {mine['n_tokens']} in {mine['n_units']}: other runs=/where=, or records published into the "
            "selection (a capture still running) or deleted from it since the state was saved. A loader keeps the "
            "selection it was made on; resume on one made on exactly those records (runs= the runs finished then, "
            "or where=)")


def _state_int(state: dict[str, Any], key: str) -> int:
    """``state[key]``, which must be an int >= 0."""
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"state {key} must be an int >= 0, not {value!r:.200}")
    return value


# ------------------------------------------------------------------------------ construction


def open_loader(catalog: Any, packs: PackStore, model_id: str, *, hooks: Any = "resid_post", layers: Any = None,
                runs: Any = None, phases: Any = None, where: str | None = None, params: dict | None = None,
                batch_size: int = 4096, dtype: torch.dtype | None = torch.float32, shuffle: bool = True,
                seed: int = 0, shuffle_buffer: int = 65536, layout: str = "stack", with_tokens: bool = False,
                normalize: bool = False, drop_last: bool = False, on_error: str = "raise", num_workers: int = 0,
                rank: int | None = None, world_size: int | None = None, prefetch: int = 2, read_threads: int = 4,
                max_gap: int = DEFAULT_MAX_GAP, direct_io: bool = True,
                multiprocessing_context: Any = None, require_model: Callable[[str], None]) -> TokenLoader:
    """Select, plan and configure a :class:`TokenLoader` (the arguments of ``Store.loader``;
    ``require_model(model_id)`` raises, naming the catalog's models, when it holds no such model)."""
    hook_names = _hook_names(hooks)
    for name, value, low in (("batch_size", batch_size, 1), ("shuffle_buffer", shuffle_buffer, 1),
                             ("prefetch", prefetch, 1), ("read_threads", read_threads, 1),
                             ("num_workers", num_workers, 0), ("seed", seed, 0), ("max_gap", max_gap, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidArgumentError(f"{name} must be an int >= {low}, not {value!r}")
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if on_error not in ON_ERROR:
        raise InvalidArgumentError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype or None, not {dtype!r}")
    if not isinstance(direct_io, bool):
        raise InvalidArgumentError(f"direct_io must be True (around the page cache) or False (through it), "
                                   f"not {direct_io!r}")
    _check_phases(phases)
    rank, world_size = _rank_and_world(rank, world_size)
    _check_context(multiprocessing_context)
    if num_workers and fork_may_hang(multiprocessing_context):
        warnings.warn(FORK_HANG_WARNING, RuntimeWarning, stacklevel=3)
    entries = catalog.select_records(model_id, run_ids=runs, hooks=hook_names, layers=layers, phases=phases,
                                     where=where, params=params)
    if not entries:
        require_model(model_id)
        raise RecordNotFoundError(_nothing_selected(model_id, hooks=hook_names, layers=layers, runs=runs,
                                                    phases=phases, where=where))
    plan = build_plan(entries, hook_names or _hook_catalogue())
    _check_requested(plan, hook_names, layers)
    _check_layout(plan, layout, dtype)
    scales = _unit_norm_scales(plan) if normalize else None
    config = LoaderConfig(batch_size, bool(shuffle), seed, shuffle_buffer, bool(drop_last), bool(with_tokens),
                          RowFormat(dtype, scales, layout), on_error, prefetch, read_threads, max_gap,
                          direct_io)
    return TokenLoader(plan, packs, config, rank=rank, world_size=world_size, num_workers=num_workers,
                       multiprocessing_context=multiprocessing_context)


def _nothing_selected(model_id: str, **selection: Any) -> str:
    """Why a selection of a model the catalog holds has no record: the filters given, named."""
    given = ", ".join(f"{name}={value!r:.200}" for name, value in selection.items() if value is not None)
    return (f"model {model_id!r}: the selection ({given or 'every record'}) matches no published records; "
            f"see what it holds with `dmi requests {model_id}` and `dmi show {model_id} REQUEST`")


def _check_requested(plan: Plan, hooks: tuple[str, ...] | None, layers: Any) -> None:
    """Refuse a selection that holds none of the records of a requested hook, layer or (both
    given) hook and layer, naming what is missing and what is held: a feature asked for is
    never silently absent from ``loader.features``. (``layers`` was checked by the catalog.)"""
    held = {(f.hook, f.layer) for f in plan.features}
    wanted_layers = None if layers is None else ((layers,) if isinstance(layers, int) else tuple(layers))
    if hooks is not None and wanted_layers is not None:
        missing = [f"{h}.{layer}" for h in hooks for layer in wanted_layers if (h, layer) not in held]
    elif hooks is not None:
        missing = [h for h in hooks if h not in {h for h, _ in held}]
    elif wanted_layers is not None:
        missing = [f"layer {layer}" for layer in wanted_layers if layer not in {layer for _, layer in held}]
    else:
        missing = []
    if missing:
        raise RecordNotFoundError(f"the selection holds no records of {', '.join(missing)}; it holds "
                                  f"{', '.join(f.name for f in plan.features)}")


def _check_phases(phases: Any) -> None:
    """Refuse a phase that no record can have (a typo would otherwise select nothing, or
    silently less), naming the phases there are; other shapes are the catalog's to check."""
    from dmi.storage.records import PHASES

    given = (phases,) if isinstance(phases, str) else phases if isinstance(phases, (list, tuple, set)) else ()
    unknown = [p for p in given if isinstance(p, str) and p not in PHASES]
    if unknown:
        raise InvalidArgumentError(f"unknown phase {', '.join(map(repr, unknown))}; phases: {', '.join(PHASES)}")


def _hook_names(hooks: Any) -> tuple[str, ...] | None:
    """``hooks`` as a tuple of catalogue names (``None``: every hook), each a ``str``: bytes or a
    list of non-str values is refused rather than iterated (``b"resid_post"`` would be read as
    the numbers of its bytes)."""
    if hooks is None:
        return None
    if not isinstance(hooks, (str, Iterable)):
        raise InvalidArgumentError(f"hooks must be a hook name or a list of them, not {hooks!r}")
    names = (hooks,) if isinstance(hooks, str) else tuple(hooks)
    for name in names:
        if not isinstance(name, str):
            raise InvalidArgumentError(f"a hook is a str (a hook name), not {name!r}; hooks={hooks!r}")
    catalogue = _hook_catalogue()
    from dmi.storage.errors import HookSelectionError

    for name in names:
        if name not in catalogue:
            raise HookSelectionError(f"unknown hook {name!r}; hooks: {', '.join(catalogue)}")
    return names


def _hook_catalogue() -> tuple[str, ...]:
    from dmi.capture import HOOKS

    return tuple(HOOKS)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit ``rank``/``world_size``, else torch.distributed's when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise InvalidArgumentError("pass both rank= and world_size=, or neither (torch.distributed decides)")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, world_size)) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}")
    return rank, world_size


FORK_FIXED = {(3, 10): 15, (3, 11): 10}
"""The first patch release of each affected CPython whose forked child cannot deadlock on the
interpreter's thread-state lock (gh-112275); 3.12 and later never could."""

FORK_HANG_WARNING = (
    "DataLoader workers forked from a torch.distributed rank can hang for good on this Python "
    f"({sys.version.split()[0]}; fixed in 3.10.15, 3.11.10 and 3.12, CPython gh-112275): the process group's "
    "threads enter Python after every backward, and a worker forked at that moment never starts. Pass "
    "multiprocessing_context=<a 'forkserver' context> (docs/loader.md, DDP) or upgrade Python."
)


def fork_may_hang(multiprocessing_context: Any, version: tuple = tuple(sys.version_info[:3])) -> bool:
    """Whether workers started with ``multiprocessing_context`` would be forked from a process
    with a torch.distributed group on a CPython whose fork can deadlock the child."""
    fixed = FORK_FIXED.get(version[:2])
    if version[:2] >= (3, 12) or (fixed is not None and version[2] >= fixed):
        return False
    if _start_method(multiprocessing_context) != "fork":
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _check_context(context: Any) -> None:
    """Refuse a ``multiprocessing_context`` the workers could not be started with, when the
    loader is made: torch would raise its own ``ValueError`` or ``TypeError`` only when an
    epoch starts its workers (and never, without workers)."""
    if context is None or isinstance(context, multiprocessing.context.BaseContext):
        return
    methods = multiprocessing.get_all_start_methods()
    if not isinstance(context, str) or context not in methods:
        raise InvalidArgumentError(f"multiprocessing_context must be a start method ({', '.join(map(repr, methods))} "
                                   f"here), a multiprocessing context (multiprocessing.get_context(...)) or None "
                                   f"(multiprocessing's default), not {context!r:.200}")


def _start_method(context: Any) -> str:
    """The start method DataLoader workers get from ``context`` (a name, a context, or None
    for multiprocessing's default), without fixing the default as ``get_start_method()`` does."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else context.get_start_method()


def _check_layout(plan: Plan, layout: str, dtype: torch.dtype | None) -> None:
    features = plan.features
    if dtype is None and len({f.dtype for f in features}) > 1:
        raise InvalidArgumentError(f"the features have dtypes {sorted({f.dtype for f in features})}; pass dtype=")
    if layout == "stack" and len({f.width for f in features}) > 1:
        widths = {f.name: f.width for f in features}
        raise InvalidArgumentError(f"layout='stack' needs one width, the features have {widths}; use layout='concat'")


def _unit_norm_scales(plan: Plan) -> tuple[float, ...]:
    """Per feature, the factor that makes the mean squared token norm over the selection 1.

    From the catalog's per-record L2 norms: sum of squared record norms / tokens is the
    mean squared token norm, so no payload is read.
    """
    scales = []
    for f, feature in enumerate(plan.features):
        squares, tokens = 0.0, 0
        for unit in plan.units:
            for e in unit.records[f]:
                if e.meta.stats is None:
                    raise InvalidArgumentError(f"{feature.name}: record {e.meta.key.request_id} at token "
                                               f"{e.meta.key.start_token} has no statistics; normalize=False")
                squares += e.meta.stats.l2_norm ** 2
                tokens += e.meta.key.n_tokens
        if squares == 0.0:
            raise InvalidArgumentError(f"{feature.name} is all zeros; it cannot be normalised")
        scales.append(math.sqrt(tokens / squares))
    return tuple(scales)
