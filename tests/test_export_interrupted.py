"""``export_tensor`` stopped part-way: a full disk, Ctrl-C, a bug in a writer.

Each format's write is made to fail after part of the file is on disk, by a fake file
handle that takes the first bytes and then raises: a full disk cannot be made portably (it
needs root to mount a small tmpfs), and Ctrl-C cannot be timed to land inside a write. In
every case the partial file is removed and the target path is left as it was; a full disk
is the named ``ExportError`` for every format (``torch.save`` reports it as a
``RuntimeError`` of its own), Ctrl-C stays ``KeyboardInterrupt``, a bug stays itself.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import dmi._export as export
from dmi._export import EXPORT_FORMATS, export_tensor
from dmi.storage.errors import ExportError

TAKEN = 1000
"""Bytes a failing handle writes before it raises: past every format's header, short of the data."""


class _FailingHandle:
    """The temporary file's handle, writing at most ``TAKEN`` bytes (the part that fits, as a
    full disk does) and then raising ``exc``; ``left`` is the file's size at that moment."""

    def __init__(self, handle, temp: str, exc: BaseException):
        self.handle, self.temp, self.exc = handle, temp, exc
        self.written, self.left = 0, None

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        part = data[:TAKEN - self.written]
        self.written += self.handle.write(part)
        if len(part) < len(data):
            self.handle.flush()
            self.left = os.path.getsize(self.temp)
            raise self.exc
        return len(part)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.handle.close()


@pytest.fixture
def writes_fail(monkeypatch):
    """``writes_fail(exc)``: each export's temporary file takes ``TAKEN`` bytes, then raises
    ``exc``; returns the list of the failing handles made."""
    made: list[_FailingHandle] = []

    def failing(exc: BaseException) -> list[_FailingHandle]:
        real = export._open_temp

        def open_temp(out):
            made.append(_FailingHandle(*real(out), exc))
            return made[-1], made[-1].temp

        monkeypatch.setattr(export, "_open_temp", open_temp)
        return made

    return failing


def _tensor() -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32)


@pytest.mark.parametrize("ext", EXPORT_FORMATS)
def test_a_full_disk_is_an_export_error_and_leaves_nothing(tmp_path, writes_fail, ext):
    handles = writes_fail(OSError(errno.ENOSPC, "No space left on device"))
    target = tmp_path / f"x{ext}"
    with pytest.raises(ExportError, match=rf"could not write .*x\{ext} \(No space left on device\); nothing was "
                                          r"written: make room there .* or export elsewhere") as raised:
        export_tensor(_tensor(), target, name="x")
    assert [h.left for h in handles] == [TAKEN]  # the write did fail part-way
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ext", EXPORT_FORMATS)
def test_ctrl_c_during_a_write_leaves_nothing_and_stays_an_interrupt(tmp_path, writes_fail, ext):
    handles = writes_fail(KeyboardInterrupt())
    target = tmp_path / f"x{ext}"
    target.write_bytes(b"before")
    with pytest.raises(KeyboardInterrupt):
        export_tensor(_tensor(), target, name="x")
    assert [h.left for h in handles] == [TAKEN]
    assert list(tmp_path.iterdir()) == [target] and target.read_bytes() == b"before"


def test_a_torch_error_that_is_not_the_write_is_raised_as_it_is(tmp_path, monkeypatch):
    """Only the write's own failure becomes ``ExportError``; a ``RuntimeError`` of torch.save
    with no failed write behind it (a bug) keeps its type and message, and no file is left."""
    def broken_save(tensor, handle):
        handle.write(b"partial")
        raise RuntimeError("a bug in torch.save")

    monkeypatch.setattr(export.torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="^a bug in torch.save$") as raised:
        export_tensor(_tensor(), tmp_path / "x.pt", name="x")
    assert not isinstance(raised.value, ExportError)
    assert list(tmp_path.iterdir()) == []
