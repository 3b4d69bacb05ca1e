"""Reads around the page cache (``O_DIRECT``): the same bytes as cached reads, or a named error.

Direct reads need a filesystem that takes ``O_DIRECT`` (ext4, xfs; not tmpfs). Where the test
directory's filesystem refuses it, the store reads through the cache (``alignment`` 0) — that
fallback is asserted, and the tests that need a direct descriptor are skipped with the reason.
"""

from __future__ import annotations

import os
import zlib

import pyarrow.fs as pafs
import pytest
import torch

import dmi
from dmi.reader import read_records
from dmi.storage import DIRECT_ALIGNMENT, FileSystemPackStore, PackStore, PackWriter
from dmi.storage.errors import InvalidArgumentError, PackTruncatedError
from dmi.storage.records import RecordKey


def _direct_io_works(directory) -> bool:
    probe = os.path.join(directory, "direct-probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * DIRECT_ALIGNMENT)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        os.unlink(probe)
    return True


def _tensor(i: int, n: int, d: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{i}".encode()))
    return torch.randn(n, d, generator=g).to(dtype)


@pytest.fixture
def packs(tmp_path):
    """One pack of records of odd sizes (none starts or ends on a 4 KiB boundary), in three codecs."""
    store = PackStore.local(tmp_path / "packs")
    sealed = []
    with PackWriter(store, on_seal=sealed.append) as writer:
        for i, (n, codec) in enumerate([(3, "raw"), (700, "raw"), (5, "split-zstd"), (129, "zstd"), (1, "raw")]):
            key = RecordKey("m", "r", f"q{i}", "resid_post", 0, 0, n, phase="forward")
            writer.append(key, _tensor(i, n, 37, torch.bfloat16 if codec == "split-zstd" else torch.float32), codec=codec)
    (descriptor,) = sealed
    return store, list(descriptor.records)


def _needs_direct(store) -> None:
    if not _direct_io_works(store.root):
        pytest.skip(f"the filesystem of {store.root} refuses O_DIRECT: reads stay cached there (asserted elsewhere)")


def test_a_direct_input_reads_the_same_bytes_as_a_cached_one(packs):
    store, entries = packs
    _needs_direct(store)
    last = max(entries, key=lambda e: e.payload.offset)
    with store.open_input(last.pack_id) as cached, store.open_input(last.pack_id, direct=True) as direct:
        assert cached.alignment == 0 and direct.alignment == DIRECT_ALIGNMENT
        size = cached.size
        whole = bytearray(size)
        cached.read_into(0, whole)
        start = (size - 1) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT  # the last block: the file ends inside it
        room = torch.empty(2 * DIRECT_ALIGNMENT, dtype=torch.uint8)
        block = room[-room.data_ptr() % DIRECT_ALIGNMENT:][:DIRECT_ALIGNMENT]
        direct.read_direct_into(start, block.numpy(), needed=size - start)
        assert bytes(block[: size - start].numpy()) == bytes(whole[start:])
        with pytest.raises(PackTruncatedError, match="truncated"):
            direct.read_direct_into(start, block.numpy(), needed=size - start + 1)


def test_a_direct_read_stops_at_the_short_last_block(packs, monkeypatch):
    """After the file's last, short block a direct read must not ask again: the next offset is
    unaligned. Linux's ext4 answers such a read with 0 bytes, so the stop cannot be told apart
    here; ``os.preadv`` is made to refuse unaligned direct reads with EINVAL, as the O_DIRECT
    contract allows a filesystem to."""
    store, entries = packs
    _needs_direct(store)
    real_preadv = os.preadv

    def strict_preadv(fd, buffers, offset, *args):
        if offset % DIRECT_ALIGNMENT:
            raise OSError(22, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", strict_preadv)
    last = max(entries, key=lambda e: e.payload.offset)
    with store.open_input(last.pack_id, direct=True) as direct:
        size = direct.size
        start = (size - 1) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        room = torch.empty(3 * DIRECT_ALIGNMENT, dtype=torch.uint8)
        block = room[-room.data_ptr() % DIRECT_ALIGNMENT:][: 2 * DIRECT_ALIGNMENT]
        direct.read_direct_into(start, block.numpy(), needed=size - start)
    with open(store.location(last.pack_id), "rb") as f:
        f.seek(start)
        assert bytes(block[: size - start].numpy()) == f.read()


@pytest.mark.parametrize("max_gap", [0, 1 << 20])
def test_records_read_directly_equal_records_read_through_the_cache(packs, max_gap):
    store, entries = packs
    cached = read_records(store, entries, max_gap=max_gap)
    direct = read_records(store, entries, max_gap=max_gap, direct=True)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(cached, direct, strict=True))
    assert [tuple(t.shape) for t in direct] == [(3, 37), (700, 37), (5, 37), (129, 37), (1, 37)]


def test_a_pack_cut_short_is_a_named_error_when_read_directly(packs):
    store, entries = packs
    _needs_direct(store)
    victim = max(entries, key=lambda e: e.payload.offset)
    os.truncate(store.location(victim.pack_id), victim.payload.offset + victim.payload.length - 1)
    with pytest.raises(PackTruncatedError, match="records affected: .*q4"):
        read_records(store, [victim], direct=True)


def test_stores_without_direct_reads_read_through_the_cache(packs, tmp_path):
    store, entries = packs
    other = FileSystemPackStore(pafs.LocalFileSystem(), store.root)
    with other.open_input(entries[0].pack_id, direct=True) as source:
        assert source.alignment == 0
    assert all(torch.equal(a, b) for a, b in zip(read_records(other, entries, direct=True), read_records(store, entries)))


def test_a_filesystem_that_refuses_direct_io_leaves_reads_cached(packs, monkeypatch):
    """tmpfs refuses ``O_DIRECT`` with EINVAL at open; the real one cannot be mounted here, so
    ``os.open`` answers as tmpfs would for that flag (and only for it)."""
    store, entries = packs
    real_open = os.open

    def tmpfs_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", tmpfs_open)
    with store.open_input(entries[0].pack_id, direct=True) as source:
        assert source.alignment == 0
    assert all(torch.equal(a, b) for a, b in zip(read_records(store, entries, direct=True), read_records(store, entries)))


@pytest.fixture
def home(tmp_path):
    with dmi.open(home=tmp_path / "home") as store:
        sealed = []
        with PackWriter(store.packs, max_records=7, on_seal=sealed.append) as writer:
            for r in range(20):
                key = RecordKey("m", "run", f"req-{r:02d}", "resid_post", 0, 0, 11 + r, phase="forward")
                writer.append(key, _tensor(r, 11 + r, 64, torch.bfloat16))
        with store.catalog.publisher("direct-test") as publisher:
            publisher.publish(sealed)
        yield store


def _count_direct_reads(monkeypatch) -> list[int]:
    """The bytes of each direct range read from now on, one entry a read."""
    from dmi.storage._store import _LocalPackInput

    direct_reads = []
    real = _LocalPackInput.read_direct_into

    def counted(self, offset, out, needed):
        direct_reads.append(needed)
        return real(self, offset, out, needed)

    monkeypatch.setattr(_LocalPackInput, "read_direct_into", counted)
    return direct_reads


def test_the_loader_yields_the_same_batches_reading_directly(home, monkeypatch):
    _needs_direct(home.packs)
    direct_reads = _count_direct_reads(monkeypatch)

    def epoch(direct_io):
        loader = home.loader("m", batch_size=33, shuffle_buffer=100, dtype=None, with_tokens=True, seed=5,
                             read_threads=3, direct_io=direct_io)
        return list(loader)

    cached = epoch(False)
    assert not direct_reads
    direct = epoch(True)
    assert len(direct_reads) >= 3  # at least one range read of each of the three packs
    assert len(cached) == len(direct) == -(-sum(11 + r for r in range(20)) // 33)
    for (x, tokens), (y, direct_tokens) in zip(cached, direct, strict=True):
        assert torch.equal(x, y) and x.dtype == torch.bfloat16 and tokens == direct_tokens


def test_the_loader_reads_around_the_page_cache_unless_told_otherwise(home, monkeypatch):
    """A cold read through the page cache costs CPU for every page (and, on a VM that hands
    free memory back to its host, waits for the host to back each page again: docs/loader.md,
    "Direct I/O"), so the loader reads directly by default; ``direct_io=False`` reads through
    the cache."""
    _needs_direct(home.packs)
    direct_reads = _count_direct_reads(monkeypatch)
    loader = home.loader("m", batch_size=33, shuffle_buffer=100)
    assert loader.config.direct_io is True
    assert sum(len(x) for x in loader) == sum(11 + r for r in range(20))
    assert len(direct_reads) >= 3  # at least one range read of each of the three packs
    assert home.loader("m", direct_io=False).config.direct_io is False
    for wrong in ("yes", None, 1):
        with pytest.raises(InvalidArgumentError, match="direct_io"):
            home.loader("m", direct_io=wrong)
