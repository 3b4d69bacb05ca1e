"""The drain's decode staging buffer is bounded by ``decode_chunk_bytes`` as well as by
``decode_chunk_steps``: it reserves room for the steps a chunk can still take before the drain
emits it, never more than the bytes bound and one step — a huge ``decode_chunk_steps`` no
longer reserves ``rows x decode_chunk_steps`` rows (gigabytes per hook and layer, or an
allocation that fails the drain). The records it emits are unchanged.

Sizes are read from the buffer each ``_Staged.add`` leaves (its bytes, reserved and used)."""

from __future__ import annotations

import torch

from dmi.capture import ModelGeometry, attach
from dmi.capture import _drain
from dmi.capture._drain import Drain, KeyContext
from dmi.capture._plan import RowSpan, StepPlan
from tests._models import MemoryWriter, left_padded_batch, tiny
from tests.test_drain_coalescing import _Records

SMALL = ModelGeometry("llama", 2, 8, 2, 2, 4, 16, 32, torch.float32)  # resid_post: 8 floats, 32 bytes a row
LLAMA_8B = ModelGeometry("llama", 32, 4096, 32, 8, 128, 14336, 128256, torch.bfloat16)  # 8 KiB a row
HOOKS = {"resid_post": (0,)}


def _reserved(monkeypatch) -> list[int]:
    """The bytes of the staging buffer after each ``_Staged.add``, in order."""
    seen: list[int] = []
    add = _drain._Staged.add

    def recording_add(self, *args):
        add(self, *args)
        seen.append(self._buffer.nbytes)

    monkeypatch.setattr(_drain._Staged, "add", recording_add)
    return seen


def _plan(step: int, requests, geometry) -> StepPlan:
    """A decode step whose rows hold ``requests`` (request id, position), one token each."""
    spans = tuple(RowSpan(0, rid, i, pos, 1, i, 0) for i, (rid, pos) in enumerate(requests))
    return StepPlan(1, len(requests), "decode", step, spans, None, geometry, HOOKS)


def _rows(requests, width: int, dtype) -> torch.Tensor:
    """One row per request whose values name it and its position (so a misplaced row shows)."""
    return torch.tensor([[float(ord(rid[0]) * 100 + pos % 100)] * width for rid, pos in requests], dtype=dtype)


def _stage_all(steps, geometry, **options) -> list:
    """The records a drain stores from decode ``steps`` (step, requests) staged one after another."""
    writer = _Records()
    drain = Drain(None, writer, KeyContext("m", "r", geometry=geometry), **options)
    try:
        for step, requests in steps:
            rows = _rows(requests, geometry.hidden, geometry.dtype)
            drain._stage("resid_post", 0, _plan(step, requests, geometry), rows)
        drain._emit_all_staged()
    finally:
        drain.close(5)
    return writer.records


def test_a_llama_8b_batch_reserves_the_default_16_mib_not_gigabytes(monkeypatch):
    # batch 8, bf16, hidden 4096: 64 KiB a step; decode_chunk_steps=100000 reserved 6.5 GB before
    reserved = _reserved(monkeypatch)
    batch = [(f"r{i}", 10) for i in range(8)]
    steps = [(s, [(rid, pos + s) for rid, pos in batch]) for s in range(257)]
    records = _stage_all(steps, LLAMA_8B, decode_chunk_steps=100_000)
    assert Drain.__init__.__kwdefaults__["decode_chunk_bytes"] == 16 << 20
    assert reserved == [16 << 20] * 257  # 256 steps reach 16 MiB: the chunk ends there, the next reserves as much
    keys = [(k.request_id, k.step, k.start_token, k.n_tokens) for k, _ in records]
    assert keys == [(f"r{i}", 0, 10, 256) for i in range(8)] + [(f"r{i}", 256, 266, 1) for i in range(8)]
    assert torch.equal(records[0][1], _rows([("r0", 10 + s) for s in range(256)], 4096, torch.bfloat16))


def test_a_growing_batch_reserves_no_more_than_the_bound_and_one_step(monkeypatch):
    # a alone (32 bytes a step) reserves the 32 rows that reach 1000 bytes; b and c join (96 bytes
    # a step); at 31 rows staged, 992 bytes, the next step grows the buffer by that step alone
    reserved = _reserved(monkeypatch)
    steps = [(0, [("a", 5)])] + [(s, [("a", 5 + s), ("b", 20 + s), ("c", 40 + s)]) for s in range(1, 12)]
    records = _stage_all(steps, SMALL, decode_chunk_steps=10**12, decode_chunk_bytes=1000)
    assert reserved == [1024] * 11 + [1088]  # 1088 = 34 rows: under 1000 bytes and one step (96)
    keys = [(k.request_id, k.step, k.start_token, k.n_tokens) for k, _ in records]
    assert keys == [("a", 0, 5, 12), ("b", 1, 21, 11), ("c", 1, 41, 11)]
    assert torch.equal(records[1][1], _rows([("b", 21 + s) for s in range(11)], 8, torch.float32))


def test_the_step_bound_still_reserves_only_its_steps(monkeypatch):
    # 3 requests, 96 bytes a step: 4 steps (384 bytes) are under the 16 MiB bound
    reserved = _reserved(monkeypatch)
    steps = [(s, [("a", s), ("b", 10 + s), ("c", 20 + s)]) for s in range(6)]
    records = _stage_all(steps, SMALL, decode_chunk_steps=4)
    assert reserved == [384] * 6  # each chunk reserves its 4 steps (the second is emitted after 2)
    assert [(k.request_id, k.step, k.n_tokens) for k, _ in records] == [
        ("a", 0, 4), ("b", 0, 4), ("c", 0, 4), ("a", 4, 2), ("b", 4, 2), ("c", 4, 2)]


def _capture(model, steps: int):
    """Records of a greedy generation of 6 tokens for 3 requests (5 decode steps), by key (the
    request by its number in the run: each run's ids differ)."""
    ids, mask = left_padded_batch()
    writer = MemoryWriter()
    with attach(model, hooks="resid_post", layers=0, writer=writer, decode_chunk_steps=steps) as cap:
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        cap.flush()
    return {(k.request_id.rsplit("-", 1)[1], k.phase, k.step, k.start_token, k.n_tokens): d
            for k, d, _ in writer.records}


def test_attach_takes_a_huge_decode_chunk_steps_and_stores_the_same_records(monkeypatch):
    model = tiny()
    reserved = _reserved(monkeypatch)
    whole = _capture(model, 5)  # the 5 decode steps in one chunk: 3 rows x 32 floats, 384 bytes a step
    assert reserved == [1920] * 5
    reserved.clear()
    huge = _capture(model, 10**12)  # was a DrainError: an allocation of 384 TB
    assert reserved == [16 << 20 | 128] * 5  # 43,691 steps of 384 bytes: the first to reach 16 MiB
    assert whole.keys() == huge.keys()
    assert all(torch.equal(whole[k], huge[k]) and whole[k].dtype == huge[k].dtype for k in whole)
    per_step = _capture(model, 1)
    decode = sorted(k for k in huge if k[1] == "decode")
    assert [k[4] for k in decode] == [5, 5, 5]
    for rid, _, step, start, n in decode:
        pieces = [per_step[(rid, "decode", step + i, start + i, 1)] for i in range(n)]
        assert torch.equal(huge[(rid, "decode", step, start, n)], torch.cat(pieces))
