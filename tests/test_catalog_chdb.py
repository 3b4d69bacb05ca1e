"""The embedded (chDB) catalog: the conformance suite, plus what only chDB has."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dmi.catalog import default_catalog_uri, open_catalog
from dmi.storage import (
    BackendNotInstalledError,
    CatalogError,
    CatalogLockedError,
    InvalidArgumentError,
    InvalidIdentifierError,
)
from tests.catalog_conformance import CatalogConformance, pack


class TestChdbCatalog(CatalogConformance):
    @pytest.fixture
    def catalog_uri(self, tmp_path):
        return f"chdb://{tmp_path / 'catalog'}"


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)


def _holder(code: str) -> subprocess.Popen:
    """A process that prints HELD once it holds the directory, then holds it until killed."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_held(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.strip() == "HELD", line + proc.stderr.read()


OPEN_WITH_SHORT_WAIT = """
    from dmi.catalog import open_catalog
    from dmi.storage import CatalogLockedError
    try:
        open_catalog({directory!r}, lock_timeout=0.5)
    except CatalogLockedError as exc:
        print("LOCKED", exc)
    else:
        print("OPENED")
"""


def test_an_open_but_idle_catalog_does_not_lock_out_another_process(tmp_path):
    directory = tmp_path / "held"
    with open_catalog(f"chdb://{directory}") as catalog:
        assert catalog.models() == []
        out = _python(OPEN_WITH_SHORT_WAIT.format(directory=str(directory)))
        assert out.stdout.strip() == "OPENED", out.stdout + out.stderr
        assert out.stderr == ""
        assert catalog.models() == []  # and this process takes its turn again


def test_a_unit_of_work_held_too_long_gives_a_named_lock_error_and_no_chdb_line(tmp_path):
    directory = tmp_path / "busy"
    holder = _holder(f"""
        import time
        from dmi.catalog import open_catalog
        catalog = open_catalog({str(directory)!r})
        with catalog._backend.session():  # stands in for a long unit of work
            print("HELD", flush=True)
            time.sleep(60)
    """)
    try:
        _wait_held(holder)
        out = _python(OPEN_WITH_SHORT_WAIT.format(directory=str(directory)))
    finally:
        holder.kill()
        holder.communicate()
    assert out.stdout.startswith("LOCKED "), out.stdout + out.stderr
    assert str(directory) in out.stdout and "another process" in out.stdout
    assert out.stderr == ""  # chDB was never asked, so it printed nothing (no "Code: 76")
    # Released when the holder dies: the directory opens again, from another process.
    again = _python(OPEN_WITH_SHORT_WAIT.format(directory=str(directory)))
    assert again.stdout.strip() == "OPENED", again.stdout + again.stderr


def test_chdbs_own_lock_is_waited_for_too(tmp_path):
    """A process that is not DMI (plain chDB) holds the directory: DMI waits, never asks chDB."""
    directory = tmp_path / "foreign"
    open_catalog(f"chdb://{directory}").close()
    holder = _holder(f"""
        import time
        from chdb import _chdb
        conn = _chdb.connect({str(directory)!r})
        print("HELD", flush=True)
        time.sleep(60)
    """)
    try:
        _wait_held(holder)
        out = _python(OPEN_WITH_SHORT_WAIT.format(directory=str(directory)))
    finally:
        holder.kill()
        holder.communicate()
    assert out.stdout.startswith("LOCKED "), out.stdout + out.stderr
    assert out.stderr == ""


def test_lock_error_is_a_catalog_error():
    assert issubclass(CatalogLockedError, CatalogError)


def test_two_directories_in_one_process_take_turns(tmp_path):
    with open_catalog(f"chdb://{tmp_path / 'a'}") as first, open_catalog(f"chdb://{tmp_path / 'b'}") as second:
        with first.publisher("s", holder="h") as publisher:
            publisher.publish([pack(request="only-in-a")])
        assert first.requests("gpt2") == ["only-in-a"]
        assert second.requests("gpt2") == []
        # The same directory is fine too, and so is another database in it.
        with open_catalog(f"chdb://{tmp_path / 'a'}", database="other-db") as third:
            assert third.tables["records"].startswith("`other-db`.")
            assert third.models() == []
        assert first.requests("gpt2") == ["only-in-a"]


def test_bad_lock_timeout_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="lock_timeout"):
        open_catalog(f"chdb://{tmp_path / 'x'}", lock_timeout="soon")


def test_many_threads_share_one_catalog(tmp_path):
    """Inserts and queries from many threads at once: without the statement lock, chDB's
    ``Python(<variable>)`` inserts read another thread's table and queries fail."""
    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        errors: list[BaseException] = []
        counts: list[int] = []

        def work(i):
            try:
                publisher = catalog.publisher(f"scope-{i}", holder=f"h{i}")
                publisher.acquire()
                for j in range(8):
                    publisher.publish([pack(request=f"r{i}-{j}")])
                    found = catalog.find_records("gpt2", request_id=f"r{i}-{j}", layers=[0, 1, 2])
                    counts.append(len(found))
                    assert [e.meta.key.request_id for e in found] == [f"r{i}-{j}"] * 3
                publisher.release()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors[:3]
        assert counts == [3] * (12 * 8)
        assert len(catalog.requests("gpt2")) == 12 * 8


def test_default_directory_and_env_override(tmp_path, monkeypatch):
    monkeypatch.delenv("DMI_CATALOG", raising=False)
    monkeypatch.delenv("DMI_HOME", raising=False)
    assert default_catalog_uri() == "chdb://" + os.path.expanduser("~/.local/share/dmi/catalog")
    monkeypatch.setenv("DMI_HOME", str(tmp_path / "home"))
    assert default_catalog_uri() == f"chdb://{tmp_path / 'home' / 'catalog'}"
    monkeypatch.setenv("DMI_CATALOG", f"chdb://{tmp_path / 'env'}")
    with open_catalog() as catalog:
        assert catalog.where == f"chdb://{tmp_path / 'env'}"
    assert (tmp_path / "env").is_dir()


def test_missing_backend_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "chdb", None)
    with pytest.raises(BackendNotInstalledError, match="pip install 'chdb"):
        open_catalog(f"chdb://{tmp_path / 'x'}")
    monkeypatch.setitem(sys.modules, "clickhouse_driver", None)
    with pytest.raises(BackendNotInstalledError, match="pip install 'clickhouse-driver"):
        open_catalog("clickhouse://default:@127.0.0.1:1/db")
    assert isinstance(BackendNotInstalledError("x"), ImportError)


def test_bad_uris_and_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown catalog URI scheme"):
        open_catalog("mysql://x/y")
    with pytest.raises(InvalidIdentifierError):
        open_catalog(f"chdb://{tmp_path / 'n'}", database="bad`name")
    with pytest.raises(InvalidIdentifierError):
        open_catalog("clickhouse://default:@127.0.0.1:1/bad%25name")
    with pytest.raises(InvalidIdentifierError):
        open_catalog(f"chdb://{tmp_path / 'n'}", table_prefix="x`")


@pytest.mark.parametrize(
    "uri",
    [
        "clickhouse://h:abc/db",
        "clickhouse://h:99999/db",
        "clickhouse://[::1/db",
        "clickhouse:/db-host:9000/analytics",
        "clickhouse:db-host",
        "CH:db-host",
        "chdb:",
        "chdb:cat",
        "file:cat",
        "chdb:///{cwd}/x?cluster=foo",
        "chdb:///{cwd}/y#frag",
        "chdb:///{cwd}/z?",
        "{cwd}/cat?readonly=0&x",
        "cat#x",
        "chdb:///{cwd}/cat%3Freadonly=0",
        123,
        b"/tmp/x",
    ],
)
def test_malformed_uris_are_refused_and_create_nothing(tmp_path, monkeypatch, uri):
    monkeypatch.chdir(tmp_path)
    if isinstance(uri, str):
        uri = uri.format(cwd=tmp_path)
    with pytest.raises(InvalidArgumentError) as info:
        open_catalog(uri)
    assert not isinstance(info.value, (TypeError, UnicodeError))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["mycat", "./a:b", "chdbish:x", "sub/clickhouse:x"])
def test_plain_relative_paths_are_still_directories(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with open_catalog(name) as catalog:
        assert catalog.backend == "chdb"
        assert catalog.where == f"chdb://{(tmp_path / name).resolve()}"
    assert (tmp_path / name / "dmi.lock").is_file()


def test_the_format_function_is_not_a_format_clause(tmp_path):
    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        assert catalog.sql("SELECT format('{}-{}', 'a', 'b') AS a").to_pylist() == [{"a": "a-b"}]
        assert catalog.sql("SELECT format ('{}!', 'c') AS a").to_pylist() == [{"a": "c!"}]


def test_without_contention_the_session_is_kept_not_reopened(tmp_path):
    """Nobody waits: neither idle gaps of seconds nor more than MAX_HOLD_SECONDS of use make
    the process give its session up (a reopen costs 10–400 ms, and threads chDB never ends)."""
    from dmi.catalog import _chdb

    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        catalog.models()
        session = _chdb._SESSION._conns[False]
        deadline = time.monotonic() + _chdb.MAX_HOLD_SECONDS + 0.5
        while time.monotonic() < deadline:
            time.sleep(0.3)
            catalog.models()
            assert _chdb._SESSION._conns[False] is session
        time.sleep(2.5)  # idle for longer than the old 2 s close: a notebook between two cells
        catalog.models()
        assert _chdb._SESSION._conns[False] is session  # each reopen would keep chDB threads for good


def test_user_sql_and_other_calls_share_one_running_server(tmp_path):
    """User SQL runs on a read-only connection kept beside the read-write one: alternating them
    reopens neither (each start of chDB's server keeps threads and descriptors for good), and
    the read-only one still refuses to write."""
    from dmi.catalog import _chdb
    from dmi.storage import ServerError

    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        catalog.models()
        catalog.sql("SELECT 1")
        conns = dict(_chdb._SESSION._conns)
        assert set(conns) == {False, True} and conns[False] is not conns[True]
        for _ in range(3):
            assert catalog.sql("SELECT 2 AS x").to_pylist() == [{"x": 2}]
            assert catalog.models() == []
        assert _chdb._SESSION._conns == conns
        with pytest.raises(ServerError, match="READONLY"):
            catalog.sql(f"DROP TABLE {catalog.tables['records']}")
        assert catalog.models() == []


def test_running_out_of_descriptors_says_why_and_what_to_do(tmp_path):
    """chDB keeps threads and descriptors from every start of its server, and a catalog opened
    after the last one was closed starts it again: a process that opens and closes a store per
    call runs out of descriptors. Under a low limit (a real one, in a child process) the error
    says that, and how to avoid it, whichever of its errors chDB gives (a timer it cannot
    create, or a server it cannot start)."""
    out = _python(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160))
        from dmi.catalog import open_catalog
        from dmi.storage import ServerError
        for round in range(400):
            try:
                with open_catalog({str(tmp_path / 'c')!r}) as catalog:
                    catalog.models()
            except ServerError as exc:
                print("ERROR", exc)
                break
        else:
            print("NO ERROR")
    """)
    assert out.stdout.startswith("ERROR "), out.stdout + out.stderr
    assert "The process ran out of file descriptors" in out.stdout and "Keep one store open (dmi.open())" in out.stdout


def test_a_chdb_error_near_the_descriptor_limit_says_why_whatever_its_text():
    """chDB may report running out of descriptors as a server it could not start
    (``BAD_ARGUMENTS``, no errno): near the limit the error still says why. Far from it, the
    same error is chDB's own."""
    out = _python("""
        import os, resource
        from dmi.catalog import _chdb
        message = "Code: 36. DB::Exception: Error initializing EmbeddedServer: . (BAD_ARGUMENTS)"
        print("FAR", "ran out of file descriptors" in str(_chdb._chdb_error(message)))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        while len(os.listdir("/proc/self/fd")) < 60:
            held.append(os.open(os.devnull, os.O_RDONLY))
        error = _chdb._chdb_error(message)
        print("NEAR", error.code, error.name, "ran out of file descriptors" in str(error))
    """)
    assert out.stdout.split("\n")[:2] == ["FAR False", "NEAR 36 BAD_ARGUMENTS True"], out.stdout + out.stderr


def test_an_idle_holder_gives_its_session_up_when_another_process_waits(tmp_path):
    """The holder would keep its idle session for an hour; the waiter's signal (a shared flock
    on dmi.waiting) makes it close at once, so the waiter gets in well inside its wait."""
    directory = tmp_path / "signal"
    open_catalog(f"chdb://{directory}").close()
    holder = _holder(f"""
        import time
        from dmi.catalog import _chdb, open_catalog
        _chdb.IDLE_CLOSE_SECONDS = 3600.0
        catalog = open_catalog({str(directory)!r})
        catalog.models()
        print("HELD", flush=True)
        time.sleep(60)
    """)
    try:
        _wait_held(holder)
        out = _python(OPEN_WITH_SHORT_WAIT.replace("lock_timeout=0.5", "lock_timeout=10").format(directory=str(directory)))
    finally:
        holder.kill()
        holder.communicate()
    assert out.stdout.strip() == "OPENED", out.stdout + out.stderr


@pytest.mark.parametrize("stream_max_rows", [0, 1 << 20], ids=["by-reference", "streamed"])
def test_both_insert_paths_store_the_same_rows(tmp_path, monkeypatch, stream_max_rows):
    """Small inserts are streamed as Arrow IPC bytes, large ones read through ``Python()``
    (``STREAM_INSERT_MAX_ROWS``): either way a publish's index rows come back as written."""
    from dmi.catalog import _chdb

    monkeypatch.setattr(_chdb, "STREAM_INSERT_MAX_ROWS", stream_max_rows)
    published = pack(request="r-paths")
    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        with catalog.publisher("paths") as publisher:
            publisher.publish([published])
        found = catalog.find_records("gpt2", request_id="r-paths", layers=[0, 1, 2])
    assert found == list(published.records)


def test_a_refused_insert_is_a_server_error_and_the_session_goes_on(tmp_path):
    """An insert chDB refuses — into a table that does not exist, or a streamed one whose values
    the column cannot hold (``Python()`` would have stored 0) — raises ``ServerError`` with
    ClickHouse's code, writes nothing, and the next statement runs."""
    import pyarrow as pa

    from dmi.storage import ServerError

    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        backend = catalog._backend
        with pytest.raises(ServerError, match="ClickHouse error 60 UNKNOWN_TABLE") as caught:
            backend.insert("`dmi`.`no_such_table`", pa.table({"a": [1, 2]}))
        assert caught.value.code == 60
        backend.command("CREATE TABLE `dmi`.`numbers` (a UInt64) ENGINE = MergeTree ORDER BY a")
        with pytest.raises(ServerError, match="ClickHouse error 6 CANNOT_PARSE_TEXT"):
            backend.insert("`dmi`.`numbers`", pa.table({"a": ["one", "two"]}))
        backend.insert("`dmi`.`numbers`", pa.table({"a": pa.array([7], pa.uint64())}))
        assert backend.query("SELECT a FROM `dmi`.`numbers`").column("a").to_pylist() == [7]


def test_an_interrupted_streamed_insert_is_cancelled(tmp_path):
    """An insert left open blocks every later statement on the connection, so one interrupted
    between its data and its end is cancelled. The interrupt is the one fake here: a
    ``KeyboardInterrupt`` raised, through a wrapper of the real connection, where chDB would
    have finished the insert (nothing real arrives at that moment on demand)."""
    import pyarrow as pa

    from dmi.catalog._chdb import _arrow_stream, stream_insert

    class _InterruptedAtTheEnd:
        def __init__(self, conn):
            self._conn = conn

        def __getattr__(self, name):
            return getattr(self._conn, name)

        def insert_done(self, inserter):
            raise KeyboardInterrupt

    with open_catalog(f"chdb://{tmp_path / 'c'}") as catalog:
        backend = catalog._backend
        backend.command("CREATE TABLE `dmi`.`numbers` (a UInt64) ENGINE = MergeTree ORDER BY a")
        with backend.session() as conn:
            with pytest.raises(KeyboardInterrupt) as caught:
                stream_insert(_InterruptedAtTheEnd(conn), "INSERT INTO `dmi`.`numbers` (a)",
                              _arrow_stream(pa.table({"a": pa.array([5], pa.uint64())})))
        # the traceback keeps the insert's handle alive (chDB cancels an insert whose handle is
        # freed), as a caller that logs or re-raises the interrupt would
        assert caught.tb is not None
        assert backend.query("SELECT count() AS n FROM `dmi`.`numbers`").column("n").to_pylist() == [0]
