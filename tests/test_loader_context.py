"""``store.loader(multiprocessing_context=...)``: a value DataLoader workers cannot be started
with is refused when the loader is made, with ``InvalidArgumentError`` naming what is
accepted — not torch's own ``ValueError`` / ``TypeError`` when the first epoch starts its
workers (or an ``AttributeError`` from the fork check)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

import dmi
from dmi.storage import PackWriter
from dmi.storage.errors import InvalidArgumentError
from dmi.storage.records import RecordKey


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with dmi.open(home=tmp_path_factory.mktemp("loader-context")) as opened:
        descriptors = []
        with PackWriter(opened.packs, on_seal=descriptors.append) as writer:
            key = RecordKey("m", "r", "q", "resid_post", 0, 0, 4, phase="forward")
            writer.append(key, torch.arange(32.0).view(4, 8))
        with opened.catalog.publisher("loader-context") as publisher:
            publisher.publish(descriptors)
        yield opened


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("context", ["bogus", "Spawn", 42, object()], ids=["unknown", "wrong-case", "int", "object"])
def test_a_context_workers_cannot_start_with_is_refused_when_the_loader_is_made(store, context, workers):
    with pytest.raises(InvalidArgumentError) as info:
        store.loader("m", batch_size=2, num_workers=workers, multiprocessing_context=context)
    message = str(info.value)
    assert message.startswith("multiprocessing_context must be a start method (")
    assert all(repr(method) in message for method in multiprocessing.get_all_start_methods())
    assert "multiprocessing.get_context(...)" in message and message.endswith(f"not {context!r}")


@pytest.mark.parametrize("context", [None, "spawn", multiprocessing.get_context("spawn")],
                         ids=["none", "name", "object"])
def test_start_method_names_and_contexts_are_taken(store, context):
    loader = store.loader("m", batch_size=2, num_workers=2, multiprocessing_context=context)
    assert loader.multiprocessing_context is context
    assert (loader.num_workers, loader.n_tokens, len(loader)) == (2, 4, 2)


def test_without_workers_a_good_context_still_reads_every_row(store):
    loader = store.loader("m", batch_size=2, shuffle=False, num_workers=0, multiprocessing_context="spawn")
    assert torch.equal(torch.cat(list(loader)).view(4, 8), torch.arange(32.0).view(4, 8))
