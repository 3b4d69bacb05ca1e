"""PackWriter at its edges, read back bit-exact: empty and one-element records, sizes that are
not multiples of a disk block, a record far larger than every internal buffer, ten thousand
tiny records, a repeated key, roll-over exactly at ``max_records``/``max_bytes``, direct writes
on, off and refused by the filesystem, a closed writer, and a write or seal that fails half-way
(failures simulated by patching ``os.fsync``/``os.pwrite``/``os.open`` to raise once)."""

import errno
import os
from unittest import mock

import pytest
import torch

from dmi.reader import read_record, read_records
from dmi.storage import CODECS, LocalPackStore, PackError, PackSealError, PackWriter, RecordKey, verify_pack
from dmi.storage import _direct_write
from dmi.storage._pack_format import _dtype_table
from tests.test_pack_writer import random_tensor, same_bits

_DTYPES = _dtype_table()
STORABLE = sorted(n for n in _DTYPES if not n.startswith(("qint", "quint")))


def key(layer=0, start=0):
    return RecordKey("model", "run", "req-1", "resid_post", layer, start, 4)




def fails_once(real, call_number: int, code: int):
    """``real``, except that its ``call_number``-th call (from 1) raises ``OSError(code)``."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call_number:
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    return wrapper


def write_all(store, tensors, **options):
    with PackWriter(store, **options) as writer:
        for i, t in enumerate(tensors):
            writer.append(key(layer=i), t)
        return writer.seal()


def files_in(store) -> list[str]:
    return sorted(os.listdir(store.root))


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def store(request, tmp_path):
    return LocalPackStore(tmp_path / "packs", direct_writes=request.param)


ODD_SIZES = [
    lambda: torch.empty(0, 5),
    lambda: torch.empty(3, 0, dtype=torch.bfloat16),
    lambda: torch.tensor([7], dtype=torch.int64),
    lambda: torch.tensor(True),
    lambda: random_tensor(torch.uint8, (4097,), 1),
    lambda: random_tensor(torch.float32, (129,), 2),
    lambda: random_tensor(torch.bool, (513,), 3),
    lambda: random_tensor(torch.float16, (2049,), 4),
]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("batch_bytes", [1, 4096, 1 << 20])
def test_empty_single_and_unaligned_records_round_trip(store, codec, batch_bytes):
    tensors = [make() for make in ODD_SIZES]
    desc = write_all(store, tensors, codec=codec, batch_bytes=batch_bytes)
    verify_pack(store, desc.pack_id)
    assert [e.meta.shape for e in desc.records] == [(0, 5), (3, 0), (1,), (), (4097,), (129,), (513,), (2049,)]
    for got, entry, t in zip(read_records(store, desc.records), desc.records, tensors):
        assert same_bits(got, t)
        assert same_bits(read_record(store, entry), t)


def test_every_dtype_round_trips_with_and_without_direct_writes(store):
    tensors = [random_tensor(_DTYPES[name], (3, 7), seed=i) for i, name in enumerate(STORABLE)]
    desc = write_all(store, tensors, codec="raw")
    assert [e.meta.dtype for e in desc.records] == STORABLE
    for got, t in zip(read_records(store, desc.records), tensors):
        assert same_bits(got, t)


def test_record_larger_than_every_buffer_between_small_ones(store):
    small = random_tensor(torch.float16, (1001,), 1)
    big = random_tensor(torch.bfloat16, (32 * 1024 * 1024 + 7,), 2)  # 64 MiB + 14 bytes
    desc = write_all(store, [small, big, small], codec="raw")
    verify_pack(store, desc.pack_id)
    assert [e.payload.length for e in desc.records] == [2002, 2 * (32 * 1024 * 1024 + 7), 2002]
    for got, t in zip(read_records(store, desc.records), [small, big, small]):
        assert same_bits(got, t)


def test_ten_thousand_tiny_records_in_one_pack(tmp_path):
    store = LocalPackStore(tmp_path / "packs")
    tensors = [torch.tensor([i], dtype=torch.int16) for i in range(10_000)]
    sealed = []
    assert write_all(store, tensors, max_records=10_000, on_seal=sealed.append) is None  # sealed at the 10 000th
    [desc] = sealed
    assert store.list_packs() == [desc.pack_id]
    assert len(desc.records) == 10_000
    verify_pack(store, desc.pack_id)
    assert [int(t) for t in read_records(store, desc.records)] == list(range(10_000))


def test_roll_over_exactly_at_max_records(store):
    sealed = []
    with PackWriter(store, max_records=3, on_seal=sealed.append) as writer:
        for i in range(6):
            writer.append(key(layer=i), torch.full((4,), float(i)))
        assert writer.seal() is None  # the sixth record sealed the second pack: nothing open
    assert [[e.meta.key.layer for e in d.records] for d in sealed] == [[0, 1, 2], [3, 4, 5]]
    assert sorted(store.list_packs()) == sorted(d.pack_id for d in sealed)


def test_roll_over_exactly_at_max_bytes(store):
    """16-byte raw records under ``max_bytes=32``: a pack seals on reaching 32, never passes it."""
    sealed = []
    with PackWriter(store, max_bytes=32, codec="raw", on_seal=sealed.append) as writer:
        for i in range(5):
            writer.append(key(layer=i), torch.full((4,), float(i)))
    assert [[e.meta.key.layer for e in d.records] for d in sealed] == [[0, 1], [2, 3], [4]]
    for d in sealed:
        assert [read_record(store, e).tolist() for e in d.records] == [[float(e.meta.key.layer)] * 4 for e in d.records]


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_writes(tmp_path):
    """``open_direct`` takes EINVAL as "no direct I/O here" and the sink writes through the
    page cache (``_direct_write.py``'s docstring; docs/pack-format.md, "Local directory")."""
    store = LocalPackStore(tmp_path / "packs")
    real_open = os.open
    refused = []

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    t = random_tensor(torch.float32, (1025,), 5)
    with mock.patch("os.open", refuse_direct):
        desc = write_all(store, [t], codec="raw")
    assert len(refused) == 1
    verify_pack(store, desc.pack_id)
    assert same_bits(read_record(store, desc.records[0]), t)


def test_close_twice_and_use_after_close(store):
    writer = PackWriter(store, writer_id="w-edge")
    writer.append(key(), torch.zeros(2))
    desc = writer.close()
    assert [e.meta.key for e in desc.records] == [key()]
    assert writer.close() is None
    with pytest.raises(PackError, match="pack writer w-edge is closed"):
        writer.append(key(1), torch.zeros(2))
    with pytest.raises(PackError, match="pack writer w-edge is closed"):
        writer.seal()
    assert store.list_packs() == [desc.pack_id]


def test_enospc_from_fsync_at_a_seal_publishes_nothing_and_keeps_sealed_packs(store):
    """``os.fsync`` is patched to raise ENOSPC once (a simulated full disk) while the second
    pack seals: the first pack stays whole, no file is left under the failed pack's name or
    a temporary one, and the writer goes on to seal a third pack."""
    writer = PackWriter(store, max_records=2)
    writer.append(key(0), torch.arange(4.0))
    writer.append(key(1), torch.arange(4.0) + 1)  # seals the first pack
    [first] = store.list_packs()
    writer.append(key(2), random_tensor(torch.float32, (5000,), 6))
    failing = writer._pack.pack_id
    with mock.patch("os.fsync", fails_once(os.fsync, 1, errno.ENOSPC)), pytest.raises(PackSealError) as caught:
        writer.seal()
    assert caught.value.lost_keys == (key(2),)
    assert failing in str(caught.value) and "nothing published" in str(caught.value)
    assert files_in(store) == [f"{first}.arrow"]
    assert [read_record(store, e).tolist() for e in verify_pack(store, first).records] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]]
    writer.append(key(3), torch.ones(3))
    third = writer.close()
    assert read_record(store, third.records[0]).tolist() == [1.0, 1.0, 1.0]
    assert sorted(store.list_packs()) == sorted([first, third.pack_id])


def test_a_failed_direct_write_mid_record_discards_only_the_open_pack(tmp_path):
    """``os.pwrite`` is patched to raise EIO on its second call (a simulated disk error under
    a 20 MiB record, written in 4 MiB staging buffers): the append fails with
    :class:`PackSealError` naming the one lost record, nothing is left behind, and the writer
    writes the next pack whole."""
    probe = _direct_write.open_direct(str(tmp_path / "probe"))
    if probe is None:
        pytest.skip("this filesystem refuses O_DIRECT: no direct write to fail")
    probe.close()
    store = LocalPackStore(tmp_path / "packs")
    big = random_tensor(torch.float32, (5 * 1024 * 1024,), 7)
    writer = PackWriter(store, codec="raw")
    with mock.patch("os.pwrite", fails_once(os.pwrite, 2, errno.EIO)), pytest.raises(PackSealError) as caught:
        writer.append(key(0), big)
        writer.seal()
    assert caught.value.lost_keys == (key(0),)
    assert files_in(store) == []
    writer.append(key(1), big)
    desc = writer.close()
    assert same_bits(read_record(store, desc.records[0]), big)
    assert store.list_packs() == [desc.pack_id]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_staging_buffers_pooled_before_a_fork_are_not_shared_with_the_child():
    """The parent's and a forked child's direct-write staging buffers are their own: a buffer
    pooled before the fork, filled by both processes at once, keeps each one's bytes (shared
    memory would let the child's pack bytes land in the parent's, and the reverse)."""
    _direct_write._give_back(_direct_write._take_buffer())
    parent_to_child, child_to_parent = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(parent_to_child[0], 1)
            _direct_write._take_buffer()[:4096] = 0x22
            os.write(child_to_parent[1], b"x")
        finally:
            os._exit(0)
    buffer = _direct_write._take_buffer()
    buffer[:4096] = 0x11
    os.write(parent_to_child[1], b"x")
    os.read(child_to_parent[0], 1)
    os.waitpid(pid, 0)
    assert bytes(buffer[:4096]) == b"\x11" * 4096
    _direct_write._give_back(buffer)
