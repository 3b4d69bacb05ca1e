"""A failed drain's accounting where a second thing fails after the first: every token position
the model handed the drain is in a pack in the store or counted lost, once, with a reason, and
the ``DrainError`` message counts what it lost.

* A seal that fails after the drain failed (the flush that reaches the failure seals the open
  pack, and the disk is full by then) loses that pack's records: they are counted 'pack not
  written', and the error says how many beyond its cause's. Before, that seal's failure was
  dropped with the records it discarded, which were then neither in the store nor counted.
* An error while a slot is cut into records (a view that fails; on CUDA the slot's event
  failing its wait) fails the drain like a failed write: what of the slot was not handed to the
  writer is counted 'drain failed'. Before, the rest of that slot was dropped uncounted.

The ledger (what the ring handed the drain, the keys it counted lost) is
tests/test_drain_failure_staged.py's.
"""

from __future__ import annotations

import os

import pytest

import dmi.capture._drain as drain_module
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, verify_pack
from tests.test_drain_failure_staged import (
    FIRST_DECODE_APPEND,
    _assert_drain_failed,
    _assert_every_position_accounted,
    _capture,
    _counted_by_reason,
    _reasons,
)
from tests.test_full_disk import _fill, small_disk  # noqa: F401 - small_disk is a fixture


def test_a_seal_that_fails_after_the_drain_failed_counts_the_records_it_lost(small_disk, tmp_path):
    """The second failure is a real full disk (a 2 MiB tmpfs, filled as the first failure
    happens): the flush that reaches the failure cannot seal the open pack, ENOSPC from write(2)
    discarding it with the records it held, written before the failure. The first failure is a
    stand-in, an append that raises and discards nothing (the pack directory replaced by a
    file): a full disk cannot be it, since a failed pack write discards the open pack and leaves
    the second seal nothing to lose."""
    store = LocalPackStore(small_disk / "packs")
    failed_at: list[int] = []

    def fill_the_disk_and_fail(cap):
        append, calls = cap.drain.writer.append, []

        def append_or_fail(key, *args, **kwargs):
            calls.append(key)
            if len(calls) == FIRST_DECODE_APPEND + 4:
                _fill(small_disk, 0)
                failed_at.append(len(calls))
                raise OSError("pack directory replaced by a file")
            return append(key, *args, **kwargs)
        cap.drain.writer.append = append_or_fail

    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, ledger, error = _capture(store, catalog, fail=fill_the_disk_and_fail)
        losses = catalog.losses(model_id="m").to_pylist()
    assert failed_at == [FIRST_DECODE_APPEND + 4]
    assert str(error.__cause__) == "pack directory replaced by a file"
    assert os.statvfs(small_disk).f_bavail == 0  # the seal's write(2) found the disk full
    _assert_every_position_accounted(store, ledger)
    reasons = _reasons(ledger)
    # packs of 6: the 18 prefill records sealed whole; the open pack held the 4 decode records before the failure
    assert reasons["pack not written"] == cap.stats["records"] - len(_stored_keys(store)) == 4
    # and the step the error cut short, where it surfaced in the middle of one
    assert set(reasons) - {"step interrupted"} == {"pack not written", "drain failed"}
    assert _counted_by_reason(losses) == reasons
    assert cap.stats["records_lost"] == len(ledger.lost)
    assert ("; 4 more record(s) were lost with pack(s) whose write failed after it (records_lost, and the "
            "catalog's losses where it answers: reason 'pack not written')") in str(error)
    assert str(error).endswith(f"; {reasons['drain failed']} record(s) it had not written yet are counted as lost "
                               "(records_lost, and the catalog's losses where it answers: reason 'drain failed')")


def _stored_keys(store) -> list:
    return [entry.meta.key for pack_id in store.list_packs() for entry in verify_pack(store, pack_id).records]


# -- a slot that fails while it is cut. The fakes are needed: on the CPU a slot has no event to
# wait (on CUDA, ``event.synchronize()`` raises an asynchronous CUDA error), and the views that cut
# a slot do not fail on their own; the failures are injected where the drain cuts.

class _FailingEvent:
    """A slot's CUDA event whose wait fails, as after an illegal memory access in the model."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _event_fails_on_slot(n: int):
    """Break the ``n``-th slot handed to the drain: waiting its event fails."""
    def fail(cap):
        submit, slots = cap.ring._on_submit, []

        def submit_with_a_failing_event(slot):
            slots.append(slot)
            if len(slots) == n:
                slot.event = _FailingEvent()
            submit(slot)
        cap.ring._on_submit = submit_with_a_failing_event
    return fail


class _CutFails:
    """A hook's spec whose ``token_shape`` (the drain's cut of rows into records) raises on the
    ``at``-th call counted in ``calls``, shared by every hook."""

    def __init__(self, spec, calls: list, at: int):
        self.spec, self.calls, self.at = spec, calls, at

    def token_shape(self, *args):
        self.calls.append(None)
        if len(self.calls) == self.at:
            raise RuntimeError("cannot view the rows")
        return self.spec.token_shape(*args)

    def __getattr__(self, name):
        return getattr(self.spec, name)


def _cut_fails_at(monkeypatch, at: int):
    """Break the drain's ``at``-th cut of rows into records (:class:`_CutFails`)."""
    calls: list = []
    hooks = {name: _CutFails(spec, calls, at) for name, spec in drain_module.HOOKS.items()}

    def fail(cap):
        monkeypatch.setattr(drain_module, "HOOKS", hooks)
    return fail


# token_shape calls: each call's prefill cuts 2 hooks x 3 layers (calls 1-6), then every 4 decode
# steps the staged rows of each hook and layer (calls 7-12 for the first 4 steps)
@pytest.mark.parametrize(("name", "at"), [("prefill entry", 4), ("staged decode rows", 9)])
def test_a_failure_cutting_a_slot_counts_the_rest_of_it(tmp_path, monkeypatch, name, at):
    store = LocalPackStore(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, ledger, error = _capture(store, catalog, fail=_cut_fails_at(monkeypatch, at))
        losses = catalog.losses(model_id="m").to_pylist()
    assert str(error.__cause__) == "cannot view the rows"
    _assert_every_position_accounted(store, ledger)
    _assert_drain_failed(cap, ledger, losses, error)


def test_a_slot_whose_event_fails_is_counted_whole(tmp_path):
    """The second slot's event fails its wait: none of that slot is written, all of it counted."""
    store = LocalPackStore(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, ledger, error = _capture(store, catalog, fail=_event_fails_on_slot(2))
        losses = catalog.losses(model_id="m").to_pylist()
    assert str(error.__cause__) == "CUDA error: an illegal memory access was encountered"
    _assert_every_position_accounted(store, ledger)
    _assert_drain_failed(cap, ledger, losses, error)
