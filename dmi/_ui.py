"""``dmi ui``: a small local web page to build a capture plan and browse a store.

A standard-library HTTP server (no web framework, nothing to install) serving one plain
HTML/JS/SVG page (:mod:`dmi._ui_page`) and a JSON API in which every endpoint delegates to
the code the command line uses — ``parse_plan`` / ``dump_plan``, ``describe_model``,
``estimate_plan``, ``Store.models`` / ``requests`` / ``contents`` and the norm plot — so
what the page accepts is exactly what DMI accepts.

Safe by default:

* it binds to loopback; any other address needs the per-launch token (printed in the URL)
  on every request (``X-DMI-Token`` header or ``token`` query parameter), else 403;
* cross-origin requests are refused (403): an ``Origin`` other than the server's own, a
  ``Host`` that is not the server's address (DNS rebinding), and ``POST`` bodies that are
  not ``application/json`` (which a cross-origin form cannot send without a preflight,
  and no CORS header is ever granted);
* the browser reaches no file but the plan path named on the command line (saved there)
  and the models named at launch (the plan's, ``--model``, and the built-in ones).

Reference: ``docs/ui.md``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dmi.storage.errors import DMIError, InvalidArgumentError, PlanError

__all__ = ["UIConfig", "UIServer", "is_loopback", "is_unspecified", "start_server"]

_MAX_BODY = 1 << 20
_BODY_TIMEOUT_S = 30.0
"""How long a connection may stall (request line, headers or body) before it is dropped."""
_ONE_AT_A_TIME = threading.Lock()
"""Endpoints run one at a time: the catalog serialises its statements anyway, and lazy
imports (``transformers``) are not safe to race from two request threads."""


def is_unspecified(host: str) -> bool:
    """Whether ``host`` is the any-address (``0.0.0.0``, ``::``): the server answers on every
    interface, under whatever name or address a client reached it by."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost`` counts)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class UIConfig:
    """What one ``dmi ui`` launch may touch."""

    plan_path: str | None  # the only file the page can write (and read back)
    models: tuple[str, ...]  # the models the page may describe
    open_store: Any  # () -> dmi.Store, or None: no store browsing
    token: str | None  # required on every request when not None


class _Refused(Exception):
    def __init__(self, status: HTTPStatus, reason: str, field_path: str | None = None):
        super().__init__(reason)
        self.status, self.reason, self.field = status, reason, field_path


@dataclass(slots=True)
class UIServer:
    """A running server: ``url`` (with the token when there is one), ``close()``."""

    httpd: ThreadingHTTPServer
    url: str
    thread: threading.Thread = field(repr=False)
    stores: _StoreHolder = field(repr=False)

    def close(self) -> None:
        """Stop serving, then close the store: after the endpoint running, if any, finishes;
        a request still in flight that needs the store afterwards is answered 503."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
        self.stores.close()


class _StoreHolder:
    """The one store a server browses: opened by the first request that needs it, kept until
    the server closes.

    Not one per request: each store open and close starts and stops chDB's embedded server,
    and chDB keeps threads and descriptors from every start (``bench/bench_chdb_sessions.py``),
    so a page browsed for a while would run the process out of descriptors.

    Request threads are daemons the server's close does not wait for, so a request can still
    be in flight when the holder closes: it finishes with the store it holds, and none asks
    for a store afterwards (503), as that would reopen one nobody closes."""

    def __init__(self, open_store: Any):
        self._open = open_store
        self._store = None
        self._closed = False
        self._lock = threading.Lock()

    def get(self):
        """The store, opened on first use; ``_Refused`` (503) once the holder is closed."""
        with self._lock:
            if self._closed:
                raise _Refused(HTTPStatus.SERVICE_UNAVAILABLE, "dmi ui is shutting down: start it again to browse")
            if self._store is None:
                self._store = self._open()
            return self._store

    def close(self) -> None:
        """Refuse every later ``get``, then close the store once the endpoint running (which
        may be using it) has finished: endpoints hold the endpoint lock while they run."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            with _ONE_AT_A_TIME:
                store.close()


def start_server(config: UIConfig, host: str = "127.0.0.1", port: int = 0, *, scan: int = 0) -> UIServer:
    """Serve ``config`` on ``host:port`` in a daemon thread. ``scan > 0``: if the port is
    taken, try the next ``scan`` ports. A non-loopback host without a token is refused."""
    if not is_loopback(host) and not config.token:
        raise InvalidArgumentError(f"binding {host} (not loopback) needs a per-launch token")
    httpd = None
    stores = _StoreHolder(config.open_store)
    for candidate in range(port, port + scan + 1):
        try:
            httpd = ThreadingHTTPServer((host, candidate), _handler(config, stores))
            break
        except OSError as exc:
            if candidate == port + scan:
                raise InvalidArgumentError(f"cannot listen on {host}:{candidate}: {exc.strerror or exc}") from exc
    assert httpd is not None
    httpd.daemon_threads = True
    bound = httpd.server_address[1]
    shown = _shown_host(host)
    url = f"http://{shown}:{bound}/" + (f"?token={config.token}" if config.token else "")
    thread = threading.Thread(target=httpd.serve_forever, name="dmi-ui", daemon=True)
    thread.start()
    return UIServer(httpd, url, thread, stores)


def _shown_host(host: str) -> str:
    """The host part of the printed URL: the machine's name for the any-address (a browser
    cannot open ``http://0.0.0.0:port/`` from another machine), brackets around IPv6."""
    if is_unspecified(host):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _handler(config: UIConfig, stores: _StoreHolder) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        ui = config
        store_holder = stores

    return Handler


class _Handler(BaseHTTPRequestHandler):
    ui: UIConfig
    store_holder: _StoreHolder
    server_version = "dmi-ui"
    timeout = _BODY_TIMEOUT_S  # StreamRequestHandler sets it on the socket: a stalled client frees its thread
    payload: dict[str, Any] | None = None  # a POST's JSON body, read before the endpoint lock

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: the terminal shows the URL, not a line per request."""

    # -- dispatch
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        """A GET's status and headers without its body (a link checker, ``curl -I``)."""
        self._serve("GET", head=True)

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def _serve(self, method: str, *, head: bool = False) -> None:
        url = urlsplit(self.path)
        try:
            query = _query(self.path, url.query)
            self._check_request(method, query)
            route = _ROUTES.get((method, url.path))
            if route is None:
                raise _Refused(HTTPStatus.NOT_FOUND, f"no {method} {url.path}")
            if method == "POST":
                self.payload = self._read_body()  # outside the lock: a slow client delays only itself
            with _ONE_AT_A_TIME:
                status, ctype, body = route(self, query)
        except _Refused as exc:
            status, ctype, body = exc.status, "application/json", _json({"error": exc.reason, "field": exc.field})
        except PlanError as exc:
            status, ctype, body = HTTPStatus.BAD_REQUEST, "application/json", _json(
                {"error": str(exc), "field": exc.field})
        except InvalidArgumentError as exc:
            status, ctype, body = HTTPStatus.BAD_REQUEST, "application/json", _json({"error": str(exc), "field": None})
        except DMIError as exc:
            status, ctype, body = HTTPStatus.NOT_FOUND if isinstance(exc, LookupError) else HTTPStatus.CONFLICT, \
                "application/json", _json({"error": str(exc), "field": None})
        except Exception as exc:  # noqa: BLE001 - a bug still answers the page, in one line
            status, ctype, body = HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", _json(
                {"error": f"internal error: {type(exc).__name__}: {exc}", "field": None})
        try:
            self._send(status, ctype, body, head=head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser left (navigated away, or a timeout): nobody is waiting for the answer

    def _send(self, status: HTTPStatus, ctype: str, body: bytes, *, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self'; "
                                                    "style-src 'unsafe-inline'; script-src 'unsafe-inline'")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _check_request(self, method: str, query: dict[str, str]) -> None:
        """Token, Host and Origin checks; JSON bodies only."""
        if self.ui.token is not None:
            given = self.headers.get("X-DMI-Token") or query.get("token") or ""
            if not secrets.compare_digest(given, self.ui.token):
                raise _Refused(HTTPStatus.FORBIDDEN, "missing or wrong token (use the URL dmi ui printed)")
        allowed = self._allowed_hosts()
        if self.headers.get("Host") not in allowed:
            raise _Refused(HTTPStatus.FORBIDDEN, "request for another host refused")
        origin = self.headers.get("Origin")
        if origin is not None and origin.removeprefix("http://") not in allowed:
            raise _Refused(HTTPStatus.FORBIDDEN, "cross-origin request refused")
        if method == "POST" and self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            raise _Refused(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "POST bodies must be application/json")

    def _allowed_hosts(self) -> set[str]:
        """The ``Host`` (and ``Origin``) values a request may carry.

        Bound to one address: that address and the loopback names, so a page on another site
        that rebinds its DNS name to this machine is refused. Bound to the any-address (which
        needs the token): the name the client used, whatever it is — the server answers on
        every interface under any name, and the token, which a rebinding page cannot know,
        is the guard."""
        host, port = self.server.server_address[:2]
        if is_unspecified(host) and self.ui.token is not None:
            return {self.headers.get("Host") or ""}
        return {f"{h}:{port}" for h in (host, f"[{host}]", "localhost", "127.0.0.1", "[::1]")}

    def _read_body(self) -> dict[str, Any]:
        """The request's JSON object body; a ``Content-Length`` that is not a decimal byte
        count is 400 (``-1`` would read until the client closes), over :data:`_MAX_BODY` 413,
        a body that stalls past :data:`_BODY_TIMEOUT_S` 408."""
        text = (self.headers.get("Content-Length") or "0").strip()
        if not re.fullmatch(r"[0-9]{1,20}", text):
            raise _Refused(HTTPStatus.BAD_REQUEST, f"Content-Length must be a byte count; got {text[:40]!r}")
        length = int(text)
        if length > _MAX_BODY:
            raise _Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
        try:
            raw = self.rfile.read(length)
        except TimeoutError as exc:
            raise _Refused(HTTPStatus.REQUEST_TIMEOUT, f"body not received within {self.timeout:g} s") from exc
        try:
            value = json.loads(raw or b"{}")
        except ValueError as exc:
            raise _Refused(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise _Refused(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
        return value


def _query(target: str, text: str) -> dict[str, str]:
    """The query parameters of a request target (the last value of each name), percent-decoded
    as UTF-8. Raw non-ASCII bytes in the target, or an escape that is not UTF-8 (``%ff``), are
    400: decoded leniently they became other ids (``U+FFFD``, ``ÿ``), answered as unknown."""
    if not target.isascii():
        raise _Refused(HTTPStatus.BAD_REQUEST, "the URL holds bytes that are not ASCII: percent-encode it as UTF-8")
    try:
        pairs = parse_qs(text, errors="strict")
    except UnicodeDecodeError as exc:
        raise _Refused(HTTPStatus.BAD_REQUEST,
                       f"a query parameter is not UTF-8 ({exc.reason}): percent-encode text as UTF-8") from None
    return {name: values[-1] for name, values in pairs.items()}


def _json(value: Any) -> bytes:
    return json.dumps(value, default=str).encode()


def _ok(value: Any) -> tuple[HTTPStatus, str, bytes]:
    return HTTPStatus.OK, "application/json", _json(value)


def _need(query: dict[str, Any], name: str) -> str:
    value = query.get(name)
    if not isinstance(value, str) or not value:
        raise _Refused(HTTPStatus.BAD_REQUEST, f"missing {name}", name)
    return value


# ----------------------------------------------------------------------------- endpoints


def _page(h: _Handler, query: dict[str, str]):
    from dmi._ui_page import PAGE

    return HTTPStatus.OK, "text/html; charset=utf-8", PAGE.encode()


def _session(h: _Handler, query: dict[str, str]):
    """What this launch offers: the models, the plan path and its current text."""
    from dmi._plan_file import CapturePlan, _layers_text, dump_plan, load_plan

    if h.ui.plan_path and os.path.exists(h.ui.plan_path):
        plan = load_plan(h.ui.plan_path)
    else:
        plan = CapturePlan(model=h.ui.models[0])
    fields = {"model": plan.model if plan.model in h.ui.models else h.ui.models[0], "hooks": list(plan.hooks),
              "layers": _layers_text(plan.layers), "phases": list(plan.schedule.phases)}
    return _ok({"models": list(h.ui.models), "plan_path": h.ui.plan_path, "plan": dump_plan(plan), "fields": fields,
                "store": h.ui.open_store is not None})


def _allowed_model(h: _Handler, name: Any) -> str:
    if name not in h.ui.models:
        raise _Refused(HTTPStatus.FORBIDDEN, f"model {name!r} was not named at launch; offered: "
                                             f"{', '.join(h.ui.models)}", "model")
    return name


def _describe(h: _Handler, query: dict[str, str]):
    from dmi._describe import describe_model

    return _ok(describe_model(_allowed_model(h, _need(query, "model"))).as_dict())


def _parse(h: _Handler, body: dict[str, Any]):
    from dmi._plan_file import parse_plan

    text = body.get("plan")
    if not isinstance(text, str):
        raise _Refused(HTTPStatus.BAD_REQUEST, "body.plan must be the plan's YAML text", "plan")
    return parse_plan(text, source="plan")


def _estimate(h: _Handler, query: dict[str, str]):
    from dmi._describe import model_geometry, read_model_config
    from dmi._estimate import estimate_plan

    body = h.payload
    plan = _parse(h, body)
    name = _allowed_model(h, plan.model or h.ui.models[0])
    where, config = read_model_config(name)
    workload = {k: body[k] for k in ("tokens", "new_tokens", "batch", "tp") if k in body}
    geometry = model_geometry(config, where=where)
    return _ok(estimate_plan(plan, geometry, model=name, source="plan", config=config, **workload).as_dict())


def _save(h: _Handler, query: dict[str, str]):
    from dmi._plan_file import dump_plan

    if not h.ui.plan_path:
        raise _Refused(HTTPStatus.CONFLICT, "no plan path was named at launch (dmi ui --plan FILE)")
    plan = _parse(h, h.payload)
    text = dump_plan(plan)
    with open(h.ui.plan_path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return _ok({"saved": h.ui.plan_path, "plan": text})


def _store(h: _Handler):
    if h.ui.open_store is None:
        raise _Refused(HTTPStatus.NOT_FOUND, "no store to browse")
    return h.store_holder.get()


def _models(h: _Handler, query: dict[str, str]):
    return _ok([m.as_dict() for m in _store(h).models()])


def _requests(h: _Handler, query: dict[str, str]):
    return _ok([r.as_dict() for r in _store(h).requests(_need(query, "model"), run_id=query.get("run"))])


def _contents(h: _Handler, query: dict[str, str]):
    return _ok(_store(h).contents(_need(query, "model"), _need(query, "request"), run_id=query.get("run")).as_dict())


def _plot(h: _Handler, query: dict[str, str]):
    """The PNG ``dmi plot`` draws."""
    from dmi._plot import check_plottable, token_norms, write_norm_plot

    model, request, hook = _need(query, "model"), _need(query, "request"), _need(query, "hook")
    view = _store(h).lazy(model, request, hook, run_id=query.get("run"))
    check_plottable(hook, view.dtype)
    tensor = view[:]
    norms = token_norms(tensor if view.per_layer else tensor.unsqueeze(0))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plot.png")
        write_norm_plot(norms, view.layers if view.per_layer else (-1,), path, width=900, height=360,
                        title=f"{hook} L2 norm · {model} · {request}")
        with open(path, "rb") as handle:
            return HTTPStatus.OK, "image/png", handle.read()


_ROUTES = {
    ("GET", "/"): _page,
    ("GET", "/api/session"): _session,
    ("GET", "/api/describe"): _describe,
    ("POST", "/api/estimate"): _estimate,
    ("POST", "/api/plan"): _save,
    ("GET", "/api/models"): _models,
    ("GET", "/api/requests"): _requests,
    ("GET", "/api/contents"): _contents,
    ("GET", "/api/plot.png"): _plot,
}
