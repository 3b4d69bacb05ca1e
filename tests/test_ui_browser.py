"""``dmi ui`` driven through its controls in a real browser: headless Chromium over the
DevTools protocol.

Debian's ``chromium`` runs with ``--remote-debugging-pipe`` (the protocol as NUL-terminated
JSON on file descriptors 3 and 4: no port, no websocket library, only the standard
library). The test works the page as a keyboard user would — arrow keys on the model list,
space on hook boxes, typing into the layers field, Enter on "Save plan" — and checks after
each change that the estimate the page shows is the one the API computes for the selection
(each step's figure differs from the last, so a stale page cannot pass), that the diagram
marks the selected hook points, and that the saved file loads with ``load_plan`` into
exactly the plan chosen.

A second test browses a captured run: ``tiny-llama`` generates from two prompts under a plan
file into a store in ``tmp_path``, the page opens at the store link
(``#model=tiny-llama&request=fox&hook=resid_post``), and what it shows — the model's request
count, each request's run and token count, the hooks of a request with their layers,
tokens, dtype and bytes — must equal what ``Store.models`` / ``requests`` / ``contents``
answer; the heatmap must have loaded at the size ``/api/plot.png`` draws and be painted
(many colours, not a blank or broken image). Then, by keyboard, Enter on the other request
and on one of its hooks moves the table and the plot there.

Screenshots: each test saves its page (``ui-plan.png``: the plan page after the controls
were driven; ``ui-store.png``: the store page at the link above) into ``tmp_path``, and when
the environment variable ``DMI_ARTIFACTS`` names a directory, copies it there under that
name (creating the directory). CI (``.ci/run``) sets it and keeps the files as artifacts;
``docs/ui.md`` shows them. Skipped only when ``chromium`` is not installed.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

import dmi
from dmi._estimate import estimate_plan_file
from dmi._models import load_model
from dmi._plan_file import load_plan, parse_plan
from dmi._ui import UIConfig, start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)"),
]

PLAN = "version: 1\nmodel: tiny-llama\nhooks: [resid_post, logits]\nlayers: '0:2'\nschedule: {phases: [forward]}\n"
WORKLOAD = {"tokens": 512, "new_tokens": 0, "batch": 1, "tp": 1}
"""What the page's workload fields hold for a plan of forward passes."""

PNG = b"\x89PNG\r\n\x1a\n"

WAIT = 90.0
"""Seconds a step may take on a loaded machine (describing a model imports transformers)."""

KEYS = {
    "ArrowDown": {"key": "ArrowDown", "code": "ArrowDown", "windowsVirtualKeyCode": 40},
    "Space": {"key": " ", "code": "Space", "windowsVirtualKeyCode": 32, "text": " "},
    "Enter": {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r"},
    "SelectAll": {"key": "a", "code": "KeyA", "windowsVirtualKeyCode": 65, "modifiers": 2, "commands": ["selectAll"]},
}


class Browser:
    """Headless Chromium with one page, driven over the DevTools pipe."""

    def __init__(self, profile: str):
        to_browser, self._commands = os.pipe()
        self._replies, from_browser = os.pipe()

        def on_fds_3_and_4() -> None:  # runs in the child before exec: the pipe ends chromium expects
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1300,1150", "about:blank"],
            preexec_fn=on_fds_3_and_4, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._next_id = 0
        self._answers: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.exceptions: list[str] = []  # uncaught script errors on the page
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = None

    def _read(self) -> None:
        pending = b""
        while chunk := os.read(self._replies, 1 << 16):
            pending += chunk
            *messages, pending = pending.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if message.get("method") == "Runtime.exceptionThrown":
                    self.exceptions.append(message["params"]["exceptionDetails"].get("text", ""))
                elif "id" in message:
                    with self._lock:
                        self._answers.pop(message["id"]).put(message)

    def call(self, method: str, params: dict | None = None, *, browser_level: bool = False) -> dict:
        """Send one command (to the page unless ``browser_level``) and return its result."""
        with self._lock:
            self._next_id += 1
            ident, answer = self._next_id, queue.Queue()
            self._answers[ident] = answer
        message = {"id": ident, "method": method, "params": params or {}}
        if self.session and not browser_level:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        reply = answer.get(timeout=WAIT)
        assert "error" not in reply, (method, reply["error"])
        return reply["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": url}, browser_level=True)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 browser_level=True)["sessionId"]
        self.call("Runtime.enable")

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, expected, what: str):
        """Poll ``expression`` until it equals ``expected``; fail naming ``what`` and the status line."""
        deadline, value = time.monotonic() + WAIT, None
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value == expected:
                return
            time.sleep(0.1)
        status = self.js("document.getElementById('status').textContent")
        pytest.fail(f"{what}: page shows {value!r}, expected {expected!r}; status: {status!r}")

    def press(self, selector: str, key: str) -> None:
        """Focus ``selector`` and press ``key`` on it, as the keyboard would."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        for kind in ("keyDown", "keyUp"):
            event = dict(KEYS[key], type=kind)
            if kind == "keyUp":
                event.pop("text", None)
                event.pop("commands", None)
            self.call("Input.dispatchKeyEvent", event)

    def type_into(self, selector: str, text: str) -> None:
        """Replace the field's text by typing ``text`` (select all, then insert)."""
        self.press(selector, "SelectAll")
        self.call("Input.insertText", {"text": text})

    def screenshot(self, path) -> None:
        """The whole page as a PNG (beyond the window when it is taller)."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.call("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close", browser_level=True)
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self._commands)
            self._reader.join(timeout=30)
            os.close(self._replies)


def keep_screenshot(browser: Browser, tmp_path: Path, name: str) -> Path:
    """Save the page as ``tmp_path/name``; when ``DMI_ARTIFACTS`` names a directory, copy it
    there under the same name (creating the directory): CI keeps that directory."""
    path = tmp_path / name
    browser.screenshot(path)
    assert path.read_bytes()[:8] == PNG, f"{name} is not a PNG"
    if artifacts := os.environ.get("DMI_ARTIFACTS"):
        os.makedirs(artifacts, exist_ok=True)
        shutil.copyfile(path, os.path.join(artifacts, name))
    return path


def _api_estimate(url: str, plan: dict) -> int:
    """What ``POST /api/estimate`` answers for ``plan`` (raw bytes per million tokens)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT)
    conn.request("POST", "/api/estimate", body=json.dumps({"plan": json.dumps(plan), **WORKLOAD}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 200, body
    return body["raw_bytes_per_million_tokens"]


def _plan(model: str, hooks: list[str], layers) -> dict:
    return {"version": 1, "model": model, "hooks": hooks, "layers": layers, "schedule": {"phases": ["forward"]}}


SHOWN = "document.getElementById('estimate-total')?.dataset.raw"
HOOKS_CHECKED = "[...document.querySelectorAll('input[name=hook]:checked')].map((c) => c.value)"
TABLE_HOOKS = "[...document.querySelectorAll('#estimate-table td:first-child')].map((td) => td.textContent)"
RED_DOTS = "document.querySelectorAll('#diagram circle[fill=\"#c30\"]').length"


@pytest.fixture
def driven(tmp_path):
    """A ``dmi ui`` server on the plan file, and a browser on its page."""
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(PLAN)
    server = start_server(UIConfig(str(plan_path), ("tiny-llama", "small-llama"), None, None), "127.0.0.1", 0)
    browser = Browser(str(tmp_path / "profile"))
    try:
        browser.open(server.url)
        yield browser, server.url, plan_path
    finally:
        browser.close()
        server.close()


def test_the_controls_update_the_estimate_and_save_the_chosen_plan(driven, tmp_path):
    browser, url, plan_path = driven
    steps = [
        _plan("tiny-llama", ["resid_post", "logits"], "0:2"),  # as loaded from the plan file
        _plan("small-llama", ["resid_post", "logits"], "0:2"),  # another model
        _plan("small-llama", ["attn_out", "resid_post"], "0:2"),  # attn_out ticked, logits unticked
        _plan("small-llama", ["attn_out", "resid_post"], "2-5"),  # a span typed (both ends included)
        _plan("small-llama", ["attn_out", "resid_post"], [1, 3, 5]),  # layers typed
    ]
    expected = [_api_estimate(url, plan) for plan in steps]
    assert len(set(expected)) == len(expected)  # every step changes the figure

    browser.wait_for(SHOWN, str(expected[0]), "estimate of the plan file")
    assert browser.js(HOOKS_CHECKED) == ["resid_post", "logits"] and browser.js("$('layers').value") == "0:2"

    browser.press("#model", "ArrowDown")
    browser.wait_for(SHOWN, str(expected[1]), "estimate after choosing small-llama")
    assert browser.js("$('model').value") == "small-llama"

    browser.press("input[name=hook][value=attn_out]", "Space")
    browser.press("input[name=hook][value=logits]", "Space")
    browser.wait_for(SHOWN, str(expected[2]), "estimate after ticking attn_out and unticking logits")
    assert browser.js(HOOKS_CHECKED) == ["attn_out", "resid_post"]

    browser.type_into("#layers", "2-5")
    browser.wait_for(SHOWN, str(expected[3]), "estimate after typing layers 2-5")
    assert browser.js(RED_DOTS) == 2 * 4  # two per-layer hooks at layers 2, 3, 4 and 5

    browser.type_into("#layers", "1,3,5")
    browser.wait_for(SHOWN, str(expected[4]), "estimate after typing layers 1,3,5")
    assert browser.js(TABLE_HOOKS) == ["attn_out", "resid_post"]
    assert browser.js(RED_DOTS) == 2 * 3  # two per-layer hooks at three of small-llama's 8 drawn layers

    browser.press("#save", "Enter")
    browser.wait_for("$('status').textContent", f"saved {plan_path}", "status after Save plan")
    saved = load_plan(plan_path)
    assert saved == parse_plan(json.dumps(steps[-1]))
    assert (saved.model, saved.hooks, saved.layers, saved.schedule.phases) == (
        "small-llama", ("attn_out", "resid_post"), (1, 3, 5), ("forward",))
    assert browser.js("$('plan-text').textContent") == plan_path.read_text()
    assert estimate_plan_file(str(plan_path), **WORKLOAD).raw_bytes_per_million_tokens == expected[-1]
    assert browser.exceptions == [] and browser.js("$('status').className") == ""
    keep_screenshot(browser, tmp_path, "ui-plan.png")


STORE_PLAN = ("version: 1\nmodel: tiny-llama\nmodel_id: tiny-llama\nrun_id: ui-run\nhooks: [resid_post, attn_out]\n"
              "schedule: {phases: [prefill, decode]}\n")
PROMPTS = {"fox": "the quick brown fox jumps over the lazy dog", "hi": "hi there"}
"""Request id → prompt, generated in one batch under ``STORE_PLAN``."""

HEADING = "document.querySelector('#{} h3')?.textContent"
BUTTONS = "[...document.querySelectorAll('#{} button')].map((b) => b.textContent)"
CONTENTS_ROWS = "[...document.querySelectorAll('#contents tr')].slice(1).map((tr) => [...tr.cells].map((td) => td.textContent))"
PLOT = """(() => {
  const p = $('plot');
  if (!p.complete || !p.naturalWidth) return null;
  const q = Object.fromEntries(new URL(p.src).searchParams);
  return {width: p.naturalWidth, height: p.naturalHeight, alt: p.alt, query: q};
})()"""
PLOT_COLOURS = """(() => {
  const p = $('plot'), c = document.createElement('canvas');
  c.width = p.naturalWidth; c.height = p.naturalHeight;
  const g = c.getContext('2d'); g.drawImage(p, 0, 0);
  const d = g.getImageData(0, 0, c.width, c.height).data, seen = new Set();
  for (let i = 0; i < d.length; i += 4) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
  return seen.size;
})()"""


def _human(n: int) -> str:
    """The page's ``human()``: bytes in B / KiB / ... with two decimals (JS ``toFixed``
    rounds a tie up, so ``ROUND_HALF_UP`` on the exact value, not Python's ``format``)."""
    units, value, i = ["B", "KiB", "MiB", "GiB", "TiB"], n, 0
    while value >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    shown = str(Decimal(value).quantize(Decimal("0.01"), ROUND_HALF_UP)) if i else str(value)
    return f"{shown} {units[i]}"


@pytest.fixture
def browsed(tmp_path):
    """A run captured from ``tiny-llama`` into a store in ``tmp_path``, what the store API
    says of it, a ``dmi ui`` server on that store and a browser at the store link."""
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(STORE_PLAN)
    home = tmp_path / "home"
    tiny = load_model("tiny-llama")
    enc = tiny.tokenizer(list(PROMPTS.values()), return_tensors="pt", padding=True)
    with dmi.open(home=home) as store:
        with dmi.capture(tiny.model, plan=str(plan_path), store=store) as cap:
            with torch.inference_mode():
                cap.generate(enc["input_ids"], enc["attention_mask"], request_ids=list(PROMPTS), max_new_tokens=4,
                             do_sample=False)
        api = {"models": store.models(), "requests": store.requests("tiny-llama", run_id="ui-run"),
               "contents": {r: store.contents("tiny-llama", r, run_id="ui-run") for r in PROMPTS},
               "layers": tiny.model.config.num_hidden_layers}
    server = start_server(UIConfig(str(plan_path), ("tiny-llama",), lambda: dmi.open(home=home), None), "127.0.0.1", 0)
    browser = Browser(str(tmp_path / "profile"))
    try:
        browser.open(server.url + "#model=tiny-llama&request=fox&hook=resid_post")
        yield browser, api, plan_path
    finally:
        browser.close()
        server.close()


def test_the_store_link_browses_a_captured_run(browsed, tmp_path):
    browser, api, plan_path = browsed
    requests, contents = api["requests"], api["contents"]
    assert [m.model_id for m in api["models"]] == ["tiny-llama"] and api["models"][0].requests == 2
    assert sorted(r.request_id for r in requests) == ["fox", "hi"] and {r.run_id for r in requests} == {"ui-run"}
    for held in contents.values():  # the plan's hooks at every layer: what the page must then show
        assert sorted(h.hook for h in held.hooks) == ["attn_out", "resid_post"]
        assert all(h.layers == tuple(range(api["layers"])) for h in held.hooks)

    def rows(request: str) -> list[list[str]]:
        return [[h.hook, str(len(h.layers)), str(h.n_tokens), h.dtype, _human(h.raw_bytes)]
                for h in contents[request].hooks]

    def plotted(request: str, hook: str) -> dict:
        return {"width": 900, "height": 360, "alt": f"{hook} norms of {request}",  # the size _ui's plot draws
                "query": {"model": "tiny-llama", "request": request, "run": "ui-run", "hook": hook}}

    # the link opened the store at request fox and plotted its resid_post
    browser.wait_for(HEADING.format("contents"), "Hooks of fox", "contents heading after the store link")
    browser.wait_for(PLOT, plotted("fox", "resid_post"), "the heatmap of fox's resid_post")
    assert browser.js(PLOT_COLOURS) > 50  # a painted heatmap, not a blank or broken image
    assert browser.js(HEADING.format("models")) == "Models"
    assert browser.js(BUTTONS.format("models")) == [f"{m.model_id} ({m.requests} requests)" for m in api["models"]]
    assert browser.js(HEADING.format("requests")) == "Requests of tiny-llama"
    assert browser.js(BUTTONS.format("requests")) == [f"{r.request_id} ({r.run_id}, {r.n_tokens} tokens)"
                                                      for r in requests]
    assert browser.js(CONTENTS_ROWS) == rows("fox")
    # the plan side shows the plan that captured the run, with its estimate
    expected = estimate_plan_file(str(plan_path), tokens=512, new_tokens=16).raw_bytes_per_million_tokens
    browser.wait_for(SHOWN, str(expected), "estimate of the capture plan")
    assert browser.js(HOOKS_CHECKED) == ["attn_out", "resid_post"]
    assert browser.exceptions == [] and browser.js("$('status').className") == ""
    keep_screenshot(browser, tmp_path, "ui-store.png")

    # by keyboard: Enter on request hi, then on its attn_out
    order = [r.request_id for r in requests]
    browser.press(f"#requests button:nth-of-type({order.index('hi') + 1})", "Enter")
    browser.wait_for(HEADING.format("contents"), "Hooks of hi", "contents heading after Enter on request hi")
    assert browser.js(CONTENTS_ROWS) == rows("hi")
    hooks = [h.hook for h in contents["hi"].hooks]
    browser.press(f"#contents tr:nth-child({hooks.index('attn_out') + 2}) button", "Enter")
    browser.wait_for(PLOT, plotted("hi", "attn_out"), "the heatmap of hi's attn_out after Enter on it")
    assert browser.js(PLOT_COLOURS) > 50
    assert browser.exceptions == [] and browser.js("$('status').textContent") == "plotting attn_out"
