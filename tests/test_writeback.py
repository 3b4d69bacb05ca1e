"""Write-behind: a local pack written through the page cache (``direct_writes=False``, or a
filesystem that refuses ``O_DIRECT``) starts the disk on what it has written every
WRITEBACK_BYTES, from byte 0 without gaps, and a disk failure there fails the pack like a
failed write."""

import errno
import os

import pytest
import torch

from dmi.storage import LocalPackStore, PackSealError, PackWriter, RecordKey, verify_pack
from dmi.storage import _store, _writeback
from dmi.reader import read_record
from dmi.storage._writeback import WRITEBACK_BYTES, start_writeback

RECORD = torch.arange(3 * WRITEBACK_BYTES // 8, dtype=torch.float32).reshape(-1, 512) / 7  # 3/8 of a step


def key(i: int) -> RecordKey:
    return RecordKey("model", "run", f"req-{i}", "resid_post", 0, 0, RECORD.shape[0])


def recording(monkeypatch, result=None):
    """Calls to start_writeback as (offset, nbytes); the real call runs unless ``result``."""
    calls = []

    def record(fd, offset, nbytes):
        calls.append((offset, nbytes))
        return start_writeback(fd, offset, nbytes) if result is None else result(offset)

    monkeypatch.setattr(_store, "start_writeback", record)
    return calls


def test_writeback_covers_the_pack_from_its_first_byte_in_steps(tmp_path, monkeypatch):
    calls = recording(monkeypatch)
    store = LocalPackStore(tmp_path, direct_writes=False)
    with PackWriter(store, codec="raw") as w:
        for i in range(8):
            w.append(key(i), RECORD)
        desc = w.seal()
    assert len(calls) >= 2
    assert calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))  # contiguous
    assert all(n >= WRITEBACK_BYTES for _, n in calls)
    assert calls[-1][0] + calls[-1][1] > desc.size - WRITEBACK_BYTES - RECORD.nbytes
    verify_pack(store, desc.pack_id)
    assert all(torch.equal(read_record(store, e), RECORD) for e in desc.records)


def test_a_file_that_cannot_take_it_is_not_asked_again(tmp_path, monkeypatch):
    calls = recording(monkeypatch, result=lambda offset: False)
    store = LocalPackStore(tmp_path, direct_writes=False)
    with PackWriter(store, codec="raw") as w:
        for i in range(8):
            w.append(key(i), RECORD)
        desc = w.seal()
    assert calls == [(0, calls[0][1])]
    assert all(torch.equal(read_record(store, e), RECORD) for e in desc.records)


def test_a_disk_failure_there_fails_the_pack_and_leaves_nothing(tmp_path, monkeypatch):
    """A fake: a real disk cannot be made to fail writeback on cue (EIO) here."""

    def eio(offset):
        raise OSError(errno.EIO, "Input/output error")

    recording(monkeypatch, result=eio)
    store = LocalPackStore(tmp_path, direct_writes=False)
    w = PackWriter(store, codec="raw")
    with pytest.raises(PackSealError, match="write failed .*Input/output error.*discarded"):
        for i in range(8):
            w.append(key(i), RECORD)
    assert store.list_packs() == []
    assert os.listdir(tmp_path) == []  # the temporary file is gone too


def test_start_writeback_on_a_real_file_and_on_a_pipe(tmp_path):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
        f.flush()
        assert start_writeback(f.fileno(), 0, 65536) is (_writeback._sync_file_range is not None)
    read_end, write_end = os.pipe()
    try:
        assert start_writeback(write_end, 0, 1) is False  # ESPIPE: not a file, nothing to start
    finally:
        os.close(read_end)
        os.close(write_end)
