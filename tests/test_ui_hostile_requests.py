"""``dmi ui`` against malformed requests, on a real loopback server: a query parameter that
is not UTF-8 (``%ff``) or raw non-ASCII bytes in the URL are a 400 saying so — they used to
be decoded leniently into another id (``U+FFFD``, ``ÿ``) and answered 404 "no model" —, a
run id with a control character is a 400 (it was a 404 "no run"), ``HEAD`` answers as ``GET``
without the body (it was 501), and path traversal reaches no file."""

from __future__ import annotations

import json
import socket

import pytest
import torch

import dmi
from dmi._ui import UIConfig, start_server
from dmi.storage import PackWriter
from dmi.storage.records import RecordKey


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("ui-hostile")
    with dmi.open(home=home) as store:
        descriptors = []
        with PackWriter(store.packs, on_seal=descriptors.append) as writer:
            writer.append(RecordKey("m", "r", "a", "resid_post", 0, 0, 4, phase="forward"), torch.ones(4, 8))
        with store.catalog.publisher("ui-hostile") as publisher:
            publisher.publish(descriptors)
    srv = start_server(UIConfig(plan_path=None, models=("tiny-llama",), open_store=lambda: dmi.open(home=home),
                                token=None), "127.0.0.1", 0)
    yield srv
    srv.close()


def _raw(srv, method: str, target: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.0 request with ``target`` as given (bytes, unencoded) and read it all."""
    port = srv.httpd.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(method.encode() + b" " + target + b" HTTP/1.0\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("target", [
    b"/api/requests?model=%ff%fe",
    b"/api/requests?model=m&run=%ff",
    b"/api/contents?model=m&request=%c3",
    b"/api/describe?model=%ff",
], ids=["model", "run", "truncated-utf8", "describe"])
def test_a_query_parameter_that_is_not_utf8_is_400(server, target):
    status, _, body = _raw(server, "GET", target)
    assert status == 400
    assert json.loads(body)["error"].startswith("a query parameter is not UTF-8 (")


def test_raw_non_ascii_bytes_in_the_url_are_400(server):
    status, _, body = _raw(server, "GET", b"/api/requests?model=\xff")
    assert (status, json.loads(body)["error"]) == (
        400, "the URL holds bytes that are not ASCII: percent-encode it as UTF-8")


def test_utf8_query_parameters_still_reach_the_store(server):
    status, _, body = _raw(server, "GET", b"/api/requests?model=m")
    assert status == 200 and [r["request_id"] for r in json.loads(body)] == ["a"]
    status, _, body = _raw(server, "GET", b"/api/requests?model=%C3%A9")
    assert status == 404 and "no model '\u00e9'" in json.loads(body)["error"]


@pytest.mark.parametrize("target, what", [
    (b"/api/contents?model=m&request=a&run=%0A", "run id '\\n' contains the control character U+000A"),
    (b"/api/contents?model=m&request=a&run=%00", "run id '\\x00' contains the control character U+0000"),
    (b"/api/requests?model=m%00x", "model id 'm\\x00x' contains the control character U+0000"),
], ids=["run-newline", "run-nul", "model-nul"])
def test_a_control_character_in_an_id_is_400(server, target, what):
    status, _, body = _raw(server, "GET", target)
    assert status == 400
    assert json.loads(body)["error"] == what


@pytest.mark.parametrize("target", [b"/", b"/api/models", b"/api/contents?model=m&request=a"])
def test_head_answers_as_get_without_a_body(server, target):
    got_status, got_headers, got_body = _raw(server, "GET", target)
    status, headers, body = _raw(server, "HEAD", target)
    assert (status, body) == (got_status, b"") and got_body
    assert headers["Content-Type"] == got_headers["Content-Type"]
    assert headers["Content-Length"] == str(len(got_body))


@pytest.mark.parametrize("target", [b"/../../etc/passwd", b"/%2e%2e/%2e%2e/etc/passwd", b"//etc/passwd",
                                    b"/api/../api/models", b"/api/describe?model=../../etc/passwd"])
def test_path_traversal_reaches_no_file(server, target):
    status, _, body = _raw(server, "GET", target)
    assert status in (403, 404)
    assert b"root:" not in body and json.loads(body)["error"]
