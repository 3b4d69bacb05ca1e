"""A drain that fails never drops a record without counting it: every token position the model
handed to the drain — of decode rows it held staged (``decode_chunk_steps > 1``), of the slot it
failed in, of the slots handed to it afterwards — is either in a pack in the store or counted
as lost with a reason (``records_lost``, the catalog's losses, the error's message).

The positions produced are what the ring handed the drain (each slot's entries, by request,
hook, layer and position); the positions stored are those of every pack in the store; the
positions lost those of the keys the drain counted (the catalog's losses count records)."""

from __future__ import annotations

import collections
import os
import threading

import pyarrow as pa
import pytest

from dmi.capture import attach
from dmi.capture._hooks import HOOKS
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, verify_pack
from dmi.storage.errors import DrainError, PackSealError
from dmi.storage.errors import RequestExistsError, RingFullError
from tests._models import MemoryWriter, left_padded_batch, tiny

HOOK_NAMES = "resid_post mlp_out"
FIRST_DECODE_APPEND = 3 * 2 * 3 + 1  # after the prefill's records: 3 requests x 2 hooks x 3 layers


class _FullAfter(LocalPackStore):
    """A store whose disk is full after ``packs`` packs: every later pack body goes to
    /dev/full (a real ENOSPC from write(2))."""

    def __init__(self, root, packs: int):
        super().__init__(root)
        self.packs = packs
        self.created = 0

    def create(self, pack_id):
        sink = super().create(pack_id)
        self.created += 1
        if self.created > self.packs:
            sink.stream.close()
            os.unlink(sink.temp_path)
            sink.stream = pa.OSFile("/dev/full", "wb")
        return sink


def _positions(key) -> list[tuple]:
    return [(key.request_id, key.hook, key.layer, p) for p in range(key.start_token, key.start_token + key.n_tokens)]


class _Ledger:
    """What the ring handed the drain, and the keys the drain counted as lost (with reasons)."""

    def __init__(self, cap):
        self.produced: collections.Counter = collections.Counter()
        self.lost: list = []
        submit, record_losses = cap.ring._on_submit, cap.drain._record_losses

        def counting_submit(slot):
            for e in slot.entries:
                spans = e.plan.spans if HOOKS[e.hook].key_axis is None else (e.plan.spans[e.span_index],)
                for s in spans:
                    self.produced.update((s.request_id, e.hook, e.layer, p) for p in range(s.start, s.start + s.n))
            submit(slot)

        def counting_losses(keys):
            self.lost.extend(keys)
            if record_losses is not None:  # a session without a catalog keeps no losses table
                record_losses(keys)

        def counting_drops(hook, layer, plan, *args):
            self.produced.update((s.request_id, hook, layer, p) for s in plan.spans for p in range(s.start, s.start + s.n))
            note_loss(hook, layer, plan, *args)

        note_loss = cap.drain.note_loss
        cap.ring._on_submit = counting_submit
        cap.drain._record_losses = counting_losses
        cap.drain.note_loss = counting_drops

    def lost_positions(self) -> collections.Counter:
        return collections.Counter(p for key, _ in self.lost for p in _positions(key))


def _stored_positions(store) -> collections.Counter:
    return collections.Counter(p for pack_id in store.list_packs()
                               for entry in verify_pack(store, pack_id).records for p in _positions(entry.meta.key))


def _capture(store, catalog, *, fail=None, calls: int = 3, encode_threads: int = 1):
    """Generate ``calls`` times (8 decode steps each, staged 4 at a time) until the drain fails;
    ``fail(cap)`` breaks something once attached."""
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with pytest.raises(DrainError) as raised:
        with attach(model, hooks=HOOK_NAMES, store=store, catalog=catalog, model_id="m", decode_chunk_steps=4,
                    writer_options={"max_records": 6, "codec": "raw"}, encode_threads=encode_threads) as cap:
            ledger = _Ledger(cap)
            if fail is not None:
                fail(cap)
            for _ in range(calls):
                cap.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    return cap, ledger, raised.value


def _reasons(ledger: _Ledger) -> collections.Counter:
    """The records the drain counted lost, by reason."""
    return collections.Counter(reason for _, reason in ledger.lost)


def _counted_by_reason(losses) -> collections.Counter:
    """The catalog's losses, summed by reason."""
    counted: collections.Counter = collections.Counter()
    for row in losses:
        counted[row["reason"]] += row["count"]
    return counted


def _assert_drain_failed(cap, ledger: _Ledger, losses, error, *, also=frozenset()) -> collections.Counter:
    """The drain counted its lost records 'drain failed' (and ``also``'s reasons), in
    ``records_lost``, the catalog's losses and the error's message; returns the counts by reason.

    The drain's error surfaces on the model thread at the start of its next step or in the
    middle of one, as the two threads race; in the middle, the step it cut short is counted
    'step interrupted' too (tests/test_interrupted_capture.py), a count the error, raised
    before it, does not hold."""
    reasons = _reasons(ledger)
    assert reasons["drain failed"] > 0
    assert set(reasons) - {"step interrupted"} == {"drain failed", *also}
    assert _counted_by_reason(losses) == reasons
    assert cap.stats["records_lost"] == len(ledger.lost)
    assert (f"; {reasons['drain failed']} record(s) it had not written yet are counted as lost (records_lost, "
            "and the catalog's losses where it answers: reason 'drain failed')") in str(error)
    return reasons


def _assert_every_position_accounted(store, ledger: _Ledger) -> None:
    stored, lost = _stored_positions(store), ledger.lost_positions()
    assert stored + lost == ledger.produced  # each position once: stored, or counted lost
    assert set(stored).isdisjoint(lost)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("encode_threads", [1, 2])
@pytest.mark.parametrize("packs", [1, 2, 5])
def test_a_full_disk_loses_no_staged_row_uncounted(tmp_path, packs, encode_threads):
    """Also with two encoding threads: appends after the failing one may open a pack of their
    own, whose seal fails too (its records counted 'pack not written' as well)."""
    store = _FullAfter(tmp_path / "packs", packs)
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, ledger, error = _capture(store, catalog, encode_threads=encode_threads)
        losses = catalog.losses(model_id="m").to_pylist()
    assert isinstance(error.__cause__, PackSealError)
    _assert_every_position_accounted(store, ledger)
    reasons = collections.Counter()
    for key, reason in ledger.lost:
        reasons[reason] += 1
    # and the step the error cut short, where it surfaced in the middle of one
    assert {r["reason"] for r in losses} == set(reasons) <= {"pack not written", "drain failed", "step interrupted"}
    assert reasons["pack not written"] > 0  # 'drain failed' where the drain held records the failure did not discard
    assert cap.stats["records_lost"] == len(ledger.lost) == sum(r["count"] for r in losses)
    tail = (f"; {reasons['drain failed']} record(s) it had not written yet are counted as lost "
            "(records_lost, and the catalog's losses where it answers: reason 'drain failed')")
    assert str(error).endswith(tail) if reasons["drain failed"] else "not written yet" not in str(error)


def test_a_failed_append_loses_the_rest_of_its_slot_and_the_staged_rows_counted(tmp_path):
    """An append that fails with no pack discarded (nothing in its ``lost_keys``): that record,
    the rest of the slot and the staged rows are each counted, reason 'drain failed'."""
    store = LocalPackStore(tmp_path / "packs")

    def fail_in_the_first_decode_chunk(cap):
        append, calls = cap.drain.writer.append, []

        def append_or_fail(key, *args, **kwargs):
            calls.append(key)
            if len(calls) >= FIRST_DECODE_APPEND + 4:  # the others' rows are still staged
                raise OSError("pack directory replaced by a file")
            return append(key, *args, **kwargs)
        cap.drain.writer.append = append_or_fail

    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, ledger, error = _capture(store, catalog, fail=fail_in_the_first_decode_chunk)
        losses = catalog.losses(model_id="m").to_pylist()
    _assert_every_position_accounted(store, ledger)
    _assert_drain_failed(cap, ledger, losses, error)


def test_a_catalog_that_fails_leaves_the_staged_rows_counted(tmp_path):
    """The catalog refuses every publish after the first call (6 decode steps: 2 still staged as
    it returns): the packs stay in the store unpublished, and what the drain held then, or was
    handed after, is counted as lost in ``records_lost``, the catalog's losses and the error."""
    store = LocalPackStore(tmp_path / "packs")
    gone = threading.Event()
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError, match="catalog gone") as raised:
            with attach(model, hooks=HOOK_NAMES, store=store, catalog=catalog, model_id="m", decode_chunk_steps=4,
                        writer_options={"max_records": 6, "codec": "raw"}) as cap:
                ledger = _Ledger(cap)
                cap.drain._publish = _refusing_once_gone(cap.drain._publish, gone)
                for _ in range(3):
                    cap.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
                    gone.set()
        losses = catalog.losses(model_id="m").to_pylist()
    _assert_every_position_accounted(store, ledger)
    assert {reason for _, reason in ledger.lost} == {r["reason"] for r in losses} <= {"drain failed", "step interrupted"}
    assert cap.stats["records_lost"] == len(ledger.lost) == sum(r["count"] for r in losses)
    counted = f"{len(ledger.lost)} record(s) it had not written yet are counted as lost"
    assert counted in str(raised.value) if ledger.lost else "not written yet" not in str(raised.value)


def _refusing_once_gone(publish, gone: threading.Event):
    """``publish`` until ``gone`` is set, then a catalog that is gone."""
    def publish_or_refuse(batch):
        if gone.is_set():
            raise ConnectionError("catalog gone")
        return publish(batch)
    return publish_or_refuse


# -- the drain held in a write (a writer of the tests, no storage): no timer decides what is staged

GATE_S = 30  # bounds a wait that the test ends by opening the gate; never reached when it passes
HELD_AT = 10  # 9 prefill records (3 requests x 3 layers), then the first decode chunk: rows staged


class _HeldWriter(MemoryWriter):
    """Holds the drain in its ``HELD_AT``-th append (``held`` set) until ``gate`` opens; that
    append then fails (``fail``) or is written."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail, self.calls = fail, 0
        self.held, self.gate = threading.Event(), threading.Event()

    def append(self, key, data, *, shard=None, token_axis=0, key_axis=None):  # no codec=: never switched
        self.calls += 1
        if self.calls == HELD_AT:
            self.held.set()
            self.gate.wait(GATE_S)
            if self.fail:
                raise OSError("pack directory replaced by a file")
        super().append(key, data, shard=shard, token_axis=token_axis, key_axis=key_axis)


def _written_positions(writer: MemoryWriter) -> collections.Counter:
    return collections.Counter(p for key, _, _ in writer.records for p in _positions(key))


def _run(**options):
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    return attach(model, hooks="resid_post", ring_slots=1, slot_bytes=1024, decode_chunk_steps=4, **options), ids, mask


def test_drops_after_the_drain_failed_are_counted_with_the_staged_rows():
    """``drop_policy="drop"``: the tensors dropped while the drain was held are counted 'ring
    full' also where the drain failed before it reached them; the staged rows and the slots after
    the failure are counted 'drain failed'."""
    writer = _HeldWriter(fail=True)
    ctx, ids, mask = _run(writer=writer, drop_policy="drop")
    try:
        with pytest.raises(DrainError, match="pack directory replaced by a file"):
            with ctx as cap:
                ledger = _Ledger(cap)
                cap.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
                assert writer.held.is_set()
                writer.gate.set()
    finally:
        writer.gate.set()
    stored, lost = _written_positions(writer), ledger.lost_positions()
    assert stored + lost == ledger.produced and set(stored).isdisjoint(lost)
    assert {reason for _, reason in ledger.lost} == {"ring full", "drain failed"}
    assert cap.stats["records_lost"] == len(ledger.lost)


def test_rows_staged_when_the_ring_times_out_are_written():
    writer = _HeldWriter(fail=False)
    ctx, ids, mask = _run(writer=writer, ring_timeout=0.1)
    try:
        with ctx as cap:
            ledger = _Ledger(cap)
            with pytest.raises(RingFullError):
                cap.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
            writer.gate.set()
    finally:
        writer.gate.set()
    assert _written_positions(writer) + ledger.lost_positions() == ledger.produced
    interrupted = {(key.request_id, key.hook, key.layer) for key, reason in ledger.lost if reason == "step interrupted"}
    assert {reason for _, reason in ledger.lost} == {"step interrupted"}  # the step the timeout cut short, whole
    assert len(interrupted) == len(ledger.lost) == cap.stats["records_lost"] == 3 * 3  # requests x layers


def test_rows_staged_when_another_thread_closes_the_session_are_written():
    writer = _HeldWriter(fail=False)
    ctx, ids, mask = _run(writer=writer, ring_timeout=GATE_S)
    cap = ctx.__enter__()
    ledger = _Ledger(cap)
    call = threading.Thread(target=cap.generate, args=(ids,), kwargs={"attention_mask": mask, "max_new_tokens": 9,
                                                                      "do_sample": False})
    call.start()
    try:
        assert writer.held.wait(GATE_S)
        closer = threading.Thread(target=ctx.__exit__, args=(None, None, None))
        closer.start()
    finally:
        writer.gate.set()
    call.join(GATE_S)
    closer.join(GATE_S)
    assert not call.is_alive() and not closer.is_alive()
    assert _written_positions(writer) == ledger.produced
    assert sum(1 for key, _, _ in writer.records if key.phase == "decode") == 3 * 3 * 2  # 8 steps: 2 records of 4
    assert cap.stats["records_lost"] == 0 and ledger.lost == []


def test_rows_staged_when_a_request_id_is_refused_are_written():
    """A call refused (its request ids hold records) between two calls: the first call's staged
    rows (6 decode steps, 4 a record) are written all the same."""
    writer = MemoryWriter()
    ctx, ids, mask = _run(writer=writer)
    with ctx as cap:
        ledger = _Ledger(cap)
        cap.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, request_ids=["a", "b", "c"])
        with pytest.raises(RequestExistsError):
            cap.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, request_ids=["c", "d", "e"])
        cap.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, request_ids=["d", "e", "f"])
    assert _written_positions(writer) == ledger.produced
    assert {key.request_id for key, _, _ in writer.records} == set("abcdef")
    assert cap.stats["records_lost"] == 0 and ledger.lost == []
