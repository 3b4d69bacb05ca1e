"""Embedded backend: chDB (ClickHouse in-process) on a directory.

chDB facts this backend is built around:

* **One process per directory.** The embedded server takes a file lock on
  ``<directory>/status``; a second process gets a generic "Error initializing
  EmbeddedServer". We probe the lock after such a failure and raise
  :class:`~dmi.catalog.CatalogLockedError` naming the directory and what to do.
* **One directory per process.** The embedded server is process-wide. Opening the same
  directory again shares one connection (reference counted); opening a *different*
  directory while one is open raises :class:`~dmi.catalog.CatalogError` saying which one
  is open. Close every catalog on it first, or use a ClickHouse server.
* **One statement at a time.** Every call goes through one process-wide lock, so many
  threads can share a catalog (parameterised queries on one shared session are not
  otherwise safe to interleave).
* Arrow inserts use chDB's ``Python(<name>)`` table function, which reads a pyarrow table
  from the calling frame's local variables without copying it through SQL text.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa

from dmi.catalog._catalog_backend import CatalogBackend, server_error_from_message
from dmi.catalog._sql import bind, quote_identifier, validate_identifier
from dmi.storage.errors import BackendNotInstalledError, CatalogError, CatalogLockedError

_registry_lock = threading.Lock()
_open: dict[str, object] = {"path": None, "conn": None, "refs": 0}
_statement_lock = threading.RLock()


def _import_chdb():
    try:
        from chdb import _chdb  # the C extension: its query() sees our frame's locals
    except ImportError as exc:  # pragma: no cover - exercised only without chdb
        raise BackendNotInstalledError(
            "the embedded catalog needs chDB: pip install 'chdb>=3.0' "
            "(or open a server catalog with open_catalog('clickhouse://user:password@host:port/db'))"
        ) from exc
    return _chdb


def _locked_by_other_process(directory: Path) -> bool:
    status = directory / "status"
    if not status.exists():
        return False
    try:
        fd = os.open(status, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _acquire_connection(directory: Path):
    chdb = _import_chdb()
    key = str(directory)
    with _registry_lock:
        if _open["path"] is not None:
            if _open["path"] != key:
                raise CatalogError(
                    f"this process already has the embedded catalog {_open['path']} open; chDB runs one "
                    f"database directory per process, so {key} cannot be opened too. Close every catalog "
                    "on the first directory, use the same directory, or use a ClickHouse server "
                    "(clickhouse://...)."
                )
            _open["refs"] += 1
            return _open["conn"]
        directory.mkdir(parents=True, exist_ok=True)
        try:
            conn = chdb.connect(key)
        except Exception as exc:
            if _locked_by_other_process(directory):
                raise CatalogLockedError(
                    f"the embedded catalog directory {key} is in use by another process (chDB allows one "
                    "process per directory). Stop that process, or open the catalog from it, or give this "
                    "process its own directory (DMI_CATALOG=/other/dir or open_catalog('chdb:///other/dir')), "
                    "or use a ClickHouse server for several processes."
                ) from exc
            raise server_error_from_message(str(exc)) from exc
        _open.update(path=key, conn=conn, refs=1)
        return conn


def _release_connection(directory: Path) -> None:
    with _registry_lock:
        if _open["path"] != str(directory):
            return
        _open["refs"] -= 1
        if _open["refs"] > 0:
            return
        conn = _open["conn"]
        _open.update(path=None, conn=None, refs=0)
    with _statement_lock:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass


class ChdbBackend(CatalogBackend):
    kind = "chdb"

    def __init__(self, directory: str | os.PathLike[str], database: str = "dmi"):
        self.directory = Path(directory).expanduser().resolve()
        self.database = validate_identifier(database, "database name")
        self.where = f"chdb:///{str(self.directory).lstrip('/')}"
        self._conn = _acquire_connection(self.directory)
        self._closed = False
        try:
            self.command(f"CREATE DATABASE IF NOT EXISTS {quote_identifier(self.database, 'database name')}")
        except BaseException:
            self.close()
            raise

    def _run(self, sql: str, fmt: str):
        if self._closed:
            raise CatalogError(f"the catalog at {self.where} is closed")
        with _statement_lock:
            try:
                return self._conn.query(sql, fmt, params={})
            except RuntimeError as exc:
                raise server_error_from_message(str(exc)) from None

    def command(self, sql: str, params: Mapping[str, object] | None = None) -> None:
        self._run(bind(sql, params), "CSV")

    def query(self, sql: str, params: Mapping[str, object] | None = None) -> pa.Table:
        result = self._run(bind(sql, params), "Arrow")
        data = result.bytes()
        if not data:
            return pa.table({})
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()

    def insert(self, table: str, data: pa.Table) -> None:
        if data.num_rows == 0:
            return
        if self._closed:
            raise CatalogError(f"the catalog at {self.where} is closed")
        columns = ", ".join(quote_identifier(name, "column name") for name in data.column_names)
        dmi_arrow_input = data  # noqa: F841 - read by chDB's Python() table function
        sql = f"INSERT INTO {table} ({columns}) SELECT {columns} FROM Python(dmi_arrow_input)"
        with _statement_lock:
            try:
                self._conn.query(sql, "CSV", params={})
            except RuntimeError as exc:
                raise server_error_from_message(str(exc)) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _release_connection(self.directory)
