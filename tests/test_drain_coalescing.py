"""Decode coalescing on the drain thread when the batch changes between steps (vLLM's
continuous batching: requests join after their prompt, leave when they finish, move rows).

A request's decode rows become one record while it is in every step at the next position,
whatever else the steps hold; a gap in its steps or positions starts a new record; a seal for
finished requests stores only theirs. Values are checked against the rows fed in, keys against
the first step and position of each run."""

from __future__ import annotations

import torch

from dmi.capture import ModelGeometry
from dmi.capture._drain import Drain, KeyContext
from dmi.capture._plan import RowSpan, StepPlan

GEOMETRY = ModelGeometry("llama", 2, 8, 2, 2, 4, 16, 32, torch.float32)
HOOKS = {"resid_post": (0,)}


class _Records:
    """A writer that keeps what it is given."""

    def __init__(self):
        self.records = []

    def append(self, key, data, **options):
        self.records.append((key, data.clone()))

    def seal(self):
        return None

    def close(self):
        return None

    def by_request(self):
        out = {}
        for key, data in self.records:
            out.setdefault(key.request_id, []).append((key, data))
        return out


def _plan(step: int, requests: list[tuple[str, int]]) -> StepPlan:
    """A decode step whose rows hold ``requests`` (request id, position), one token each."""
    spans = tuple(RowSpan(0, rid, i, pos, 1, i, 0) for i, (rid, pos) in enumerate(requests))
    return StepPlan(1, len(requests), "decode", step, spans, None, GEOMETRY, HOOKS)


def _rows(requests: list[tuple[str, int]]) -> torch.Tensor:
    """One row per request whose values name it and its position (so a misplaced row shows)."""
    return torch.tensor([[float(ord(rid[0]) * 1000 + pos)] * 8 for rid, pos in requests])


def _drain(writer, chunk=32):
    return Drain(None, writer, KeyContext("m", "r", geometry=GEOMETRY), decode_chunk_steps=chunk)


def _stage(drain, steps):
    for step, requests in steps:
        drain._stage("resid_post", 0, _plan(step, requests), _rows(requests))


def _records_of(steps, chunk=32) -> _Records:
    """What the drain stores from ``steps`` staged one after another, then everything emitted."""
    writer = _Records()
    drain = _drain(writer, chunk)
    try:
        _stage(drain, steps)
        drain._emit_all_staged()
    finally:
        drain.close(5)
    return writer


def _expected(rid: str, positions: range) -> torch.Tensor:
    return torch.cat([_rows([(rid, p)]) for p in positions])


def test_requests_joining_and_leaving_the_batch_keep_one_record_each():
    # a decodes throughout; b joins at step 11 (after its prompt) in front of a; c leaves after step 11
    got = _records_of([
        (10, [("a", 5), ("c", 40)]),
        (11, [("b", 7), ("a", 6), ("c", 41)]),
        (12, [("b", 8), ("a", 7)]),
        (13, [("a", 8), ("b", 9)]),  # rows reordered
    ]).by_request()
    assert {rid: len(recs) for rid, recs in got.items()} == {"a": 1, "b": 1, "c": 1}
    (ka, va), = got["a"]
    assert (ka.start_token, ka.n_tokens, ka.step, ka.phase) == (5, 4, 10, "decode")
    assert torch.equal(va, _expected("a", range(5, 9)))
    (kb, vb), = got["b"]
    assert (kb.start_token, kb.n_tokens, kb.step) == (7, 3, 11)
    assert torch.equal(vb, _expected("b", range(7, 10)))
    (kc, vc), = got["c"]
    assert (kc.start_token, kc.n_tokens, kc.step) == (40, 2, 10)
    assert torch.equal(vc, _expected("c", range(40, 42)))


def test_a_request_missing_from_a_step_starts_a_new_record():
    got = _records_of([
        (20, [("a", 1), ("b", 3)]),
        (21, [("b", 4)]),  # a not scheduled this step
        (22, [("a", 2), ("b", 5)]),
    ]).by_request()
    a_keys = [(k.start_token, k.n_tokens, k.step) for k, _ in got["a"]]
    assert a_keys == [(1, 1, 20), (2, 1, 22)]  # each record's step + offset is the step that fed the token
    (kb, vb), = got["b"]
    assert (kb.start_token, kb.n_tokens, kb.step) == (3, 3, 20)
    assert torch.equal(vb, _expected("b", range(3, 6)))


def test_a_request_whose_position_jumps_starts_a_new_record():
    got = _records_of([(40, [("a", 3)]), (41, [("a", 9)]), (42, [("a", 10)])]).by_request()
    assert [(k.start_token, k.n_tokens, k.step) for k, _ in got["a"]] == [(3, 1, 40), (9, 2, 41)]
    assert torch.equal(got["a"][1][1], _expected("a", range(9, 11)))


def test_a_seal_for_finished_requests_stores_theirs_and_the_others_keep_coalescing():
    writer = _Records()
    drain = _drain(writer)
    try:
        _stage(drain, [(30, [("a", 10), ("b", 20)]), (31, [("a", 11), ("b", 21)])])
        drain._emit_all_staged({"a"})  # a finished
        assert [(k.request_id, k.start_token, k.n_tokens) for k, _ in writer.records] == [("a", 10, 2)]
        _stage(drain, [(32, [("b", 22)]), (33, [("b", 23)])])
        drain._emit_all_staged()
    finally:
        drain.close(5)
    got = writer.by_request()
    assert len(got["a"]) == 1  # never stored twice
    (kb, vb), = got["b"]
    assert (kb.start_token, kb.n_tokens, kb.step) == (20, 4, 30)
    assert torch.equal(vb, _expected("b", range(20, 24)))


def test_the_chunk_bound_still_cuts_a_changing_batch():
    writer = _records_of([(1, [("a", 0)]), (2, [("b", 0), ("a", 1)]), (3, [("a", 2), ("b", 1)])], chunk=2)
    keys = sorted((k.request_id, k.start_token, k.n_tokens, k.step) for k, _ in writer.records)
    assert keys == [("a", 0, 2, 1), ("a", 2, 1, 3), ("b", 0, 1, 2), ("b", 1, 1, 3)]
