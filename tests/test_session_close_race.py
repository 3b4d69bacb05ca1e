"""A capture session closed, or flushed, while one of its calls runs: the close waits for the call
(or forward) in progress, so its records are complete and the model thread sees no error.

Threads are ordered by events, never by time: a forward hook pauses the model thread mid-step,
and the session gate's condition tells the test when another thread waits for the holder. A
join's timeout only bounds a thread that should not be blocked at all."""

from __future__ import annotations

import threading

import pytest
import torch

from ._models import MemoryWriter, left_padded_batch, tiny
from dmi.capture import attach
from dmi.storage.errors import AttachError, CaptureError

N_NEW = 6
JOIN_S = 30  # bounds a thread that must not be blocked; never reached when the test passes
HOOKS = "resid_post"

CALLS = {
    "session-generate": lambda cap, model, ids, mask: cap.generate(
        ids, mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False),
    "model-generate": lambda cap, model, ids, mask: model.generate(
        ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False),
    "model-forward": lambda cap, model, ids, mask: model(ids, attention_mask=mask),
    "session-forward": lambda cap, model, ids, mask: cap.forward(ids, mask),
}


class _Worker(threading.Thread):
    """Runs ``fn`` on a daemon thread and keeps its result or error; sets ``done`` as it ends."""

    def __init__(self, fn, done: threading.Event | None = None):
        super().__init__(daemon=True)
        self.fn, self.done = fn, done or threading.Event()
        self.result = self.error = None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test by finish()
            self.error = exc
        finally:
            self.done.set()

    def finish(self):
        self.join(JOIN_S)
        assert not self.is_alive(), "the thread is still blocked: something holds the session"
        if self.error is not None:
            raise self.error
        return self.result


class _Pause:
    """A hook that stops the thread running it at its ``at``-th call until ``go`` is set."""

    def __init__(self, at: int = 1):
        self.at, self.calls = at, 0
        self.paused, self.go = threading.Event(), threading.Event()

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            self.paused.set()
            assert self.go.wait(JOIN_S)


class _SignalWaits(threading.Condition):
    """The session gate's condition: sets ``waiting`` whenever a thread waits on it (for the
    session's holder to let go), and ``freed`` whenever the holder lets go of its last hold."""

    def __init__(self, waiting: threading.Event, freed: threading.Event | None = None):
        super().__init__()
        self.waiting, self.freed = waiting, freed or threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)

    def notify_all(self):
        self.freed.set()
        super().notify_all()


class _InterruptedWait(threading.Condition):
    """A gate condition whose waits are interrupted, as Ctrl-C interrupts a close that waits."""

    def wait(self, timeout=None):
        raise KeyboardInterrupt


def _by_key(writer) -> dict:
    """Every (request, layer)'s positions, its records joined in token order."""
    out = {}
    for rid, layer in sorted({(k.request_id, k.layer) for k, _, _ in writer.records}):
        recs = sorted(((k.start_token, d) for k, d, _ in writer.records
                       if k.request_id == rid and k.layer == layer), key=lambda r: r[0])
        starts = [s for s, _ in recs]
        assert starts == sorted(set(starts)), f"{rid} layer {layer}: a position captured twice"
        out[rid, layer] = torch.cat([d for _, d in recs])
    return out


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _as_reference(got: dict, rids: list[str]) -> dict:
    """The records of requests ``rids``, renamed as an uninterrupted run names its rows."""
    return {(f"r-{rids.index(rid):06d}", layer): v for (rid, layer), v in got.items() if rid in rids}


def _uninterrupted(model, how, ids, mask) -> dict:
    """The records of ``how`` run with nothing in its way, every position checked there."""
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id="r") as cap:
        CALLS[how](cap, model, ids, mask)
    want = _by_key(w)
    steps = N_NEW - 1 if how.endswith("generate") else 0
    real = mask.sum(1).tolist()
    layers = model.config.num_hidden_layers
    assert {k: v.shape[0] for k, v in want.items()} == {
        (f"r-{i:06d}", layer): n + steps for i, n in enumerate(real) for layer in range(layers)}
    return want


def _paused_session(model, at: int, gate_event: threading.Event | None = None):
    """A pause on layer 1's forward (registered before the session's, so it stops the model thread
    inside the layer's hooks, before the session's own), then the session; with ``gate_event``,
    the gate signals waits on it."""
    pause = _Pause(at)
    model.model.layers[1].register_forward_hook(pause)
    w = MemoryWriter()
    ctx = attach(model, hooks=HOOKS, writer=w, run_id="r")
    cap = ctx.__enter__()
    if gate_event is not None:
        cap._lock._cond = _SignalWaits(gate_event)
    return pause, w, ctx, cap


def _close_first_when_freed(model, pause: _Pause, freed: threading.Event, closed: threading.Event) -> None:
    """A pre-hook on the model, before the session's: a forward after the pause, where the
    session was let go since (nothing held it across the call), first waits for the close to
    end — the worst order the race can take, made certain."""
    def hook(module, args):
        if pause.go.is_set() and freed.is_set():
            assert closed.wait(JOIN_S)

    model.register_forward_pre_hook(hook)


def _pause_at_call_start(cap, pause: _Pause) -> None:
    """The session's call pauses once it checked that the session is open, before it runs the model."""
    open_call = cap._open_call

    def paused(*args, **kwargs):
        pause()
        return open_call(*args, **kwargs)

    cap._open_call = paused


def _close_during(how: str, at: int, before=None, at_call_start: bool = False) -> None:
    """Run ``how`` on a thread, paused at layer 1's ``at``-th call (or, ``at_call_start``, as the
    session's call starts); close the session from another thread meanwhile; check that the close
    waited: the records equal an uninterrupted run's, and neither thread saw an error.
    ``before(model)`` runs before attaching, ``before.run(model, ids, mask)`` in the session."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, how, ids, mask)
    progressed, freed, closed = threading.Event(), threading.Event(), threading.Event()
    pause = _Pause(at)
    if not at_call_start:
        model.model.layers[1].register_forward_hook(pause)
    if before is not None:
        before(model)
    _close_first_when_freed(model, pause, freed, closed)
    w = MemoryWriter()
    ctx = attach(model, hooks=HOOKS, writer=w, run_id="r")
    cap = ctx.__enter__()
    cap._lock._cond = _SignalWaits(progressed, freed)
    if at_call_start:
        _pause_at_call_start(cap, pause)
    if before is not None:
        before.run(model, ids, mask)
    caller = _Worker(lambda: CALLS[how](cap, model, ids, mask))
    assert pause.paused.wait(JOIN_S)

    def close():
        try:
            return ctx.__exit__(None, None, None)
        finally:
            progressed.set()

    closer = _Worker(close, done=closed)
    assert progressed.wait(JOIN_S)  # the close waits for the call (or, unguarded, has closed)
    freed.clear()
    pause.go.set()
    caller.finish()
    assert closer.finish() is False
    _same(_by_key(w), want)
    with pytest.raises(CaptureError, match="closed"):
        cap.forward(ids, mask)


@pytest.mark.parametrize("how,at", [("session-generate", 3), ("model-generate", 3), ("model-forward", 1)])
def test_close_on_another_thread_waits_for_the_running_call(how, at):
    _close_during(how, at)


@pytest.mark.parametrize("how", ["session-generate", "session-forward"])
def test_close_on_another_thread_waits_for_a_call_that_is_starting(how):
    _close_during(how, 1, at_call_start=True)


def test_a_forward_whose_pre_hooks_failed_before_the_sessions_leaves_the_session_held_right():
    """A pre-hook of the user's, before the session's, raises: PyTorch still runs the session's
    always-call post-hook, which must not let go of a hold its forward never took."""
    class FailOnce:
        """Registers a pre-hook that fails once; ``run`` makes it fail in a direct forward."""

        def __call__(self, model):
            def hook(module, args):
                self.handle.remove()
                raise ValueError("the user's pre-hook failed")

            self.handle = model.register_forward_pre_hook(hook)

        def run(self, model, ids, mask):
            with pytest.raises(ValueError, match="pre-hook failed"):
                model(ids, attention_mask=mask)

    _close_during("model-generate", 3, before=FailOnce())


def test_flush_on_another_thread_waits_for_the_running_call():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-generate", ids, mask)
    progressed = threading.Event()
    pause, w, ctx, cap = _paused_session(model, 3, progressed)
    caller = _Worker(lambda: CALLS["session-generate"](cap, model, ids, mask))
    assert pause.paused.wait(JOIN_S)
    flusher = _Worker(lambda: (cap.flush(), _by_key(w))[1], done=progressed)
    assert progressed.wait(JOIN_S)
    pause.go.set()
    caller.finish()
    _same(flusher.finish(), want)  # as the flush returned, the whole call was written
    ctx.__exit__(None, None, None)


def test_closing_from_inside_its_own_call_closes_as_the_call_returns():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-generate", ids, mask)
    w = MemoryWriter()
    ctx = attach(model, hooks=HOOKS, writer=w, run_id="r")
    cap = ctx.__enter__()
    seen = []

    def hook(module, args, output):  # layer 1, on the model thread, inside cap.generate
        if len(seen) == 1:
            seen.append(ctx.__exit__(None, None, None))  # returns at once: no wait on itself
        elif len(seen) == 2:
            with pytest.raises(AttachError):  # the model stays attached until the call returns
                attach(model, writer=MemoryWriter()).__enter__()
            seen.append("still attached")
        else:
            seen.append("step")

    model.model.layers[1].register_forward_hook(hook)
    rids, out = CALLS["session-generate"](cap, model, ids, mask)
    assert seen[:3] == ["step", False, "still attached"] and len(seen) == N_NEW
    _same(_by_key(w), want)
    with pytest.raises(CaptureError, match="closed"):
        cap.forward(ids, mask)
    with attach(model, writer=MemoryWriter()):  # closed, and given back, as the call returned
        pass


def test_an_interrupted_close_is_left_to_the_running_call():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-generate", ids, mask)
    pause, w, ctx, cap = _paused_session(model, 3)
    cap._lock._cond = _InterruptedWait()
    caller = _Worker(lambda: CALLS["session-generate"](cap, model, ids, mask))
    assert pause.paused.wait(JOIN_S)
    with pytest.raises(KeyboardInterrupt):
        ctx.__exit__(None, None, None)
    with pytest.raises(AttachError):  # not closed under the running call
        attach(model, writer=MemoryWriter()).__enter__()
    pause.go.set()
    caller.finish()
    _same(_by_key(w), want)  # the call closed the session as it ended
    with attach(model, writer=MemoryWriter()):
        pass


def _interrupt_once(model):
    """A hook on layer 1 that raises KeyboardInterrupt once: PyTorch then skips the model's
    always-call post-hook, so the forward ends without letting go of the session itself."""
    def hook(module, args, output):
        handle.remove()
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_hook(hook)


def test_a_forward_interrupted_inside_a_call_leaves_the_session_to_other_threads():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-forward", ids, mask)
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id="r") as cap:
        _interrupt_once(model)
        with pytest.raises(KeyboardInterrupt):
            cap.forward(ids, mask, request_ids=["x0", "x1", "x2"])
        rids = ["y0", "y1", "y2"]
        _Worker(lambda: cap.forward(ids, mask, request_ids=rids)).finish()
    _same(_as_reference(_by_key(w), rids), want)


def test_a_direct_forward_interrupted_leaves_the_session_free():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-forward", ids, mask)
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id="r") as cap:
        _interrupt_once(model)
        with pytest.raises(KeyboardInterrupt):
            model(ids, attention_mask=mask)
        model(ids, attention_mask=mask)  # the next forward on this thread takes the hold over, and ends it
        rids = ["y0", "y1", "y2"]
        _Worker(lambda: cap.forward(ids, mask, request_ids=rids)).finish()
        _interrupt_once(model)
        with pytest.raises(KeyboardInterrupt):
            model(ids, attention_mask=mask)
    # leaving the block on the interrupted thread closed the session and gave the model back
    with attach(model, writer=MemoryWriter()):
        pass
    _same(_as_reference(_by_key(w), rids), want)


def test_a_forward_interrupted_on_a_thread_that_ended_does_not_hold_the_session_for_ever():
    """A direct forward whose post-hook PyTorch skipped (``KeyboardInterrupt``) on a thread that
    then ended leaves a hold no one will let go: the close, and a call on another thread, take
    the session over once they see its holder's thread is gone."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-forward", ids, mask)
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id="r") as cap:
        _interrupt_once(model)
        interrupted = _Worker(lambda: model(ids, attention_mask=mask))
        interrupted.join(JOIN_S)
        assert isinstance(interrupted.error, KeyboardInterrupt)
        assert cap._lock._holder == interrupted.ident  # the ended thread still holds the session
        rids = ["z0", "z1", "z2"]
        _Worker(lambda: cap.forward(ids, mask, request_ids=rids)).finish()
        _interrupt_once(model)
        _Worker(lambda: model(ids, attention_mask=mask)).join(JOIN_S)
    with attach(model, writer=MemoryWriter()):  # the close ran and gave the model back
        pass
    _same(_as_reference(_by_key(w), rids), want)


class _InterruptedAsTaken:
    """Makes the next forward's hold of the session end in ``KeyboardInterrupt`` the moment the
    gate is taken: the earliest bytecode a real Ctrl-C could fall on in the pre-hook."""

    def __init__(self, gate):
        self.gate, self.take = gate, gate.acquire_forward

    def __call__(self):
        self.take()
        del self.gate.acquire_forward  # once
        raise KeyboardInterrupt


@pytest.mark.parametrize("how", ["session-forward", "model-forward"])
def test_an_interrupt_as_a_forward_takes_the_session_leaves_it_to_other_threads_and_to_close(how):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = _uninterrupted(model, "session-forward", ids, mask)
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id="r") as cap:
        cap._lock.acquire_forward = _InterruptedAsTaken(cap._lock)
        with pytest.raises(KeyboardInterrupt):
            CALLS[how](cap, model, ids, mask)
        if how == "model-forward":
            model(ids, attention_mask=mask)  # the next forward on this thread takes the hold over, and ends it
        rids = ["y0", "y1", "y2"]
        _Worker(lambda: cap.forward(ids, mask, request_ids=rids)).finish()
        assert _Worker(lambda: cap.flush()).finish() == []  # returns: a memory writer seals no pack
    assert cap._lock._holder is None
    with attach(model, writer=MemoryWriter()):  # closed, and the model given back
        pass
    _same(_as_reference(_by_key(w), rids), want)


def _forward_at_close(hold_gate: bool):
    """A direct forward stopped by a pre-hook that runs before the session's (PyTorch has taken
    the list of pre-hooks), the session closed, the forward let go. With ``hold_gate`` the test
    holds the session first, so the forward reaches the session's pre-hook and waits there for
    the close; without, the close removes that hook before PyTorch calls it."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    want = model(ids, attention_mask=mask).logits
    pause = _Pause()
    model.register_forward_pre_hook(pause)
    progressed = threading.Event()
    w = MemoryWriter()
    ctx = attach(model, hooks=HOOKS, writer=w, run_id="r")
    cap = ctx.__enter__()
    cap._lock._cond = _SignalWaits(progressed)
    caller = _Worker(lambda: model(ids, attention_mask=mask))
    assert pause.paused.wait(JOIN_S)
    if hold_gate:
        cap._lock.acquire()
        pause.go.set()
        assert progressed.wait(JOIN_S)  # the forward waits for the session
        ctx.__exit__(None, None, None)  # this thread holds it: closes as it lets go
        cap._lock.release()
    else:
        ctx.__exit__(None, None, None)
        pause.go.set()
    assert torch.equal(caller.finish().logits, want)
    assert cap.stats["forwards"] == 0 and w.records == []
    with pytest.raises(CaptureError, match="closed"):  # the session is not held by the forward
        _Worker(cap.flush).finish()


def test_a_forward_whose_session_hook_was_removed_as_it_started_runs_uncaptured():
    _forward_at_close(hold_gate=False)


def test_a_forward_that_waited_for_a_closing_session_runs_uncaptured():
    _forward_at_close(hold_gate=True)
