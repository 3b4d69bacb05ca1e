"""Reading one loader window: its records through coalesced range reads, as aligned token rows.

A window's records are grouped by pack and each group is read with
:func:`dmi.reader.read_records` (one coalesced range read per neighbourhood, checksums
verified, decode in the thread that read it; zstd decoding releases the GIL) on a thread
pool. A damaged record raises its named ``PackError`` — or, with ``on_error="skip"``, its
unit's rows are left out of the window and the damage is counted (the record listed once
per share, by the window where its unit's rows begin).
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
    those record tensors (``sources``) and each row's (source, row) in them (``picks``); the
    rows' (unit, row) origin; what was skipped. Batches copy their rows out (:meth:`fill`),
    so the window holds no copy of its own."""

    sources: tuple[tuple[torch.Tensor, ...], ...]
    picks: tuple[np.ndarray, ...]
    units: np.ndarray
    rows: np.ndarray
    damaged: tuple[str, ...]
    skipped_rows: int

    def __len__(self) -> int:
        return len(self.units)

    def fill(self, lo: int, hi: int, places: list[torch.Tensor], fmt: RowFormat) -> None:
        """Copy rows ``[lo, hi)`` into ``places`` (one ``[hi - lo, width]`` view per feature),
        converted to the places' dtype and scaled by ``fmt``: one gather per feature, in the
        stored dtype straight into its place when nothing converts."""
        for f, place in enumerate(places):
            sources, picks = self.sources[f], self.picks[f][lo:hi]
            stored = sources[0].dtype if sources else place.dtype
            if fmt.scales is None and stored == place.dtype:
                gather_rows(sources, picks, place)
                continue
            rows = torch.empty(hi - lo, place.shape[1], dtype=stored)
            gather_rows(sources, picks, rows)
            if fmt.scales is not None:
                rows = rows.to(torch.float32).mul_(fmt.scales[f])
            place.copy_(rows)  # converted to the batch's dtype as it is copied in


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
        """The rows of ``slices``, damaged units left out (skip mode), in the order of
        ``permutation(n_rows)`` (``None``: stream order). A damaged record is listed by the
        window where its unit's rows in the share begin (its first row, or the share's first
        window: ``opens_share``), so a unit spread over several windows lists it once."""
        tensors, bad = self._read_records([e for s in slices for group in self.plan.units[s.unit].records for e in group])
        damaged_units = {s.unit for s in slices if bad and any(e in bad for g in self.plan.units[s.unit].records for e in g)}
        begins = {s.unit for s in slices if s.lo == 0 or opens_share}
        listed = sorted(text for e, text in bad.items() if any(e in g for u in damaged_units & begins
                                                               for g in self.plan.units[u].records))
        kept = [s for s in slices if s.unit not in damaged_units]
        skipped = sum(s.hi - s.lo for s in slices) - sum(s.hi - s.lo for s in kept)
        units, rows = slice_rows(kept)
        order = permutation(len(units)) if permutation is not None and len(units) else None
        sources, picks = [], []
        for f, feature in enumerate(self.plan.features):
            feature_sources, feature_picks = self._picks(f, feature.width, kept, tensors)
            sources.append(tuple(feature_sources))
            picks.append(feature_picks if order is None else feature_picks[order])
        if order is not None:
            units, rows = units[order], rows[order]
        return Window(tuple(sources), tuple(picks), units, rows, tuple(listed), skipped)

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
