"""One read of a pack serves both halves of ``dmi verify``: the records read back
(``dmi.reader._read.check_records``) and the whole-file check (``check_whole_pack``), from the
bytes ``read_whole_pack`` read once. Each half still finds what it found with its own read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmi.reader._read import check_records
from dmi.storage import LocalPackStore, PackWriter, RecordKey, read_pack_descriptor, verify_pack
from dmi.storage._pack_read import check_whole_pack, read_whole_pack
from dmi.storage._store import _LocalPackInput
from dmi.storage.errors import PackCorruptError, PackNotFoundError

KEYS = [RecordKey("m", "run", "q", "resid_post", layer, 0, 4) for layer in range(3)]
CODECS = ["raw", "zstd", "split-zstd"]


class _CountingStore(LocalPackStore):
    """A local store that counts its opens and the bytes read through ``read_into``."""

    def __init__(self, path):
        super().__init__(path, direct_writes=False)
        self.opened = 0
        self.read_bytes = 0

    def _open_input(self, pack_id):
        self.opened += 1
        return _CountingInput(self, pack_id, self._path(pack_id))


class _CountingInput(_LocalPackInput):
    def __init__(self, store: _CountingStore, pack_id: str, path: str):
        super().__init__(pack_id, path)
        self._store = store

    def read_into(self, offset, out):
        super().read_into(offset, out)
        self._store.read_bytes += memoryview(out).nbytes


@pytest.fixture
def packed(tmp_path):
    """A counting store holding one pack of three records, one per codec, and that pack's index."""
    store = _CountingStore(tmp_path / "packs")
    with PackWriter(store) as writer:
        for layer, (key, codec) in enumerate(zip(KEYS, CODECS)):
            writer.append(key, torch.arange(32, dtype=torch.float32).reshape(4, 8) + layer, codec=codec)
    (pack_id,) = store.list_packs()
    return store, read_pack_descriptor(store, pack_id)


def _flip(store, pack_id: str, offset: int) -> None:
    with open(store.location(pack_id), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_the_pack_is_opened_once_and_read_once_for_both_checks(packed):
    store, descriptor = packed
    store.opened = store.read_bytes = 0
    pack = read_whole_pack(store, descriptor.pack_id)
    check_records(pack.descriptor, pack.data, descriptor.records)
    check_whole_pack(pack)
    assert (store.opened, store.read_bytes) == (1, descriptor.size)
    assert pack.descriptor == descriptor
    with open(store.location(descriptor.pack_id), "rb") as f:
        assert pack.data.tobytes() == f.read()


def test_verify_pack_is_the_one_read_then_the_whole_file_check(packed):
    store, descriptor = packed
    store.opened = store.read_bytes = 0
    assert verify_pack(store, descriptor.pack_id) == descriptor
    assert (store.opened, store.read_bytes) == (1, descriptor.size)


def test_a_record_whose_bytes_fail_their_checksum_does_not_read_back(packed):
    store, descriptor = packed
    entry = descriptor.records[1]
    _flip(store, descriptor.pack_id, entry.payload.offset + 3)
    pack = read_whole_pack(store, descriptor.pack_id)
    check_records(pack.descriptor, pack.data, [descriptor.records[0], descriptor.records[2]])
    with pytest.raises(PackCorruptError) as failed:
        check_records(pack.descriptor, pack.data, descriptor.records)
    assert str(failed.value) == f"pack {descriptor.pack_id}: record {entry.meta.key.describe()} fails its checksum"


def test_a_catalog_row_the_index_does_not_hold_does_not_read_back(packed):
    store, descriptor = packed
    entry = descriptor.records[0]
    moved = dataclasses.replace(entry, payload=dataclasses.replace(entry.payload, offset=entry.payload.offset + 8))
    pack = read_whole_pack(store, descriptor.pack_id)
    with pytest.raises(PackCorruptError) as failed:
        check_records(pack.descriptor, pack.data, [moved])
    assert str(failed.value) == (
        f"pack {descriptor.pack_id}: record {entry.meta.key.describe()} at {moved.payload} does not match the "
        "pack's own index; the catalog row is stale or wrong"
    )


def test_damage_beside_the_records_is_found_in_the_same_bytes(packed):
    """A flipped leading magic: every record reads back whole, the file check refuses it."""
    store, descriptor = packed
    _flip(store, descriptor.pack_id, 0)
    pack = read_whole_pack(store, descriptor.pack_id)
    check_records(pack.descriptor, pack.data, descriptor.records)
    with pytest.raises(PackCorruptError) as failed:
        check_whole_pack(pack)
    assert str(failed.value).startswith(f"pack {descriptor.pack_id}: the leading Arrow magic is damaged: ")


def test_a_missing_pack_is_not_found(packed):
    store, descriptor = packed
    store.delete(descriptor.pack_id)
    with pytest.raises(PackNotFoundError):
        read_whole_pack(store, descriptor.pack_id)
