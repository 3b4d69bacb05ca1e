"""Compiled capture at its edges: recompiles, sessions one after another, a compiled
submodule, autograd and inference mode, rows that end early, autocast.

The reference is the eager hook path on the same model and inputs: every record must be
byte-identical. Compiling uses ``backend="aot_eager"`` (dynamo and AOT autograd trace the
taps and the op into one graph, eager kernels run it), so the bytes can be compared; tiny
models (2 layers, hidden 32) keep each compile to seconds.
"""

from __future__ import annotations

import pytest
import torch

from ._models import MemoryWriter, left_padded_batch, tiny
from dmi.capture import attach
from dmi.capture._compiled import compiled_form
from dmi.storage.errors import CaptureError

pytestmark = pytest.mark.filterwarnings(  # torch's inductor import uses its own deprecated API
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

HOOKS = "token_ids embed attn_q attn_k mlp_post resid_post final_norm logits"
CALLS = (left_padded_batch(), left_padded_batch((5, 9), seed=2), left_padded_batch((3,), seed=3))
"""Three forwards of other batch sizes and prompt lengths: each new shape recompiles."""


def _model(dtype=torch.float32):
    return tiny("llama", num_hidden_layers=2, dtype=dtype)


def _records(writer) -> dict:
    return {(k.request_id, k.hook, k.layer, k.start_token, k.n_tokens, k.step, k.phase): d
            for k, d, _ in writer.records}


def _capture(model, calls=CALLS, hooks=HOOKS, **attach_kw):
    w = MemoryWriter()
    with attach(model, hooks=hooks, writer=w, run_id="run", **attach_kw) as cap, torch.no_grad():
        for ids, mask in calls:
            cap.forward(ids, attention_mask=mask)
    return _records(w), cap


def _assert_same_records(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, data in want.items():
        assert got[key].dtype == data.dtype and torch.equal(got[key], data), key


def _compiled_forward(model, **compile_kw):
    model.forward = torch.compile(model.forward, backend="aot_eager", **compile_kw)
    return model


@pytest.mark.parametrize("dtype, dynamic", [(torch.float32, None), (torch.bfloat16, True)])
def test_recompiles_for_new_batch_sizes_and_lengths_record_what_eager_hooks_record(dtype, dynamic):
    reference, _ = _capture(_model(dtype), compiled=False)
    got, cap = _capture(_compiled_forward(_model(dtype), dynamic=dynamic))
    assert cap.compiled
    _assert_same_records(got, reference)
    assert len(reference) == (3 + 2 + 1) * (6 + 2 * 3)  # requests × (global hooks + layers × layer hooks)


def test_sessions_one_after_another_on_one_compiled_model_and_none_after():
    """Each session has its own staging buffer (a new address); the second must not run a
    graph holding the first's, and a forward after both ran writes into neither."""
    reference, _ = _capture(_model(), CALLS[:1], "resid_post", compiled=False)
    model = _compiled_forward(_model())
    first, cap1 = _capture(model, CALLS[:1], "resid_post")
    second, cap2 = _capture(model, CALLS[:1], "resid_post")
    _assert_same_records(first, reference)
    _assert_same_records(second, reference)
    assert cap1._staging.buffer.data_ptr() != cap2._staging.buffer.data_ptr()
    for cap in (cap1, cap2):
        cap._staging.buffer.zero_()
    ids, mask = CALLS[0]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert not cap1._staging.buffer.any() and not cap2._staging.buffer.any()


def test_a_submodule_compiled_before_attaching_takes_the_compiled_path():
    """``model.model.compile()`` traced a graph of the decoder before any hook existed; an
    eager session would run that graph and record nothing of its layers, silently."""
    reference, _ = _capture(_model(), CALLS[:1], "resid_post", compiled=False)
    model = _model()
    model.model.compile(backend="aot_eager")
    ids, mask = CALLS[0]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)  # traced without taps
    got, cap = _capture(model, CALLS[:1], "resid_post")
    _assert_same_records(got, reference)
    assert cap.compiled and compiled_form(model) == "submodule"


def test_grad_mode_with_backward_and_inference_mode_record_what_eager_hooks_record():
    """The taps detach what they stage: autograd neither sees the op nor loses its gradients."""
    hooks = "attn_q mlp_post resid_post"
    reference, _ = _capture(_model(), CALLS[:2], hooks, compiled=False)
    model = _compiled_forward(_model())
    w = MemoryWriter()
    with attach(model, hooks=hooks, writer=w, run_id="run") as cap:
        _, out = cap.forward(*CALLS[0])
        out.logits.sum().backward()
        with torch.inference_mode():
            cap.forward(*CALLS[1])
    _assert_same_records(_records(w), reference)
    assert all(p.grad is not None for p in model.model.layers.parameters())


def test_rows_ending_early_in_a_compiled_session_record_what_eager_hooks_record():
    """Row 0 of a left-padded batch stops at its end token on the second step; its later
    (padding) steps are not recorded, exactly as on the eager path."""
    model = _model()
    ids, mask = left_padded_batch()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    eos = int(plain[0, ids.shape[1] + 1])
    runs = []
    for compiled in (False, True):
        w = MemoryWriter()
        with attach(model, hooks=HOOKS, writer=w, run_id="run", compiled=compiled) as cap:
            _, out = cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=eos)
        runs.append((_records(w), out))
    (reference, want), (got, out) = runs
    assert torch.equal(out, want) and out[0, ids.shape[1] + 2:].eq(0).all()
    _assert_same_records(got, reference)
    assert {k[5] for k in got if k[0] == "run-000000"} == {0, 1}  # prefill and the step feeding the end token


def test_autocast_is_refused_by_name_and_the_session_goes_on():
    """Under autocast the projections return bf16 where the geometry planned float32 bytes:
    the op refuses the tensor rather than writing over its neighbour, and says what to do."""
    reference, _ = _capture(_model(), CALLS[:1], "attn_q", compiled=False)
    w = MemoryWriter()
    with attach(_model(), hooks="attn_q", writer=w, run_id="run", compiled=True) as cap, torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(CaptureError) as refused:
            cap.forward(*CALLS[1])
        cap.forward(*CALLS[0])
    assert "compiled=False on the uncompiled model" in str(refused.value)
    assert "torch.autocast" in str(refused.value)
    got = _records(w)
    # the refused call's two requests (run-000000, run-000001) left nothing
    assert sorted({k[0] for k in got}) == ["run-000002", "run-000003", "run-000004"]
    renamed = {(f"run-{int(k[0][4:]) - 2:06d}",) + k[1:]: d for k, d in got.items()}
    _assert_same_records(renamed, reference)


@pytest.mark.parametrize("aside", [False, True], ids=["compiled forward, compiled=False", "compiled wrapper aside"])
def test_an_eager_session_on_a_model_traced_before_attaching_records_through_the_graph(aside):
    """A model compiled and run before an eager session attaches (its ``forward`` compiled and
    ``compiled=False`` asked, or a ``torch.compile`` wrapper the session is not given): the graph
    traced then holds no hook, so the session turns dynamo's hook guards on and the next call
    retraces around the hooks — every record, byte-identical to an uncompiled model's."""
    ids, mask = CALLS[0]
    reference, _ = _capture(_model(), CALLS[:1], "resid_post", compiled=False)
    model = _model()
    call = torch.compile(model, backend="aot_eager") if aside else _compiled_forward(model)
    with torch.no_grad():
        call(input_ids=ids, attention_mask=mask, use_cache=False)  # traced before any hook exists
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w, run_id="run", compiled=False) as cap, torch.no_grad():
        call(input_ids=ids, attention_mask=mask, use_cache=False)
    assert not cap.compiled
    _assert_same_records(_records(w), reference)
