"""``store.loader`` with DataLoader workers started by ``spawn``, and the loader as a pickle.

``spawn`` (the default start method on macOS and Windows, and the one CUDA needs) starts
each worker as a fresh interpreter and sends it the dataset pickled, so everything a
loader holds (plan, pack store, options) must pickle and work in another process. Records
are the loader tests' (``tests/test_loader.py``): real packs, a real chDB catalog. The
spawn test is kept to one small epoch: each spawned worker imports torch and DMI anew.
"""

from __future__ import annotations

import pickle
from collections import Counter

import pyarrow.fs as pafs
import pytest
import torch

import dmi
from dmi.storage import FileSystemPackStore, PackWriter
from tests.test_loader import ALL, _write

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    home = tmp_path_factory.mktemp("spawn-home")
    with dmi.open(home=home) as opened:
        descriptors = []
        with PackWriter(opened.packs, max_records=10, on_seal=descriptors.append) as writer:
            _write(writer)
        with opened.catalog.publisher("spawn-test") as publisher:
            publisher.publish(descriptors)
        yield opened


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


def test_spawned_workers_yield_every_row_exactly_once(store):
    """Two spawned workers yield, interleaved, exactly the batches of two single-process ranks."""
    options = dict(layers=[0], batch_size=9, shuffle_buffer=16, with_tokens=True, seed=4)
    got = list(store.loader("m", num_workers=2, multiprocessing_context="spawn", **options))
    assert Counter(t for _, tokens in got for t in tokens) == Counter(ALL)
    ranks = [list(store.loader("m", rank=r, world_size=2, **options)) for r in range(2)]
    interleaved = [b for pair in zip(*ranks) for b in pair] + ranks[0][len(ranks[1]):] + ranks[1][len(ranks[0]):]
    assert _same(got, interleaved)


def test_a_pickled_loader_continues_where_it_stood(store):
    """Over a ``pyarrow.fs`` pack store (the object-storage path): a copy made mid-epoch
    yields the rest of the epoch, as the original does."""
    packs = FileSystemPackStore(pafs.LocalFileSystem(), store.packs.uri.removeprefix("file://"))
    loader = dmi.Store(store.catalog, packs).loader("m", layers=[1], batch_size=6, shuffle_buffer=10,
                                                    with_tokens=True, seed=8)
    batches = iter(loader)
    head = [next(batches), next(batches)]
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.state_dict() == loader.state_dict()
    rest = list(copy)
    assert _same(rest, list(batches))
    assert Counter(t for _, tokens in head + rest for t in tokens) == Counter(ALL)
