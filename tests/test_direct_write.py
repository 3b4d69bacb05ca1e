"""Packs written around the page cache (``storage/_direct_write.py``): the bytes that reach the
file, the buffers' reuse, a failing write and a filesystem that refuses ``O_DIRECT``."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

from dmi.reader import read_record
from dmi.storage import LocalPackStore, PackStore, PackWriter, RecordKey, verify_pack
from dmi.storage import _direct_write
from dmi.storage._direct_write import DIRECT_ALIGNMENT, STAGING_BYTES, open_direct
from dmi.storage.errors import PackSealError

KEY = RecordKey("model", "run", "req", "resid_post", 0, 0, 4)


def direct_or_skip(path: str):
    stream = open_direct(path)
    if stream is None:
        pytest.skip(f"the filesystem of {os.path.dirname(path)} refuses O_DIRECT")
    return stream


CHUNKS = [1, DIRECT_ALIGNMENT - 1, DIRECT_ALIGNMENT + 1, STAGING_BYTES - 3, 7, STAGING_BYTES + 1, 2 * STAGING_BYTES, 5]


@pytest.mark.parametrize("tail", [0, 1, DIRECT_ALIGNMENT, 12345])
def test_every_byte_lands_in_order_and_the_file_has_its_length(tmp_path, tail):
    """Writes of every size across buffer and block boundaries, then a tail of ``tail`` bytes:
    the file holds exactly them (the padding of the last block is cut off)."""
    path = str(tmp_path / "f")
    stream = direct_or_skip(path)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, n, dtype=np.uint8) for n in [*CHUNKS, tail] if n]
    for chunk in chunks:
        stream.write(chunk)
    expected = np.concatenate(chunks).tobytes()
    assert stream.tell() == len(expected)
    stream.close()
    with open(path, "rb") as f:
        assert f.read() == expected


def test_a_buffer_is_refilled_only_after_its_write(tmp_path, monkeypatch):
    """Writes that take their time (the real write, delayed): every byte still lands as given,
    because a buffer waits for its previous write before it is filled again."""
    real = _direct_write._write_fully

    def slow(fd, data, offset):
        time.sleep(0.05)
        real(fd, data, offset)

    monkeypatch.setattr(_direct_write, "_write_fully", slow)
    path = str(tmp_path / "f")
    stream = direct_or_skip(path)
    chunks = [np.full(STAGING_BYTES, i, dtype=np.uint8) for i in range(7)]
    for chunk in chunks:
        stream.write(chunk)
    stream.close()
    with open(path, "rb") as f:
        assert f.read() == np.concatenate(chunks).tobytes()


def test_buffers_are_reused_by_the_next_file(tmp_path):
    first = direct_or_skip(str(tmp_path / "a"))
    first.write(np.zeros(2 * STAGING_BYTES, dtype=np.uint8))
    first.close()
    kept = {id(b) for b in _direct_write._pool}
    second = direct_or_skip(str(tmp_path / "b"))
    second.write(np.ones(10, dtype=np.uint8))
    second.flush()  # through Arrow's buffer to the file's own
    taken = {id(b) for b in _direct_write._pool}
    assert len(kept) >= 2 and len(kept - taken) == 1  # the second file took one kept buffer
    second.close()


def test_a_record_batch_reaches_the_file_in_few_writes(tmp_path, monkeypatch):
    """Arrow writes a record batch as dozens of small pieces; its buffer gathers them, so the
    file's Python ``write`` runs about once per ``ARROW_BUFFER_BYTES``, not once per piece: once
    for this pack (82 times without the buffer)."""
    direct_or_skip(str(tmp_path / "probe")).close()
    calls = []
    real_write = _direct_write.DirectFile.write
    monkeypatch.setattr(_direct_write.DirectFile, "write", lambda self, data: calls.append(1) or real_write(self, data))
    with PackWriter(PackStore.local(tmp_path / "packs"), codec="raw") as writer:
        for layer in range(40):
            writer.append(RecordKey("model", "run", "req", "resid_post", layer, 0, 4), torch.ones(4, 8))
        desc = writer.seal()
    assert desc.size < _direct_write.ARROW_BUFFER_BYTES
    assert len(calls) == 1  # the whole pack, smaller than the buffer, in one write at close


def write_pack(store, records: int = 5) -> tuple:
    tensors = [torch.randn(300, 1000 + i).to(torch.bfloat16) for i in range(records)]
    with PackWriter(store, codec="raw") as writer:
        for layer, tensor in enumerate(tensors):
            writer.append(RecordKey("model", "run", "req", "resid_post", layer, 0, 300), tensor)
        desc = writer.seal()
    return desc, tensors


@pytest.mark.parametrize("direct_writes", [True, False])
def test_packs_read_back_bit_exact_either_way(tmp_path, direct_writes):
    store = LocalPackStore(tmp_path, direct_writes=direct_writes)
    desc, tensors = write_pack(store)
    assert verify_pack(store, desc.pack_id) == desc
    assert desc.size == os.path.getsize(store.location(desc.pack_id))
    for entry, tensor in zip(desc.records, tensors):
        assert torch.equal(read_record(store, entry), tensor)


def test_a_store_writes_direct_by_default(tmp_path):
    direct_or_skip(str(tmp_path / "probe")).close()
    os.unlink(tmp_path / "probe")
    store = PackStore.local(tmp_path)
    sink = store.create("a" * 32)
    try:
        assert isinstance(sink.stream, pa.BufferedOutputStream)  # Arrow's buffer before a DirectFile, not an OSFile
        assert sink._writeback_from is None  # nothing to start early: bytes go to disk as written
    finally:
        sink.abort()
    buffered = LocalPackStore(tmp_path, direct_writes=False).create("b" * 32)
    try:
        assert buffered._writeback_from == 0
    finally:
        buffered.abort()
    assert os.listdir(tmp_path) == []


def test_a_failed_direct_write_discards_the_pack(tmp_path, monkeypatch):
    """A fake ENOSPC from the write thread (a real one needs a small filesystem mounted, which
    takes root): the seal fails with the disk's error, nothing is published, no file is left."""
    direct_or_skip(str(tmp_path / "probe")).close()
    os.unlink(tmp_path / "probe")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_direct_write, "_write_fully", full)
    store = PackStore.local(tmp_path)
    with pytest.raises(PackSealError, match="No space") as info:
        write_pack(store)
    assert isinstance(info.value, OSError)
    monkeypatch.undo()
    assert store.list_packs() == [] and os.listdir(tmp_path) == []
    desc, _ = write_pack(store)  # the same store writes again once there is room
    assert store.list_packs() == [desc.pack_id]


def test_a_filesystem_without_direct_io_writes_through_the_cache(tmp_path, monkeypatch):
    """A fake refusal (EINVAL on an ``O_DIRECT`` open, what such a filesystem answers)."""
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    assert open_direct(str(tmp_path / "f")) is None
    store = PackStore.local(tmp_path)
    desc, tensors = write_pack(store)
    monkeypatch.undo()
    assert verify_pack(store, desc.pack_id) == desc
    assert torch.equal(read_record(store, desc.records[-1]), tensors[-1])


def test_close_raises_a_failure_of_a_write_still_in_flight(tmp_path, monkeypatch):
    """A fake failure of the first buffer's write only (on the write thread), the tail's write
    succeeding: close still raises it."""
    real = _direct_write._write_fully

    def first_fails(fd, data, offset):
        if offset == 0:
            raise OSError(errno.EIO, "Input/output error")
        real(fd, data, offset)

    monkeypatch.setattr(_direct_write, "_write_fully", first_fails)
    stream = direct_or_skip(str(tmp_path / "f"))
    stream.write(np.zeros(STAGING_BYTES + 10, dtype=np.uint8))
    with pytest.raises(OSError, match="Input/output"):
        stream.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_pool_is_locked_can_still_take_a_buffer():
    with _direct_write._pool_lock:
        pid = os.fork()
        if pid == 0:
            try:
                _direct_write._take_buffer()
            finally:
                os._exit(0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the child waited on the pool's lock its parent held at the fork")
