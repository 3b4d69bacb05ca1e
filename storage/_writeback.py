"""Start the kernel writing a file's dirty pages to disk without waiting for it.

A pack is made durable by one ``fsync`` at its seal. Written pages otherwise sit dirty in
the page cache until then, so the seal waits for the whole pack's I/O after all of its
encoding is done. Started early (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which
queues the writeback and returns), the disk works while the writer encodes the next records
and the seal's ``fsync`` finds little left (``bench/bench_storage.py``; docs/pack-format.md,
"Write-behind"). The seal's ``fsync`` stays the only durability point.

Where the call does not exist (not Linux), a sandbox refuses it (``EPERM``) or the file
cannot take it, nothing is started and sealing works as before.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["WRITEBACK_BYTES", "start_writeback"]

WRITEBACK_BYTES = 8 * 1024 * 1024
"""A local pack starts the writeback of what it holds each time this much more was written."""

_SYNC_FILE_RANGE_WRITE = 2
# not a failure of the disk: no such call (or a sandbox that refuses it), a file that cannot take it
_UNSUPPORTED = (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP)


def _bind():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError, TypeError):  # no C library of this process, or no such call
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _bind()


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Queue the writeback of ``nbytes`` at ``offset`` of ``fd`` (the GIL is released).

    Returns False where it cannot be started here (no such call, a file that does not take it),
    so the caller stops asking; raises :class:`OSError` for a failure of the disk or the file
    (``EIO``, ``ENOSPC``), which the writer treats as a failed write."""
    if _sync_file_range is None:
        return False
    if _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, f"starting the writeback of {nbytes} bytes failed: {os.strerror(code)}")
