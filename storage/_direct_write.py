"""A local pack written around the page cache: ``O_DIRECT`` from reused, aligned staging buffers.

Why: a buffered write copies every byte into page-cache pages, which the kernel then writes
back and keeps. Where those pages are memory the machine has not touched lately (a VM whose
host reclaims free guest memory, as the project's benchmark VM does), the copy costs far more
CPU than the disk's own work, and that CPU is taken from the model during a capture. Here the writer copies
each byte once into a staging buffer it reuses, and the disk reads it from there
(``bench/bench_storage.py``'s ``dmi raw`` row and its ``buffered writes`` row; docs/pack-format.md,
"Writing around the page cache").

A :class:`DirectFile` fills :data:`STAGING_BYTES` buffers in order, behind an Arrow buffer of
:data:`ARROW_BUFFER_BYTES` that gathers the IPC writer's small pieces before they cost a Python call. A full one is written by
``pwrite`` on the file's own write thread (the GIL is released) while the next one fills; at
most :data:`STAGING_BUFFERS` are in flight, so a slow disk holds the writer back instead of
piling up memory. :meth:`DirectFile.close` writes the tail, zero-padded to
:data:`DIRECT_ALIGNMENT`, truncates the file to its length and raises the first write error.
Durability is still the sink's ``fsync`` at seal. Buffers go back to a small pool, so a run
that writes many packs keeps reusing the same memory.

:func:`open_direct` returns None where the filesystem refuses ``O_DIRECT``; the sink then
writes through the page cache as before.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

__all__ = ["ARROW_BUFFER_BYTES", "DIRECT_ALIGNMENT", "STAGING_BUFFERS", "STAGING_BYTES", "DirectFile", "open_direct"]

DIRECT_ALIGNMENT = 4096
"""Offset, length and buffer address of a direct read or write are multiples of this: 4 KiB
covers every logical block size Linux filesystems use for ``O_DIRECT`` (512 B and 4 KiB)."""

STAGING_BYTES = 4 * 1024 * 1024
"""One staging buffer: the size of each direct write but the last."""

STAGING_BUFFERS = 3
"""Buffers one file fills and writes in turn: one filling, the others on their way to disk."""

ARROW_BUFFER_BYTES = 256 * 1024
"""Arrow's own buffer in front of a :class:`DirectFile`: the IPC writer writes a record batch
as dozens of pieces (each column's buffers, padding, the metadata); gathered here in C++, they
reach the file's Python ``write`` once per this many bytes, and a piece at least this large
goes straight through."""

_POOL_KEPT = 8
_pool: list[np.ndarray] = []
_pool_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    """A child forked while another thread held the pool's lock would wait on it forever."""
    global _pool_lock
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def open_direct(path: str) -> pa.NativeFile | None:
    """``path`` created (or truncated) for direct writes, as an Arrow output stream; None where
    its filesystem refuses ``O_DIRECT`` (or this platform has none). Other failures raise
    :class:`OSError`."""
    if not hasattr(os, "O_DIRECT"):
        return None
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None
    return pa.BufferedOutputStream(pa.PythonFile(DirectFile(fd), mode="w"), buffer_size=ARROW_BUFFER_BYTES)


def _take_buffer() -> np.ndarray:
    """A page-aligned staging buffer, from the pool or new. Private memory: ``mmap``'s default
    (shared) would let a process forked after the pool filled write into its parent's
    buffers, each one's pack bytes landing in the other's."""
    with _pool_lock:
        if _pool:
            return _pool.pop()
    region = mmap.mmap(-1, STAGING_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8)


def _give_back(buffer: np.ndarray) -> None:
    with _pool_lock:
        if len(_pool) < _POOL_KEPT:
            _pool.append(buffer)


def _write_fully(fd: int, data: memoryview, offset: int) -> None:
    """``data`` at ``offset``; a short write is continued, a write of nothing is a full disk."""
    while data:
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "No space left on device (a direct write wrote nothing)")
        data, offset = data[written:], offset + written


class DirectFile:
    """The file object behind :func:`open_direct`'s stream (``write``, ``tell``, ``close``)."""

    def __init__(self, fd: int):
        self._fd = fd
        self._buffers: list[np.ndarray] = []
        self._pending: list[Future | None] = []
        self._current = 0  # index of the buffer being filled
        self._filled = 0  # bytes in it
        self._flushed = 0  # file offset where it goes
        self._thread: ThreadPoolExecutor | None = None
        self.closed = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._flushed + self._filled

    def flush(self) -> None:
        """Nothing to do: bytes reach the file as buffers fill and at :meth:`close`."""

    def write(self, data) -> int:
        if self.closed:
            raise ValueError("write to a closed pack file")
        source = np.frombuffer(data, dtype=np.uint8)
        done = 0
        while done < source.nbytes:
            buffer = self._filling()
            step = min(STAGING_BYTES - self._filled, source.nbytes - done)
            buffer[self._filled : self._filled + step] = source[done : done + step]
            self._filled += step
            done += step
            if self._filled == STAGING_BYTES:
                self._send_full()
        return done

    def close(self) -> None:
        """Write the tail and wait for every write; the first failure raises :class:`OSError`.
        The descriptor and the buffers are released whatever happens."""
        if self.closed:
            return
        self.closed = True
        try:
            self._write_tail()
            for index in range(len(self._pending)):
                self._wait(index)
        finally:
            self._release()

    def _filling(self) -> np.ndarray:
        """The buffer to fill, once its previous write (if any) has finished."""
        if self._current == len(self._buffers):
            self._buffers.append(_take_buffer())
            self._pending.append(None)
        elif self._filled == 0:
            self._wait(self._current)
        return self._buffers[self._current]

    def _send_full(self) -> None:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="dmi-pack-write")
        view = memoryview(self._buffers[self._current])
        self._pending[self._current] = self._thread.submit(_write_fully, self._fd, view, self._flushed)
        self._flushed += STAGING_BYTES
        self._filled = 0
        self._current = (self._current + 1) % STAGING_BUFFERS

    def _wait(self, index: int) -> None:
        pending = self._pending[index]
        self._pending[index] = None
        if pending is not None:
            pending.result()

    def _write_tail(self) -> None:
        if not self._filled:
            return
        self._wait(self._current)
        buffer = self._buffers[self._current]
        padded = -(-self._filled // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
        buffer[self._filled : padded] = 0
        _write_fully(self._fd, memoryview(buffer[:padded]), self._flushed)
        os.ftruncate(self._fd, self._flushed + self._filled)

    def _release(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        os.close(self._fd)
        for buffer in self._buffers:
            _give_back(buffer)
        self._buffers = []
