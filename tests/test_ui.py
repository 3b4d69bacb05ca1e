"""``dmi ui``: the HTTP contract, against a real server on loopback — every endpoint answers
what the plan / describe / estimate / store code answers, the plan path is the only file
written, and the guards (token off loopback, Host, Origin, JSON bodies) refuse from outside."""

from __future__ import annotations

import concurrent.futures
import http.client
import shutil
import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import torch

import dmi
from dmi._describe import describe_model
from dmi._estimate import estimate_plan_file
from dmi._models import BUILTIN_MODELS
from dmi._ui import UIConfig, _Handler, is_loopback, is_unspecified, start_server
from dmi.storage.errors import CatalogError, InvalidArgumentError
from tests._models import left_padded_batch, tiny

PLAN = "version: 1\nmodel: tiny-llama\nhooks: [resid_post, logits]\nlayers: '0:2'\nschedule: {phases: [forward]}\n"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A store with one captured request, to browse."""
    home = tmp_path_factory.mktemp("ui-home")
    with dmi.open(home=home) as store:
        with dmi.capture(tiny("llama"), hooks="resid_post,token_ids", store=store, model_id="ui-model",
                         run_id="ui-run") as cap:
            with torch.inference_mode():
                cap.forward(*left_padded_batch((5,)), request_ids=["r0"])
    return home


@pytest.fixture
def server(home, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(PLAN)
    config = UIConfig(plan_path=str(plan_path), models=("tiny-llama", "small-llama"),
                      open_store=lambda: dmi.open(home=home), token=None)
    srv = start_server(config, "127.0.0.1", 0)
    yield srv, plan_path
    srv.close()


def _call(url: str, method: str = "GET", path: str = "/", body=None, headers=None, timeout: float = 60):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, ctype, json.loads(raw) if ctype == "application/json" else raw


def test_page_and_session(server):
    srv, plan_path = server
    status, ctype, page = _call(srv.url)
    assert status == 200 and ctype.startswith("text/html") and b'aria-live="polite"' in page
    status, _, session = _call(srv.url, path="/api/session")
    assert status == 200
    assert session["fields"] == {"model": "tiny-llama", "hooks": ["resid_post", "logits"], "layers": "0:2",
                                 "phases": ["forward"]}
    assert session["plan_path"] == str(plan_path) and session["store"] is True


def test_describe_is_describe_model(server):
    srv, _ = server
    status, _, doc = _call(srv.url, path="/api/describe?model=tiny-llama")
    assert status == 200 and doc == json.loads(json.dumps(describe_model("tiny-llama").as_dict()))


def test_describe_refuses_models_not_named_at_launch(server, tmp_path):
    srv, _ = server
    (tmp_path / "config.json").write_text("{}")
    status, _, err = _call(srv.url, path=f"/api/describe?model={tmp_path}")
    assert status == 403 and err["field"] == "model" and "not named at launch" in err["error"]


def test_estimate_is_estimate_plan(server):
    srv, plan_path = server
    status, _, doc = _call(srv.url, "POST", "/api/estimate", {"plan": PLAN, "tokens": 32, "batch": 2})
    assert status == 200
    assert doc == json.loads(json.dumps(estimate_plan_file(str(plan_path), tokens=32, batch=2).as_dict(), default=str))


def test_estimate_reports_plan_errors_at_their_field(server):
    srv, _ = server
    status, _, err = _call(srv.url, "POST", "/api/estimate", {"plan": PLAN + "layer: 3\n"})
    assert status == 400 and err["field"] == "layer" and "did you mean 'layers'" in err["error"]


def test_save_writes_only_the_plan_path(server):
    srv, plan_path = server
    text = '{"version": 1, "model": "small-llama", "hooks": ["embed"], "layers": "1:3"}'
    status, _, doc = _call(srv.url, "POST", "/api/plan", {"plan": text})
    assert status == 200 and doc["saved"] == str(plan_path)
    assert plan_path.read_text() == doc["plan"] and dmi.load_plan(plan_path).hooks == ("embed",)
    assert sorted(p.name for p in plan_path.parent.iterdir()) == ["plan.yaml"]
    status, _, _ = _call(srv.url, "POST", "/api/plan", {"plan": "version: 1\nhooks: [nope]\n"})
    assert status == 400 and dmi.load_plan(plan_path).hooks == ("embed",)  # a refused plan is not written


def test_browse_the_store(server, home):
    srv, _ = server
    status, _, models = _call(srv.url, path="/api/models")
    with dmi.open(home=home) as store:
        assert status == 200 and models == [m.as_dict() for m in store.models()]
        status, _, reqs = _call(srv.url, path="/api/requests?model=ui-model")
        assert status == 200 and [r["request_id"] for r in reqs] == ["r0"]
        status, _, contents = _call(srv.url, path="/api/contents?model=ui-model&request=r0&run=ui-run")
        assert contents == json.loads(json.dumps(store.contents("ui-model", "r0", run_id="ui-run").as_dict()))
    status, ctype, png = _call(srv.url, path="/api/plot.png?model=ui-model&request=r0&hook=resid_post")
    assert (status, ctype) == (200, "image/png") and png[:8] == b"\x89PNG\r\n\x1a\n"
    status, _, err = _call(srv.url, path="/api/plot.png?model=ui-model&request=r0&hook=token_ids")
    assert status == 400 and err["error"].startswith("token_ids holds int64 ids, not activations")
    status, _, err = _call(srv.url, path="/api/requests?model=nope")
    assert status == 404 and "nope" in err["error"]


def test_the_server_opens_its_store_once_and_closes_it_with_itself(home):
    """One store for the server's life, not one per request: every store open and close starts
    and stops chDB's embedded server, which keeps threads and descriptors from each start
    (bench/bench_chdb_sessions.py), so a page browsed for a while would exhaust them."""
    opened = []

    def open_store():
        opened.append(dmi.open(home=home))
        return opened[-1]

    srv = start_server(UIConfig(plan_path=None, models=("tiny-llama",), open_store=open_store, token=None),
                       "127.0.0.1", 0)
    try:
        assert opened == []  # nothing opened until a request needs it
        for path in ("/api/models", "/api/requests?model=ui-model", "/api/contents?model=ui-model&request=r0",
                     "/api/plot.png?model=ui-model&request=r0&hook=resid_post", "/api/models"):
            assert _call(srv.url, path=path)[0] == 200, path
        assert len(opened) == 1
    finally:
        srv.close()
    with pytest.raises(CatalogError, match="closed"):
        opened[0].models()


def test_cross_origin_and_foreign_host_refused(server):
    srv, _ = server
    port = urlsplit(srv.url).port
    assert _call(srv.url, path="/api/session", headers={"Origin": f"http://127.0.0.1:{port}"})[0] == 200
    status, _, err = _call(srv.url, path="/api/session", headers={"Origin": "http://evil.example"})
    assert status == 403 and "cross-origin" in err["error"]
    status, _, err = _call(srv.url, path="/api/session", headers={"Host": f"evil.example:{port}"})
    assert status == 403 and "another host" in err["error"]
    status, _, _ = _call(srv.url, "POST", "/api/plan", {"plan": PLAN}, headers={"Content-Type": "text/plain"})
    assert status == 415


def test_unknown_route_and_bad_body(server):
    srv, _ = server
    assert _call(srv.url, path="/etc/passwd")[0] == 404
    status, _, err = _call(srv.url, "POST", "/api/estimate", b"{not json")
    assert status == 400 and "not JSON" in err["error"]


def _raw_request(port: int, head: str, *, timeout: float = 5.0) -> tuple[int, dict]:
    """Send ``head`` (request line and headers, no body) and read the answer; the socket stays
    open for writing, as a client that never sends its body leaves it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(head.encode() + b"\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def _estimate_head(port: int, length) -> str:
    """The headers of a POST to /api/estimate announcing ``length`` body bytes (``_raw_request`` ends them)."""
    return (f"POST /api/estimate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n")


@pytest.mark.parametrize("length", ["-1", "abc", "+5", "1e3", "1_0"])
def test_a_bad_content_length_is_400_at_once_and_blocks_nobody(server, length):
    """``Content-Length: -1`` once made the server read until the client closed, holding the
    endpoint lock, so every other request waited; ``abc`` was a 500. Now both are refused
    before anything is read, while another client is answered."""
    srv, _ = server
    port = urlsplit(srv.url).port
    head = _estimate_head(port, length)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bad = pool.submit(_raw_request, port, head)
        time.sleep(0.2)  # the bad request has reached the server
        # held behind a lock the bad request took, this call would time out instead of answering
        status, _, doc = _call(srv.url, path="/api/describe?model=tiny-llama", timeout=5)
        assert status == 200 and doc == json.loads(json.dumps(describe_model("tiny-llama").as_dict()))
        status, err = bad.result()
    assert status == 400 and "Content-Length must be a byte count" in err["error"]


def test_a_stalled_body_holds_no_lock_and_times_out(server, monkeypatch):
    """A client that announces a body and never sends it delays only itself: other requests
    are answered meanwhile, and its own connection is answered 408 after the socket timeout."""
    assert _Handler.timeout == 30.0  # the socket timeout every connection gets (None: wait forever)
    monkeypatch.setattr(_Handler, "timeout", 2.0)  # shortened to keep the test quick
    srv, _ = server
    port = urlsplit(srv.url).port
    head = _estimate_head(port, 100)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(_raw_request, port, head, timeout=10)
        time.sleep(0.2)  # the stalled request is being read
        status, _, doc = _call(srv.url, "POST", "/api/estimate", {"plan": PLAN, "tokens": 4}, timeout=5)
        assert status == 200 and doc["tokens"] == 4
        assert not stalled.done()  # answered while the other body was still awaited
        status, err = stalled.result()
    assert status == 408 and err["error"].endswith("body not received within 2 s")


def test_off_loopback_needs_the_token(home):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    config = UIConfig(plan_path=None, models=("tiny-llama",), open_store=None, token=None)
    with pytest.raises(InvalidArgumentError, match="needs a per-launch token"):
        start_server(config, "0.0.0.0", 0)
    config = UIConfig(plan_path=None, models=("tiny-llama",), open_store=None, token="s3cret")
    srv = start_server(config, "0.0.0.0", 0)
    try:
        assert srv.url.endswith("/?token=s3cret")
        port = urlsplit(srv.url).port
        local = f"http://127.0.0.1:{port}/"
        host = {"Host": f"0.0.0.0:{port}"}
        status, _, err = _call(local, path="/api/session", headers=host)
        assert status == 403 and "token" in err["error"]
        assert _call(local, path="/api/session", headers={**host, "X-DMI-Token": "wrong"})[0] == 403
        status, _, session = _call(local, path="/api/session?token=s3cret", headers=host)
        assert status == 200 and session["store"] is False and session["plan_path"] is None
        assert _call(local, path="/api/session", headers={**host, "X-DMI-Token": "s3cret"})[0] == 200
    finally:
        srv.close()


def _interface_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if is_loopback(address) or is_unspecified(address) else address


def test_any_address_bind_answers_every_host_name_with_the_token():
    """``--host 0.0.0.0`` serves other machines: a browser there sends the name or address it
    used as ``Host`` (never ``0.0.0.0``); with the token required, any Host is served and the
    printed URL names this machine. Origin must still be the page's own."""
    config = UIConfig(plan_path=None, models=("tiny-llama",), open_store=None, token="s3cret")
    srv = start_server(config, "0.0.0.0", 0)
    try:
        port = urlsplit(srv.url).port
        assert srv.url == f"http://{socket.gethostname()}:{port}/?token=s3cret"
        local = f"http://127.0.0.1:{port}/"
        name = f"workstation.example:{port}"
        token = {"X-DMI-Token": "s3cret"}
        status, _, session = _call(local, path="/api/session", headers={**token, "Host": name})
        assert status == 200 and session["models"] == ["tiny-llama"]
        status, _, doc = _call(local, "POST", "/api/estimate", {"plan": PLAN, "tokens": 4},
                               headers={**token, "Host": name, "Origin": f"http://{name}"})
        assert status == 200 and doc["tokens"] == 4
        status, _, err = _call(local, "POST", "/api/estimate", {"plan": PLAN},
                               headers={**token, "Host": name, "Origin": "http://evil.example"})
        assert status == 403 and "cross-origin" in err["error"]
        status, _, err = _call(local, path="/api/session", headers={"Host": name})
        assert status == 403 and "token" in err["error"]
        address = _interface_address()
        if address is not None:  # a real connection through another interface, Host as a browser sends it
            status, _, session = _call(f"http://{address}:{port}/", path="/api/session?token=s3cret")
            assert status == 200 and session["models"] == ["tiny-llama"]
    finally:
        srv.close()


def test_port_scan_moves_to_the_next_free_port():
    config = UIConfig(plan_path=None, models=tuple(BUILTIN_MODELS), open_store=None, token=None)
    first = start_server(config, "127.0.0.1", 0)
    try:
        taken = urlsplit(first.url).port
        with pytest.raises(InvalidArgumentError, match="cannot listen"):
            start_server(config, "127.0.0.1", taken)
        second = start_server(config, "127.0.0.1", taken, scan=5)
        try:
            assert taken < urlsplit(second.url).port <= taken + 5
        finally:
            second.close()
    finally:
        first.close()


def _start_ui(tmp_path, *options):
    """``dmi ui`` on a plan in a child process, and the URL it printed."""
    import signal
    import subprocess
    import sys

    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    # Ctrl-C as a terminal delivers it: the child gets SIGINT's default action even when this suite
    # was started in the background (a non-interactive shell starts `cmd &` with SIGINT ignored, and
    # Python installs its KeyboardInterrupt handler only where SIGINT is not ignored)
    proc = subprocess.Popen([sys.executable, "-m", "dmi.cli", "ui", "--plan", str(plan), "--no-browser",
                             "--home", str(tmp_path / "home"), *options], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = proc.stdout.readline()
    assert line.startswith("dmi ui: http://127.0.0.1:") and line.rstrip().endswith("(Ctrl-C stops)"), line
    return proc, line.split()[2]


def _interrupt(proc) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == ""


def test_dmi_ui_prints_its_url_and_stops_on_interrupt(tmp_path):
    """The command: binds loopback (next free port from 8765), prints the URL, offers the
    plan's model and the built-in ones, exits 0 on Ctrl-C."""
    proc, url = _start_ui(tmp_path)
    try:
        assert 8765 <= urlsplit(url).port <= 8815
        status, _, session = _call(url, path="/api/session")
        assert status == 200 and session["models"] == ["tiny-llama", *[m for m in BUILTIN_MODELS if m != "tiny-llama"]]
    finally:
        _interrupt(proc)


def test_dmi_ui_port_0_binds_a_port_the_system_picks(tmp_path):
    """``--port 0`` means any free port, as for any server: not the default 8765 and its scan."""
    proc, url = _start_ui(tmp_path, "--port", "0")
    try:
        port = urlsplit(url).port
        assert port and not 8765 <= port <= 8815
        status, _, _ = _call(url, path="/api/session")
        assert status == 200
    finally:
        _interrupt(proc)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_page_in_headless_chromium(home, tmp_path):
    """A real browser runs the page's script: it reads the plan, describes the model, shows the
    estimate the API computes, and (``#model=...&request=...&hook=...``) browses the captured
    run to its hooks and plot. Checked on the DOM after the scripts ran; screenshots taken."""
    import re
    import subprocess

    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(PLAN)
    srv = start_server(UIConfig(str(plan_path), ("tiny-llama",), lambda: dmi.open(home=home), None),
                       "127.0.0.1", 0)
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--window-size=1300,1000"]
    browse = srv.url + "#model=ui-model&request=r0&hook=resid_post"
    try:
        dom = subprocess.run([*cmd, "--dump-dom", browse], capture_output=True, text=True, timeout=120).stdout
        for name, url in (("plan", srv.url), ("store", browse)):
            subprocess.run([*cmd, f"--screenshot={tmp_path / name}.png", url], capture_output=True, timeout=120,
                           check=True)
    finally:
        srv.close()
    expected = estimate_plan_file(str(plan_path), tokens=512).raw_bytes_per_million_tokens
    assert re.search(r'id="estimate-total" data-raw="(\d+)"', dom).group(1) == str(expected)
    assert "Requests of ui-model" in dom and "Hooks of r0" in dom
    assert re.search(r'<img id="plot" alt="resid_post norms of r0"[^>]*src="/api/plot.png\?model=ui-model', dom)
    for name in ("plan", "store"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
