"""A real ClickHouse server killed (SIGKILL) or stopped (SIGSTOP) under a catalog, and restarted.

Each test starts a ``clickhouse-server`` of its own (``tests/_clickhouse.py``'s
``LocalServerProcess``: the session's shared server must not be killed), so these tests need
the local binary and skip without it; they are not ``live`` tests, which the fixture chain may
serve from a container or a URL.

What is checked: a server gone between statements is ``CatalogUnavailableError`` saying it
cannot be reached, with ``outcome_unknown = False`` (nothing was sent, so a publisher need
not quarantine); a stopped server, which accepts connections and answers nothing, fails
within ``connect_timeout`` and is named a timeout; the same catalog answers again once the
server is back; a capture session loses no sealed pack: those published before the kill
stay readable, those sealed after stay in the store and ``recover`` publishes them.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.reader import assemble, read_records
from dmi.storage import PackStore
from dmi.storage.errors import CatalogUnavailableError, DrainError
from tests._models import left_padded_batch, tiny

pytestmark = pytest.mark.slow


def _database() -> str:
    return f"dmi_faults_{uuid.uuid4().hex[:12]}"


def test_a_server_killed_between_statements_is_unreachable_for_certain_and_answers_after_restart(own_server):
    with open_catalog(own_server.uri(_database())) as catalog:
        before = catalog.models()
        own_server.kill()
        with pytest.raises(CatalogUnavailableError, match=r"cannot reach ClickHouse at .*Connection refused.*; "
                                                          "check that the server is running") as raised:
            catalog.models()
        assert raised.value.outcome_unknown is False  # nothing reached the server: no quarantine needed
        own_server.restart()
        assert catalog.models() == before == []


def test_a_stopped_server_fails_within_connect_timeout_named_as_a_timeout(own_server):
    with open_catalog(own_server.uri(_database()), connect_timeout=1, send_receive_timeout=600) as catalog:
        catalog.models()
        own_server.pause()
        with pytest.raises(CatalogUnavailableError, match=r"no answer within 1 s \(connect_timeout; a server "
                                                          r"stopped or overloaded answers nothing\)") as raised:
            catalog.models()
        assert raised.value.outcome_unknown is False
        own_server.resume()
        assert catalog.models() == []


def test_a_renewal_whose_server_died_before_its_write_keeps_the_lease_for_after_the_restart(own_server, monkeypatch):
    """The server is killed between the renewal's read and its write: the write never left
    this process, so the publisher keeps its term (no quarantine) and renews once the server
    is back. The kill lands there through the backend's ``insert``; everything else is real."""
    with open_catalog(own_server.uri(_database())) as catalog:
        publisher = catalog.publisher("faults", holder="A", lease_seconds=600)
        term = publisher.acquire()
        expires = publisher.expires_at
        backend = catalog._backend
        real_insert = backend.insert

        def killed_first(table, data):
            own_server.kill()
            monkeypatch.setattr(backend, "insert", real_insert)
            return real_insert(table, data)

        monkeypatch.setattr(backend, "insert", killed_first)
        with pytest.raises(CatalogUnavailableError, match="cannot reach ClickHouse") as raised:
            publisher.renew()
        assert raised.value.outcome_unknown is False
        assert (publisher.term, publisher.quarantined, publisher.expires_at) == (term, False, expires)
        own_server.restart()
        assert publisher.renew() > expires
        assert catalog.lease_state("faults").term == term


def _read_all(store, catalog, model_id: str) -> dict:
    """Every request's ``resid_post`` as one tensor, by request id."""
    entries = catalog.find_records(model_id, hook="resid_post")
    by_request = {}
    for entry in entries:
        by_request.setdefault(entry.meta.key.request_id, []).append(entry)
    return {rid: assemble(group, read_records(store, group)) for rid, group in by_request.items()}


def test_a_capture_whose_server_dies_loses_no_sealed_pack(own_server, tmp_path):
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(own_server.uri(_database())) as catalog:
        session = attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m",
                         writer_options={"max_records": 10})
        cap = session.__enter__()
        first, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        published = {d.pack_id for d in cap.flush()}
        own_server.kill()
        with pytest.raises(DrainError) as raised:
            for _ in range(3):  # the drain fails at its first publish; the step after says so
                cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
            cap.flush()
        assert isinstance(raised.value.__cause__, CatalogUnavailableError)
        assert "check that the server is running" in str(raised.value)
        with pytest.raises(DrainError):
            session.__exit__(None, None, None)
        sealed = set(store.list_packs())
        assert published < sealed  # packs sealed after the kill are kept, unpublished
        own_server.restart()
        assert catalog.published_pack_ids() == published
        assert set(_read_all(store, catalog, "m")) == set(first)
        assert set(catalog.recover(store)) == sealed - published
        assert catalog.published_pack_ids() == sealed
        with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m") as again:
            later, _ = again.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert set(first) | set(later) <= set(_read_all(store, catalog, "m"))


def test_an_unreachable_server_prints_nothing_beside_the_error_raised(tmp_path):
    """clickhouse-driver logs a "Failed to connect" warning with its traceback; with no handler
    configured, Python would print it to stderr beside the named error. Nothing is printed."""
    code = ("import dmi\n"
            "try:\n"
            f"    dmi.open(catalog='clickhouse://default@127.0.0.1:1/d', packs={str(tmp_path / 'packs')!r})\n"
            "except dmi.DMIError as exc:\n"
            "    print(type(exc).__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (0, "CatalogUnavailableError\n", "")
