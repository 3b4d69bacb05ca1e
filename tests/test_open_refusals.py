"""``dmi.open`` refuses a malformed catalog or packs URI before it creates anything: no packs
directory, no catalog directory, not even the home that would hold them."""

from __future__ import annotations

import pytest

import dmi
import dmi._store as store_module
from dmi.catalog import open_catalog
from dmi.storage.errors import InvalidArgumentError, PackError

MALFORMED_CATALOGS = [
    ("clickhouse://u:p@host:notaport/db", "the port must be a number from 1 to 65535"),
    ("chdb:/x", "looks like a chdb: URI without '//'"),
    ("chdb:///d?x=1", "a chDB catalog URI takes no query or fragment"),
]


@pytest.fixture(autouse=True)
def _no_store_environment(monkeypatch):
    for name in ("DMI_HOME", "DMI_CATALOG", "DMI_PACKS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("catalog", "reason"), MALFORMED_CATALOGS)
def test_malformed_catalog_creates_no_packs_directory(tmp_path, catalog, reason):
    packs = tmp_path / "x" / "packs"
    with pytest.raises(InvalidArgumentError, match=reason):
        dmi.open(catalog=catalog, packs=str(packs))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("catalog", "reason"), MALFORMED_CATALOGS)
def test_malformed_catalog_creates_no_default_packs(tmp_path, monkeypatch, catalog, reason):
    monkeypatch.setenv("DMI_HOME", str(tmp_path / "home"))
    with pytest.raises(InvalidArgumentError, match=reason):
        dmi.open(catalog=catalog)
    assert not (tmp_path / "home").exists()


def test_malformed_catalog_creates_no_file_uri_packs(tmp_path):
    packs = tmp_path / "x" / "packs"
    with pytest.raises(InvalidArgumentError, match="looks like a chdb: URI"):
        dmi.open(catalog="chdb:/x", packs=packs.as_uri())
    assert not (tmp_path / "x").exists()


def test_malformed_packs_uri_creates_no_catalog(tmp_path):
    with pytest.raises(InvalidArgumentError, match="cannot open pack store 'nosuch://bucket/packs'"):
        dmi.open(packs="nosuch://bucket/packs", home=tmp_path / "home")
    assert not (tmp_path / "home").exists()


def test_pack_store_that_fails_to_open_closes_the_catalog(tmp_path, monkeypatch):
    opened = []

    def recording_open_catalog(uri):
        opened.append(open_catalog(uri))
        return opened[-1]

    monkeypatch.setattr(store_module, "open_catalog", recording_open_catalog)
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(PackError, match="cannot create pack directory"):
        dmi.open(catalog="chdb://" + str(tmp_path / "catalog"), packs=str(tmp_path / "a-file" / "packs"))
    assert len(opened) == 1 and repr(opened[0]).endswith("(closed)>")


def test_good_uris_still_open(tmp_path):
    with dmi.open(catalog="chdb://" + str(tmp_path / "catalog"), packs=(tmp_path / "packs").as_uri()) as store:
        assert store.packs_uri == (tmp_path / "packs").as_uri()
        assert store.models() == []
    assert (tmp_path / "catalog").is_dir() and (tmp_path / "packs").is_dir()


@pytest.mark.parametrize("uri", [
    "clickhouse://u:hunter2@127.0.0.1:99999/d",  # port out of range
    "clickhouse://dmi:hunter2@h:1/dmi?cluster=dmi&foo=1",  # a query item other than cluster
    "ch://u:hunter2@h/a/b",  # a path of two names
    "clickhouse://u:hunter2@h/d#frag",  # a fragment
    "clickhouse://u:hunt/er2@h/d",  # a password holding '/', unencoded
    "clickhouse:/u:hunter2@h/d",  # no '//'
    "clickhouse://u:hunter2@[::1/d",  # an unclosed IPv6 host
    "postgres://u:hunter2@h/d",  # an unknown scheme
])
def test_a_refused_server_uri_is_quoted_without_its_password(uri):
    """A server URI's password never reaches an error message (logs, CI output): the URI is
    quoted with ``***`` in its place, the user and host kept to say which URI it was."""
    with pytest.raises(InvalidArgumentError) as refused:
        open_catalog(uri)
    message = str(refused.value)
    assert "hunter2" not in message and "hunt/er2" not in message
    assert ("dmi:***@" if uri.startswith("clickhouse://dmi") else "u:***@") in message
