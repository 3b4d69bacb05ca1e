"""Where pack files live: a directory on a ``pyarrow.fs`` filesystem.

Sealing is an operation of the store, not of the writer, because it differs by backend:

* :class:`LocalPackStore` (a local directory, the default) writes to a hidden temporary
  name, fsyncs the file, renames it to ``<pack_id>.arrow`` and fsyncs the directory. A
  crash at any point leaves either the sealed pack or a temporary file that
  :meth:`PackStore.list_packs` never reports and no pack id can name.
* :class:`PackStore` (any other ``pyarrow.fs`` filesystem, e.g. S3) writes the final key
  directly: object stores have no atomic rename, and a multipart upload becomes visible
  only when it completes.

Range reads go through :class:`PackInput`, which reads straight into caller-owned
buffers (``os.preadv`` locally, no intermediate copy) and turns short reads into
:class:`PackTruncatedError`.
"""

from __future__ import annotations

import errno
import os
import secrets
from contextlib import suppress

import pyarrow as pa
import pyarrow.fs as pafs

from dmi.storage._pack_names import PACK_SUFFIX, is_pack_id
from dmi.storage.errors import (
    InvalidArgumentError,
    PackError,
    PackNotFoundError,
    PackSealError,
    PackTruncatedError,
)

__all__ = ["PackStore", "LocalPackStore", "PackInput", "PackSink"]


def _check_pack_id(pack_id: str) -> None:
    if not isinstance(pack_id, str) or not is_pack_id(pack_id):
        raise InvalidArgumentError(f"not a pack id: {pack_id!r} (expected 32 lowercase hex digits)")


def _is_missing(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or getattr(exc, "errno", None) == errno.ENOENT


class PackInput:
    """A pack opened for range reads. Thread-safe: every read is positional."""

    def __init__(self, pack_id: str, file: pa.NativeFile):
        self.pack_id = pack_id
        self._file = file

    @property
    def size(self) -> int:
        return self._file.size()

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
    """Local file: ``os.preadv`` straight into the caller's buffer, GIL released."""

    def __init__(self, pack_id: str, path: str):
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found at {path}") from exc
            raise PackError(f"pack {pack_id}: cannot open {path}: {exc}") from exc
        self.pack_id = pack_id
        self._path = path
        self._file = None

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read_into(self, offset: int, out) -> None:
        view = memoryview(out).cast("B")
        filled = 0
        while filled < len(view):
            try:
                n = os.preadv(self._fd, [view[filled:]], offset + filled)
            except OSError as exc:
                raise PackError(f"pack {self.pack_id}: read at {offset + filled} failed: {exc}") from exc
            if n == 0:
                raise self._truncated(offset, len(view), filled)
            filled += n

    def arrow_file(self) -> pa.NativeFile:
        if self._file is None:
            self._file = pa.OSFile(self._path, "rb")
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PackSink:
    """A pack being written. ``stream`` takes the bytes; :meth:`seal` makes them a pack."""

    def __init__(self, store: PackStore, pack_id: str, stream: pa.NativeFile):
        self.store = store
        self.pack_id = pack_id
        self.stream = stream

    def seal(self) -> int:
        """Make the pack durable and visible under its id; return its size in bytes."""
        try:
            size = self.stream.tell()
            self.stream.close()
        except OSError as exc:
            raise PackSealError(f"pack {self.pack_id}: could not complete the upload: {exc}") from exc
        return size

    def abort(self) -> None:
        """Give up: nothing under this pack id becomes (or stays) visible."""
        with suppress(OSError):
            self.stream.close()
        with suppress(OSError):
            self.store.filesystem.delete_file(self.store._path(self.pack_id))


class _LocalPackSink(PackSink):
    """Temporary name → fsync → rename → fsync directory. Each step is its own method."""

    def __init__(self, store: LocalPackStore, pack_id: str):
        self.store = store
        self.pack_id = pack_id
        self.final_path = store._path(pack_id)
        self.temp_path = os.path.join(store.root, f".{pack_id}.{secrets.token_hex(4)}.tmp")
        try:
            self.stream = pa.OSFile(self.temp_path, "wb")
        except OSError as exc:
            raise PackSealError(f"pack {pack_id}: cannot create {self.temp_path}: {exc}") from exc

    def seal(self) -> int:
        try:
            size = self.stream.tell()
            self._close_stream()
            self._fsync_file()
            self._rename()
        except OSError as exc:
            self.abort()
            raise PackSealError(f"pack {self.pack_id}: sealing failed, nothing published: {exc}") from exc
        try:
            self._fsync_dir()
        except OSError as exc:
            raise PackSealError(
                f"pack {self.pack_id}: renamed into place but the directory fsync failed "
                f"({exc}); the pack is complete but may not survive a power loss"
            ) from exc
        return size

    def abort(self) -> None:
        with suppress(OSError):
            self.stream.close()
        with suppress(FileNotFoundError):
            os.unlink(self.temp_path)

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


class PackStore:
    """Pack files in one directory of a ``pyarrow.fs`` filesystem (object storage path).

    Use :meth:`local` or :meth:`from_uri`; construct directly to choose a filesystem.
    """

    def __init__(self, filesystem: pafs.FileSystem, root: str, *, uri: str | None = None):
        self.filesystem = filesystem
        self.root = root.rstrip("/") or "/"
        self._uri = uri or f"{filesystem.type_name}://{self.root}"

    @staticmethod
    def local(path: str | os.PathLike) -> LocalPackStore:
        """A local directory (created if missing)."""
        return LocalPackStore(path)

    @staticmethod
    def from_uri(uri_or_path: str | os.PathLike) -> PackStore:
        """A plain path or ``file://`` URI → local; anything else ``pyarrow.fs`` understands."""
        text = os.fspath(uri_or_path)
        if "://" not in text:
            return LocalPackStore(text)
        try:
            filesystem, path = pafs.FileSystem.from_uri(text)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InvalidArgumentError(f"cannot open pack store {text!r}: {exc}") from exc
        if isinstance(filesystem, pafs.LocalFileSystem):
            return LocalPackStore(path)
        return PackStore(filesystem, path, uri=text)

    @property
    def uri(self) -> str:
        return self._uri

    def _path(self, pack_id: str) -> str:
        return f"{self.root}/{pack_id}{PACK_SUFFIX}"

    def location(self, pack_id: str) -> str:
        """Where the pack's file is: a URI (a plain path for local stores)."""
        _check_pack_id(pack_id)
        return f"{self._uri.rstrip('/')}/{pack_id}{PACK_SUFFIX}"

    def list_packs(self) -> list[str]:
        """Ids of sealed packs, sorted. Temporary files are never listed."""
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError as exc:
            raise PackError(f"cannot list pack store {self._uri}: {exc}") from exc
        return sorted(_pack_id_of(info.base_name) for info in infos if _pack_id_of(info.base_name))

    def exists(self, pack_id: str) -> bool:
        _check_pack_id(pack_id)
        return self.filesystem.get_file_info(self._path(pack_id)).type == pafs.FileType.File

    def open_input(self, pack_id: str) -> PackInput:
        """Open a sealed pack for range reads; :class:`PackNotFoundError` if it is not there."""
        _check_pack_id(pack_id)
        try:
            return PackInput(pack_id, self.filesystem.open_input_file(self._path(pack_id)))
        except OSError as exc:
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found in {self._uri}") from exc
            raise PackError(f"pack {pack_id}: cannot open in {self._uri}: {exc}") from exc

    def create(self, pack_id: str) -> PackSink:
        """Start writing a new pack; it becomes visible only when the sink is sealed."""
        _check_pack_id(pack_id)
        try:
            if self.exists(pack_id):
                raise PackSealError(f"pack {pack_id} already exists in {self._uri}")
            self.filesystem.create_dir(self.root, recursive=True)
            return PackSink(self, pack_id, self.filesystem.open_output_stream(self._path(pack_id)))
        except PackSealError:
            raise
        except OSError as exc:
            raise PackSealError(f"pack {pack_id}: cannot create in {self._uri}: {exc}") from exc

    def delete(self, pack_id: str) -> None:
        """Remove a sealed pack (garbage collection of unpublished test packs, tooling)."""
        _check_pack_id(pack_id)
        try:
            self.filesystem.delete_file(self._path(pack_id))
        except OSError as exc:
            if _is_missing(exc):
                raise PackNotFoundError(f"pack {pack_id} not found in {self._uri}") from exc
            raise PackError(f"pack {pack_id}: cannot delete: {exc}") from exc

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._uri!r})"


class LocalPackStore(PackStore):
    """A local directory: temp-name + fsync + rename + fsync-dir sealing, ``preadv`` reads."""

    def __init__(self, path: str | os.PathLike):
        root = os.path.abspath(os.fspath(path))
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise PackError(f"cannot create pack directory {root}: {exc}") from exc
        super().__init__(pafs.LocalFileSystem(), root, uri=f"file://{root}")

    def location(self, pack_id: str) -> str:
        _check_pack_id(pack_id)
        return self._path(pack_id)

    def exists(self, pack_id: str) -> bool:
        _check_pack_id(pack_id)
        return os.path.isfile(self._path(pack_id))

    def open_input(self, pack_id: str) -> PackInput:
        _check_pack_id(pack_id)
        return _LocalPackInput(pack_id, self._path(pack_id))

    def create(self, pack_id: str) -> PackSink:
        _check_pack_id(pack_id)
        return _LocalPackSink(self, pack_id)  # an existing pack is refused at rename time


def _pack_id_of(name: str) -> str | None:
    if name.endswith(PACK_SUFFIX) and is_pack_id(name[: -len(PACK_SUFFIX)]):
        return name[: -len(PACK_SUFFIX)]
    return None
