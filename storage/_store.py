"""Where pack files live: the :class:`PackStore` contract and its two stores.

A store is a flat namespace of sealed packs named ``<pack_id>.arrow``. The contract is four
primitives each store implements — list the names it holds, open one pack for ranged reads
(:class:`PackInput`), create a :class:`PackSink` whose :meth:`PackSink.seal` makes the pack
visible exactly once and refuses an id that already exists, delete — plus where a pack is
(``location``, ``uri``). The base class validates pack ids, filters listings down to pack
names and derives ``exists``, so every store shares those rules; ``tests/pack_store_conformance.py``
is the suite every store passes.

Sealing is an operation of the store, not of the writer, because it differs by backend:

* :class:`LocalPackStore` (a local directory, the default) writes to a hidden temporary
  name (around the page cache where the filesystem allows it: ``_direct_write.py``; else
  through it, starting the disk's writeback as it grows: ``_writeback.py``), fsyncs the file,
  renames it to ``<pack_id>.arrow`` and fsyncs the directory. A crash at any point leaves
  either the sealed pack or a temporary file that :meth:`PackStore.list_packs` never
  reports and no pack id can name.
* :class:`FileSystemPackStore` (any other ``pyarrow.fs`` filesystem) writes the final key
  directly: object stores have no atomic rename, and a multipart upload becomes visible
  only when it completes. ``s3://`` URIs get :class:`~dmi.storage.S3PackStore` instead
  (``_store_s3.py``: one create-if-absent PUT per seal).

Range reads go through :class:`PackInput`, which reads straight into caller-owned
buffers (``os.preadv`` locally, no intermediate copy) and turns short reads into
:class:`PackTruncatedError`. ``open_input(pack_id, direct=True)`` asks for reads around the
page cache (``O_DIRECT``): a local store gives an input whose :attr:`PackInput.alignment`
is :data:`DIRECT_ALIGNMENT` where its filesystem allows it; every other store, and a
filesystem that refuses ``O_DIRECT`` (tmpfs), reads through the cache as usual
(``alignment`` 0). Why and when: docs/loader.md, "Direct I/O".
"""

from __future__ import annotations

import errno
import importlib
import os
import secrets
import stat
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from contextlib import suppress

import pyarrow as pa
import pyarrow.fs as pafs

from dmi.storage._direct_write import DIRECT_ALIGNMENT, open_direct
from dmi.storage._pack_names import PACK_SUFFIX, is_pack_id
from dmi.storage._writeback import WRITEBACK_BYTES, start_writeback
from dmi.storage.errors import (
    InvalidArgumentError,
    PackError,
    PackNotDurableError,
    PackNotFoundError,
    PackSealError,
    PackTruncatedError,
)

__all__ = ["PackStore", "LocalPackStore", "FileSystemPackStore", "PackInput", "PackSink", "DIRECT_ALIGNMENT",
           "full_disk_advice"]


def _check_pack_id(pack_id: str) -> None:
    if not isinstance(pack_id, str) or not is_pack_id(pack_id):
        raise InvalidArgumentError(f"not a pack id: {pack_id!r} (expected 32 lowercase hex digits)")


def _is_missing(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENOENT


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def full_disk_advice(exc: BaseException, where: str) -> str:
    """What to do about ``exc``, as the end of an error message, where it is a full disk (or
    quota) under the store ``where``; "" for any other failure. A full disk is the one write
    failure a user fixes, so the message says how: the errno alone does not name the store."""
    if getattr(exc, "errno", None) not in _NO_SPACE:
        return ""
    return (f"; the disk holding {where} is full: free space there (or give the store a larger disk) "
            "and run again; packs sealed before this one are complete, and any not yet published are "
            "found by `dmi recover`")


class PackInput:
    """A pack opened for range reads. Thread-safe: every read is positional."""

    alignment = 0
    """0: reads go through the page cache and take any offset and length. Otherwise the input
    reads around it (:meth:`read_direct_into`), in multiples of ``alignment``."""

    def __init__(self, pack_id: str, file: pa.NativeFile):
        self.pack_id = pack_id
        self._file = file

    @property
    def size(self) -> int:
        return self._file.size()

    @property
    def version(self) -> Hashable:
        """What tells this file apart from another put under its name since: a pack replaced by
        one of another version must not be read through the index cached for the old one.
        ``None``: nothing does (this input knows no more than its bytes), so a reader holding a
        cached index reads the index again from this input rather than trust it."""
        return None

    def read_into(self, offset: int, out) -> None:
        """Fill the writable buffer ``out`` with the bytes at ``[offset, offset + len(out))``."""
        view = memoryview(out).cast("B")
        try:
            data = self._file.read_at(len(view), offset)
        except OSError as exc:
            raise PackError(f"pack {self.pack_id}: read at {offset} failed: {exc}") from exc
        if len(data) != len(view):
            raise self._truncated(offset, len(view), len(data))
        view[:] = memoryview(data)

    def read_direct_into(self, offset: int, out, needed: int) -> None:
        """Fill ``out`` from ``offset`` around the page cache. ``offset``, ``len(out)`` and the
        address of ``out`` are multiples of :attr:`alignment`; the file may end inside ``out``,
        but not before its first ``needed`` bytes (else :class:`PackTruncatedError`)."""
        raise PackError(f"pack {self.pack_id}: this input reads through the page cache only (alignment 0)")

    def arrow_file(self) -> pa.NativeFile:
        """The underlying pyarrow file, for ``pyarrow.ipc.open_file``."""
        return self._file

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PackInput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _truncated(self, offset: int, wanted: int, got: int) -> PackTruncatedError:
        return PackTruncatedError(
            f"pack {self.pack_id}: file ends before byte {offset + wanted} "
            f"(read {got} of {wanted} bytes at offset {offset}); the pack is truncated"
        )


class _LocalPackInput(PackInput):
    """Local file: ``os.preadv`` straight into the caller's buffer, GIL released. With
    ``direct``, a second descriptor opened ``O_DIRECT`` serves :meth:`read_direct_into`
    where the filesystem allows it."""

    def __init__(self, pack_id: str, path: str, *, direct: bool = False):
        self.pack_id = pack_id
        self._path = path
        self._file = None
        self._fd = self._direct_fd = -1
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = _open_regular(pack_id, path, flags)
            if direct and hasattr(os, "O_DIRECT"):
                self._open_direct(flags | os.O_DIRECT)
        except OSError as exc:
            self.close()
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found at {path}") from exc
            raise PackError(f"pack {pack_id}: cannot open {path}: {exc}") from exc

    def _open_direct(self, flags: int) -> None:
        """The ``O_DIRECT`` descriptor; a filesystem without direct I/O (EINVAL) leaves reads cached."""
        try:
            self._direct_fd = os.open(self._path, flags)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return
        self.alignment = DIRECT_ALIGNMENT

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    @property
    def version(self) -> Hashable:
        """Size, modification and status-change times, inode and device, from one ``fstat``: a
        file renamed over the pack (a restored backup, a re-sealed pack) has another inode, one
        rewritten in place another ``st_ctime_ns`` (which no one can set back), whatever its size."""
        st = os.fstat(self._fd)
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def read_into(self, offset: int, out) -> None:
        view = memoryview(out).cast("B")
        filled = self._fill(self._fd, view, offset, block=0)
        if filled < len(view):
            raise self._truncated(offset, len(view), filled)

    def read_direct_into(self, offset: int, out, needed: int) -> None:
        filled = self._fill(self._direct_fd, memoryview(out).cast("B"), offset, block=self.alignment)
        if filled < needed:
            raise self._truncated(offset, needed, filled)

    def _fill(self, fd: int, view: memoryview, offset: int, *, block: int) -> int:
        """Bytes read into ``view`` from ``offset`` until it is full or the file ends: a read of
        0 bytes, or (``block`` > 0, direct reads) one that is not whole blocks — only the file's
        last block comes back short, and the next offset would not be aligned."""
        filled = 0
        while filled < len(view):
            try:
                n = os.preadv(fd, [view[filled:]], offset + filled)
            except OSError as exc:
                raise PackError(f"pack {self.pack_id}: read at {offset + filled} failed: {exc}") from exc
            filled += n
            if n == 0 or (block and n % block):
                break
        return filled

    def arrow_file(self) -> pa.NativeFile:
        """The file this input opened, not its path again: a pack deleted or replaced since
        the open still reads as the one opened. Reopened through ``/dev/fd`` where the system
        has it, as an Arrow ``OSFile``: a ``PythonFile`` over the descriptor would make a Python
        call of every read (``verify_pack`` reads whole packs through it)."""
        if self._file is None:
            by_fd = f"/dev/fd/{self._fd}"
            self._file = pa.OSFile(by_fd if os.path.exists(by_fd) else self._path, "rb")
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1


class _FileSystemPackInput(PackInput):
    """A pack of a :class:`FileSystemPackStore`, with the modification time its filesystem gave
    for it just before the open (``FileInfo.mtime_ns``; ``None`` where the filesystem gives none)."""

    def __init__(self, pack_id: str, file: pa.NativeFile, filesystem: pafs.FileSystem, path: str,
                 modified_ns: int | None):
        super().__init__(pack_id, file)
        self._filesystem = filesystem
        self._path = path
        self._modified_ns = modified_ns
        self._version: Hashable = _UNASKED

    @property
    def version(self) -> Hashable:
        """Size and modification time, when the time taken before the open is the time the file
        has still when first asked (one more ``get_file_info``): then the bytes opened are that
        version's. ``None`` (the index is read again) where the filesystem gives no time, the
        file changed around the open, or its time cannot be asked now (an ``OSError``: the reads
        that follow meet it, or not, on their own). Unseen: a replacement of the same size given
        the same time (a copy that keeps times, or one within the filesystem's time resolution)."""
        if self._version is _UNASKED:
            self._version = None if self._modified_ns is None else self._version_now()
        return self._version

    def _version_now(self) -> Hashable:
        try:
            now = _modified_ns(self._filesystem, self._path)
        except OSError:
            return None
        return (self.size, now) if now == self._modified_ns else None


_UNASKED = object()
"""A :class:`_FileSystemPackInput` whose version no one has asked for yet."""


def _modified_ns(filesystem: pafs.FileSystem, path: str) -> int | None:
    """``path``'s modification time in nanoseconds, ``None`` where the filesystem gives none (or
    nothing is there: the open that follows says so)."""
    return filesystem.get_file_info(path).mtime_ns


class PackSink(ABC):
    """A pack being written. ``stream`` takes the bytes; :meth:`seal` makes them a pack.

    A sink is used once: either :meth:`seal` (the pack becomes visible under its id, or
    :class:`PackSealError` and nothing new is visible — but for :class:`PackNotDurableError`,
    whose pack is whole and visible) or :meth:`abort`.
    """

    store: PackStore
    pack_id: str
    stream: pa.NativeFile

    @abstractmethod
    def seal(self) -> int:
        """Make the pack durable and visible under its id; return its size in bytes.

        Raises :class:`PackSealError` if the bytes cannot be made a pack, or if a pack with
        this id already exists (which stays as it was); :class:`PackNotDurableError` (a
        ``PackSealError``) where the pack is complete and visible but could not be made
        durable (a local store's directory fsync after the rename failed).
        """

    @abstractmethod
    def abort(self) -> str | None:
        """Give up: nothing under this pack id becomes (or stays) visible. Never raises; returns
        what could not be cleaned up (e.g. a temporary file it could not remove), or ``None``."""

    def written(self) -> None:
        """Bytes were just added to :attr:`stream`: a sink may start making them durable now,
        so :meth:`seal` waits less. Raises :class:`OSError` if the bytes cannot be stored."""


class _FileSystemPackSink(PackSink):
    """Writes the final key directly; closing the stream completes the upload."""

    def __init__(self, store: FileSystemPackStore, pack_id: str, stream: pa.NativeFile):
        self.store = store
        self.pack_id = pack_id
        self.stream = stream

    def seal(self) -> int:
        try:
            size = self.stream.tell()
            self.stream.close()
        except OSError as exc:
            left = self.abort()  # a failed upload may have left part of the file under the pack's name
            raise PackSealError(
                f"pack {self.pack_id}: could not complete the upload: {exc}"
                + full_disk_advice(exc, self.store.uri) + (f"; {left}" if left else "")
            ) from exc
        return size

    def abort(self) -> str | None:
        with suppress(OSError):
            self.stream.close()
        path = self.store._path(self.pack_id)
        try:
            self.store.filesystem.delete_file(path)
        except OSError as exc:
            if not _is_missing(exc):
                return f"{path} may hold part of the pack and could not be deleted ({exc}); delete it by hand"
        return None


class _LocalPackSink(PackSink):
    """Temporary name → fsync → rename → fsync directory. Each step is its own method."""

    def __init__(self, store: LocalPackStore, pack_id: str):
        self.store = store
        self.pack_id = pack_id
        self.final_path = store._path(pack_id)
        self.temp_path = os.path.join(store.root, f".{pack_id}.{secrets.token_hex(4)}.tmp")
        try:
            direct = open_direct(self.temp_path) if store.direct_writes else None
            self.stream = pa.OSFile(self.temp_path, "wb") if direct is None else direct
        except OSError as exc:
            raise PackSealError(
                f"pack {pack_id}: cannot create {self.temp_path}: {exc}" + full_disk_advice(exc, store.root)
            ) from exc
        # None: nothing to start early (a direct write is on its way to disk already, or this
        # file cannot take an early writeback)
        self._writeback_from: int | None = 0 if direct is None else None

    def written(self) -> None:
        """Start the disk on every :data:`WRITEBACK_BYTES` written (``_writeback.py``)."""
        start = self._writeback_from
        if start is None:
            return
        end = self.stream.tell()
        if end - start >= WRITEBACK_BYTES:
            started = start_writeback(self.stream.fileno(), start, end - start)
            self._writeback_from = end if started else None

    def seal(self) -> int:
        try:
            size = self.stream.tell()
            self._close_stream()
            self._fsync_file()
            self._rename()
        except OSError as exc:
            left = self.abort()
            raise PackSealError(
                f"pack {self.pack_id}: sealing failed, nothing published: {exc}"
                + full_disk_advice(exc, self.store.root) + (f"; {left}" if left else "")
            ) from exc
        try:
            self._fsync_dir()
        except OSError as exc:
            raise PackNotDurableError(
                f"pack {self.pack_id}: renamed into place but the directory fsync failed "
                f"({exc}); the pack is complete and visible but may not survive a power loss: "
                f"check the disk holding {self.store.root}"
            ) from exc
        return size

    def abort(self) -> str | None:
        with suppress(OSError):
            self.stream.close()
        try:
            os.unlink(self.temp_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            return f"the temporary file {self.temp_path} could not be removed ({exc}); delete it by hand"
        return None

    def _close_stream(self) -> None:
        self.stream.close()

    def _fsync_file(self) -> None:
        fd = os.open(self.temp_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _rename(self) -> None:
        if os.path.exists(self.final_path):
            raise FileExistsError(errno.EEXIST, "pack already exists", self.final_path)
        os.rename(self.temp_path, self.final_path)

    def _fsync_dir(self) -> None:
        fd = os.open(self.store.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class PackStore(ABC):
    """The pack storage contract: list, open for ranged reads, seal-once write, delete.

    Use :meth:`local` or :meth:`from_uri`, or construct a concrete store. Subclasses
    implement the primitives (``_list_names``, ``_open_input``, ``_create``, ``_delete``,
    ``_location``, :attr:`uri`); the public methods here check the pack id first, so no
    primitive ever sees a malformed one (a path like ``../x`` never reaches a filesystem).
    """

    @staticmethod
    def local(path: str | os.PathLike) -> LocalPackStore:
        """A local directory (created if missing)."""
        return LocalPackStore(path)

    @staticmethod
    def from_uri(uri_or_path: str | os.PathLike) -> PackStore:
        """A plain path or ``file://`` URI → local; ``s3://`` → :class:`~dmi.storage.S3PackStore`
        (conditional-PUT sealing); anything else ``pyarrow.fs`` understands → generic."""
        text = os.fspath(uri_or_path)
        directory = PackStore.local_directory(text)
        if directory is not None:
            return LocalPackStore(directory)
        scheme = text.split("://", 1)[0]
        if scheme in _SCHEME_STORES:
            return _scheme_store(scheme)(text)
        filesystem, path = _filesystem_of(text)
        if isinstance(filesystem, pafs.LocalFileSystem):
            _refuse_local_uri_extras(text)
            return LocalPackStore(path)
        return FileSystemPackStore(filesystem, path, uri=text)

    @staticmethod
    def local_directory(uri_or_path: str | os.PathLike) -> str | None:
        """The directory a plain path or ``file://`` URI names, checked as :meth:`from_uri`
        checks it (:class:`InvalidArgumentError`) but not created; ``None`` for any other URI.
        For a caller that must refuse a bad URI before it creates anything else."""
        text = os.fspath(uri_or_path)
        if "://" not in text:
            return text
        if text.split("://", 1)[0].lower() != "file":
            return None
        filesystem, path = _filesystem_of(text)
        if not isinstance(filesystem, pafs.LocalFileSystem):
            return None
        _refuse_local_uri_extras(text)
        return path

    @property
    @abstractmethod
    def uri(self) -> str:
        """The store itself as a URI (``file://<dir>`` for local stores)."""

    def location(self, pack_id: str) -> str:
        """Where the pack's file is: a URI (a plain path for local stores)."""
        _check_pack_id(pack_id)
        return self._location(pack_id)

    def list_packs(self) -> list[str]:
        """Ids of sealed packs, sorted. Temporary and foreign files are never listed."""
        return sorted(pack_id for pack_id in map(_pack_id_of, self._list_names()) if pack_id)

    def not_regular_files(self, pack_ids: Iterable[str]) -> dict[str, str]:
        """Of ``pack_ids`` (as :meth:`list_packs` gave them), those whose entry is not a regular
        file, each with what it is in words (``"FIFO"``, ``"directory"``): no pack can be read
        from one, so recovery skips and names them instead of stopping at the first. Stores
        that list only files (object stores, ``pyarrow.fs``) have none."""
        return {}

    def exists(self, pack_id: str) -> bool:
        """Whether a sealed pack has this id."""
        _check_pack_id(pack_id)
        return self._exists(pack_id)

    def open_input(self, pack_id: str, *, direct: bool = False) -> PackInput:
        """Open a sealed pack for range reads; :class:`PackNotFoundError` if it is not there.
        ``direct``: read around the page cache where this store can (``PackInput.alignment``)."""
        _check_pack_id(pack_id)
        return self._open_direct_input(pack_id) if direct else self._open_input(pack_id)

    def create(self, pack_id: str) -> PackSink:
        """Start writing a new pack; it becomes visible only when the sink is sealed."""
        _check_pack_id(pack_id)
        return self._create(pack_id)

    def delete(self, pack_id: str) -> None:
        """Remove a sealed pack (garbage collection of deleted runs, tooling).

        A pack that is not there is a :class:`PackNotFoundError`, so a caller that races
        another deleter (``purge``) sees it and can skip, and a typo is not silent.
        """
        _check_pack_id(pack_id)
        self._delete(pack_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    @abstractmethod
    def _location(self, pack_id: str) -> str:
        """The location of a (valid) pack id."""

    @abstractmethod
    def _list_names(self) -> Iterable[str]:
        """Base names of the files in the store (an empty store, or no store yet: none)."""

    @abstractmethod
    def _open_input(self, pack_id: str) -> PackInput:
        """Open a sealed pack; :class:`PackNotFoundError` if there is none."""

    def _open_direct_input(self, pack_id: str) -> PackInput:
        """A sealed pack for reads around the page cache; stores that have none read through it."""
        return self._open_input(pack_id)

    @abstractmethod
    def _create(self, pack_id: str) -> PackSink:
        """A sink for a new pack, invisible until sealed."""

    @abstractmethod
    def _delete(self, pack_id: str) -> None:
        """Remove a sealed pack; :class:`PackNotFoundError` if there is none."""

    def _exists(self, pack_id: str) -> bool:
        """Derived from opening the pack; stores with a cheaper lookup override it."""
        try:
            self._open_input(pack_id).close()
        except PackNotFoundError:
            return False
        return True


class LocalPackStore(PackStore):
    """A local directory: temp-name + fsync + rename + fsync-dir sealing, ``preadv`` reads.

    ``direct_writes`` (the default) writes packs around the page cache where the filesystem
    allows ``O_DIRECT`` (``_direct_write.py``); False writes them through it, which leaves a
    pack just written in memory for a reader that follows at once."""

    def __init__(self, path: str | os.PathLike, *, direct_writes: bool = True):
        self.root = os.path.abspath(os.fspath(path))
        self.direct_writes = direct_writes
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise PackError(f"cannot create pack directory {self.root}: {exc}") from exc

    @property
    def uri(self) -> str:
        return f"file://{self.root}"

    def _path(self, pack_id: str) -> str:
        return os.path.join(self.root, f"{pack_id}{PACK_SUFFIX}")

    def _location(self, pack_id: str) -> str:
        return self._path(pack_id)

    def _list_names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except OSError as exc:
            raise PackError(f"cannot list pack store {self.uri}: {exc}") from exc

    def _exists(self, pack_id: str) -> bool:
        return os.path.isfile(self._path(pack_id))

    def not_regular_files(self, pack_ids: Iterable[str]) -> dict[str, str]:
        """One ``stat`` a pack id; a name that vanished since it was listed is left to the read,
        which says it is missing."""
        odd = {}
        for pack_id in pack_ids:
            _check_pack_id(pack_id)
            try:
                mode = os.stat(self._path(pack_id)).st_mode
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise PackError(f"pack {pack_id}: cannot stat {self._path(pack_id)}: {exc}") from exc
            if not stat.S_ISREG(mode):
                odd[pack_id] = _file_kind(mode)
        return odd

    def _open_input(self, pack_id: str) -> PackInput:
        return _LocalPackInput(pack_id, self._path(pack_id))

    def _open_direct_input(self, pack_id: str) -> PackInput:
        return _LocalPackInput(pack_id, self._path(pack_id), direct=True)

    def _create(self, pack_id: str) -> PackSink:
        return _LocalPackSink(self, pack_id)  # an existing pack is refused at rename time

    def _delete(self, pack_id: str) -> None:
        try:
            os.unlink(self._path(pack_id))
        except OSError as exc:
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found in {self.uri}") from exc
            raise PackError(f"pack {pack_id}: cannot delete: {exc}") from exc


class FileSystemPackStore(PackStore):
    """Pack files in one directory of any ``pyarrow.fs`` filesystem (the object-storage path).

    A pack is written straight to its final key and becomes visible when the upload
    completes (object stores have no atomic rename). What guards a double write is the
    check in :meth:`create`: an id that already exists is refused before anything is
    written. Two sinks created concurrently for the same id are not refused by that check
    (on an object store the later upload would replace the earlier one); pack ids are 128
    random bits, so only a bug reuses one. For S3, :class:`~dmi.storage.S3PackStore` makes
    the final write create-if-absent (``If-None-Match: *``). On filesystems that show a file as soon as it
    is opened for writing (pyarrow's ``LocalFileSystem``), an unsealed pack is visible
    under its name while it is written; use :class:`LocalPackStore` for local disks.
    """

    def __init__(self, filesystem: pafs.FileSystem, root: str, *, uri: str | None = None):
        self.filesystem = filesystem
        self.root = root.rstrip("/") or "/"
        self._uri = uri or f"{filesystem.type_name}://{self.root}"

    @property
    def uri(self) -> str:
        return self._uri

    def _path(self, pack_id: str) -> str:
        return f"{self.root}/{pack_id}{PACK_SUFFIX}"

    def _location(self, pack_id: str) -> str:
        return f"{self._uri.rstrip('/')}/{pack_id}{PACK_SUFFIX}"

    def _list_names(self) -> list[str]:
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError as exc:
            raise PackError(f"cannot list pack store {self._uri}: {exc}") from exc
        return [info.base_name for info in infos if info.type == pafs.FileType.File]

    def _open_input(self, pack_id: str) -> PackInput:
        """The pack, with its modification time taken first: a version read before the bytes can
        be older than them (the index is then read again), never newer (a stale one kept)."""
        path = self._path(pack_id)
        try:
            modified = _modified_ns(self.filesystem, path)
            return _FileSystemPackInput(pack_id, self.filesystem.open_input_file(path), self.filesystem, path, modified)
        except OSError as exc:
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found in {self._uri}") from exc
            raise PackError(f"pack {pack_id}: cannot open in {self._uri}: {exc}") from exc

    def _create(self, pack_id: str) -> PackSink:
        if self._exists(pack_id):
            raise PackSealError(f"pack {pack_id} already exists in {self._uri}")
        try:
            self.filesystem.create_dir(self.root, recursive=True)
            stream = self.filesystem.open_output_stream(self._path(pack_id))
        except OSError as exc:
            raise PackSealError(f"pack {pack_id}: cannot create in {self._uri}: {exc}") from exc
        return _FileSystemPackSink(self, pack_id, stream)

    def _delete(self, pack_id: str) -> None:
        try:
            self.filesystem.delete_file(self._path(pack_id))
        except OSError as exc:
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found in {self._uri}") from exc
            raise PackError(f"pack {pack_id}: cannot delete: {exc}") from exc


_SCHEME_STORES = {"s3": ("dmi.storage._store_s3", "S3PackStore")}
"""URI schemes served by a store of their own instead of :class:`FileSystemPackStore`: the
module and class, imported when such a URI is first opened (their client libraries are
optional, and the store module builds on this one)."""


def _filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """``pyarrow.fs``'s filesystem and path for ``uri``; a URI it refuses is an argument error."""
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidArgumentError(f"cannot open pack store {uri!r}: {exc}") from exc


def _refuse_local_uri_extras(uri: str) -> None:
    """A local (``file://``) store URI names a directory and nothing else: ``pyarrow.fs`` drops
    a query or fragment without a word, so one is refused rather than silently ignored."""
    if "?" in uri or "#" in uri:
        raise InvalidArgumentError(
            f"{uri!r}: a local pack store URI takes no query or fragment ('?', '#'); write "
            "file:///absolute/path, or pass the directory as a plain path (where '?' and '#' are "
            "part of the name)"
        )


def _open_regular(pack_id: str, path: str, flags: int) -> int:
    """A blocking descriptor of ``path``, refused (:class:`PackError`, naming the path) unless it
    is a regular file. Opened ``O_NONBLOCK`` first: opening a FIFO named like a pack would
    otherwise wait forever for a writer; a directory opens, so both are caught by ``fstat``."""
    fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PackError(
                f"pack {pack_id}: {path} is not a regular file (it is a {_file_kind(mode)}); "
                "move it out of the pack store, or restore the pack file there"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words, for error messages."""
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def _scheme_store(scheme: str) -> type[PackStore]:
    module, name = _SCHEME_STORES[scheme]
    return getattr(importlib.import_module(module), name)


def _pack_id_of(name: str) -> str | None:
    if name.endswith(PACK_SUFFIX) and is_pack_id(name[: -len(PACK_SUFFIX)]):
        return name[: -len(PACK_SUFFIX)]
    return None
