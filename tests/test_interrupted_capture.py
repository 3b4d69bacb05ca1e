"""A capture interrupted in the middle: the model raises mid-forward (a forward hook on a middle
layer that raises — a fake standing in for an out-of-memory error), a ``KeyboardInterrupt``
(Ctrl-C) arrives inside a forward or from a stopping criterion, the user's code raises in the
block. After the error propagates the model is hook-free and computes what it did before; the
steps that completed are stored bit-exact; the step that did not is stored nowhere and counted,
record by record, in the losses (reason ``"step interrupted"``), so no request holds a step at
some layers and not others; and the same store captures again at once (no lease, thread or
ring slot left behind)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import dmi
from dmi.capture import attach
from dmi.capture._drain import RING_FULL, STEP_INTERRUPTED

from ._models import MemoryWriter, left_padded_batch, tiny
from .test_capture_guards import n_hooks

N_NEW = 5
PROMPTS = (7, 4, 6)
RIDS = ["a", "b", "c"]


class _FakeOOM(RuntimeError):
    """Stands in for ``torch.OutOfMemoryError`` raised by a layer's forward."""


JOIN_S = 30  # bounds a join of a thread that ends by itself; never reached when the test passes


def _new_threads(before: set) -> set[str]:
    """Threads started since ``before`` and still running, but the embedded catalog's own. The
    thread that acquired the lease ends by itself once it did (its executor is shut down
    without waiting): it is joined first, so that a thread still ending is not taken for one left."""
    new = [t for t in set(threading.enumerate()) - before if not t.name.startswith("dmi-chdb")]
    for t in new:
        if t.name.startswith("dmi-drain-start"):
            t.join(JOIN_S)
    return {t.name for t in new if t.is_alive()}


def _raise_at(model, layer: int, call: int, exc: BaseException):
    """A forward hook on ``layer`` raising ``exc`` at its ``call``-th call. Registered before
    attach it runs before DMI's hook there (``layer`` is not captured at that call), after
    attach after it (``layer`` is)."""
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1
        if calls[0] == call:
            raise exc

    return model.model.layers[layer].register_forward_hook(hook)


def _reference(ids, mask):
    """The hidden states of an uncaptured ``generate`` of the same model: per step, per layer."""
    model = tiny("llama")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                             do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    return out


def _generate(cap, ids, mask, rids, **kwargs):
    return cap.generate(ids, mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                        request_ids=rids, **kwargs)


def _check_steps(got: torch.Tensor, want, row: int, n_prompt: int, steps: int) -> None:
    """``got`` ([layers, tokens, hidden]) is the prompt and ``steps`` decode steps of ``row``,
    bit-exact (layers 0 and 1: HF's last hidden state is after the final norm)."""
    assert tuple(got.shape) == (3, n_prompt + steps, 32)
    for layer in (0, 1):
        assert torch.equal(got[layer, :n_prompt], want.hidden_states[0][layer + 1][row, -n_prompt:])
        for k in range(steps):
            assert torch.equal(got[layer, n_prompt + k], want.hidden_states[k + 1][layer + 1][row, 0])


@pytest.mark.parametrize("exc", [_FakeOOM("CUDA out of memory (fake)"), KeyboardInterrupt()],
                         ids=["fake-oom", "ctrl-c"])
def test_a_forward_raising_mid_step_stores_the_steps_before_it_and_counts_its_own_as_lost(tmp_path, exc):
    ids, mask = left_padded_batch(PROMPTS)
    want = _reference(ids, mask)
    model = tiny("llama")
    before = n_hooks(model)
    threads = set(threading.enumerate())
    with dmi.open(f"chdb://{tmp_path / 'catalog'}", str(tmp_path / "packs")) as store:
        handle = _raise_at(model, 1, 3, exc)  # the third forward (decode step 2), before layer 1 is captured
        with pytest.raises(type(exc)):
            with store.capture(model, hooks="resid_post", model_id="m", run_id="r1") as cap:
                _generate(cap, ids, mask, RIDS)
        handle.remove()
        assert n_hooks(model) == before
        assert _new_threads(threads) == set()
        with torch.no_grad():  # the model computes, uncaptured, what a never-captured one does
            plain = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                   do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
        assert torch.equal(plain.sequences, want.sequences)
        assert all(torch.equal(x, y) for got, ref in zip(plain.hidden_states, want.hidden_states, strict=True)
                   for x, y in zip(got, ref, strict=True))
        for row, rid in enumerate(RIDS):  # prefill and decode step 1, whole at every layer
            _check_steps(store.get_internal("m", rid, "resid_post", run_id="r1"), want, row, PROMPTS[row], 1)
        lost = store.catalog.losses(model_id="m", run_id="r1").to_pylist()
        assert [(r["request_id"], r["hook"], r["layer"], r["count"], r["reason"]) for r in lost] == [
            (rid, "resid_post", layer, 1, STEP_INTERRUPTED) for rid in RIDS for layer in range(3)]
        assert cap.stats["records_lost"] == 9
        # the same model, store and run (publish scope) capture again at once: no lease, hook or slot left
        again_rids = ["d", "e", "f"]
        with store.capture(model, hooks="resid_post", model_id="m", run_id="r1") as again:
            result = _generate(again, ids, mask, again_rids)
        assert torch.equal(result.output, want.sequences)
        for row, rid in enumerate(again_rids):
            _check_steps(store.get_internal("m", rid, "resid_post", run_id="r1"), want, row, PROMPTS[row], N_NEW - 1)
        assert store.catalog.losses(model_id="m", run_id="r1").num_rows == 9
        assert _new_threads(threads) == set()


def _by_step(writer: MemoryWriter) -> dict:
    """``{(request, layer): [(phase, step, tokens), ...]}`` of the records written."""
    out: dict = {}
    for key, data, _ in writer.records:
        out.setdefault((key.request_id, key.layer), []).append((key.phase, key.step, data.shape[0]))
    return out


def _lost(cap) -> list[tuple]:
    return sorted((k.request_id, k.hook, k.layer, k.step, k.phase, k.start_token, k.n_tokens, reason)
                  for k, reason in cap.drain.lost_keys)


def test_a_step_that_filled_a_slot_before_it_raised_keeps_what_the_drain_had_and_counts_the_rest():
    """Slots smaller than one layer's tensor: layer 0 of the failing prefill went to the drain
    as layer 1 took the next slot (stored), layer 1 is taken back out of its slot and layer 2
    never ran (both counted lost) — nothing stored without being counted."""
    ids, mask = left_padded_batch(PROMPTS)
    model = tiny("llama")
    w = MemoryWriter()
    handle = _raise_at(model, 2, 1, _FakeOOM("fake"))
    with pytest.raises(_FakeOOM):
        with attach(model, hooks="resid_post", writer=w, run_id="r", slot_bytes=64, ring_slots=4) as cap:
            _generate(cap, ids, mask, RIDS)
    handle.remove()
    assert _by_step(w) == {(rid, 0): [("prefill", 0, n)] for rid, n in zip(RIDS, PROMPTS)}
    assert _lost(cap) == sorted((rid, "resid_post", layer, 0, "prefill", 0, n, STEP_INTERRUPTED)
                                for rid, n in zip(RIDS, PROMPTS) for layer in (1, 2))


def test_a_record_the_ring_dropped_in_the_failing_step_is_counted_once():
    """One slot, room for layer 0 only: a dropping ring drops layer 1 (``"ring full"``); the step
    then fails at layer 2 — layers 0 and 2 are counted as interrupted, layer 1 not twice."""
    ids, mask = left_padded_batch(PROMPTS)
    model = tiny("llama")
    w = MemoryWriter()
    handle = _raise_at(model, 2, 1, _FakeOOM("fake"))
    with pytest.raises(_FakeOOM):
        with attach(model, hooks="resid_post", writer=w, run_id="r", ring_slots=1, slot_bytes=3000,
                    drop_policy="drop") as cap:
            _generate(cap, ids, mask, RIDS)
    handle.remove()
    assert w.records == []
    assert _lost(cap) == sorted((rid, "resid_post", layer, 0, "prefill", 0, n,
                                 RING_FULL if layer == 1 else STEP_INTERRUPTED)
                                for rid, n in zip(RIDS, PROMPTS) for layer in range(3))


def test_an_attention_pattern_step_that_raised_is_counted_request_by_request():
    """Attention patterns are emitted one request at a time: one slot of 1100 bytes takes layer 0's
    patterns of requests a (784 bytes) and b (256), the ring drops c's and all of layers 1 and 2's
    (``"ring full"``; layer 2's attention runs before the layer raises) — each request's record is
    counted once, for its own reason."""
    ids, mask = left_padded_batch(PROMPTS)
    model = tiny("llama", attn="eager")
    w = MemoryWriter()
    handle = _raise_at(model, 2, 1, _FakeOOM("fake"))
    with pytest.raises(_FakeOOM):
        with attach(model, hooks="attn_pattern", writer=w, run_id="r", ring_slots=1, slot_bytes=1100,
                    drop_policy="drop") as cap:
            cap.forward(ids, mask, request_ids=RIDS)
    handle.remove()
    assert w.records == []

    def reason(rid, layer):
        return STEP_INTERRUPTED if layer == 0 and rid != "c" else RING_FULL

    assert _lost(cap) == sorted((rid, "attn_pattern", layer, 0, "forward", 0, n, reason(rid, layer))
                                for rid, n in zip(RIDS, PROMPTS) for layer in range(3))


def test_ctrl_c_in_a_direct_forward_abandons_its_step_when_the_next_forward_starts():
    """PyTorch skips the model's post-hook on ``KeyboardInterrupt``: the next forward on the
    thread finds the step left open, and abandons it rather than letting it be stored."""
    ids, mask = left_padded_batch(PROMPTS)
    model = tiny("llama")
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w, run_id="r") as cap:
        handle = _raise_at(model, 1, 1, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            model(ids, attention_mask=mask)
        handle.remove()
        cap.forward(ids, mask, request_ids=RIDS)
    interrupted = sorted({k.request_id for k, _, _ in w.records} - set(RIDS))
    assert interrupted == []  # nothing of the interrupted forward was stored
    first = [f"r-{i:06d}" for i in range(3)]  # the implicit call's default request ids
    assert _lost(cap) == sorted((rid, "resid_post", layer, 0, "forward", 0, n, STEP_INTERRUPTED)
                                for rid, n in zip(first, PROMPTS) for layer in range(3))
    assert sorted(_by_step(w)) == [(rid, layer) for rid in RIDS for layer in range(3)]


def test_a_flush_after_ctrl_c_in_a_direct_forward_flushes_no_part_of_its_step():
    """The interrupted forward captured layers 0 and 1 before Ctrl-C: a ``flush()`` on its thread
    abandons that step (counted) instead of handing its first layers to the drain."""
    ids, mask = left_padded_batch(PROMPTS)
    model = tiny("llama")
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w, run_id="r") as cap:
        handle = _raise_at(model, 1, 1, KeyboardInterrupt())  # after DMI's hook on layer 1
        with pytest.raises(KeyboardInterrupt):
            model(ids, attention_mask=mask)
        handle.remove()
        cap.flush()
        assert w.records == []
        first = [f"r-{i:06d}" for i in range(3)]
        assert _lost(cap) == sorted((rid, "resid_post", layer, 0, "forward", 0, n, STEP_INTERRUPTED)
                                    for rid, n in zip(first, PROMPTS) for layer in range(3))
        cap.forward(ids, mask, request_ids=RIDS)  # the session is free again, and captures whole
    assert sorted(_by_step(w)) == [(rid, layer) for rid in RIDS for layer in range(3)]


@pytest.mark.parametrize("then", ["close", "forward", "flush"])
def test_ctrl_c_ending_a_direct_forward_s_thread_leaves_no_part_of_its_step_to_other_threads(then):
    """The interrupted forward's thread ended holding the session, its step open in the ring. The
    next holder on another thread — a close, a forward, a flush, once it sees that thread gone —
    abandons that step (counted) before anything else reaches the ring."""
    ids, mask = left_padded_batch(PROMPTS)
    model = tiny("llama")
    w = MemoryWriter()
    errors = []

    def interrupted():
        try:
            model(ids, attention_mask=mask)
        except KeyboardInterrupt as exc:
            errors.append(exc)

    with attach(model, hooks="resid_post", writer=w, run_id="r") as cap:
        handle = _raise_at(model, 1, 1, KeyboardInterrupt())  # after DMI's hook on layer 1
        worker = threading.Thread(target=interrupted)
        worker.start()
        worker.join(JOIN_S)
        handle.remove()
        assert len(errors) == 1 and cap._lock._holder == worker.ident
        if then == "forward":
            cap.forward(ids, mask, request_ids=RIDS)
        elif then == "flush":
            cap.flush()
    first = [f"r-{i:06d}" for i in range(3)]
    assert _lost(cap) == sorted((rid, "resid_post", layer, 0, "forward", 0, n, STEP_INTERRUPTED)
                                for rid, n in zip(first, PROMPTS) for layer in range(3))
    stored = RIDS if then == "forward" else []
    assert sorted(_by_step(w)) == [(rid, layer) for rid in stored for layer in range(3)]


class _Raise(StoppingCriteria):
    """A stopping criterion raising ``exc`` at its ``at``-th call (after that many forwards)."""

    def __init__(self, exc: BaseException, at: int):
        self.exc, self.at, self.calls = exc, at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), ValueError("criterion")], ids=["ctrl-c", "error"])
def test_a_stopping_criterion_raising_between_steps_leaves_every_step_run_whole(exc):
    ids, mask = left_padded_batch(PROMPTS)
    want = _reference(ids, mask)
    model = tiny("llama")
    w = MemoryWriter()
    with pytest.raises(type(exc)):
        with attach(model, hooks="resid_post", writer=w, run_id="r") as cap:
            _generate(cap, ids, mask, RIDS, stopping_criteria=StoppingCriteriaList([_Raise(exc, 3)]))
    assert _lost(cap) == []
    for row, rid in enumerate(RIDS):  # the prefill and decode steps 1 and 2 ran whole
        by_layer = [torch.cat([d for k, d in w.by("resid_post", rid) if k.layer == layer]) for layer in range(3)]
        _check_steps(torch.stack(by_layer), want, row, PROMPTS[row], 2)
    with attach(model, hooks="resid_post", writer=MemoryWriter()):
        pass


def test_leaving_an_attach_twice_is_harmless():
    """``attach`` used without ``with``: a second ``__exit__`` (a close after a close, or after the
    block's error) does nothing and raises nothing."""
    model = tiny("llama")
    ctx = attach(model, hooks="resid_post", writer=MemoryWriter())
    ctx.__enter__()
    assert ctx.__exit__(ValueError, ValueError("user"), None) is False
    assert ctx.__exit__(None, None, None) is False
    assert n_hooks(model) == 0
