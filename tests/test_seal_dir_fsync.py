"""A local pack whose directory fsync fails after its rename is whole and visible: none of its
records is lost, and a capture publishes it (warning that it may not survive a power loss).

Before, the store raised a plain ``PackSealError``: the writer reported the pack's records as
discarded (``lost_keys``), the drain failed and counted them lost (reason ``pack not written``),
while the pack stayed whole on disk and ``recover`` published it — the same records both
counted lost and visible. Now the store raises ``PackNotDurableError`` (a ``PackSealError``);
the writer hands the pack's descriptor to ``on_seal`` and attaches it to the error, and the drain
publishes the pack, counts it in ``packs_not_durable`` and warns.

The failing disk is a fake at the system-call boundary: ``os.fsync`` raising ``EIO`` for
directory descriptors only (a real directory fsync failure needs a failing device).
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackNotDurableError, PackSealError, PackStore, PackWriter, RecordKey, verify_pack
from tests._models import left_padded_batch, tiny


def _failing_directory_fsync(monkeypatch, times: int = 1) -> list[int]:
    """``os.fsync`` raising ``EIO`` on its first ``times`` directory descriptors (files sync as
    usual); returns the list the failures are counted in."""
    real, failures = os.fsync, []

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode) and len(failures) < times:
            failures.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failures


def key(layer: int) -> RecordKey:
    return RecordKey("model", "run", "req-1", "resid_post", layer, 0, 2)


def values(layer: int) -> torch.Tensor:
    return torch.full((2, 4), float(layer))


@pytest.fixture
def store(tmp_path):
    return PackStore.local(tmp_path / "packs")


def test_the_store_raises_not_durable_and_leaves_the_pack_whole(store, monkeypatch):
    sink = store.create("a" * 32)
    sink.stream.write(b"0123456789")
    _failing_directory_fsync(monkeypatch)
    with pytest.raises(PackNotDurableError) as raised:
        sink.seal()
    assert isinstance(raised.value, PackSealError)
    assert (raised.value.lost_keys, raised.value.descriptor) == ((), None)
    assert str(raised.value) == (
        f"pack {'a' * 32}: renamed into place but the directory fsync failed ([Errno 5] Input/output error); the "
        f"pack is complete and visible but may not survive a power loss: check the disk holding {store.root}")
    assert store.list_packs() == ["a" * 32]
    assert os.path.getsize(os.path.join(store.root, f"{'a' * 32}.arrow")) == 10


def test_the_writer_gives_the_pack_to_on_seal_and_the_error(store, monkeypatch):
    seen = []
    writer = PackWriter(store, on_seal=seen.append)
    for layer in range(3):
        writer.append(key(layer), values(layer))
    _failing_directory_fsync(monkeypatch)
    with pytest.raises(PackNotDurableError) as raised:
        writer.seal()
    descriptor = raised.value.descriptor
    assert raised.value.lost_keys == ()
    assert seen == [descriptor]
    assert [r.meta.key for r in descriptor.records] == [key(0), key(1), key(2)]
    assert descriptor.size == os.path.getsize(os.path.join(store.root, f"{descriptor.pack_id}.arrow"))
    assert verify_pack(store, descriptor.pack_id).records == descriptor.records
    writer.append(key(3), values(3))  # the writer goes on
    assert [r.meta.key for r in writer.close().records] == [key(3)]


def test_an_append_that_seals_a_full_pack_keeps_its_record(store, monkeypatch):
    """``max_records``: the record fills the pack, which seals not durable; the record is in it."""
    seen = []
    writer = PackWriter(store, max_records=2, on_seal=seen.append)
    writer.append(key(0), values(0))
    _failing_directory_fsync(monkeypatch)
    with pytest.raises(PackNotDurableError) as raised:
        writer.append(key(1), values(1))
    assert raised.value.lost_keys == ()
    writer.append(key(2), values(2))
    writer.close()
    assert [[r.meta.key for r in d.records] for d in seen] == [[key(0), key(1)], [key(2)]]
    assert seen[0] is raised.value.descriptor


def test_an_append_that_seals_the_pack_before_it_keeps_its_record(store, monkeypatch):
    """``max_bytes``: the pack before the record seals not durable; the record opens the next."""
    seen = []
    writer = PackWriter(store, codec="raw", max_bytes=80, on_seal=seen.append)  # 32-byte records: two fit
    writer.append(key(0), values(0))
    writer.append(key(1), values(1))
    _failing_directory_fsync(monkeypatch)
    with pytest.raises(PackNotDurableError) as raised:
        writer.append(key(2), values(2))  # 96 bytes would pass max_bytes: [0, 1] seals first
    assert raised.value.lost_keys == ()
    writer.close()
    assert [[r.meta.key for r in d.records] for d in seen] == [[key(0), key(1)], [key(2)]]
    assert seen[0] is raised.value.descriptor


@pytest.mark.parametrize("max_records, encode_threads", [(10, 1), (10, 2), (10_000, 1)],
                         ids=["sealed-by-an-append", "sealed-by-an-encoding-thread", "sealed-by-the-flush"])
def test_a_capture_publishes_the_pack_and_counts_nothing_lost(tmp_path, monkeypatch, max_records, encode_threads):
    """End to end: hooks, ring, drain, writer, catalog. The pack whose directory fsync failed is
    published, no record is counted lost, and ``recover`` finds nothing left to publish."""
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.warns(RuntimeWarning, match=r"directory fsync failed .* published with its records, none of "
                                                r"them lost") as warned:
            with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m",
                        writer_options={"max_records": max_records}, encode_threads=encode_threads) as cap:
                failures = _failing_directory_fsync(monkeypatch)
                cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        monkeypatch.undo()
        assert len(failures) == 1
        assert len([w for w in warned if "directory fsync failed" in str(w.message)]) == 1
        packs = store.list_packs()
        on_disk = sum(len(verify_pack(store, pack_id).records) for pack_id in packs)
        assert (cap.drain.stats.packs_not_durable, cap.stats["records_lost"]) == (1, 0)
        assert catalog.losses(model_id="m").to_pylist() == []
        assert catalog.published_pack_ids() == set(packs)
        assert len(catalog.select_records("m")) == on_disk == cap.stats["records"] == 18
        assert catalog.recover(store) == []
