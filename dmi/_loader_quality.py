"""Shuffle quality: how many distinct requests and packs feed each batch, against the ideal.

The ideal is uniform sampling of ``batch_size`` token rows without replacement from the
whole selection: a group (request or pack) of ``n`` of the ``N`` rows appears in a batch
with probability ``1 - C(N - n, B) / C(N, B)``, and the expected number of distinct groups
is the sum of those. Batches are composed from the plan alone, exactly as the loader
composes them, so no payload is read.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from dmi._loader_plan import EpochOrder, Plan, n_windows, slice_rows, window_permutation, window_slices


@dataclass(frozen=True, slots=True)
class ShuffleQuality:
    """Mean distinct requests and packs per batch, and their expectation under uniform sampling.

    ``request_ratio`` and ``pack_ratio`` are measured / ideal (1.0: as mixed as uniform
    sampling; a sequential reader scores near 1 / batch-size-in-requests).
    """

    batch_size: int
    batches: int
    requests_per_batch: float
    ideal_requests_per_batch: float
    packs_per_batch: float
    ideal_packs_per_batch: float

    @property
    def request_ratio(self) -> float:
        return self.requests_per_batch / self.ideal_requests_per_batch

    @property
    def pack_ratio(self) -> float:
        return self.packs_per_batch / self.ideal_packs_per_batch


def shuffle_quality(plan: Plan, batch_size: int, window: int, *, seed: int, epoch: int, shuffle: bool,
                    slot: int, n_slots: int, batches: int, drop_last: bool = False) -> ShuffleQuality:
    """Measure the first ``batches`` full batches of consumer ``slot`` (see the module doc);
    ``drop_last``: the share is cut to whole batches, as the loader cuts it (its last window
    is shorter, and permuted otherwise)."""
    request_of = np.array(_group_ids([(u.run_id, u.request_id) for u in plan.units]))
    pack_of = np.array(_group_ids([u.records[0][0].pack_id for u in plan.units]))
    units = _slot_rows(plan, batch_size * batches, window, seed=seed, epoch=epoch, shuffle=shuffle,
                       slot=slot, n_slots=n_slots, whole_batches=batch_size if drop_last else None)
    full = len(units) // batch_size
    if full == 0:
        from dmi.storage.errors import InvalidArgumentError

        raise InvalidArgumentError(f"this consumer holds fewer than one full batch of {batch_size} rows")
    per_batch = units[: full * batch_size].reshape(full, batch_size)
    requests = float(np.mean([len(np.unique(request_of[b])) for b in per_batch]))
    packs = float(np.mean([len(np.unique(pack_of[b])) for b in per_batch]))
    rows_per_request = Counter()
    rows_per_pack = Counter()
    for u in plan.units:
        rows_per_request[(u.run_id, u.request_id)] += u.n_tokens
        rows_per_pack[u.records[0][0].pack_id] += u.n_tokens
    total = plan.n_tokens
    return ShuffleQuality(batch_size, full, requests, _ideal(rows_per_request.values(), total, batch_size),
                          packs, _ideal(rows_per_pack.values(), total, batch_size))


def _group_ids(keys: list) -> list[int]:
    ids: dict = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def _slot_rows(plan: Plan, limit: int, window: int, *, seed: int, epoch: int, shuffle: bool, slot: int,
               n_slots: int, whole_batches: int | None) -> np.ndarray:
    """Unit index of each of the first ``limit`` rows the slot emits (no damage assumed)."""
    order = EpochOrder(plan, seed=seed, epoch=epoch, shuffle=shuffle)
    parts, have = [], 0
    for w in range(n_windows(order.total, slot, n_slots, window, whole_batches=whole_batches)):
        units, _ = slice_rows(window_slices(order, slot, n_slots, window, w, whole_batches=whole_batches))
        parts.append(units[window_permutation(len(units), seed=seed, epoch=epoch, slot=slot, w=w, shuffle=shuffle)])
        have += len(units)
        if have >= limit:
            break
    return np.concatenate(parts)[:limit] if parts else np.zeros(0, dtype=np.int64)


def _ideal(group_sizes, total: int, batch: int) -> float:
    """Expected distinct groups in a uniform sample of ``batch`` of ``total`` rows."""
    batch = min(batch, total)
    log_all = math.lgamma(total + 1) - math.lgamma(total - batch + 1)
    expected = 0.0
    for n in group_sizes:
        rest = total - n
        if rest < batch:
            expected += 1.0
            continue
        missed = math.lgamma(rest + 1) - math.lgamma(rest - batch + 1) - log_all
        expected += 1.0 - math.exp(missed)
    return expected
