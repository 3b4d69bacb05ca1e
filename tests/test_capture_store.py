"""Capture into real packs, published in a real (embedded chDB) catalog, read back through the reader."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dmi.capture import attach
from dmi.reader import assemble, read_records

from ._models import GatedWriter, left_padded_batch, tiny

N_NEW = 4


def read_back(store, catalog, model_id, request_id, hook, run_id=None):
    entries = catalog.find_records(model_id, request_id=request_id, hook=hook, run_id=run_id)
    return assemble(entries, read_records(store, entries))


@pytest.mark.parametrize("chunk", [1, 32])
def test_resid_post_every_layer_read_back_bit_exact_over_prefill_and_decode(store_and_catalog, chunk):
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    with attach(model, hooks="resid_post final_norm token_ids", store=store, catalog=catalog,
                model_id="tiny-llama-test", writer_options={"max_records": 10},
                decode_chunk_steps=chunk) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(cap.published) >= 2  # several packs sealed (max_records=10) and all published
    assert cap.stats["packs_published"] == len(cap.published)
    n_layers = model.config.num_hidden_layers
    steps = ref.hidden_states
    for i, rid in enumerate(rids):
        got = read_back(store, catalog, "tiny-llama-test", rid, "resid_post")
        assert got.shape == (n_layers, ids.shape[1] - pads[i] + N_NEW - 1, model.config.hidden_size)
        for layer in range(n_layers):
            want = torch.cat([steps[0][layer + 1][i, pads[i]:]] + [steps[s][layer + 1][i] for s in range(1, N_NEW)])
            if layer == n_layers - 1:  # HF's last hidden state is the normed one: check via final_norm
                want_norm = want
                assert torch.equal(read_back(store, catalog, "tiny-llama-test", rid, "final_norm"), want_norm)
            else:
                assert torch.equal(got[layer], want), layer
        toks = read_back(store, catalog, "tiny-llama-test", rid, "token_ids")
        assert torch.equal(toks, ref.sequences[i, pads[i]:-1])
        entries = catalog.find_records("tiny-llama-test", request_id=rid, hook="resid_post", layers=0)
        # prefill is one record; decode steps are one record per step, or coalesced
        assert len(entries) == (1 + (N_NEW - 1) if chunk == 1 else 2)
        decode = [e.meta.key for e in entries if e.meta.key.phase == "decode"]
        assert decode[0].step == 1 and sum(k.n_tokens for k in decode) == N_NEW - 1


def test_bf16_capture_under_inference_mode(store_and_catalog):
    store, catalog = store_and_catalog
    model = tiny("qwen2", dtype=torch.bfloat16)
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    with torch.inference_mode():
        ref = model(ids, attention_mask=mask, output_hidden_states=True)
        with attach(model, hooks="resid_pre attn_v", layers=[1], store=store, catalog=catalog) as cap:
            rids, _ = cap.forward(ids, attention_mask=mask)
    for i, rid in enumerate(rids):
        got = read_back(store, catalog, cap.model_id, rid, "resid_pre")
        assert got.dtype == torch.bfloat16
        assert torch.equal(got[0], ref.hidden_states[1][i, pads[i]:])
        e = catalog.find_records(cap.model_id, request_id=rid, hook="attn_v")
        assert e[0].meta.key.phase == "forward" and e[0].meta.shape == (ids.shape[1] - pads[i], 2, 8)


def test_drop_policy_counts_every_dropped_record_in_the_catalog(store_and_catalog):
    _, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = GatedWriter()
    with attach(model, hooks="resid_post", writer=w, ring_slots=1, slot_bytes=1024, drop_policy="drop",
                catalog=catalog, model_id="m-drop", decode_chunk_steps=1) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=4)
        w.gate.set()
    expected = 3 * 3 * 4  # requests x layers x steps
    losses = catalog.losses(model_id="m-drop").to_pylist()
    lost = sum(r["count"] for r in losses)
    assert cap.ring.stats.dropped_tensors > 0
    assert lost == cap.stats["records_lost"] > 0
    assert len(w.records) + lost == expected
    assert {r["reason"] for r in losses} == {"ring full"}
    assert {r["hook"] for r in losses} == {"resid_post"}


def test_a_held_publishing_scope_surfaces_and_nothing_is_published(store_and_catalog):
    from dmi.storage.errors import DrainError, LeaseHeldError

    store, catalog = store_and_catalog
    other = catalog.publisher("capture/held-scope", holder="someone-else")
    other.acquire()
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(DrainError) as e:
        with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m-held",
                    publish_scope="capture/held-scope") as cap:
            cap.forward(ids, attention_mask=mask)
    assert isinstance(e.value.__cause__, LeaseHeldError)
    assert catalog.find_records("m-held") == []
    other.release()


class _SlowLeaseCatalog:
    """The real catalog, with its publishers' ``acquire`` held until ``gate`` opens. It stands
    in for a catalog that answers slowly — below a model on the CPU the drain's lease
    statements took a whole ``generate`` on this project's machine — which the real one cannot
    be made to do on demand. ``clock``, where given, is its publishers' lease clock."""

    def __init__(self, catalog, clock=None):
        self._catalog = catalog
        self._clock = clock
        self.gate = threading.Event()
        self.asked = threading.Event()

    def __getattr__(self, name):
        return getattr(self._catalog, name)

    def publisher(self, *args, **kwargs):
        if self._clock is not None:
            kwargs["clock"] = self._clock
        publisher = self._catalog.publisher(*args, **kwargs)
        acquire = publisher.acquire

        def acquire_when_let():
            self.asked.set()
            assert self.gate.wait(60), "the test never opened the gate"
            return acquire()

        publisher.acquire = acquire_when_let
        return publisher


def test_the_drain_writes_while_the_lease_is_acquired_and_publishes_once_it_is_held(store_and_catalog):
    """Six steps through a ring of two one-step slots while the lease is still being acquired:
    the drain frees the slots as the model fills them (a drain that waited for the lease first
    would leave the model waiting for a slot until ``RingFullError``), and publishes nothing
    until the lease is held. Nor does it renew a lease it does not hold yet: the gate stays shut
    for more than a renewal's interval (a third of ``lease_seconds``) and two keep-alive ticks.

    The lease's clock stands still: held, the 2 s lease cannot expire while the machine's load
    keeps the drain thread off the CPU (a holder that does not run for its lease's length loses
    it, as it should: not what this test is about); the keep-alive ticks still run on real time.
    ``ring_timeout`` only bounds the wait of a drain that held its slots for the lease."""
    store, catalog = store_and_catalog
    still = time.time()
    slow = _SlowLeaseCatalog(catalog, clock=lambda: still)
    model = tiny("llama")
    ids, mask = left_padded_batch()
    try:
        with attach(model, hooks="resid_post", store=store, catalog=slow, model_id="m-slow-lease",
                    ring_slots=2, slot_bytes=8192, ring_timeout=60, decode_chunk_steps=1,
                    writer_options={"max_records": 6}, lease_seconds=2.0) as cap:
            rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            assert slow.asked.is_set() and not slow.gate.is_set()
            assert cap.stats["forwards"] == 6  # a drain that waited for the lease would have held both slots by the third
            assert catalog.find_records("m-slow-lease") == []
            assert cap.stats["packs_published"] == 0
            time.sleep(1.5)
            slow.gate.set()
    finally:
        slow.gate.set()
    layers = model.config.num_hidden_layers
    assert cap.stats["packs_published"] >= 3
    assert len(catalog.find_records("m-slow-lease", hook="resid_post")) == len(rids) * layers * 6


def test_a_lease_refused_while_the_model_runs_stops_it_at_a_following_step(store_and_catalog):
    """The lease is refused after the model started: the refusal stops the model's next
    forwards (each step checks the drain), not only the flush at the end; nothing is published,
    and what the drain wrote meanwhile is sealed in the store, where recovery publishes it
    once the scope is free."""
    from dmi.storage.errors import DrainError, LeaseHeldError

    store, catalog = store_and_catalog
    other = catalog.publisher("capture/held-later", holder="someone-else")
    other.acquire()
    slow = _SlowLeaseCatalog(catalog)
    model = tiny("llama")
    ids, mask = left_padded_batch()
    try:
        with pytest.raises(DrainError) as e:
            with attach(model, hooks="resid_post", store=store, catalog=slow, model_id="m-held-later",
                        publish_scope="capture/held-later") as cap:
                cap.forward(ids, attention_mask=mask)
                per_forward = ids.shape[0] * model.config.num_hidden_layers
                written_by = time.monotonic() + 30
                while cap.stats["records"] < per_forward and time.monotonic() < written_by:
                    time.sleep(0.01)
                slow.gate.set()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    cap.forward(ids, attention_mask=mask)
                pytest.fail("the refused lease never stopped the model's forwards")
    finally:
        slow.gate.set()
        other.release()
    assert isinstance(e.value.__cause__, LeaseHeldError)
    assert catalog.find_records("m-held-later") == []
    assert len(catalog.recover(store)) >= 1
    recovered = len(catalog.find_records("m-held-later", hook="resid_post"))
    assert recovered >= per_forward and recovered % per_forward == 0  # whole forwards, the first one at least


def test_two_tensor_parallel_ranks_of_one_run_publish_side_by_side(store_and_catalog):
    """Each rank attaches in its own process in real use; two model instances attached at once
    stand in for them here. On the default scope both must publish (one lease per rank).
    ``resid_post`` is replicated, so rank 1 writes its copy only when asked (``tp_replicas="all"``)."""
    store, catalog = store_and_catalog
    ids, mask = left_padded_batch()
    models = [tiny("llama"), tiny("llama")]
    with attach(models[0], hooks="resid_post", store=store, catalog=catalog, model_id="m-tp", run_id="r",
                tp_rank=0, tp_size=2) as rank0, \
            attach(models[1], hooks="resid_post", store=store, catalog=catalog, model_id="m-tp", run_id="r",
                   tp_rank=1, tp_size=2, tp_replicas="all") as rank1:
        rank0.forward(ids, attention_mask=mask)
        rank1.forward(ids, attention_mask=mask)
    ranks = {e.meta.key.shard_rank for e in catalog.find_records("m-tp", run_id="r")}
    assert ranks == {0, 1}


def test_a_run_holding_a_request_id_of_other_digits_is_continued(store_and_catalog):
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m-digits", run_id="R") as cap:
        cap.forward(ids, request_ids=["R-\u00b2", "R-000004"])  # '²'.isdigit(), yet no int
    with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m-digits", run_id="R") as cap:
        rids, _ = cap.forward(ids)
    assert rids == ("R-000005", "R-000006")


def test_an_attach_failing_after_the_drain_started_stops_it_and_frees_the_lease(store_and_catalog, monkeypatch):
    from dmi.capture import _session

    def broken(run_id, taken):
        raise RuntimeError("the session could not be made")

    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    before = set(threading.enumerate())
    monkeypatch.setattr(_session, "_next_default_index", broken)  # CaptureSession() calls it, after Drain()
    with pytest.raises(RuntimeError, match="the session could not be made"):
        with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m-undo", run_id="R"):
            pass
    monkeypatch.undo()
    assert [t.name for t in set(threading.enumerate()) - before if t.name == "dmi-drain"] == []
    # at once: the same model, run and publishing scope
    with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m-undo", run_id="R") as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    assert rids == ("R-000000", "R-000001", "R-000002")
    assert len(catalog.find_records("m-undo", hook="resid_post")) == 3 * 3  # requests x layers
