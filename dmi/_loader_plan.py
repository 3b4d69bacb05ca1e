"""The loader's plan: selected records grouped into aligned token units, and each epoch's order.

A *feature* is one (hook, layer) of the selection. A *unit* is a token range of one
(run, request) that every feature covers with whole records: its rows are read by reading
those records and nothing else. Units are the coarsest ranges whose edges are record edges
of every feature, so a feature chunked finer than another (say, per decode step against one
record for the whole generation) still aligns. Token identity is (run, request, position).

An epoch's order is a pure function of (seed, epoch): a permutation of the units makes one
global token stream; each of the ``n_slots`` consumers (DDP rank × DataLoader worker) takes
a contiguous share of it (sizes differ by at most one token), cut into windows of
``shuffle_buffer`` rows that are permuted again with a seed of their own. Nothing here
reads a payload.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dmi.storage.errors import DuplicateChunkError, InvalidArgumentError, ReaderError
from dmi.storage.records import GLOBAL_LAYER, RecordEntry

PATTERN_HOOK = "attn_pattern"

UNPUBLISHED_TAIL = (
    ". They start together and end apart, as while this run is still being captured: a capture publishes whole "
    "steps, but a hook's decode steps are published a chunk at a time (decode_chunk_steps), and hooks of "
    "other sizes reach their chunks at other steps. Make the loader again once the capture's `with` block has "
    "ended, or select finished runs with runs=")
"""Added to a misalignment whose features share a first token and end at different ones: the
selection caught a running capture between two publishes."""

APART_TAIL = (
    ": every feature must hold the same tokens of a request, and a hook that keeps fewer positions "
    "(logits keeps only the last prompt position of a prefill) does not; select the tokens all of them hold, such as "
    "phases='decode' (--phases decode on the command line), or leave that hook out")
"""Added to a misalignment whose features start at different tokens: one hook keeps fewer
positions than the others (``logits`` under ``generate``)."""


@dataclass(frozen=True, slots=True)
class Feature:
    """One (hook, layer) of a loader's selection; ``width`` values per token."""

    hook: str
    layer: int
    width: int
    dtype: str

    @property
    def name(self) -> str:
        """``hook`` for global hooks, else ``hook.layer`` (``resid_post.3``)."""
        return self.hook if self.layer == GLOBAL_LAYER else f"{self.hook}.{self.layer}"


@dataclass(frozen=True, slots=True)
class Unit:
    """Tokens ``[start, start + n_tokens)`` of one request, with each feature's records for them."""

    run_id: str
    request_id: str
    start: int
    n_tokens: int
    records: tuple[tuple[RecordEntry, ...], ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """The features and units of a selection, units in (run, request, start) order."""

    features: tuple[Feature, ...]
    units: tuple[Unit, ...]

    @property
    def n_tokens(self) -> int:
        return sum(u.n_tokens for u in self.units)


@dataclass(frozen=True, slots=True)
class Slice:
    """Rows ``[lo, hi)`` (relative to the unit's start) of unit ``unit``."""

    unit: int
    lo: int
    hi: int


def build_plan(entries: Sequence[RecordEntry], hook_order: Sequence[str]) -> Plan:
    """Group ``entries`` (at least one) into features and aligned units; refuse what cannot align."""
    features = _features(entries, hook_order)
    index = {(f.hook, f.layer): i for i, f in enumerate(features)}
    by_request: dict[tuple[str, str], list[list[RecordEntry]]] = defaultdict(lambda: [[] for _ in features])
    for e in entries:
        k = e.meta.key
        by_request[(k.run_id, k.request_id)][index[(k.hook, k.layer)]].append(e)
    units: list[Unit] = []
    for (run, request) in sorted(by_request):
        units.extend(_request_units(run, request, features, by_request[(run, request)]))
    return Plan(tuple(features), tuple(units))


def _features(entries: Sequence[RecordEntry], hook_order: Sequence[str]) -> list[Feature]:
    order = {h: i for i, h in enumerate(hook_order)}
    found: dict[tuple[str, int], tuple[int, str]] = {}
    for e in entries:
        k = e.meta.key
        if k.hook == PATTERN_HOOK:
            raise InvalidArgumentError("attn_pattern has no token rows (tokens are on axis 1); select other hooks")
        if not e.meta.shape or e.meta.shape[0] != k.n_tokens:
            raise ReaderError(f"record {k.request_id}/{k.hook}/layer {k.layer} has shape {e.meta.shape}, "
                              f"not {k.n_tokens} tokens on axis 0")
        width = math.prod(e.meta.shape[1:])
        seen = found.setdefault((k.hook, k.layer), (width, e.meta.dtype))
        if seen != (width, e.meta.dtype):
            raise ReaderError(f"{k.hook} layer {k.layer} has records of width/dtype {seen} and "
                              f"{(width, e.meta.dtype)}; select one run or shard rank with where=")
    keys = sorted(found, key=lambda hl: (order.get(hl[0], len(order)), hl[0], hl[1]))
    return [Feature(h, layer, *found[(h, layer)]) for h, layer in keys]


def _request_units(run: str, request: str, features: Sequence[Feature],
                   per_feature: list[list[RecordEntry]]) -> list[Unit]:
    where = f"run {run} request {request}"
    edges: set[int] | None = None
    span = None
    for feature, records in zip(features, per_feature):
        if not records:
            raise ReaderError(f"{where} has no {feature.name} records while other requests do: the features "
                              "are not aligned; narrow the selection (runs=, layers=, where=; on the command line "
                              "--runs, --layers, --where)")
        records.sort(key=lambda e: e.meta.key.start_token)
        own = _tile_edges(where, feature, records)
        if span is None:
            span = (min(own), max(own))
        elif (min(own), max(own)) != span:
            raise ReaderError(f"{where}: {feature.name} covers tokens {min(own)}..{max(own)} but "
                              f"{features[0].name} covers {span[0]}..{span[1]}; the features are not aligned"
                              + (UNPUBLISHED_TAIL if min(own) == span[0] else APART_TAIL))
        edges = own if edges is None else edges & own
    cuts = sorted(edges)
    grouped = [_split_at(records, cuts) for records in per_feature]
    return [Unit(run, request, lo, hi - lo, tuple(groups[i] for groups in grouped))
            for i, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]


def _split_at(records: list[RecordEntry], cuts: list[int]) -> list[tuple[RecordEntry, ...]]:
    """Start-ordered ``records`` split into one group per interval between ``cuts``."""
    groups: list[tuple[RecordEntry, ...]] = []
    i = 0
    for hi in cuts[1:]:
        j = i
        while j < len(records) and records[j].meta.key.start_token < hi:
            j += 1
        groups.append(tuple(records[i:j]))
        i = j
    return groups


def _tile_edges(where: str, feature: Feature, records: list[RecordEntry]) -> set[int]:
    """Record edges of one feature's records, which must tile a token range exactly."""
    edges = {records[0].meta.key.start_token}
    expected = records[0].meta.key.start_token
    for e in records:
        k = e.meta.key
        if k.start_token < expected:
            raise DuplicateChunkError(
                f"{where}: {feature.name} has more than one record for token {k.start_token} (shard ranks or "
                "repeated captures); choose one with where='shard_rank = 0' or runs=")
        if k.start_token > expected:
            raise ReaderError(f"{where}: {feature.name} is missing tokens {expected}..{k.start_token}")
        expected += k.n_tokens
        edges.add(expected)
    return edges


# ------------------------------------------------------------------------------ epoch order


class EpochOrder:
    """The global token stream of one epoch: units in permuted (or catalogue) order."""

    def __init__(self, plan: Plan, *, seed: int, epoch: int, shuffle: bool):
        lengths = np.fromiter((u.n_tokens for u in plan.units), dtype=np.int64, count=len(plan.units))
        self.order = np.random.default_rng([seed, epoch]).permutation(len(lengths)) if shuffle else np.arange(len(lengths))
        self.ends = np.cumsum(lengths[self.order])
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def slices(self, lo: int, hi: int) -> list[Slice]:
        """The unit slices making up stream positions ``[lo, hi)``, in stream order."""
        out = []
        first = int(np.searchsorted(self.ends, lo, side="right"))
        for i in range(first, len(self.ends)):
            begin = int(self.ends[i - 1]) if i else 0
            if begin >= hi:
                break
            end = int(self.ends[i])
            out.append(Slice(int(self.order[i]), max(lo, begin) - begin, min(hi, end) - begin))
        return out


def slot_range(total: int, slot: int, n_slots: int, *, whole_batches: int | None = None) -> tuple[int, int]:
    """Stream positions of consumer ``slot``: contiguous, disjoint, sizes within one token.

    ``whole_batches=b`` (``drop_last``) keeps, in every slot, as many whole batches of ``b``
    rows as the smallest share holds (``total // n_slots`` rows) and leaves the rest of the
    share out of the epoch: every slot, hence every DDP rank, yields the same number of
    batches, which DDP's lock-step all-reduces need. (Cutting each share to its own whole
    batches would not do: shares one token apart can hold different numbers of batches.)
    """
    lo, hi = total * slot // n_slots, total * (slot + 1) // n_slots
    if whole_batches is not None:
        hi = lo + (total // n_slots) // whole_batches * whole_batches
    return lo, hi


def n_windows(total: int, slot: int, n_slots: int, window: int, *, whole_batches: int | None = None) -> int:
    lo, hi = slot_range(total, slot, n_slots, whole_batches=whole_batches)
    return -(-(hi - lo) // window)


def window_slices(order: EpochOrder, slot: int, n_slots: int, window: int, w: int, *,
                  whole_batches: int | None = None) -> list[Slice]:
    """Unit slices of window ``w`` of ``slot``'s share."""
    lo, hi = slot_range(order.total, slot, n_slots, whole_batches=whole_batches)
    return order.slices(lo + w * window, min(hi, lo + (w + 1) * window))


def window_permutation(n_rows: int, *, seed: int, epoch: int, slot: int, w: int, shuffle: bool) -> np.ndarray:
    """The order in which a window's ``n_rows`` rows are emitted."""
    if not shuffle:
        return np.arange(n_rows)
    return np.random.default_rng([seed, epoch, slot, w, 1]).permutation(n_rows)


def slice_rows(slices: Sequence[Slice]) -> tuple[np.ndarray, np.ndarray]:
    """(unit index, row inside the unit) of every row of ``slices``, in order."""
    if not slices:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    units = np.concatenate([np.full(s.hi - s.lo, s.unit, dtype=np.int64) for s in slices])
    rows = np.concatenate([np.arange(s.lo, s.hi, dtype=np.int64) for s in slices])
    return units, rows
