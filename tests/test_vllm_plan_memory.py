"""What the vLLM step planner keeps of requests that finished (no vLLM needed): nothing but one
8-byte digest of each DMI request id, so a server capturing for weeks does not grow per request
beyond that — while a reused id is still never merged and a fresh id never called a duplicate."""

from __future__ import annotations

import pytest
import torch

from dmi.capture import ModelGeometry, Schedule
from dmi.capture import _vllm_plan
from dmi.capture._vllm_plan import BatchView, IdDigests, VLLMPlanner

GEOMETRY = ModelGeometry("llama", 3, 128, 2, 1, 64, 256, 259, torch.float32)
RECENT = 16  # merges into the sorted array every max(16, n // 64) ids: many merges in a small test


@pytest.fixture(autouse=True)
def _small_recent_set(monkeypatch):
    monkeypatch.setattr(_vllm_plan, "RECENT_IDS_MIN", RECENT)


def _planner(schedule=None) -> VLLMPlanner:
    return VLLMPlanner(GEOMETRY, {"resid_post": (0,)}, Schedule.coerce(schedule))


def _run(planner: VLLMPlanner, engine_id: str, tokens: int = 2) -> list[str]:
    """One request's prompt in one step, then finished: the DMI ids its records carry."""
    step = planner.plan(BatchView((engine_id,), (0, tokens), (0,), (tokens,), tokens))
    planner.forget([engine_id])
    return [] if step is None else [s.request_id for p in step.token_plans for s in p.spans]


def test_finished_requests_leave_one_digest_each_and_reused_ids_are_still_kept_apart():
    planner = _planner()
    n = 3000
    assert [rid for i in range(n) for rid in _run(planner, f"req{i}-{i:08x}")] == [f"req{i}" for i in range(n)]
    # nothing per request but one 8-byte digest of its id: n entries, most in the sorted array
    assert (len(planner.next_position), len(planner.sequence), len(planner.request_ids)) == (0, 0, 0)
    assert len(planner.taken) == n and planner.taken.merged >= n - max(RECENT, n // 64)
    assert (planner.requests_seen, planner.duplicate_request_ids) == (n, 0)
    # a client retrying ids of long-finished requests (merged) and of the last ones (not yet)
    for i in (0, 1234, n - 1):
        assert _run(planner, f"req{i}-ffffffff") == [f"req{i}-ffffffff"]
    assert _run(planner, "req3000-00000000") == ["req3000"]  # fresh: its own id
    assert (planner.duplicate_request_ids, len(planner.taken)) == (3, n + 4)


def test_the_request_stride_counts_every_request_seen_not_the_ones_still_running():
    planner = _planner({"request_stride": 3})
    captured = [rid for i in range(9) for rid in _run(planner, f"r{i}-0123abcd")]
    assert captured == ["r0", "r3", "r6"]
    assert planner.requests_seen == 9 and not planner.sequence


def test_an_engine_id_seen_again_after_it_finished_is_a_new_request():
    """vLLM treats an aborted request resubmitted under its engine id as a new request: so
    does the planner (its own id, captured from position 0, nothing trimmed as recomputed)."""
    planner = _planner()
    assert _run(planner, "a-0123abcd", 4) == ["a"]
    step = planner.plan(BatchView(("a-0123abcd",), (0, 3), (0,), (3,), 3))
    assert [(s.request_id, s.start, s.n) for s in step.token_plans[0].spans] == [("a-0123abcd", 0, 3)]
    assert (planner.recomputed_tokens, planner.duplicate_request_ids, planner.requests_seen) == (0, 1, 2)


def test_an_engine_id_another_request_already_holds_gets_a_numbered_id_not_its_records():
    planner = _planner()
    assert _run(planner, "x-11111111") == ["x"]
    assert _run(planner, "x-22222222-33333333") == ["x-22222222"]  # a client's own id "x-22222222"
    # id "x" again, and vLLM's 8 random characters happen to be "22222222": both ids are taken
    assert _run(planner, "x-22222222") == ["x-22222222#2"]
    assert _run(planner, "x-22222222") == ["x-22222222#3"]
    assert planner.duplicate_request_ids == 2


def test_digests_that_collide_by_chance_call_a_fresh_id_a_duplicate_and_never_merge(monkeypatch):
    """The trade-off of keeping 8 bytes per id (probability len/2**64 per new id): a fresh id whose
    digest equals an earlier id's is stored under its engine id and counted — apart, not lost."""
    monkeypatch.setattr(_vllm_plan, "_digest", lambda rid: len(rid))
    planner = _planner()
    assert _run(planner, "ab-0123abcd") == ["ab"]
    assert _run(planner, "cd-89abcdef") == ["cd-89abcdef"]  # fresh, but "cd" and "ab" collide
    assert _run(planner, "ef-89abcdef") == ["ef-89abcdef#2"]
    assert planner.duplicate_request_ids == 2


def test_id_digests_hold_every_id_added_in_the_array_and_the_recent_set():
    digests = IdDigests()
    ids = [f"cmpl-{i:032x}" for i in range(2000)] + ["", "\ud800 lone surrogate", "é"]
    for rid in ids:
        assert rid not in digests
        digests.add(rid)
    assert len(digests) == len(ids) and digests.merged >= len(ids) - max(RECENT, len(ids) // 64)
    assert all(rid in digests for rid in ids)
    assert not any(f"cmpl-{i:032x}" in digests for i in range(2000, 4000))
