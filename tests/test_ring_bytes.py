"""The ring holds bytes, not steps; the drain switches to a cheaper codec when it falls behind.

Each test fails with its guard removed (checked once, see the report of the change):
the step-end hand-over rule, the open slot kept open when a tensor is dropped, the drain
check at the start of a step, the adaptive codec choice and the writer's codec check.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dmi.capture import Ring, attach
from dmi.capture._ring import Entry
from dmi.reader import assemble, read_records
from dmi.storage import PackStore, PackWriter, RecordKey
from dmi.storage.errors import DrainError, InvalidArgumentError, RingFullError

from ._models import MemoryWriter, left_padded_batch, tiny


class GatedPackWriter(PackWriter):
    """A real pack writer whose appends wait for ``gate``. It holds the drain thread the way a
    slow lease acquisition or a slow disk does — a stand-in, because real slowness cannot be
    produced on demand, and an event (not a sleep) makes every interleaving deterministic."""

    def __init__(self, store, **options):
        super().__init__(store, **options)
        self.gate = threading.Event()
        self.entered = threading.Event()  # the drain has taken its first slot and reached an append

    def append(self, key, data, **kwargs):
        self.entered.set()
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        super().append(key, data, **kwargs)


class GatedFailingWriter(MemoryWriter):
    """Holds the drain on ``gate``, then fails: a drain error while the open slot still has room."""

    def __init__(self):
        super().__init__(fail_after=0)
        self.gate = threading.Event()

    def append(self, key, data, *, shard=None, token_axis=0, key_axis=None):
        self.gate.wait(60)
        super().append(key, data, shard=shard, token_axis=token_axis, key_axis=key_axis)


def _step(ring: Ring, *sizes: int) -> None:
    """One model step as the session runs it: reserve and note each tensor, then end the step."""
    for n in sizes:
        slot, offset = ring.reserve(n)
        slot.entries.append(Entry("resid_post", 0, offset, n, torch.uint8, n, plan=None))
    ring.end_step()


# -- the ring's own accounting --------------------------------------------------------------------
def test_steps_share_a_slot_while_the_drain_holds_two():
    ring = Ring(4, 256, pin=False)
    handed: list = []
    ring.connect(handed.append)
    _step(ring, 32)
    _step(ring, 32)  # the drain holds 0, then 1 slot: each step end hands the open slot over
    assert len(handed) == 2 and ring.in_flight == 2
    _step(ring, 32)
    _step(ring, 32)
    _step(ring, 32)  # the drain holds 2: the next steps share one slot
    assert len(handed) == 2
    assert (ring.stats.steps, ring.stats.steps_packed, ring.stats.submitted_slots) == (5, 3, 2)
    ring.release(handed[0])  # the drain caught up: the next step end hands the shared slot over
    _step(ring, 32)
    assert len(handed) == 3 and ring.stats.steps_packed == 3
    shared = handed[2]
    assert shared.used == 128 and [e.offset for e in shared.entries] == [0, 32, 64, 96]
    assert ring.fill == (32 + 128) / (4 * 256)
    ring.release(handed[1])
    ring.release(shared)
    assert ring.fill == 0 and ring.in_flight == 0


def test_a_tensor_larger_than_the_free_bytes_is_dropped_and_counted_a_smaller_one_still_fits():
    ring = Ring(3, 256, pin=False, drop_policy="drop")
    handed: list = []
    ring.connect(handed.append)
    _step(ring, 200)
    _step(ring, 200)
    _step(ring, 100)  # two slots at the drain, the third open with 144 bytes free
    assert ring.reserve(200) is None  # fits neither the open slot nor a free one
    assert (ring.stats.dropped_tensors, ring.stats.dropped_bytes) == (1, 208)
    slot, offset = ring.reserve(48)  # the open slot stayed open: this one fits and is kept
    assert (slot.index, offset) == (handed[-1].index + 1, 112) and len(handed) == 2
    ring.release(handed[0])
    slot, offset = ring.reserve(200)  # a slot is free again: the full one goes to the drain
    assert (slot.index, offset) == (handed[0].index, 0) and len(handed) == 3
    assert ring.stats.dropped_tensors == 1


def test_a_tensor_larger_than_the_free_bytes_waits_with_the_open_slot_at_the_drain():
    ring = Ring(3, 256, pin=False, timeout=0.0)
    handed: list = []
    ring.connect(handed.append)
    _step(ring, 200)
    _step(ring, 200)
    _step(ring, 100)
    with pytest.raises(RingFullError, match="no free ring slot"):
        ring.reserve(200)
    assert len(handed) == 3 and handed[2].used == 112  # handed over before waiting, so it can be freed
    assert (ring.stats.waits, ring.stats.dropped_tensors) == (1, 0)


# -- the capture session --------------------------------------------------------------------------
def test_a_forward_and_an_8_token_generate_drop_nothing_with_the_default_ring(store_and_catalog):
    """The drain is held from its first record to the end (as while it acquires its lease):
    the default ring absorbs all nine steps, and every record is read back bit-exact."""
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_hidden_states=True)
    w = GatedPackWriter(store)
    try:
        with attach(model, hooks="all_but_patterns", writer=w, catalog=catalog, model_id="m-ring",
                    drop_policy="drop") as cap:
            rids, _ = cap.forward(ids, attention_mask=mask)
            _, out = cap.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False, return_dict_in_generate=True)
            held = dict(cap.stats)
            w.gate.set()
    finally:
        w.gate.set()
    assert out.sequences.shape[1] == ids.shape[1] + 8
    assert held["tensors_dropped"] == 0 and held["bytes_dropped"] == 0
    assert (held["slots_submitted"], held["steps_packed"]) == (2, 7)  # 9 steps: 2 slots + 1 shared
    assert cap.stats["records_lost"] == 0 and catalog.losses(model_id="m-ring").to_pylist() == []
    assert cap.stats["records"] == len(catalog.find_records("m-ring")) > 0
    for i, rid in enumerate(rids):
        entries = catalog.find_records("m-ring", request_id=rid, hook="resid_post")
        got = assemble(entries, read_records(store, entries))
        for layer in range(model.config.num_hidden_layers - 1):  # the last hidden state is normed
            assert torch.equal(got[layer], ref.hidden_states[layer + 1][i, pads[i]:])


def test_a_failed_drain_stops_the_copies_at_the_next_step_with_room_in_the_open_slot():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = GatedFailingWriter()
    with pytest.raises(DrainError):  # and again at exit
        with attach(model, hooks="resid_post", writer=w) as cap:
            for _ in range(3):  # two slots go to the held drain, the third stays open with room
                cap.forward(ids, attention_mask=mask)
            assert cap.ring._current is not None and cap.ring.stats.steps_packed == 1
            w.gate.set()
            deadline = time.monotonic() + 30
            while (cap.drain.error is None or cap.ring.in_flight) and time.monotonic() < deadline:
                time.sleep(0.01)
            copies = cap.ring.stats.copies
            with pytest.raises(DrainError) as e:
                model(ids, attention_mask=mask)  # a direct forward; its tensors would fit the open slot
            assert isinstance(e.value.__cause__, RuntimeError)
            assert cap.ring.stats.copies == copies  # nothing more was copied


# -- adaptive encoding ----------------------------------------------------------------------------
def test_a_drain_behind_the_model_stores_raw_and_every_record_reads_back_bit_exact(store_and_catalog):
    """Eight slots of 2304 bytes; per layer a prefill tensor is 2176 bytes (17 real tokens x 32
    float32), a decode step 384. The drain is held on its first record until the whole
    generate sits in the ring: then the slots holding prefill layers 1 and 2 are taken with
    the ring 67 % and 56 % full (raw), the rest below half (the writer's split-zstd)."""
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    n_new = 8
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    w = GatedPackWriter(store)
    try:
        with attach(model, hooks="resid_post", writer=w, catalog=catalog, model_id="m-adaptive",
                    ring_slots=8, slot_bytes=2304, decode_chunk_steps=1) as cap:
            # after DMI's own post-hook hands the first step over, the model waits until the drain
            # holds it: however fast the model or slow the lease, the drain reads the fill first here
            first_step = model.register_forward_hook(lambda *_: w.entered.wait(60) and None)
            rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                     do_sample=False, return_dict_in_generate=True)
            first_step.remove()
            cap.ring.submit()  # the last slot too, before the drain moves: every fill it reads is fixed
            assert cap.ring.stats.waits == 0 and cap.ring.fill == 14592 / (8 * 2304)
            w.gate.set()
    finally:
        w.gate.set()
    assert torch.equal(out.sequences, ref.sequences)
    entries = catalog.find_records("m-adaptive")
    raw = sorted((e.meta.key.layer, e.meta.key.phase) for e in entries if e.meta.codec == "raw")
    assert raw == [(1, "prefill")] * 3 + [(2, "prefill")] * 3
    assert {e.meta.codec for e in entries} == {"raw", "split-zstd"}
    assert (cap.stats["codec_switches"], cap.stats["records_fallback_codec"]) == (1, 6)
    steps = ref.hidden_states
    for i, rid in enumerate(rids):
        mine = catalog.find_records("m-adaptive", request_id=rid, hook="resid_post")
        got = assemble(mine, read_records(store, mine))
        for layer in range(model.config.num_hidden_layers - 1):
            want = torch.cat([steps[0][layer + 1][i, pads[i]:]] + [steps[s][layer + 1][i] for s in range(1, n_new)])
            assert torch.equal(got[layer], want), layer


def test_adaptive_codec_off_and_custom_writers_without_codec_keep_one_codec():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    for bad in (0, 1.5, True, "0.5", float("nan")):
        with pytest.raises(InvalidArgumentError, match="adaptive_codec"):
            with attach(model, hooks="resid_post", writer=MemoryWriter(), adaptive_codec=bad):
                pass
    w = MemoryWriter()  # its append takes no codec=: a one-slot ring is always "behind", never switched
    with attach(model, hooks="resid_post", writer=w, ring_slots=1, slot_bytes=1024) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert cap.stats["codec_switches"] == 0 and len(w.records) == cap.stats["records"] > 0


def test_the_writer_stores_a_record_with_the_codec_asked_for_and_refuses_an_unknown_one(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    data = torch.randn(5, 7).to(torch.bfloat16)
    key = RecordKey("model", "run", "req", "resid_post", 0, 0, 5)
    with PackWriter(store) as w:
        with pytest.raises(InvalidArgumentError, match="unknown codec 'lz4'"):
            w.append(key, data, codec="lz4")
        w.append(key, data, codec="raw")
        w.append(RecordKey("model", "run", "req", "resid_post", 1, 0, 5), data)
        desc = w.seal()
    assert [r.meta.codec for r in desc.records] == ["raw", "split-zstd"]
    assert all(torch.equal(t.view(torch.uint16), data.view(torch.uint16)) for t in read_records(store, desc.records))


def test_a_slot_region_is_the_buffer_bytes_at_its_offset_whatever_the_slot_size():
    """``Slot.rows`` views the slot's buffer as whole elements: 1,004 bytes hold 125 float64
    and 4 bytes more, and a view of all of them as float64 would be refused. The region
    written through it is the buffer's bytes at the offset, in order."""
    ring = Ring(1, 1004, pin=False)
    slot, off = ring.reserve(48)
    slot, off = ring.reserve(48)  # a second region, at byte 48
    slot.buffer.zero_()
    values = torch.arange(1, 7, dtype=torch.float64).reshape(2, 3)
    slot.rows(off, torch.float64, 2, 3).copy_(values)
    assert off == 48
    assert torch.equal(slot.buffer[48:96].view(torch.float64), values.reshape(-1))
    assert not slot.buffer[:48].any() and not slot.buffer[96:].any()


def test_a_grown_slot_hands_out_regions_of_its_new_buffer():
    """A tensor larger than a slot grows the slot's buffer; the views cached for the old one
    must go with it, or the copy would land in memory the drain never reads."""
    ring = Ring(1, 64, pin=False)
    slot, off = ring.reserve(32)
    slot.rows(off, torch.float32, 2, 4).fill_(1.0)  # caches a float32 view of the 64-byte buffer
    ring.submit()
    ring.release(slot)
    slot, off = ring.reserve(256)  # does not fit: the slot grows
    assert slot.capacity >= 256 and off == 0
    slot.rows(off, torch.float32, 8, 8).copy_(torch.full((8, 8), 2.0))
    assert torch.equal(slot.buffer[:256].view(torch.float32), torch.full((64,), 2.0))
