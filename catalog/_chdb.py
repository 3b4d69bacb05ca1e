"""Embedded backend: chDB (ClickHouse in-process) on a directory, shared between processes.

chDB facts this backend is built around:

* **The embedded server locks its directory** (``flock`` on ``<directory>/status``) for as
  long as a session is open, and it is process-wide: one directory at a time per process.
  A second process that asks chDB for a locked directory gets an error, and chDB prints a
  raw ``Code: 76 ... Cannot lock file`` line of its own.
* **Opening is cheap**: a session on an existing directory opens, answers and closes in
  tens of milliseconds, and sessions of several processes alternate cleanly.
* **Opening is not free**: each session start on a directory with tables leaves about five
  threads and nine descriptors that the close never releases (chDB 4.4.0,
  ``bench/bench_chdb_sessions.py``), so a process that reopens for every call runs out of
  descriptors after about a hundred calls under a 1024 limit.

So a session is held **per unit of catalog work**, not per process (:class:`_EmbeddedSession`):

* Every statement runs inside :meth:`_EmbeddedSession.use`, which opens a session on the
  directory if none is open, and re-enters it otherwise. Reopening costs tens to hundreds
  of milliseconds, so a session is given up only when someone needs it: a process waiting
  for its turn says so by holding a shared ``flock`` on ``<directory>/dmi.waiting``, and the
  holder checks that signal (a non-blocking exclusive attempt). An idle session is closed
  at once when someone waits (a background thread looks every :data:`WAITER_POLL_SECONDS`)
  and otherwise after :data:`IDLE_CLOSE_SECONDS` (for processes that are not DMI); a
  session busy for longer than :data:`MAX_HOLD_SECONDS` is closed at the end of its
  current use when someone waits, and not reopened for :data:`YIELD_SECONDS`, so a reader
  in a tight loop cannot starve a capture in another process (nor the other way round).
  Without contention nothing is closed and reopened.
* Processes take turns through DMI's own lock, ``flock`` on ``<directory>/dmi.lock``, taken
  before chDB is asked and released after chDB has closed. Before opening, the flock chDB
  itself takes on ``<directory>/status`` is tried too (non-blocking), so a process that is
  not DMI holding the directory is waited for as well. chDB is therefore never asked for a
  locked directory and never prints its own lock error. The wait is bounded
  (``lock_timeout``, default :data:`LOCK_TIMEOUT_SECONDS`); then
  :class:`~dmi.storage.CatalogLockedError` names the directory.
* **One directory at a time per process**, no longer one per process: catalogs on
  different directories may be open in one process at once; each unit of work switches
  the process's embedded server to its directory (closing an idle session on another).
* User SQL runs on a read-only connection (``readonly=1``) kept beside the read-write one,
  on the same embedded server, so alternating the two starts nothing.
* **One unit of work at a time per process.** Every use holds one process-wide lock, so
  many threads can share a catalog (parameterised queries on one shared session are not
  otherwise safe to interleave).
* Arrow inserts run on one thread, in one of two ways (``bench/bench_chdb_inserts.py``): a
  small table (a capture's publish: tens to thousands of rows) is streamed to chDB as Arrow
  IPC bytes (``send_insert`` with the ``ArrowStream`` input format), which costs less per
  statement; a large one goes through chDB's ``Python(<name>)`` table function, which reads
  the pyarrow table from the calling frame's local variables and costs less per row.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import resource
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow as pa

from dmi.catalog._catalog_backend import CatalogBackend, server_error_from_message
from dmi.catalog._sql import bind, quote_identifier, validate_identifier
from dmi.storage.errors import (
    BackendNotInstalledError,
    CatalogError,
    CatalogLockedError,
    CatalogReadOnlyError,
    InvalidArgumentError,
    ServerError,
)

#: How long an idle session stays open after its last statement when nobody waits (seconds).
#: Long, because chDB keeps threads and descriptors from every session it starts
#: (``bench/bench_chdb_sessions.py``); DMI processes that wait get it within WAITER_POLL_SECONDS.
IDLE_CLOSE_SECONDS = 60.0
#: How often the idle session looks for a process waiting for its turn.
WAITER_POLL_SECONDS = 0.02
#: A session busy this long is closed at the end of its current use when another waits.
MAX_HOLD_SECONDS = 1.0
#: After such a forced close, this process waits this long before reopening.
YIELD_SECONDS = 0.05
#: How long a unit of work waits for another process's session by default.
LOCK_TIMEOUT_SECONDS = 60.0
#: How often a waiting process tries the lock again.
POLL_SECONDS = 0.005

#: Settings of every insert: on one thread an insert of up to thousands of rows costs less CPU
#: than with ClickHouse's default team, a larger one about the same (``bench/bench_chdb_inserts.py``).
INSERT_SETTINGS = "SETTINGS max_threads = 1, max_insert_threads = 1"
#: Inserts of at most this many rows are streamed as Arrow IPC bytes, larger ones read
#: through ``Python()``: the stream's statement costs less, its rows cost more.
STREAM_INSERT_MAX_ROWS = 32_768

LOCK_FILE = "dmi.lock"
WAITING_FILE = "dmi.waiting"


def _import_chdb():
    try:
        from chdb import _chdb  # the C extension: its query() sees our frame's locals
    except ImportError as exc:  # pragma: no cover - exercised only without chdb
        raise BackendNotInstalledError(
            "the embedded catalog needs chDB: pip install 'chdb>=4.4' "
            "(or open a server catalog with open_catalog('clickhouse://user:password@host:port/db'))"
        ) from exc
    return _chdb


def _try_flock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False when another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise
    return True


def _status_free(directory: Path) -> bool:
    """Whether chDB's own lock (flock on ``<directory>/status``) is free right now."""
    try:
        fd = os.open(directory / "status", os.O_RDONLY)
    except FileNotFoundError:
        return True  # chDB removes the file when its session closes
    try:
        if not _try_flock(fd):
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def _writable(directory: Path) -> bool:
    """Whether files can be created in ``directory`` (a probe: root ignores mode bits)."""
    if not os.access(directory, os.W_OK):
        return False
    probe = directory / f".dmi-write-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError:
        return False
    return True


def read_only_error(directory: Path) -> CatalogReadOnlyError:
    """The one-line error for a catalog directory this process cannot write to."""
    return CatalogReadOnlyError(
        f"the embedded catalog directory {directory} is read-only (read-only filesystem or no "
        "write permission); the embedded catalog (chDB) must write to its directory even to read. "
        "Copy the store to a writable place, or serve its catalog from a ClickHouse server."
    )


@contextlib.contextmanager
def _waiting(directory: Path) -> Iterator[None]:
    """Say "I am waiting for this directory" for as long as the block runs: a shared flock on
    ``<directory>/dmi.waiting`` that the session's holder can see (:func:`_someone_waits`)."""
    try:
        fd = os.open(directory / WAITING_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # cannot signal (the lock file's own error is reported where it is made)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the shared flock


def _someone_waits(directory: Path) -> bool:
    """Whether another process is waiting for its turn on ``directory`` (holds the shared
    flock :func:`_waiting` takes): an exclusive attempt that does not wait fails then."""
    try:
        fd = os.open(directory / WAITING_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _open_lock_file(directory: Path) -> int:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise read_only_error(directory) from exc
        raise CatalogError(f"cannot create the embedded catalog directory {directory}: {exc}") from exc
    if not _writable(directory):
        raise read_only_error(directory)
    try:
        return os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CatalogError(f"cannot open the lock file of the embedded catalog {directory}: {exc}") from exc


class _EmbeddedSession:
    """The process's one chDB session, opened per unit of work and shared by its threads: a
    read-write connection and, once user SQL has run, a read-only one beside it. Both are on
    the one embedded server, so switching between them starts nothing (each start of the
    server keeps threads and descriptors for good: see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # held for a whole unit of work
        self._depth = 0
        self._directory: Path | None = None
        self._conns: dict[bool, object] = {}  # readonly -> connection, both on self._directory
        self._lock_fd: int | None = None
        self._opened_at = 0.0
        self._last_used = 0.0
        self._reopen_after = 0.0
        self._closer: threading.Thread | None = None
        self._wake = threading.Event()

    @contextlib.contextmanager
    def use(self, directory: Path, lock_timeout: float, readonly: bool = False) -> Iterator[object]:
        """Yield an open connection to ``directory`` for one unit of work (re-entrant).

        ``readonly``: the connection opened with ClickHouse's ``readonly=1`` setting (for user
        SQL), kept beside the read-write one.
        """
        with self._lock:
            if self._directory != directory:
                if self._depth:
                    raise CatalogError(
                        f"a unit of catalog work on {self._directory} cannot run one on {directory} inside it"
                    )
                self._close()
                self._open(directory, lock_timeout)
            conn = self._conns.get(readonly) or self._connect(readonly)
            self._depth += 1
            try:
                yield conn
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._finish_use()

    def _finish_use(self) -> None:
        now = time.monotonic()
        self._last_used = now
        if now - self._opened_at >= MAX_HOLD_SECONDS and _someone_waits(self._directory):
            self._close()
            self._reopen_after = time.monotonic() + YIELD_SECONDS
        else:
            self._wake.set()

    def _open(self, directory: Path, lock_timeout: float) -> None:
        """Take this process's turn on ``directory`` (its connections are opened by ``use``)."""
        _import_chdb()
        pause = self._reopen_after - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        fd = _open_lock_file(directory)
        try:
            self._wait_for_turn(fd, directory, lock_timeout)
        except BaseException:
            os.close(fd)  # closing the descriptor releases our flock
            raise
        self._directory, self._lock_fd = directory, fd
        self._opened_at = time.monotonic()
        self._start_closer()

    def _connect(self, readonly: bool) -> object:
        """A connection to the session's directory in this mode; a first one that fails gives
        the turn up again."""
        try:
            conn = _import_chdb().connect(str(self._directory) + ("?readonly=1" if readonly else ""))
        except Exception as exc:
            if not self._conns:
                self._close()
            raise _chdb_error(str(exc)) from exc
        self._conns[readonly] = conn
        return conn

    @staticmethod
    def _wait_for_turn(fd: int, directory: Path, lock_timeout: float) -> None:
        deadline = time.monotonic() + lock_timeout
        with _waiting(directory):
            while True:
                if _try_flock(fd):
                    if _status_free(directory):
                        return
                    fcntl.flock(fd, fcntl.LOCK_UN)  # someone other than DMI holds chDB's lock
                if time.monotonic() >= deadline:
                    raise CatalogLockedError(
                        f"the embedded catalog directory {directory} stayed in use by another process for "
                        f"{lock_timeout:g} s (DMI processes take turns on it, one unit of catalog work at a "
                        "time). Wait for that process, raise the wait with open_catalog(..., lock_timeout=...), "
                        "or use a ClickHouse server for many busy processes."
                    )
                time.sleep(POLL_SECONDS)

    def _close(self) -> None:
        conns, fd = list(self._conns.values()), self._lock_fd
        self._directory, self._conns, self._lock_fd = None, {}, None
        for conn in conns:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing must not raise; the lock goes below
                pass
        if fd is not None:
            os.close(fd)

    def _start_closer(self) -> None:
        if self._closer is None or not self._closer.is_alive():
            self._closer = threading.Thread(target=self._close_when_idle, name="dmi-chdb-idle-close", daemon=True)
            self._closer.start()

    def _close_when_idle(self) -> None:
        """Background: close the session once no unit of work has used it for a while."""
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                with self._lock:
                    if self._directory is None:
                        break
                    idle = time.monotonic() - self._last_used
                    if self._depth == 0 and (idle >= IDLE_CLOSE_SECONDS or _someone_waits(self._directory)):
                        self._close()
                        break
                time.sleep(min(max(IDLE_CLOSE_SECONDS - idle, POLL_SECONDS), WAITER_POLL_SECONDS))

    def forget(self) -> None:
        """In a forked child: drop the parent's session without closing it (it is the parent's).

        The child keeps a reference to it for good: releasing the last one would run chDB's
        close in a process that has none of chDB's threads, which hangs (a DataLoader worker
        forked while a session was open did exactly that). Children started by
        ``multiprocessing`` end with ``os._exit``, so the reference is never released."""
        _INHERITED_SESSIONS.extend(self._conns.values())
        self._lock = threading.RLock()
        self._depth = 0
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the parent's flock stays: it holds its own descriptor
        self._directory, self._conns, self._lock_fd, self._closer = None, {}, None, None
        self._wake = threading.Event()

    def close_now(self) -> None:
        """Close the session, whatever it is on (process exit)."""
        with self._lock:
            self._close()

    def close_if(self, directory: Path) -> None:
        """Close the session now if it is idle on ``directory`` (a catalog was closed)."""
        with self._lock:
            if self._depth == 0 and self._directory == directory:
                self._close()


def _chdb_error(message: str) -> ServerError:
    """chDB's error as a :class:`ServerError`; out of descriptors, with what causes it here.
    chDB does not always say so (a server that cannot start reports ``BAD_ARGUMENTS``), so the
    process's own count is looked at too."""
    error = server_error_from_message(message)
    if "Too many open files" not in message and not _near_descriptor_limit():
        return error
    return ServerError(
        f"{error}. The process ran out of file descriptors: each start of chDB's embedded server keeps "
        "threads and descriptors for good, and it starts again whenever a catalog is opened after the last "
        "one was closed, or another catalog directory is used in turn. Keep one store open (dmi.open()) "
        "and pass it to every call (dmi.capture(..., store=store)), or raise the limit (ulimit -n).",
        code=error.code, name=error.name,
    )


def _near_descriptor_limit() -> bool:
    """Whether this process holds nearly as many descriptors as it may (9/10 of the soft limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: chDB's own message has to say it
        return False
    return soft != resource.RLIM_INFINITY and held >= soft * 9 // 10


_INHERITED_SESSIONS: list = []
"""A forked child's references to its parent's chDB session: never closed, never released."""

_SESSION = _EmbeddedSession()
os.register_at_fork(after_in_child=_SESSION.forget)
atexit.register(_SESSION.close_now)  # chDB crashes at exit with a session still open


def _arrow_stream(data: pa.Table) -> bytes:
    """``data`` as Arrow IPC stream bytes, the input chDB's streaming insert parses."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data)
    return sink.getvalue().to_pybytes()


def stream_insert(conn, sql: str, payload: bytes) -> None:
    """Run ``sql`` (an INSERT without data) on ``conn`` with ``payload`` (Arrow IPC stream bytes).

    An insert left open blocks every other statement on the connection, so one interrupted
    before it finished (an exception, ``KeyboardInterrupt``) is cancelled; chDB closes one
    that failed itself."""
    inserter = conn.send_insert(sql, "ArrowStream")
    try:
        conn.insert_append(inserter, payload)
        conn.insert_done(inserter)
    except BaseException:
        try:
            conn.insert_cancel(inserter)
        except RuntimeError:
            pass  # chDB already closed the insert that failed; the failure is what is raised
        raise


def _usable_directory(directory: Path) -> Path:
    """``directory`` if chDB will use that very directory, else InvalidArgumentError.

    chDB reads its path as a connection string: from a ``?`` on it is settings
    (``cat?readonly=0`` puts the data in ``cat`` and turns user SQL's ``readonly`` off), so
    DMI would lock one directory while chDB writes another. ``#`` is refused with it (a
    URI fragment); nothing is created for a refused name.
    """
    for char in "?#":
        if char in str(directory):
            raise InvalidArgumentError(
                f"the embedded catalog directory {str(directory)!r} contains {char!r}, which chDB reads as "
                "the start of connection settings; choose a directory name without '?' or '#'"
            )
    return directory


class ChdbBackend(CatalogBackend):
    kind = "chdb"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        database: str = "dmi",
        lock_timeout: float = LOCK_TIMEOUT_SECONDS,
    ):
        self.directory = _usable_directory(Path(directory).expanduser().resolve())
        self.database = validate_identifier(database, "database name")
        if isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float)) or lock_timeout < 0:
            raise InvalidArgumentError(f"lock_timeout must be a number of seconds >= 0, not {lock_timeout!r}")
        self.lock_timeout = float(lock_timeout)
        self.where = f"chdb:///{str(self.directory).lstrip('/')}"
        self._closed = False
        self.command(f"CREATE DATABASE IF NOT EXISTS {quote_identifier(self.database, 'database name')}")

    @contextlib.contextmanager
    def session(self, readonly: bool = False) -> Iterator[object]:
        """One unit of catalog work: every statement inside shares one chDB session."""
        if self._closed:
            raise CatalogError(f"the catalog at {self.where} is closed")
        with _SESSION.use(self.directory, self.lock_timeout, readonly) as conn:
            yield conn

    def _run(self, sql: str, fmt: str, readonly: bool = False):
        with self.session(readonly) as conn:
            try:
                return conn.query(sql, fmt, params={})
            except RuntimeError as exc:
                raise _chdb_error(str(exc)) from None

    def command(self, sql: str, params: Mapping[str, object] | None = None) -> None:
        self._run(bind(sql, params), "CSV")

    def query(self, sql: str, params: Mapping[str, object] | None = None, *, readonly: bool = False) -> pa.Table:
        result = self._run(bind(sql, params), "Arrow", readonly)
        data = result.bytes()
        if not data:
            return pa.table({})
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()

    def insert(self, table: str, data: pa.Table) -> None:
        if data.num_rows == 0:
            return
        columns = ", ".join(quote_identifier(name, "column name") for name in data.column_names)
        if data.num_rows > STREAM_INSERT_MAX_ROWS:
            self._insert_by_reference(table, columns, data)
        else:
            self._insert_streamed(table, columns, data)

    def _insert_by_reference(self, table: str, columns: str, data: pa.Table) -> None:
        """chDB's ``Python()`` table function reads ``data`` from this frame: no copy."""
        dmi_arrow_input = data  # noqa: F841 - read by chDB's Python() table function
        sql = f"INSERT INTO {table} ({columns}) SELECT {columns} FROM Python(dmi_arrow_input) {INSERT_SETTINGS}"
        with self.session() as conn:
            try:
                conn.query(sql, "CSV", params={})
            except RuntimeError as exc:
                raise _chdb_error(str(exc)) from None

    def _insert_streamed(self, table: str, columns: str, data: pa.Table) -> None:
        payload = _arrow_stream(data)
        with self.session() as conn:
            try:
                stream_insert(conn, f"INSERT INTO {table} ({columns}) {INSERT_SETTINGS}", payload)
            except RuntimeError as exc:
                raise _chdb_error(str(exc)) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _SESSION.close_if(self.directory)
