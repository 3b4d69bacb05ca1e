"""A capture's publisher lease is renewed, and its packs published, on a lease thread of the
drain's at the attaching thread's priority, not on the drain thread itself: a live capture whose
drain thread cannot run for longer than its lease — nice 19 below a busy machine (under two CPU
burners ``tests/test_shared_store.py`` lost its 30 s lease in 3 of 4 runs, also in the middle
of a publish, holding the publisher's lock), or held in a long write — keeps its lease and
publishes everything. A failed renewal still fails the drain, as before.

The drain thread is held in its first append by the test (a stand-in for a thread the
scheduler does not run, which cannot be had on demand); the lease, the catalog and the packs
are real (chDB)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore
from dmi.storage.errors import DrainError, LeaseLostError
from tests._models import left_padded_batch, tiny

SCOPE = "capture/lease-keeper"
LEASE_SECONDS = 4.0
BOUND_SECONDS = 60


def _wait_until(condition, what: str):
    deadline = time.monotonic() + BOUND_SECONDS
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"waited {BOUND_SECONDS} s for {what}")


def _hold_appends(cap) -> tuple[threading.Event, threading.Event]:
    """Hold the drain thread in its next append until ``gate`` opens; ``held`` is set once it is."""
    held, gate = threading.Event(), threading.Event()
    append = cap.drain.writer.append

    def held_append(*args, **kwargs):
        held.set()
        gate.wait(BOUND_SECONDS)
        return append(*args, **kwargs)
    cap.drain.writer.append = held_append
    return held, gate


def _lease_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith("-lease") and t.is_alive()]


def test_a_drain_held_past_its_lease_keeps_it_and_publishes_everything(tmp_path):
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with attach(model, hooks="resid_post", store=LocalPackStore(tmp_path / "packs"), catalog=catalog,
                    model_id="m", publish_scope=SCOPE, lease_seconds=LEASE_SECONDS) as cap:
            held, gate = _hold_appends(cap)
            try:
                cap.forward(ids, attention_mask=mask)
                assert held.wait(BOUND_SECONDS)
                first = _wait_until(lambda: (s := catalog.lease_state(SCOPE)).live(time.time()) and s,
                                    "the capture's lease")
                _wait_until(lambda: time.time() > first.expires_at + 1.0, "the first expiry to pass")
                now = catalog.lease_state(SCOPE)
                assert (now.term, now.holder) == (first.term, first.holder)
                assert now.live(time.time()) and now.expires_at > first.expires_at
            finally:
                gate.set()
        records = catalog.find_records("m")
        released = catalog.lease_state(SCOPE)
    assert sorted((r.meta.key.request_id[-1], r.meta.key.layer) for r in records) == [
        (str(i), layer) for i in range(3) for layer in range(3)]
    assert cap.stats["records"] == 9 and cap.stats["records_lost"] == 0
    assert released.released and _lease_threads() == []


def test_a_renewal_that_fails_fails_the_drain(tmp_path):
    """The lease thread's failed renewal is the drain's error: raised at the next forward and at
    exit, nothing published; the lease thread is gone once the capture is left."""
    lost = LeaseLostError("injected: the lease was taken over")

    def renewal_fails():
        raise lost

    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError) as at_exit:
            with attach(model, hooks="resid_post", store=LocalPackStore(tmp_path / "packs"), catalog=catalog,
                        model_id="m", publish_scope=SCOPE, lease_seconds=0.4) as cap:
                cap.drain._tick = renewal_fails
                _wait_until(lambda: cap.drain.error is not None, "the drain to take the failed renewal")
                with pytest.raises(DrainError) as at_flush:
                    cap.forward(ids, attention_mask=mask)
        records = catalog.find_records("m")
    assert at_flush.value.__cause__ is lost and at_exit.value.__cause__ is lost
    assert records == [] and _lease_threads() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice levels are Linux's")
def test_packs_are_published_at_the_attaching_threads_priority(tmp_path):
    """The drain thread runs 19 levels below (a model on the CPU); its publishes do not."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    levels: list[int] = []
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with attach(model, hooks="resid_post", store=LocalPackStore(tmp_path / "packs"), catalog=catalog,
                    model_id="m", publish_scope=SCOPE, drain_nice=19) as cap:
            publish = cap.drain._publish

            def noting_publish(batch):
                levels.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                return publish(batch)
            cap.drain._publish = noting_publish
            cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert len(catalog.find_records("m")) == 3 * 3 * 2  # requests x layers x (prefill, decode)
    assert cap.stats["drain_nice"] == 19 and levels and set(levels) == {own}
