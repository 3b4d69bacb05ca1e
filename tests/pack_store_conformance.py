"""The pack store conformance suite: every store subclasses :class:`PackStoreConformance`.

A subclass provides :meth:`PackStoreConformance.make_store` (a fresh, empty store under
``tmp_path``) and :meth:`PackStoreConformance.put_foreign_file` (a file in the store's
directory that the store did not write, as another tool or a crashed writer would leave).
Everything else talks to the store only through the :class:`~dmi.storage.PackStore`
contract: list, open for ranged reads, create → seal once, abort, delete.
"""

from __future__ import annotations

import random
import secrets

import pytest

from dmi.storage import (
    InvalidArgumentError,
    PackNotFoundError,
    PackSealError,
    PackTruncatedError,
)

BAD_IDS = ["../etc/passwd", "x" * 32, "0" * 31, "", "0" * 32 + "/", "A" * 32, "0" * 32 + ".arrow", "0" * 32 + "\n"]


def new_id() -> str:
    return secrets.token_hex(16)


def body(size: int = 10_000, seed: int = 0) -> bytes:
    """Bytes that differ at every offset pattern, so a shifted or stale read shows."""
    return bytes((i * 31 + seed * 7 + (i >> 8)) % 251 for i in range(size))


def read(store, pack_id: str, offset: int, length: int) -> bytes:
    out = bytearray(length)
    with store.open_input(pack_id) as source:
        source.read_into(offset, out)
    return bytes(out)


def seal(store, pack_id: str, data: bytes) -> int:
    sink = store.create(pack_id)
    sink.stream.write(data)
    return sink.seal()


class PackStoreConformance:
    """The behaviour every :class:`~dmi.storage.PackStore` must have."""

    UNSEALED_PACKS_HIDDEN = True
    """False only for a store whose filesystem shows a file once it is opened for writing
    (the generic store over pyarrow's ``LocalFileSystem``); the store's docstring says so."""

    def make_store(self, tmp_path):
        """A fresh, empty store whose files live under ``tmp_path``."""
        raise NotImplementedError

    def put_foreign_file(self, store, name: str, data: bytes) -> None:
        """Write ``name`` into the store's directory behind the store's back."""
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        return self.make_store(tmp_path)

    def test_empty_store_lists_nothing(self, store):
        assert store.list_packs() == []
        assert not store.exists(new_id())

    def test_sealed_pack_is_listed_and_readable(self, store):
        pack_id, data = new_id(), body()
        assert seal(store, pack_id, data) == len(data)
        assert store.list_packs() == [pack_id]
        assert store.exists(pack_id)
        assert store.location(pack_id).endswith(f"{pack_id}.arrow")
        with store.open_input(pack_id) as source:
            assert source.size == len(data)
        for offset, length in [(0, len(data)), (0, 1), (1234, 4321), (len(data) - 1, 1), (len(data), 0)]:
            assert read(store, pack_id, offset, length) == data[offset : offset + length]

    def test_written_between_writes_keeps_every_byte(self, store):
        """The writer calls ``sink.written()`` after each batch; whatever a store starts there,
        the sealed pack holds exactly the bytes written, in order."""
        step = 4 * 1024 * 1024  # past the local store's writeback step within a few writes
        pack_id, data = new_id(), random.Random(0).randbytes(5 * step + 17)
        sink = store.create(pack_id)
        for start in range(0, len(data), step):
            sink.stream.write(data[start : start + step])
            sink.written()
        assert sink.seal() == len(data)
        assert read(store, pack_id, 0, len(data)) == data

    def test_listing_is_sorted(self, store):
        ids = [new_id() for _ in range(4)]
        for pack_id in ids:
            seal(store, pack_id, body(100))
        assert store.list_packs() == sorted(ids)

    @pytest.mark.parametrize("offset, length", [(9_990, 20), (10_000, 1), (50_000, 8)])
    def test_read_past_the_end_is_truncated(self, store, offset, length):
        pack_id = new_id()
        seal(store, pack_id, body())
        with pytest.raises(PackTruncatedError, match=pack_id):
            read(store, pack_id, offset, length)

    def test_unsealed_pack_is_neither_listed_nor_readable(self, store):
        if not self.UNSEALED_PACKS_HIDDEN:
            pytest.skip("this filesystem shows a file while it is written (see the store's docstring)")
        pack_id = new_id()
        sink = store.create(pack_id)
        sink.stream.write(body())
        assert store.list_packs() == []
        assert not store.exists(pack_id)
        with pytest.raises(PackNotFoundError):
            store.open_input(pack_id)
        sink.abort()

    def test_aborted_pack_leaves_nothing(self, store):
        pack_id = new_id()
        sink = store.create(pack_id)
        sink.stream.write(body())
        sink.abort()
        assert store.list_packs() == []
        assert not store.exists(pack_id)
        with pytest.raises(PackNotFoundError):
            store.open_input(pack_id)
        assert seal(store, pack_id, body(100)) == 100  # the id is free again

    def test_sealing_an_existing_id_is_refused_and_the_original_kept(self, store):
        pack_id, original = new_id(), body(seed=1)
        seal(store, pack_id, original)
        with pytest.raises(PackSealError, match="already exists"):
            seal(store, pack_id, body(20_000, seed=2))
        assert store.list_packs() == [pack_id]
        assert read(store, pack_id, 0, len(original)) == original
        with store.open_input(pack_id) as source:
            assert source.size == len(original)

    def test_missing_pack_is_not_found(self, store):
        seal(store, new_id(), body(100))
        missing = new_id()
        with pytest.raises(PackNotFoundError, match=missing) as info:
            store.open_input(missing)
        assert isinstance(info.value, FileNotFoundError)
        assert not store.exists(missing)

    @pytest.mark.parametrize("bad", BAD_IDS)
    @pytest.mark.parametrize("method", ["open_input", "create", "delete", "exists", "location"])
    def test_malformed_ids_are_refused(self, store, bad, method):
        with pytest.raises(InvalidArgumentError, match="not a pack id"):
            getattr(store, method)(bad)
        assert store.list_packs() == []

    def test_delete_removes_the_pack(self, store):
        kept, doomed = new_id(), new_id()
        seal(store, kept, body(100))
        seal(store, doomed, body(200))
        assert store.delete(doomed) is None
        assert store.list_packs() == [kept]
        assert not store.exists(doomed)
        with pytest.raises(PackNotFoundError):
            store.open_input(doomed)
        assert read(store, kept, 0, 100) == body(100)

    def test_deleting_a_missing_pack_is_not_found(self, store):
        """Documented choice: not silent, so a racing deleter (purge) can tell and skip."""
        pack_id = new_id()
        seal(store, pack_id, body(100))
        store.delete(pack_id)
        with pytest.raises(PackNotFoundError, match=pack_id) as info:
            store.delete(pack_id)
        assert isinstance(info.value, FileNotFoundError)

    def test_listing_ignores_foreign_files(self, store):
        pack_id = new_id()
        seal(store, pack_id, body(100))
        other = new_id()
        for name in ["notes.arrow", "A" * 32 + ".arrow", f".{other}.abcd.tmp", other, f"{other}.arrow.part"]:
            self.put_foreign_file(store, name, b"not a pack")
        assert store.list_packs() == [pack_id]
        assert not store.exists(other)

    def test_repr_names_the_store(self, store):
        assert repr(store) == f"{type(store).__name__}({store.uri!r})"
