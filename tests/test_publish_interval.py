"""Seals asked for because requests finished (``Drain.seal_soon``, the vLLM path) publish at
most once per ``publish_interval``: the first at once, the next at the interval's end with every
seal asked for meanwhile, whether or not more work arrives; the finished requests' rows are
stored when the seal is asked for; ``flush()`` and an idle engine's seal never wait. A drain thread with a writer and a
publish callable that keep what they are given (no ring: no slots are submitted)."""

from __future__ import annotations

import threading
import time

import torch

from dmi.capture import ModelGeometry
from dmi.capture._drain import Drain, KeyContext
from dmi.capture._plan import RowSpan, StepPlan

GEOMETRY = ModelGeometry("llama", 2, 8, 2, 2, 4, 16, 32, torch.float32)
WAIT = 30.0  # bound on waiting for the drain thread; never reached when the code is right


class _Packs:
    """A writer whose every seal of appended records is a pack (a list of request ids)."""

    def __init__(self):
        self.open: list[str] = []
        self.stored: list[str] = []

    def append(self, key, data, **options):
        self.open.append(key.request_id)
        self.stored.append(key.request_id)

    def seal(self):
        pack, self.open = self.open, []
        return pack or None

    def close(self):
        return None


class _Published:
    """The publish callable: each call's packs, and when it came."""

    def __init__(self):
        self.calls: list[tuple[float, list]] = []
        self.changed = threading.Condition()

    def __call__(self, packs):
        with self.changed:
            self.calls.append((time.monotonic(), [list(p) for p in packs]))
            self.changed.notify_all()

    def wait_for(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= n, WAIT), self.calls


def _drain(interval: float):
    writer, published = _Packs(), _Published()
    drain = Drain(None, writer, KeyContext("m", "r", geometry=GEOMETRY), publish=published,
                  publish_interval=interval)
    return drain, writer, published


def _decode(drain, step: int, requests: list[tuple[str, int]]) -> None:
    """Stage one decode step holding ``requests`` (id, position), as the drain does for a slot."""
    spans = tuple(RowSpan(0, rid, i, pos, 1, i, 0) for i, (rid, pos) in enumerate(requests))
    plan = StepPlan(1, len(requests), "decode", step, spans, None, GEOMETRY, {"resid_post": (0,)})
    drain._stage("resid_post", 0, plan, torch.zeros(len(requests), 8))


def _wait_stored(writer, request_id: str) -> None:
    deadline = time.monotonic() + WAIT
    while request_id not in writer.stored:
        assert time.monotonic() < deadline, writer.stored
        time.sleep(0.01)


def test_without_an_interval_every_seal_publishes():
    drain, writer, published = _drain(0.0)
    try:
        for step, rid in enumerate("abc"):
            _decode(drain, step, [(rid, 0)])
            drain.seal_soon({rid})
            published.wait_for(step + 1)
    finally:
        drain.close(WAIT)
    assert [packs for _, packs in published.calls] == [[["a"]], [["b"]], [["c"]]]
    assert drain.stats.seals_deferred == 0


def test_seals_within_the_interval_wait_and_share_one_publish_which_flush_does_not_wait_for():
    drain, writer, published = _drain(3600.0)
    try:
        _decode(drain, 0, [("a", 0), ("b", 0), ("c", 0)])
        drain.seal_soon({"a"})  # the first seal: at once
        published.wait_for(1)
        drain.seal_soon({"b"})  # within the interval: b's rows are stored now, the seal waits
        _wait_stored(writer, "b")
        assert "c" not in writer.stored  # c is still running: its rows keep coalescing
        drain.seal_soon({"c"})
        _wait_stored(writer, "c")
        assert len(published.calls) == 1
        drain.flush(WAIT)  # does not wait for the interval
    finally:
        drain.close(WAIT)
    assert [packs for _, packs in published.calls] == [[["a"]], [["b", "c"]]]
    assert drain.stats.seals_deferred == 2


def test_a_seal_that_waited_publishes_at_the_interval_without_more_work():
    interval = 0.3
    drain, writer, published = _drain(interval)
    try:
        _decode(drain, 0, [("a", 0), ("b", 0)])
        drain.seal_soon({"a"})
        published.wait_for(1)
        drain.seal_soon({"b"})
        published.wait_for(2)  # nothing else is submitted: the drain wakes for the due seal itself
    finally:
        drain.close(WAIT)
    (first, _), (second, packs) = published.calls
    assert packs == [["b"]]
    assert second - first >= interval  # never sooner than the interval after the previous seal


def test_an_idle_engine_seals_at_once_with_every_staged_row():
    """``seal_soon(at_once=True)`` (an idle engine) stores every staged row and publishes
    without waiting for the interval a seal just before it started."""
    drain, writer, published = _drain(3600.0)
    try:
        _decode(drain, 0, [("a", 0), ("b", 0), ("c", 0)])
        drain.seal_soon({"a"})
        published.wait_for(1)
        drain.seal_soon(at_once=True)
        published.wait_for(2)
    finally:
        drain.close(WAIT)
    assert [packs for _, packs in published.calls] == [[["a"]], [["b", "c"]]]
    assert drain.stats.seals_deferred == 0
