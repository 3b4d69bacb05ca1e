"""The read planner predicts exactly the range reads that read_records issues."""

import dataclasses

import pytest
import torch

from dmi.storage import PackStore, PackWriter, RecordKey
from dmi.storage.records import ByteRange, RecordEntry
from dmi.reader import FooterCache, PlannedRead, plan_reads, read_by_key, find_record, read_records
from dmi.storage import RecordNotFoundError, DuplicateChunkError


class CountingStore:
    """Wraps a store; records every (pack_id, offset, length) read issued through it."""

    def __init__(self, store):
        self._store = store
        self.reads = []
        self.opens = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def open_input(self, pack_id, **options):
        self.opens += 1
        source = self._store.open_input(pack_id, **options)
        inner = source.read_into
        reads = self.reads

        def read_into(offset, out):
            reads.append((pack_id, offset, memoryview(out).nbytes))
            return inner(offset, out)

        source.read_into = read_into
        return source


def key(layer, start=0, request="req"):
    return RecordKey("model", "run", request, "resid_post", layer, start, 16)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    store = PackStore.local(tmp_path_factory.mktemp("plan"))
    tensors, entries = {}, []
    for p in range(2):
        with PackWriter(store, codec="raw", batch_bytes=1) as w:
            for layer in range(6):
                t = torch.full((16, 64 * (layer + 1)), p * 100 + layer, dtype=torch.float32)
                w.append(key(layer, request=f"r{p}"), t)
                tensors[(p, layer)] = t
            w.append(key(99, request=f"r{p}"), torch.empty(0, 3))
            entries.extend(w.seal().records)
    return store, entries, tensors


@pytest.mark.parametrize("max_gap", [0, 100, 10_000, 1 << 40])
@pytest.mark.parametrize("pick", ["all", "odd", "reversed", "dup", "one"])
def test_plan_matches_reads(packs, max_gap, pick):
    store, entries, tensors = packs
    chosen = {
        "all": entries,
        "odd": entries[1::2],
        "reversed": entries[::-1],
        "dup": [entries[2], entries[2], entries[3]],
        "one": [entries[4]],
    }[pick]
    plan = plan_reads(chosen, max_gap=max_gap)
    counting = CountingStore(store)
    got = read_records(counting, chosen, max_gap=max_gap)
    assert counting.reads == [(p.pack_id, p.range.offset, p.range.length) for p in plan]
    for e, t in zip(chosen, got):
        if e.payload.length:
            assert torch.equal(t, tensors[(int(e.meta.key.request_id[1:]), e.meta.key.layer)])
        else:
            assert t.shape == (0, 3)
    served = sorted(i for p in plan for i in p.members)
    assert served == [i for i, e in enumerate(chosen) if e.payload.length]


def test_coalescing_rules():
    def entry(pack, off, n):
        meta = None
        return RecordEntry(meta=meta, pack_id=pack, payload=ByteRange(off, n))

    es = [entry("b", 0, 10), entry("a", 100, 10), entry("a", 0, 10), entry("a", 15, 5), entry("a", 12, 20), entry("a", 60, 0)]
    assert plan_reads(es, max_gap=5) == [
        PlannedRead("a", ByteRange(0, 32), (2, 4, 3)),
        PlannedRead("a", ByteRange(100, 10), (1,)),
        PlannedRead("b", ByteRange(0, 10), (0,)),
    ]
    assert plan_reads(es, max_gap=1) == [
        PlannedRead("a", ByteRange(0, 10), (2,)),
        PlannedRead("a", ByteRange(12, 20), (4, 3)),
        PlannedRead("a", ByteRange(100, 10), (1,)),
        PlannedRead("b", ByteRange(0, 10), (0,)),
    ]
    assert plan_reads(es, max_gap=68) == [
        PlannedRead("a", ByteRange(0, 110), (2, 4, 3, 1)),
        PlannedRead("b", ByteRange(0, 10), (0,)),
    ]
    with pytest.raises(ValueError):
        plan_reads(es, max_gap=-1)


def test_one_open_per_pack(packs):
    store, entries, _ = packs
    counting = CountingStore(store)
    read_records(counting, entries, max_gap=0)
    assert counting.opens == 2


def test_raw_records_are_views_of_the_read_buffer(packs):
    store, entries, _ = packs
    a, b = read_records(store, entries[:2], max_gap=1 << 20)
    assert entries[0].pack_id == entries[1].pack_id and entries[0].meta.codec == entries[1].meta.codec == "raw"
    # one range read, no copy: the records sit in the read buffer as far apart as in the pack
    assert b.data_ptr() - a.data_ptr() == entries[1].payload.offset - entries[0].payload.offset


def test_read_by_key_with_warm_footer(packs):
    store, entries, tensors = packs
    cache = FooterCache()
    counting = CountingStore(store)
    e = entries[3]
    assert torch.equal(read_by_key(counting, e.pack_id, e.meta.key, cache=cache), tensors[(0, 3)])
    footer_reads = len(counting.reads)
    counting.reads.clear()
    assert torch.equal(read_by_key(counting, e.pack_id, e.meta.key, cache=cache), tensors[(0, 3)])
    assert counting.reads == [(e.pack_id, e.payload.offset, e.payload.length)]  # warm: one read
    assert footer_reads == 1  # cold: the record only; the footer went through pyarrow
    with pytest.raises(RecordNotFoundError, match="layer 42"):
        find_record(store, e.pack_id, key(42, request="r0"), cache=cache)


def test_duplicate_keys_in_one_pack(tmp_path):
    store = PackStore.local(tmp_path)
    with PackWriter(store) as w:
        w.append(key(0), torch.zeros(2))
        w._pack.keys.discard(key(0))  # a pack written before the writer refused duplicate keys
        w.append(key(0), torch.ones(2))
        desc = w.seal()
    with pytest.raises(DuplicateChunkError):
        find_record(store, desc.pack_id, key(0))
    got = read_records(store, desc.records, cache=FooterCache())
    assert [t.tolist() for t in got] == [[0.0, 0.0], [1.0, 1.0]]
    stale = dataclasses.replace(desc.records[0], payload=desc.records[1].payload)
    with pytest.raises(Exception, match="stale"):
        read_records(store, [stale], cache=FooterCache())
