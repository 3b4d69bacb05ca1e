"""One vLLM forward step as step plans: which rows of the flattened token axis belong to which
request, at which real positions, in which phase.

vLLM schedules many requests into one forward: their tokens are concatenated
(``[num_tokens, ...]``), request ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``
at positions ``num_computed_tokens[i]`` onwards; a forward mixes prompt chunks (chunked
prefill) and decode tokens. The planner turns that into at most two :class:`StepPlan` (one for
prompt tokens, phase ``"prefill"``, one for generated tokens, phase ``"decode"``) over a single
row of ``num_tokens`` columns, plus, per phase, one for ``logits`` (one row per request: its
step's last token, from the prompt's last token on — the logits vLLM computes at the end of a
partial prompt chunk are never sampled, and are not captured, so a request's logits are
contiguous as in a Hugging Face ``generate``). Records of one request therefore always carry its real positions, whatever else shared
the forward.

**Recomputation.** A preempted request is later recomputed from its first token; the planner
remembers, per request, the next position not yet captured and trims every span to start there,
so a recomputed token is never recorded twice and a record never mixes two computations.

**Memory.** State of a request that finished is dropped (:meth:`VLLMPlanner.forget`), all but
an 8-byte digest of its DMI request id (:class:`IdDigests`): a server capturing millions of
requests keeps about 8 bytes for each.

All work here is per request and per step (a few integers each), never per element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hashlib import blake2b

import numpy as np
import torch

from ._hooks import ModelGeometry
from ._plan import RowSpan, StepPlan
from ._schedule import Schedule

__all__ = ["BatchView", "IdDigests", "VLLMPlanner", "StepPlans", "external_request_id"]

RECENT_IDS_MIN = 1024
"""Ids added to :class:`IdDigests` since its last merge, in a set, before it merges them into its
sorted array — or a 64th of the array, if more: each merge copies the array once."""


@dataclass(frozen=True, slots=True)
class BatchView:
    """What the model runner holds for the forward about to run (host-side, no device sync)."""

    request_ids: tuple[str, ...]  # engine request ids, in batch order
    query_start_loc: tuple[int, ...]  # num_requests + 1 row offsets into the token axis
    num_computed: tuple[int, ...]  # position of each request's first token this step
    num_prompt: tuple[int, ...]  # each request's prompt length
    num_tokens: int  # rows of the token axis the model runs (>= query_start_loc[-1])


@dataclass(frozen=True, slots=True)
class StepPlans:
    """The plans of one forward: per phase for the token axis, and for the logits rows."""

    token_plans: tuple[StepPlan, ...]
    logits_plans: tuple[StepPlan, ...]
    request_ids: tuple[str, ...]  # DMI request ids of the requests with a captured span


def external_request_id(engine_id: str) -> str:
    """The id the user gave (or vLLM returned): the engine appends ``-`` and 8 characters."""
    head, sep, tail = engine_id.rpartition("-")
    return head if sep and head and len(tail) == 8 else engine_id


class IdDigests:
    """The DMI request ids given in a session, as 8-byte digests (BLAKE2b), sorted in one array:
    ``rid in digests`` is true for every id added, so a reused id is always seen and two
    requests' records are never merged; for an id never added it is true with probability at
    most ``len(digests) / 2**64`` (two digests equal by chance: that any of a session's first ten
    million requests meets one is below 3e-6), which stores that fresh request under its engine
    id and counts it as a duplicate: kept apart, never lost. Ids added since the last merge wait
    in a set (:data:`RECENT_IDS_MIN`, at most a 64th of the array), so an addition never copies
    the array: 8 bytes per merged id, and a merge briefly holds the array twice."""

    __slots__ = ("_sorted", "_recent")

    def __init__(self) -> None:
        self._sorted = np.empty(0, np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, rid: str) -> bool:
        digest = _digest(rid)
        if digest in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, digest))
        return i < len(self._sorted) and int(self._sorted[i]) == digest

    def add(self, rid: str) -> None:
        self._recent.add(_digest(rid))
        if len(self._recent) >= max(RECENT_IDS_MIN, len(self._sorted) // 64):
            self._merge()

    @property
    def merged(self) -> int:
        """Digests in the sorted array (8 bytes each); the rest wait in the set."""
        return len(self._sorted)

    def _merge(self) -> None:
        recent = np.sort(np.fromiter(self._recent, np.uint64, len(self._recent)))
        self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, recent), recent)
        self._recent = set()


def _digest(rid: str) -> int:
    """64 bits of ``rid``'s BLAKE2b (``surrogatepass``: any str, as a client sent it)."""
    return int.from_bytes(blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


@dataclass(slots=True)
class VLLMPlanner:
    """Plans each forward's capture; keeps, per request, what was already captured."""

    geometry: ModelGeometry
    hooks: dict[str, tuple[int, ...]]
    schedule: Schedule
    to_request_id: object = external_request_id  # engine id -> DMI request id
    forwards: int = 0
    requests_seen: int = 0  # requests first seen in this session
    recomputed_tokens: int = 0  # tokens run again after a preemption, not captured twice
    # per request until it finishes (forget): engine id -> ...
    next_position: dict[str, int] = field(default_factory=dict)  # ... first uncaptured position
    sequence: dict[str, int] = field(default_factory=dict)  # ... order first seen
    request_ids: dict[str, str] = field(default_factory=dict)  # ... DMI request id
    taken: IdDigests = field(default_factory=IdDigests)  # every DMI request id given in this session
    duplicate_request_ids: int = 0  # requests stored under their engine id: their own id was taken

    def plan(self, batch: BatchView) -> StepPlans | None:
        """The plans for one forward (``None``: nothing of it is captured)."""
        forward_index = self.forwards
        self.forwards += 1
        spans: dict[str, list[tuple[str, int, int, int]]] = {"prefill": [], "decode": []}
        logits: dict[str, list[tuple[str, int, int]]] = {"prefill": [], "decode": []}  # (request id, row, position)
        step_ids = []
        for i, engine_id in enumerate(batch.request_ids):
            kept = self._kept(engine_id, batch, i, forward_index)
            if kept is None:
                continue
            phase, lo, hi, position = kept
            rid = self.request_ids[engine_id]
            spans[phase].append((rid, lo, hi - lo, position))
            last = position + (hi - lo) - 1
            # the logits row is the step's last token, and vLLM samples only from the prompt's last
            # token on: a prompt span ends at most there (at it only when nothing cut its end), a
            # decode span is that one token
            if last >= batch.num_prompt[i] - 1:
                logits[phase].append((rid, i, last))
            step_ids.append(rid)
        if not step_ids:
            return None
        token_plans = tuple(self._token_plan(phase, forward_index, s, batch.num_tokens)
                            for phase, s in spans.items() if s)
        logits_plans = ()
        if "logits" in self.hooks:
            logits_plans = tuple(self._logits_plan(phase, forward_index, rows, len(batch.request_ids))
                                 for phase, rows in logits.items() if rows)
        return StepPlans(token_plans, logits_plans, tuple(step_ids))

    def forget(self, engine_ids) -> None:
        """Requests that left the runner (finished or aborted; a preempted request stays in it):
        their state is no longer needed; only their ids' digests stay, in ``taken``. An engine id
        seen again afterwards is a new request (vLLM's own rule), with an id of its own."""
        for engine_id in engine_ids:
            self.next_position.pop(engine_id, None)
            self.sequence.pop(engine_id, None)
            self.request_ids.pop(engine_id, None)

    def _assign(self, engine_id: str) -> str:
        """The DMI request id of a request first seen: the id vLLM returned (``to_request_id``),
        or, when an earlier request of this session already holds it — vLLM accepts a reused
        request id (a client retrying with the same ``X-Request-Id``) and only appends its own
        random suffix — the full engine id, so that two requests never share one id's records
        (``"<engine id>#<n>"`` if even that was given: vLLM's 8 random characters repeated)."""
        rid = self.to_request_id(engine_id)
        if rid in self.taken:
            self.duplicate_request_ids += 1
            rid, n = engine_id, 1
            while rid in self.taken:
                n += 1
                rid = f"{engine_id}#{n}"
        self.taken.add(rid)
        return rid

    def _kept(self, engine_id: str, batch: BatchView, i: int, forward_index: int):
        """``(phase, first row, end row, first position)`` of request ``i``'s captured span, or None."""
        lo, hi = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        position = batch.num_computed[i]
        if engine_id not in self.sequence:
            self.sequence[engine_id] = self.requests_seen
            self.requests_seen += 1
            self.request_ids[engine_id] = self._assign(engine_id)
        seen = self.next_position.get(engine_id, 0)
        if position < seen:  # recomputed after preemption: those positions were captured already
            skip = min(seen - position, hi - lo)
            lo, position = lo + skip, position + skip
            self.recomputed_tokens += skip
        if hi <= lo:
            return None
        self.next_position[engine_id] = position + (hi - lo)
        prompt = batch.num_prompt[i]
        phase = "prefill" if position < prompt else "decode"
        step = position - prompt + 1  # the decode step that feeds this token (1 = the first)
        if not self.schedule.admits_request(self.sequence[engine_id]):
            return None
        if not self.schedule.admits_step(forward_index, phase, step):
            return None
        if phase == "prefill" and self.schedule.last_tokens is not None:
            skip = max(0, prompt - self.schedule.last_tokens - position)
            lo, position = lo + min(skip, hi - lo), position + min(skip, hi - lo)
        if self.schedule.positions is not None:
            (lo,), (position,), (hi,) = self.schedule.window([lo], [position], hi)
        if hi <= lo:
            return None
        return phase, lo, hi, position

    def _token_plan(self, phase: str, step: int, spans, num_tokens: int) -> StepPlan:
        rows, offset, parts = [], 0, []
        contiguous = True
        for rid, lo, n, position in spans:
            rows.append(RowSpan(0, rid, lo, position, n, offset, 0))
            contiguous = contiguous and lo == offset
            parts.append(torch.arange(lo, lo + n))
            offset += n
        index = None if contiguous and offset == num_tokens else torch.cat(parts)
        return StepPlan(1, num_tokens, phase, step, tuple(rows), index, self.geometry, self.hooks)

    def _logits_plan(self, phase: str, step: int, logits, n_requests: int) -> StepPlan:
        """The logits processor returns one row per scheduled request, in batch order."""
        rows = tuple(RowSpan(0, rid, row, position, 1, k, 0) for k, (rid, row, position) in enumerate(logits))
        index = None if len(rows) == n_requests else torch.tensor([row for _, row, _ in logits], dtype=torch.long)
        return StepPlan(1, n_requests, phase, step, rows, index, self.geometry, {"logits": self.hooks["logits"]})
