"""Reading one loader window: its records through coalesced range reads, as aligned token rows.

A window's records are grouped by pack and each group is read with
:func:`dmi.reader.read_records` (one coalesced range read per neighbourhood, checksums
verified, decode in the thread that read it; zstd decoding releases the GIL) on a thread
pool. A damaged record raises its named ``PackError`` — or, with ``on_error="skip"``, its
unit's rows are left out of the window and the damage is counted (the record listed once
per share, by the window where its unit's rows begin). The rows left out keep their
positions: a window is as long, and permuted the same, as it would be undamaged, so every
batch is cut at the same positions and a share yields as many batches whatever its damage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from dmi._loader_memory import Arena, LoaderMemory, WindowMemory
from dmi._loader_plan import Plan, Slice, slice_rows
from dmi.reader import FooterCache, plan_reads, read_record, read_records
from dmi.storage import DIRECT_ALIGNMENT, PackStore, gather_rows, torch_dtype
from dmi.storage.errors import PackError
from dmi.storage.records import RecordEntry

ON_ERROR = ("raise", "skip")
LAYOUTS = ("stack", "concat")


@dataclass(frozen=True, slots=True)
class RowFormat:
    """How token rows leave the loader: dtype, per-feature scale factors, feature layout."""

    dtype: torch.dtype | None
    scales: tuple[float, ...] | None
    layout: str


@dataclass(frozen=True, slots=True)
class Window:
    """A window's rows in emission order, left in the records they were read into: per feature,
    those record tensors (``sources``) and each kept row's (source, row) in them (``picks``);
    the kept rows' (unit, row) origin; what was skipped. Positions count every row of the
    window, skipped ones included: the kept rows at positions ``[lo, hi)`` are kept rows
    ``[kept[lo], kept[hi])`` (``kept``: how many rows before each position are kept). Batches
    copy their rows out (:meth:`fill`), so the window holds no copy of its own."""

    sources: tuple[tuple[torch.Tensor, ...], ...]
    picks: tuple[np.ndarray, ...]
    units: np.ndarray
    rows: np.ndarray
    kept: np.ndarray
    damaged: tuple[str, ...]
    skipped_rows: int

    def __len__(self) -> int:
        """The window's positions (its rows before any was skipped)."""
        return len(self.kept) - 1

    def count(self, lo: int, hi: int) -> int:
        """How many rows at positions ``[lo, hi)`` are kept."""
        return int(self.kept[hi] - self.kept[lo])

    def kept_rows(self, lo: int, hi: int) -> slice:
        """The kept rows at positions ``[lo, hi)``, as a slice of ``picks``, ``units`` and ``rows``."""
        return slice(int(self.kept[lo]), int(self.kept[hi]))

    def fill(self, lo: int, hi: int, places: list[torch.Tensor], fmt: RowFormat) -> None:
        """Copy the kept rows at positions ``[lo, hi)`` into ``places`` (one ``[rows, width]``
        view per feature), converted to the places' dtype and scaled by ``fmt``: one gather per
        feature, in the stored dtype straight into its place when nothing converts."""
        kept = self.kept_rows(lo, hi)
        for f, place in enumerate(places):
            sources, picks = self.sources[f], self.picks[f][kept]
            stored = sources[0].dtype if sources else place.dtype
            if fmt.scales is None and stored == place.dtype:
                gather_rows(sources, picks, place)
                continue
            rows = torch.empty(place.shape[0], place.shape[1], dtype=stored)
            gather_rows(sources, picks, rows)
            if fmt.scales is not None:
                rows = rows.to(torch.float32).mul_(fmt.scales[f])
            place.copy_(rows)  # converted to the batch's dtype as it is copied in


@dataclass(frozen=True, slots=True)
class _KeptOrder:
    """The emission order of a window's kept rows: ``rows`` indexes all its rows in stream
    order, ``stream`` the kept ones alone; ``kept[p]`` counts the kept rows before position ``p``."""

    rows: np.ndarray
    stream: np.ndarray
    kept: np.ndarray


def _kept_order(keep: np.ndarray, order: np.ndarray | None) -> _KeptOrder:
    """The kept rows (``keep``: a mask over every row in stream order) in the order ``order``
    gives every row (``None``: stream order), each still at its position among all rows."""
    order = np.arange(len(keep)) if order is None else order
    emitted = keep[order]
    kept_index = np.cumsum(keep) - 1  # a kept row's index among the kept rows in stream order
    return _KeptOrder(order[emitted], kept_index[order[emitted]],
                      np.concatenate([[0], np.cumsum(emitted)]).astype(np.int64))


def new_batch(features, fmt: RowFormat, n: int, memory: WindowMemory) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An uninitialised batch of ``n`` rows in ``fmt``'s dtype and layout, lent by ``memory``,
    and each feature's place in it (its slot of the stack, or its column block)."""
    dtype = fmt.dtype or torch_dtype(features[0].dtype)  # features of several dtypes need dtype= (checked at open)
    widths = [f.width for f in features]
    flat = memory.take(n * sum(widths) * dtype.itemsize).view(dtype)
    if len(features) > 1 and fmt.layout == "stack":
        batch = flat.view(n, len(features), widths[0])
        return batch, [batch[:, f] for f in range(len(features))]
    batch = flat.view(n, sum(widths))
    edges = np.cumsum([0, *widths])
    return batch, [batch[:, edges[f] : edges[f + 1]] for f in range(len(features))]


class WindowReader:
    """Reads windows of one plan from one pack store (one footer cache for the reader's life)."""

    def __init__(self, plan: Plan, packs: PackStore, fmt: RowFormat, *, max_gap: int, on_error: str,
                 io_pool: Executor, memory: LoaderMemory, direct_io: bool = False):
        self.plan = plan
        self.packs = packs
        self.fmt = fmt
        self.max_gap = max_gap
        self.skip = on_error == "skip"
        self.io_pool = io_pool
        self.cache = FooterCache()
        self.memory = memory
        self.direct_io = direct_io

    def read(self, slices: list[Slice], permutation: Callable[[int], np.ndarray] | None, *,
             opens_share: bool = True) -> Window:
        """The rows of ``slices`` in the order of ``permutation(n_rows)`` (``None``: stream
        order), damaged units left out (skip mode) where they stood: the permutation is that of
        every row, so the kept rows keep their positions. A damaged record is listed by the
        window where its unit's rows in the share begin (its first row, or the share's first
        window: ``opens_share``), so a unit spread over several windows lists it once."""
        tensors, bad = self._read_records([e for s in slices for group in self.plan.units[s.unit].records for e in group])
        damaged_units = {s.unit for s in slices if bad and any(e in bad for g in self.plan.units[s.unit].records for e in g)}
        begins = {s.unit for s in slices if s.lo == 0 or opens_share}
        listed = sorted(text for e, text in bad.items() if any(e in g for u in damaged_units & begins
                                                               for g in self.plan.units[u].records))
        kept = [s for s in slices if s.unit not in damaged_units]
        skipped = sum(s.hi - s.lo for s in slices) - sum(s.hi - s.lo for s in kept)
        units, rows = slice_rows(slices)
        picked = _kept_order(np.isin(units, list(damaged_units), invert=True),
                             permutation(len(units)) if permutation is not None and len(units) else None)
        sources, picks = [], []
        for f, feature in enumerate(self.plan.features):
            feature_sources, feature_picks = self._picks(f, feature.width, kept, tensors)
            sources.append(tuple(feature_sources))
            picks.append(feature_picks[picked.stream])
        return Window(tuple(sources), tuple(picks), units[picked.rows], rows[picked.rows], picked.kept,
                      tuple(listed), skipped)

    def _read_records(self, entries: list[RecordEntry]) -> tuple[dict[RecordEntry, torch.Tensor], dict[RecordEntry, str]]:
        by_pack: dict[str, list[RecordEntry]] = defaultdict(list)
        for e in entries:
            by_pack[e.pack_id].append(e)
        arena = self._arena(entries)
        futures = [self.io_pool.submit(self._read_pack, group, arena) for group in by_pack.values()]
        tensors: dict[RecordEntry, torch.Tensor] = {}
        bad: dict[RecordEntry, str] = {}
        for future in futures:
            got, failed = future.result()
            tensors.update(got)
            bad.update(failed)
        return tensors, bad

    def _arena(self, entries: list[RecordEntry]) -> Arena:
        """Room for every range read of ``entries`` and every record that decodes into memory of its own."""
        widen = 3 * DIRECT_ALIGNMENT if self.direct_io else 0  # see read_records(direct=True)
        sizes = [p.range.length + widen for p in plan_reads(entries, max_gap=self.max_gap)]
        sizes += [e.meta.raw_size for e in entries if e.meta.codec != "raw"]
        return Arena(self.memory.reads.take(Arena.room_for(sizes)))

    def _read_pack(self, group: list[RecordEntry], arena: Arena) -> tuple[dict, dict]:
        try:
            got = read_records(self.packs, group, max_gap=self.max_gap, cache=self.cache, memory=arena,
                               direct=self.direct_io)
            return dict(zip(group, got)), {}
        except PackError:
            if not self.skip:
                raise
        got, failed = {}, {}
        for e in group:  # find exactly which records are damaged; keep the rest
            try:
                got[e] = read_record(self.packs, e, cache=self.cache)
            except PackError as exc:
                failed[e] = f"{e.pack_id}: {exc}"
        return got, failed

    def _picks(self, f: int, width: int, slices: list[Slice],
               tensors: dict[RecordEntry, torch.Tensor]) -> tuple[list[torch.Tensor], np.ndarray]:
        """Feature ``f``'s record tensors as ``[tokens, width]`` sources, and the (source, row)
        of every row of ``slices`` in stream order."""
        sources: list[torch.Tensor] = []
        picks = [np.zeros((0, 2), dtype=np.int64)]
        for s in slices:
            start = 0  # the record's first row, counted from the unit's start
            for e in self.plan.units[s.unit].records[f]:
                n = e.meta.key.n_tokens
                lo, hi = max(s.lo, start), min(s.hi, start + n)
                if lo < hi:
                    rows = np.arange(lo - start, hi - start, dtype=np.int64)
                    picks.append(np.stack([np.full_like(rows, len(sources)), rows], axis=1))
                    sources.append(tensors[e].reshape(n, width))
                start += n
        return sources, np.concatenate(picks)
