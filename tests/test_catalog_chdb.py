"""The embedded (chDB) catalog: the conformance suite, plus what only chDB has."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from dmi.catalog._schema import SCHEMA_VERSION
from dmi.catalog import default_catalog_uri, open_catalog
from dmi.storage import (
    BackendNotInstalledError,
    CatalogError,
    CatalogLockedError,
    InvalidIdentifierError,
)
from tests.catalog_conformance import CatalogConformance, pack


class TestChdbCatalog(CatalogConformance):
    @pytest.fixture
    def catalog_uri(self, tmp_path):
        return f"chdb://{tmp_path / 'catalog'}"


def test_second_process_gets_a_named_lock_error(tmp_path):
    directory = tmp_path / "held"
    with open_catalog(f"chdb://{directory}") as catalog:
        assert catalog.backend == "chdb"
        code = textwrap.dedent(
            f"""
            from dmi.catalog import open_catalog
            from dmi.storage import CatalogLockedError
            try:
                open_catalog({str(directory)!r})
            except CatalogLockedError as exc:
                print("LOCKED", exc)
            """
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOCKED" in out.stdout, out.stdout + out.stderr
    assert str(directory) in out.stdout
    assert "another process" in out.stdout
    # Released when the holder closes: the directory opens again, from another process.
    again = subprocess.run([sys.executable, "-c", code + "\nprint('OPENED')"], capture_output=True, text=True, timeout=120)
    assert "OPENED" in again.stdout and "LOCKED" not in again.stdout, again.stdout + again.stderr


def test_lock_error_is_a_catalog_error():
    assert issubclass(CatalogLockedError, CatalogError)


def test_one_directory_per_process(tmp_path):
    with open_catalog(f"chdb://{tmp_path / 'a'}") as first:
        with pytest.raises(CatalogError, match="one database directory per process") as info:
            open_catalog(f"chdb://{tmp_path / 'b'}")
        assert str(tmp_path / "a") in str(info.value)
        # The same directory is fine (shared connection), and so is another database in it.
        with open_catalog(f"chdb://{tmp_path / 'a'}", database="other-db") as second:
            assert second.tables["records"].startswith("`other-db`.")
            assert second.models() == []
        assert first.models() == []
    with open_catalog(f"chdb://{tmp_path / 'b'}") as later:
        assert later.schema_version() == SCHEMA_VERSION


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
