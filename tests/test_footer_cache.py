"""FooterCache: LRU by count and bytes, recency on hit, oversize refused, thread-safe."""

import dataclasses
import math
import sys
import threading
import time
from collections import OrderedDict

import pytest
import torch

from dmi.storage import InvalidArgumentError, PackStore, PackWriter, RecordKey
from dmi.reader import FooterCache, load_footer, read_record, read_records
from dmi.storage.errors import PackCorruptError


def test_count_bound_evicts_least_recent():
    c = FooterCache(max_entries=3, max_bytes=1000)
    for k in "abc":
        c.put(k, k.upper(), 1)
    assert c.get("a") == "A"  # a is now the most recent
    c.put("d", "D", 1)
    assert c.keys() == ["c", "a", "d"]
    assert "b" not in c and len(c) == 3
    assert c.stats().evictions == 1


def test_byte_bound_evicts_until_it_fits():
    c = FooterCache(max_entries=100, max_bytes=100)
    c.put("a", 1, 40)
    c.put("b", 2, 40)
    c.get("a")
    c.put("c", 3, 30)  # 110 > 100: evict b (least recent), not a
    assert c.keys() == ["a", "c"] and c.nbytes == 70


def test_oversized_entry_not_admitted():
    c = FooterCache(max_entries=10, max_bytes=100)
    c.put("small", 1, 10)
    assert c.put("huge", 2, 101) is False
    assert c.keys() == ["small"] and c.nbytes == 10 and c.stats().rejected == 1
    assert c.put("exact", 3, 90) is True and c.nbytes == 100


def test_replacing_a_key_updates_bytes():
    c = FooterCache(max_entries=10, max_bytes=100)
    c.put("a", 1, 60)
    c.put("a", 2, 30)
    assert c.get("a") == 2 and c.nbytes == 30 and len(c) == 1
    c.put("a", 3, 500)  # oversized replacement drops the old value too
    assert "a" not in c and c.nbytes == 0


def test_hit_and_miss_counters_and_get_or_load():
    c = FooterCache()
    calls = []
    load = lambda: (calls.append(1) or "v", 5)  # noqa: E731
    assert c.get_or_load("k", load) == "v"
    assert c.get_or_load("k", load) == "v"
    assert len(calls) == 1
    s = c.stats()
    assert (s.hits, s.misses, s.entries, s.nbytes) == (1, 1, 1, 5)
    c.discard("k")
    c.clear()
    assert len(c) == 0


def test_defaults_and_validation():
    c = FooterCache()
    assert (c.max_entries, c.max_bytes) == (128, 64 * 1024 * 1024)
    with pytest.raises(InvalidArgumentError):
        FooterCache(max_entries=0)


@pytest.fixture
def fast_switching():
    """Make the interpreter switch threads as often as it can, so races show up."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class _YieldingDict(OrderedDict):
    """Gives up the GIL inside each mutation, so unsynchronised callers interleave."""

    def __setitem__(self, key, value):
        time.sleep(0)
        super().__setitem__(key, value)

    def popitem(self, last=True):
        time.sleep(0)
        return super().popitem(last)


def test_thread_safety_invariants(fast_switching):
    c = FooterCache(max_entries=50, max_bytes=5000)
    c._items = _YieldingDict()
    errors = []

    def work(t):
        try:
            for i in range(5_000):
                k = (t * 7 + i) % 200
                if c.get(k) is None:
                    c.put(k, k, 1 + k % 97)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    keys = c.keys()
    assert len(keys) <= 50 and c.nbytes == sum(1 + k % 97 for k in keys) <= 5000


def test_footers_cached_per_store_and_pack(tmp_path):
    store = PackStore.local(tmp_path)
    with PackWriter(store) as w:
        w.append(RecordKey("m", "r", "q", "h", 0, 0, 1), torch.ones(1))
        desc = w.seal()
    c = FooterCache()
    footer = load_footer(store, desc.pack_id, cache=c)
    assert footer.descriptor == desc and footer.nbytes > 0
    assert load_footer(store, desc.pack_id, cache=c) is footer
    assert c.keys() == [(store.uri, desc.pack_id)]
    read_record(store, desc.records[0], cache=c)
    assert c.stats().hits == 2


@pytest.mark.parametrize(
    "values",
    [[[1.0, float("nan")], [2.0, 3.0]], [[float("inf"), 1.0], [float("-inf"), 2.0]]],
    ids=["nan", "both-infinities"],
)
def test_records_with_nan_statistics_read_through_the_cache(tmp_path, values):
    """NaN in the values makes the statistics NaN (both infinities make the mean NaN); the
    check of an entry against its pack's own index must still find it (NaN != NaN)."""
    store = PackStore.local(tmp_path)
    original = torch.tensor(values)
    with PackWriter(store) as w:
        w.append(RecordKey("m", "r", "q", "h", 0, 0, 2), original)
        entry = w.seal().records[0]
    assert math.isnan(entry.meta.stats.mean)
    cache = FooterCache()
    assert read_record(store, entry, cache=cache).view(torch.int32).equal(original.view(torch.int32))
    (back,) = read_records(store, [entry], cache=cache)
    assert back.view(torch.int32).equal(original.view(torch.int32))


def test_an_entry_the_pack_does_not_list_is_refused_through_the_cache(tmp_path):
    store = PackStore.local(tmp_path)
    with PackWriter(store) as w:
        w.append(RecordKey("m", "r", "q", "h", 0, 0, 2), torch.tensor([[1.0, float("nan")], [2.0, 3.0]]))
        entry = w.seal().records[0]
    moved = dataclasses.replace(entry, payload=dataclasses.replace(entry.payload, offset=entry.payload.offset + 8))
    with pytest.raises(PackCorruptError, match="does not match the pack's own index"):
        read_records(store, [moved], cache=FooterCache())
