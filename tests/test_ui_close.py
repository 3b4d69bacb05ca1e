"""``UIServer.close()`` while a request is still in flight.

Request threads are daemons that the server's close does not wait for. A request waiting
for the endpoint lock when the server closes used to open the store afterwards and leave it
open (no one closes it); a request using the store when the server closed had it closed
under it. Now a request that needs the store after close is answered 503 and opens nothing,
and close waits for the endpoint using the store before closing it.

The order of events is forced with ``threading.Event``s and a stand-in endpoint lock that
says when a thread waits at it; the stores are fakes that record what was done to them.
Timeouts only bound a wait that would otherwise hang a broken build.
"""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlsplit

import pytest

from dmi import _ui
from dmi._ui import UIConfig, start_server

BOUND = 60.0
"""Seconds a test waits for an event before it fails (never reached when the code is right)."""


class _Gate:
    """The endpoint lock, recording each thread that comes to wait at it (and what else
    the test marks with ``arrive``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.arrivals: list[str] = []
        self.arrived = threading.Condition()

    def __enter__(self):
        self.arrive(threading.current_thread().name)
        self.lock.acquire()

    def __exit__(self, *exc_info) -> None:
        self.lock.release()

    def arrive(self, name: str) -> None:
        with self.arrived:
            self.arrivals.append(name)
            self.arrived.notify_all()

    def wait_for(self, count: int) -> list[str]:
        """The arrivals once ``count`` threads have come (fails after ``BOUND`` seconds)."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.arrivals) >= count, BOUND), self.arrivals
            return list(self.arrivals)


class _Store:
    """A stand-in store: ``models()`` may be held open by ``release``; records calls."""

    def __init__(self, log: list[str], release: threading.Event | None = None):
        self.log, self.release, self.in_use = log, release, threading.Event()

    def models(self):
        self.in_use.set()
        if self.release is not None:
            assert self.release.wait(BOUND)
        self.log.append("models answered")
        return []

    def close(self) -> None:
        self.log.append("closed")


@pytest.fixture
def gate(monkeypatch):
    gate = _Gate()
    monkeypatch.setattr(_ui, "_ONE_AT_A_TIME", gate)
    return gate


def _server(open_store):
    return start_server(UIConfig(plan_path=None, models=(), open_store=open_store, token=None), "127.0.0.1", 0)


def _get(url: str, path: str, answers: list) -> None:
    """GET ``path``; appends (status, JSON body) to ``answers``."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=BOUND)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        answers.append((resp.status, json.loads(resp.read())))
    finally:
        conn.close()


def test_a_request_waiting_when_the_server_closes_is_503_and_opens_no_store(gate):
    opened: list[_Store] = []

    def open_store():
        opened.append(_Store([]))
        return opened[-1]

    srv = _server(open_store)
    answers: list = []
    gate.lock.acquire()  # another endpoint is running: the request waits for its turn
    request = threading.Thread(target=_get, args=(srv.url, "/api/models", answers))
    request.start()
    assert len(gate.wait_for(1)) == 1  # the request's handler waits at the endpoint lock
    srv.close()
    gate.lock.release()
    request.join(BOUND)
    assert answers == [(503, {"error": "dmi ui is shutting down: start it again to browse", "field": None})]
    assert opened == [] and srv.stores._store is None


def test_close_waits_for_the_endpoint_using_the_store_then_closes_it(gate):
    log: list[str] = []
    release = threading.Event()
    store = _Store(log, release)
    srv = _server(lambda: store)
    answers: list = []
    request = threading.Thread(target=_get, args=(srv.url, "/api/models", answers))
    request.start()
    assert store.in_use.wait(BOUND)  # the endpoint runs, holding the lock and the store
    def close():
        srv.close()
        gate.arrive("close returned")  # so that a close that does not wait fails at once

    closer = threading.Thread(target=close, name="closer")
    closer.start()
    assert gate.wait_for(2)[1] == "closer"  # close waits for the endpoint...
    assert log == []  # ...without closing the store under it
    release.set()
    request.join(BOUND)
    closer.join(BOUND)
    assert not closer.is_alive()
    assert answers == [(200, [])]
    assert log == ["models answered", "closed"]
    with pytest.raises(_ui._Refused, match="shutting down") as refused:
        srv.stores.get()
    assert refused.value.status == 503
