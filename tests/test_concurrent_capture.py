"""Using a store while a capture runs: the loader, the reader and a second session at once.

Real tiny models (random weights, from configs), real packs in ``tmp_path`` and the embedded
chDB catalog. A capture publishes whole steps (``tests/test_step_edge_publish.py``), so a read
of a request still being captured is a prefix of its tokens; a selection whose features end at
different tokens anyway (a hook's decode chunks, hooks of other sizes) is refused with a
``ReaderError`` that says so (never a partial record, never an unpublished pack), and every
read after the capture's ``with`` block is whole and bit-exact.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dmi
from dmi.storage import PackWriter
from dmi.storage.errors import AttachError, InvalidArgumentError, ReaderError
from dmi.storage.records import RecordKey

from ._models import left_padded_batch, tiny

STILL_CAPTURED = "still being captured"


def _capture(store, model, model_id, *, new_tokens, run_id=None):
    """One generate of the padded batch under a capture; returns the request ids."""
    ids, mask = left_padded_batch()
    with store.capture(model, model_id=model_id, run_id=run_id, hooks="resid_post",
                       writer_options={"max_records": 7}, decode_chunk_steps=1) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return list(rids)


def _in_thread(target, *args, **kwargs) -> tuple[threading.Thread, list]:
    """Run ``target`` on a thread; its result or exception lands in the returned list."""
    out: list = []

    def run():
        try:
            out.append(target(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_loader_keeps_the_selection_it_was_made_on_while_a_capture_publishes(tmp_path):
    """Made before a second capture, the loader's epochs are exactly the first run's tokens while
    the capture publishes and after; its state is refused by a loader made on the grown
    selection, saying so and how to pin it, and resumes exactly on one pinned with runs=."""
    model = tiny("llama")
    with dmi.open(home=tmp_path) as store:
        _capture(store, model, "m", new_tokens=3, run_id="first")
        options = dict(layers=[0], batch_size=4, shuffle_buffer=8, seed=3)
        reference = store.loader("m", **options)
        epochs = [[b.clone() for b in reference] for _ in range(2)]
        loader = store.loader("m", **options)
        n_batches, n_tokens = len(loader), loader.n_tokens
        batches = iter(loader)
        head = [next(batches).clone() for _ in range(2)]
        state = loader.state_dict()
        thread, out = _in_thread(_capture, store, model, "m", new_tokens=12, run_id="second")
        while thread.is_alive() and not store.catalog.find_records("m", run_id="second"):
            thread.join(0.01)  # the rest of the epoch is read once the capture has published
        rest = [b.clone() for b in batches]
        assert len(loader) == n_batches
        thread.join()
        assert not isinstance(out[0], BaseException), out
        second = [b.clone() for b in loader]
        assert [torch.equal(a, b) for a, b in zip(head + rest, epochs[0])] == [True] * n_batches
        assert len(head + rest) == n_batches
        assert [torch.equal(a, b) for a, b in zip(second, epochs[1])] == [True] * n_batches
        grown = store.loader("m", **options)
        assert grown.n_tokens > n_tokens
        with pytest.raises(InvalidArgumentError, match=f"held {n_tokens} tokens .* this one {grown.n_tokens} .*runs="):
            grown.load_state_dict(state)
        pinned = store.loader("m", runs="first", **options)
        pinned.load_state_dict(state)
        assert [torch.equal(a, b) for a, b in zip(pinned, epochs[0][2:])] == [True] * (n_batches - 2)


def _publish_split_step(store) -> None:
    """What a reader sees between two publishes of a running capture: request ``q`` holds
    tokens 0..5 of layer 0 but only 0..4 of layer 1 (the rest of step 1 is in the open pack)."""
    descriptors = []
    with PackWriter(store.packs, on_seal=descriptors.append) as writer:
        for layer, ends in ((0, (4, 5)), (1, (4,))):
            start = 0
            for step, end in enumerate(ends):
                phase = "prefill" if step == 0 else "decode"
                key = RecordKey("m", "r", "q", "resid_post", layer, start, end - start, step=step, phase=phase)
                writer.append(key, torch.full((end - start, 8), float(layer)))
                start = end
        key = RecordKey("m", "r", "shifted", "resid_post", 0, 1, 3, phase="forward")
        writer.append(key, torch.zeros(3, 8))
        key = RecordKey("m", "r", "shifted", "resid_post", 1, 0, 3, phase="forward")
        writer.append(key, torch.zeros(3, 8))
    with store.catalog.publisher("split") as publisher:
        publisher.publish(descriptors)


def test_a_step_published_for_some_layers_only_is_refused_naming_the_running_capture(tmp_path):
    with dmi.open(home=tmp_path) as store:
        _publish_split_step(store)
        with pytest.raises(ReaderError, match=f"covers tokens 0..4 but resid_post.0 covers 0..5.*{STILL_CAPTURED}"):
            store.loader("m", layers=[0, 1], where="request_id = 'q'")
        with pytest.raises(ReaderError, match=f"layer 0: 5, layer 1: 4.*{STILL_CAPTURED}"):
            store.get_internal("m", "q", "resid_post")
        assert torch.equal(store.get_internal("m", "q", "resid_post", layers=1), torch.ones(1, 4, 8))
        with pytest.raises(ReaderError, match="not aligned") as shifted:  # other starts: not a capture's tail
            store.loader("m", layers=[0, 1], where="request_id = 'shifted'")
        assert STILL_CAPTURED not in str(shifted.value)


def test_reads_while_a_capture_publishes_are_whole_steps_and_whole_after(tmp_path):
    """Another thread reads every published request of a running capture: each read is every
    token published so far, a prefix of the final tensor, bit for bit, for every layer (whole
    steps are published)."""
    model = tiny("llama")
    with dmi.open(home=tmp_path) as store:
        thread, out = _in_thread(_capture, store, model, "m", new_tokens=12)
        seen: list[tuple[str, torch.Tensor]] = []
        while thread.is_alive():
            for rid in store.catalog.requests("m"):
                seen.append((rid, store.get_internal("m", rid, "resid_post")))
        thread.join()
        rids = out[0]
        final = {rid: store.get_internal("m", rid, "resid_post") for rid in rids}
    assert sorted(rid for rid, _ in seen) and {rid for rid, _ in seen} <= set(rids)
    for rid, x in seen:
        assert torch.equal(x, final[rid][:, : x.shape[1]])


def test_two_sessions_at_once_on_two_models_and_a_second_on_the_same_model(tmp_path):
    """Two models captured on two threads at once give each its own correct records; a second
    session on a model already attached is refused before the model runs."""
    llama, gpt2 = tiny("llama"), tiny("gpt2")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    refs = {name: m(ids, attention_mask=mask, output_hidden_states=True).hidden_states
            for name, m in (("llama", llama), ("gpt2", gpt2))}
    with dmi.open(home=tmp_path) as store:
        with store.capture(llama, model_id="llama", hooks="resid_post", layers=[0]) as cap:
            calls = []
            handle = llama.register_forward_hook(lambda *a: calls.append(1))
            with pytest.raises(AttachError, match="already attached"):
                with store.capture(llama, model_id="llama-again", hooks="resid_post"):
                    llama(ids, attention_mask=mask)
            handle.remove()
            assert calls == []
            threads = [_in_thread(cap.forward, ids, attention_mask=mask)]
            with store.capture(gpt2, model_id="gpt2", hooks="resid_post", layers=[0]) as other:
                threads.append(_in_thread(other.forward, ids, attention_mask=mask))
                for thread, _ in threads:
                    thread.join()
        (llama_rids, _), (gpt2_rids, _) = (out[0] for _, out in threads)
        for name, rids in (("llama", llama_rids), ("gpt2", gpt2_rids)):
            for i, rid in enumerate(rids):
                got = store.get_internal(name, rid, "resid_post")
                assert torch.equal(got[0], refs[name][1][i, pads[i]:]), (name, i)
        assert store.catalog.requests("llama-again") == []


def test_a_second_session_under_a_scope_this_process_captures_under_is_refused_before_the_model_runs(tmp_path):
    """Two models captured under one model id and run id (one publish scope) in one process: the
    second is refused at attach, naming the scope and the run, before its model runs; the first
    session's records are the only ones, and the scope is free again once it closed."""
    first, second = tiny("llama"), tiny("llama", seed=1)
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path) as store:
        with store.capture(first, model_id="m", run_id="r", hooks="resid_post", layers=[0]) as cap:
            rids, _ = cap.forward(ids, attention_mask=mask)
            calls = []
            handle = second.register_forward_hook(lambda *a: calls.append(1))
            with pytest.raises(AttachError) as refused:
                with store.capture(second, model_id="m", run_id="r", hooks="resid_post", layers=[0]):
                    second(ids, attention_mask=mask)
            handle.remove()
            assert calls == []
            assert "publish scope 'capture/m/r'" in str(refused.value)
            assert "(run 'r')" in str(refused.value)
        assert sorted(store.catalog.requests("m")) == sorted(rids)
        with store.capture(second, model_id="m", run_id="r2", hooks="resid_post", layers=[0]) as again:
            again.forward(ids, attention_mask=mask)
        with store.capture(second, model_id="m", run_id="r", hooks="resid_post", layers=[0]):
            pass  # the first session closed: its scope is free


CAPTURE_PROCESS = """
import torch, dmi
from tests._models import tiny
model, prompts, refs = tiny("llama"), [torch.randint(1, 97, (1, 5 + i), generator=torch.Generator().manual_seed(i))
                                       for i in range(2)], {{}}
wants = []
for ids in prompts:  # what resid_post of layers 0 and 1 must read back: HF's own decode, before attaching
    hs = model.generate(ids, max_new_tokens=6, do_sample=False, output_hidden_states=True,
                        return_dict_in_generate=True).hidden_states
    wants.append(torch.stack([torch.cat([step[layer + 1][0] for step in hs]) for layer in (0, 1)]))
with dmi.open(home={home!r}) as store:
    with store.capture(model, model_id="m", hooks="resid_post", layers=[0, 1], decode_chunk_steps=1,
                       slot_bytes=4096, writer_options={{"max_records": 5}}) as cap:
        for ids, want in zip(prompts, wants):
            (rid,), _ = cap.generate(ids, max_new_tokens=6, do_sample=False)
            refs[rid] = want
torch.save(refs, {out!r})
print("DONE", flush=True)
"""


def test_a_second_process_trains_and_queries_while_a_generate_publishes(tmp_path):
    """Process A captures generates that publish several packs each; this process makes
    loaders, iterates them and queries in a loop meanwhile. Nothing but the named refusal of a
    half-published step is raised, and afterwards every record A published reads back here
    bit for bit (against A's own forward over the generated tokens)."""
    import subprocess
    import sys
    from pathlib import Path

    home, out = tmp_path / "home", tmp_path / "refs.pt"
    code = CAPTURE_PROCESS.format(home=str(home), out=str(out))
    capture = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    loops = 0
    with dmi.open(home=home) as store:
        while capture.poll() is None:
            time.sleep(0.1)  # a training step's pause: the capture gets the catalog between two loops
            if "m" not in store.catalog.models():
                continue
            try:
                loader = store.loader("m", layers=[0, 1], batch_size=8)
                assert sum(len(b) for b in loader) == loader.n_tokens
            except ReaderError as exc:
                assert STILL_CAPTURED in str(exc)
            store.sql("SELECT count() FROM {records}")
            loops += 1
        stdout, stderr = capture.communicate()
        assert capture.returncode == 0 and "DONE" in stdout, stderr[-2000:]
        refs = torch.load(out)
        got = {rid: store.get_internal("m", rid, "resid_post") for rid in refs}
    assert loops > 0 and len(refs) == 2
    assert {rid: torch.equal(got[rid], refs[rid]) for rid in refs} == {rid: True for rid in refs}
