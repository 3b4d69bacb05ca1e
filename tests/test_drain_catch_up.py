"""The backlog a flush waits for is encoded on a pool as wide as the process's cores: the
caller (the model's thread) waits instead of running, so below a model on the CPU — where the
drain gets few cycles during ``generate`` and does most of its work at the flush — the cores
the model leaves idle encode it. Records are the same, bit for bit; on one core there is no
pool."""

from __future__ import annotations

import os
import sys
import threading

import pytest

import dmi

from ._models import left_padded_batch, tiny

BOUND_SECONDS = 60
HOOKS = "resid_post mlp_out"
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread CPU affinity is Linux's")


def _capture_held_until_flush(store, model, ids, mask):
    """Capture ``generate``, the drain held inside its first append until a flush waits for it:
    everything after that first record is the backlog the flush waits for. Returns the
    session, its request ids, and the name of the thread that appended each record, in order."""
    threads = []
    with store.capture(model, hooks=HOOKS, decode_chunk_steps=1) as cap:
        drain = cap.drain
        append = drain.writer.append

        def held_append(*args, **kwargs):
            if not threads:
                assert drain.caller_waits.wait(BOUND_SECONDS), "no flush came"
            threads.append(threading.current_thread().name)
            return append(*args, **kwargs)

        drain.writer.append = held_append
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               return_dict_in_generate=True)
        cap.flush()
    return cap, rids, threads


def _reference(model, ids, mask) -> dict:
    """Each row's ``resid_post`` of every layer but the last (whose hidden state HF returns normed),
    as ``generate`` itself reports it: the prompt, then one position per decode step."""
    import torch

    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    pads = (mask == 0).sum(1).tolist()
    steps = len(out.hidden_states)
    return {(i, layer): torch.cat([out.hidden_states[0][layer + 1][i, pads[i]:]]
                                  + [out.hidden_states[s][layer + 1][i, -1:] for s in range(1, steps)])
            for i in range(ids.shape[0]) for layer in range(model.config.num_hidden_layers - 1)}


@LINUX
def test_the_backlog_a_flush_waits_for_is_encoded_on_the_catch_up_pool(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no pool to catch up on")
    import torch

    model = tiny("llama")
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path / "home") as store:
        cap, rids, threads = _capture_held_until_flush(store, model, ids, mask)
        want = _reference(model, ids, mask)
        for (i, layer), value in want.items():
            got = store.get_internal(cap.model_id, rids[i], "resid_post", layers=layer, run_id=cap.run_id)
            assert got.shape[0] == 1 and torch.equal(got[0], value), (i, layer)
    drain_thread, *backlog = threads
    assert not drain_thread.startswith("dmi-drain-catch-up")
    assert len(backlog) > 10 and all(name.startswith("dmi-drain-catch-up") for name in backlog)
    assert cap.stats["records_caught_up"] == len(backlog)


@LINUX
def test_a_process_on_one_core_encodes_on_the_drain_thread_alone(tmp_path):
    """A pool on one core would only take turns with the drain thread."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread, and the drain threads it starts
    try:
        with dmi.open(home=tmp_path / "home") as store:
            cap, _, threads = _capture_held_until_flush(store, model, ids, mask)
    finally:
        os.sched_setaffinity(0, allowed)
    assert len(threads) > 10 and not any(name.startswith("dmi-drain-catch-up") for name in threads)
    assert cap.stats["records_caught_up"] == 0
