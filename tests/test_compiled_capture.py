"""Capture inside ``torch.compile``d models: the ``dmi::ring_write`` op and its staging buffer.

The eager hook path is the reference. Inductor itself does not reproduce eager numerics bit
for bit (a fused RMSNorm differs in the last bits), so:

* byte-for-byte against eager capture: the compiled path under ``backend="aot_eager"``
  (dynamo and AOT autograd trace the hooks and the op into one graph, eager kernels run it)
  and under no compilation at all (``compiled=True`` on an eager model runs the same op);
* under inductor: every record equals the tensor the compiled model itself returned in the
  same call (its hidden states, its logits), generated tokens are identical with and without
  capture, and ``torch._dynamo.explain`` reports no graph break.

Models are tiny (2 layers, hidden 32) and the inductor-compiled model is built once per module;\nthe two inductor tests still take about a minute (each new input shape compiles).
"""

from __future__ import annotations

import types

import pytest
import torch

from ._models import GatedWriter, MemoryWriter, left_padded_batch, tiny
from dmi.capture import Schedule, attach
from dmi.capture._compiled import compiled_form, ring_write
from dmi.storage.errors import AttachError, CaptureError, HookSelectionError, InvalidArgumentError

pytestmark = pytest.mark.filterwarnings(  # torch's inductor import uses its own deprecated API
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

HOOKS = "token_ids resid_pre attn_q attn_z mlp_out resid_post final_norm logits"
N_NEW = 3


def _model():
    return tiny("llama", num_hidden_layers=2)


def _records(writer) -> dict:
    return {(k.request_id, k.hook, k.layer, k.start_token, k.n_tokens, k.step, k.phase): d
            for k, d, _ in writer.records}


def _capture_generate(model, *, run_id="run", **attach_kw):
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id=run_id, **attach_kw) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 output_hidden_states=True, return_dict_in_generate=True)
    return w, rids, out, cap


def _assert_same_records(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, data in want.items():
        assert got[key].dtype == data.dtype and torch.equal(got[key], data), key


@pytest.fixture(scope="module")
def eager_reference():
    """Eager hooks on the uncompiled model: the records every compiled path must reproduce."""
    w, _, out, _ = _capture_generate(_model())
    return _records(w), out.sequences


# -- the op, without compiling --------------------------------------------------------------------
def test_op_gathers_rows_at_the_planned_offset_and_nowhere_else():
    buffer = torch.zeros(96, dtype=torch.uint8)
    src = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    rows = torch.tensor([3, 1])
    ring_write(buffer, src, rows, torch.tensor([32, 24, 0]))
    assert torch.equal(buffer[32:56].view(torch.float32).view(2, 3), src[[3, 1]])
    assert not buffer[:32].any() and not buffer[56:].any()


def test_op_refuses_a_region_that_does_not_fit_the_tensor():
    buffer = torch.zeros(64, dtype=torch.uint8)
    src = torch.ones(4, 3)
    for region in ([0, 16, 0], [0, 24, 2]):  # too few bytes; right size, wrong dtype (bf16)
        with pytest.raises(CaptureError, match="planned"):
            ring_write(buffer, src, torch.tensor([0, 1]), torch.tensor(region))
    with pytest.raises(CaptureError, match="complex64"):  # a dtype no region can describe
        ring_write(buffer, src.to(torch.complex64), torch.tensor([0]), torch.tensor([0, 24, 0]))
    assert not buffer.any()


def test_staged_path_run_eagerly_matches_eager_hooks_byte_for_byte(eager_reference):
    records, sequences = eager_reference
    w, _, out, cap = _capture_generate(_model(), compiled=True)
    assert cap.compiled
    assert torch.equal(out.sequences, sequences)
    _assert_same_records(_records(w), records)


def test_staging_buffer_keeps_its_address_across_steps():
    model = _model()
    ids, mask = left_padded_batch()
    addresses = []
    with attach(model, hooks="resid_post attn_q", writer=MemoryWriter(), compiled=True) as cap:
        staging = cap._staging
        original = staging.prepare

        def prepare(plan):
            original(plan)
            addresses.append(staging.buffer.data_ptr())

        staging.prepare = prepare
        cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert len(addresses) == 4 and len(set(addresses)) == 1


def test_steps_the_schedule_skips_stage_nothing():
    model = _model()
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w, compiled=True, schedule=Schedule(phases=("prefill",))) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert not cap._staging.active
    assert {k.phase for k, _, _ in w.records} == {"prefill"}
    assert len(w.records) == 3 * 2  # requests × layers, prefill only


def test_ring_drop_policy_counts_losses_in_compiled_mode():
    model = _model()
    ids, mask = left_padded_batch()
    w = GatedWriter()
    with attach(model, hooks="resid_post", writer=w, compiled=True, ring_slots=1, slot_bytes=64,
                drop_policy="drop") as cap:
        cap.forward(ids, attention_mask=mask)
        w.gate.set()
        cap.flush()
        lost = cap.stats["records_lost"]
    assert cap.ring.stats.dropped_tensors == 1  # layer 1: the only slot is with the drain
    assert lost == 3 and {(k.layer, k.phase) for k, _, _ in w.records} == {(0, "forward")}
    assert len(w.records) == 3


def test_a_forward_that_raises_stages_nothing_and_the_session_goes_on():
    model = _model()
    # The config claims more ids than the embedding holds, so ids past the embedding pass
    # capture's up-front vocabulary check and the forward fails inside the model.
    model.config.vocab_size += 1000
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w, compiled=True) as cap:
        with pytest.raises(IndexError):
            cap.forward(ids + 1000, attention_mask=mask)  # token ids past the embedding
        rids, _ = cap.forward(ids, attention_mask=mask)
    assert {k.request_id for k, _, _ in w.records} == set(rids) and len(w.records) == 3 * 2


def test_a_graph_without_the_taps_is_caught_not_recorded():
    model = _model()
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with pytest.raises(CaptureError, match="0 times for 2"):
        with attach(model, hooks="resid_post", writer=w, compiled=True) as cap:
            # a stand-in for a graph traced before the taps existed (attach clears compiled
            # graphs, so a real one cannot be produced): the taps' handles removed by hand
            for handle in cap._handles[-2:]:
                handle.remove()
            cap.forward(ids, attention_mask=mask)
    assert w.records == []


# -- what compiled capture refuses, before the model is touched ------------------------------------
def test_attn_pattern_refused_in_compiled_mode():
    model = tiny("llama", attn="eager", num_hidden_layers=2)
    with pytest.raises(HookSelectionError, match="attn_pattern"):
        with attach(model, hooks="attn_pattern", writer=MemoryWriter(), compiled=True):
            pass
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_tensor_parallel_shard_refused_in_compiled_mode():
    with pytest.raises(AttachError, match="tensor-parallel"):
        with attach(_model(), writer=MemoryWriter(), compiled=True, tp_rank=0, tp_size=2):
            pass


def test_compiled_switch_must_be_a_bool_or_none():
    with pytest.raises(InvalidArgumentError, match="compiled"):
        with attach(_model(), writer=MemoryWriter(), compiled="yes"):
            pass


def test_compiled_models_are_recognised_without_the_switch():
    model = _model()
    assert compiled_form(model) is None
    assert compiled_form(torch.compile(model)) == "module"  # lazy: nothing compiles here
    other = _model()
    other.forward = torch.compile(other.forward)
    assert compiled_form(other) == "forward"
    third = _model()
    third.compile()
    assert compiled_form(third) == "call"
    for m in (torch.compile(model), other, third):
        with attach(m, writer=MemoryWriter()) as cap:
            assert cap.compiled
    with attach(model, writer=MemoryWriter()) as cap:
        assert not cap.compiled


# -- traced by dynamo ----------------------------------------------------------------------------
def test_explain_reports_one_graph_and_no_break_with_capture():
    model = _model()
    ids, mask = left_padded_batch()
    with attach(model, hooks="resid_post attn_q attn_z", writer=MemoryWriter(), compiled=True):
        report = torch._dynamo.explain(model)(ids, attention_mask=mask, use_cache=False)
    assert report.graph_break_count == 0 and report.graph_count == 1
    assert str(report.graphs[0].graph).count("dmi.ring_write") == 2 * 3  # layers × hooks


def _capture_forward(model, **attach_kw):
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w, run_id="run", **attach_kw) as cap, torch.no_grad():
        cap.forward(ids, attention_mask=mask)
    return _records(w), cap


def test_optimized_module_aot_eager_matches_eager_hooks_byte_for_byte():
    model = _model()
    reference, _ = _capture_forward(model, compiled=False)
    compiled = torch.compile(model, backend="aot_eager")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask, use_cache=False)  # traced before any tap exists
    torch._dynamo.utils.counters.clear()
    got, cap = _capture_forward(compiled)
    assert cap.compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # retraced with the taps
    assert not torch._dynamo.utils.counters["graph_break"]
    _assert_same_records(got, reference)
    cap._staging.buffer.zero_()
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask, use_cache=False)  # after detach: retraced without the op
    assert not cap._staging.buffer.any()


def test_a_graph_traced_for_another_instance_without_taps_is_not_reused():
    """Dynamo shares graphs between instances of one class; without hook guards the attached
    model would run the graph traced for the plain one (and the op would not run)."""
    reference, _ = _capture_forward(_model(), compiled=False)
    plain, attached = _model(), _model()
    for m in (plain, attached):
        m.forward = torch.compile(m.forward, backend="aot_eager")
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(attached, hooks=HOOKS, writer=w, run_id="run") as cap, torch.no_grad():
        plain(input_ids=ids, attention_mask=mask, use_cache=False)  # traced first, no taps
        cap.forward(ids, attention_mask=mask)
    _assert_same_records(_records(w), reference)
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # restored when the session left


# -- inductor --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inductor_model():
    model = _model()
    model.forward = torch.compile(model.forward)
    return model


@pytest.mark.slow
def test_inductor_records_are_what_the_compiled_model_computed(inductor_model):
    model = inductor_model
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    w = MemoryWriter()
    with attach(model, hooks=HOOKS, writer=w) as cap, torch.no_grad():
        rids, out = cap.forward(ids, attention_mask=mask, output_hidden_states=True)
    assert cap.compiled
    hidden = out.hidden_states  # embeddings, then each layer's output (the last one normed)
    n_layers = model.config.num_hidden_layers

    def record(rid, hook, layer):
        (data,) = [d for k, d, _ in w.records if k.request_id == rid and k.hook == hook and k.layer == layer]
        return data

    for i, rid in enumerate(rids):
        for layer in range(n_layers):
            assert torch.equal(record(rid, "resid_pre", layer), hidden[layer][i, pads[i]:]), (rid, layer)
        for layer in range(n_layers - 1):
            assert torch.equal(record(rid, "resid_post", layer), hidden[layer + 1][i, pads[i]:]), (rid, layer)
        assert torch.equal(record(rid, "final_norm", -1), hidden[-1][i, pads[i]:])
        assert torch.equal(record(rid, "logits", -1), out.logits[i, pads[i]:])
    keys = {(k.hook, k.layer) for k, _, _ in w.records}
    assert {("attn_q", 0), ("attn_q", 1), ("attn_z", 1), ("mlp_out", 0), ("resid_post", 1)} <= keys


@pytest.mark.slow
def test_inductor_generates_the_same_tokens_with_and_without_capture(inductor_model, eager_reference):
    _, eager_sequences = eager_reference
    ids, mask = left_padded_batch()
    with attach(inductor_model, hooks=HOOKS, writer=MemoryWriter()) as cap:
        _, captured = cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    plain = inductor_model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert torch.equal(captured, plain)
    assert torch.equal(plain, eager_sequences[:, : plain.shape[1]])


# -- a compilation the session did not see: the one transformers' generate starts --------------------
def _auto_compile_config(backend="aot_eager"):
    """What ``generate`` compiles its decode steps with (on a GPU with a static cache; here
    forced on the CPU through the config's all-devices switch)."""
    from transformers import CompileConfig

    config = CompileConfig(backend=backend)
    config._compile_all_devices = True
    return config


def test_a_compile_generate_starts_runs_the_eager_hooks_outside_its_graph():
    """Traced, the eager hooks fail to compile (their ring copies mutate views dynamo cannot
    functionalise); run outside the graph, every record is what the compiled steps computed."""
    model = _model()
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    w = MemoryWriter()
    with attach(model, hooks="resid_pre logits", writer=w, decode_chunk_steps=1) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 cache_implementation="static", compile_config=_auto_compile_config(),
                                 output_hidden_states=True, output_logits=True, return_dict_in_generate=True)
    assert not cap.compiled and hasattr(model, "_compiled_call")  # the decode steps ran compiled
    checked = 0
    for i, rid in enumerate(rids):
        for k, data, _ in w.records:
            if k.request_id != rid:
                continue
            if k.hook == "resid_pre":
                hidden = out.hidden_states[k.step][k.layer]
                want = hidden[i, pads[i]:] if k.step == 0 else hidden[i]
            else:
                want = out.logits[k.step][i : i + 1]
            assert torch.equal(data, want.reshape(data.shape)), k
            checked += 1
    assert checked == len(rids) * N_NEW * (model.config.num_hidden_layers + 1)


def test_an_eager_session_turns_off_the_compile_generate_would_start(monkeypatch):
    """On a GPU with a static cache ``generate`` compiles its decode steps with CUDA graphs by
    itself; here that choice is forced (the model says the hardware qualifies)."""
    model = _model()
    monkeypatch.setattr(model, "_valid_auto_compile_criteria", lambda model_kwargs, config: not config.disable_compile)
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False, cache_implementation="static")
        model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False, cache_implementation="static")
    assert not hasattr(model, "_compiled_call")
    assert len({k.request_id for k, _, _ in w.records}) == 2 * ids.shape[0]


def test_a_compiled_session_captures_inside_the_steps_generate_compiles():
    """``compiled=True`` on an uncompiled model: the capture op is traced into the graph
    ``generate`` compiles its decode steps into (CUDA graphs on a GPU); the prefill runs the
    same op eagerly. Every record is what those steps computed."""
    model = _model()
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    w = MemoryWriter()
    with attach(model, hooks="resid_pre logits", writer=w, decode_chunk_steps=1, compiled=True) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 cache_implementation="static", compile_config=_auto_compile_config(),
                                 output_hidden_states=True, output_logits=True, return_dict_in_generate=True)
    assert cap.compiled and hasattr(model, "_compiled_call")
    for i, rid in enumerate(rids):
        for k, data, _ in w.records:
            if k.request_id == rid and k.hook == "resid_pre":
                hidden = out.hidden_states[k.step][k.layer]
                assert torch.equal(data, hidden[i, pads[i]:] if k.step == 0 else hidden[i]), k
    assert len(w.records) == len(rids) * N_NEW * (model.config.num_hidden_layers + 1)


def test_compilation_the_caller_configured_is_left_alone():
    from dmi.capture._session import _compilation_configured

    model = _model()
    assert not _compilation_configured(model, {})
    assert _compilation_configured(model, {"disable_compile": False})
    assert _compilation_configured(model, {"compile_config": _auto_compile_config()})
    model.generation_config.compile_config = _auto_compile_config()
    assert _compilation_configured(model, {})
    model.generation_config.compile_config = None
    model.generation_config.disable_compile = True
    assert _compilation_configured(model, {})
    older = types.SimpleNamespace(compile_config=None)  # a transformers without disable_compile
    assert _compilation_configured(_model(), {"generation_config": older})
