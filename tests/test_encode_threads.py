"""``attach(encode_threads=N)``: the drain's records encoded by a pool of threads are the
records one thread writes — bit-exact, none missing — and a slot's memory is not lent again
before its last record was encoded; a failing append surfaces as ``DrainError``."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

import dmi
from dmi.capture import attach
from dmi.storage.errors import DrainError, InvalidArgumentError

from ._models import MemoryWriter, left_padded_batch, tiny

HOOKS = "resid_post mlp_out attn_q token_ids logits"


def _records(store, model, ids, mask, threads: int) -> dict:
    with store.capture(model, hooks=HOOKS, encode_threads=threads) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                               return_dict_in_generate=True)
    out = {}
    for i, rid in enumerate(rids):
        for hook in HOOKS.split():
            layers = [None] if hook in ("token_ids", "logits") else range(model.config.num_hidden_layers)
            for layer in layers:
                out[(i, hook, layer)] = store.get_internal(cap.model_id, rid, hook, layers=layer, run_id=cap.run_id)
    return out


def test_records_encoded_on_three_threads_are_one_thread_s_records(tmp_path):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path / "home") as store:
        one = _records(store, model, ids, mask, 1)
        three = _records(store, model, ids, mask, 3)
    assert one.keys() == three.keys() and len(one) > 20
    for key, value in one.items():
        assert torch.equal(value, three[key]), key


class _SlowWriter(MemoryWriter):
    """Copies each record only after a pause, from an encoding thread: were the slot lent to
    the next step before every record of it was copied, the copy would hold that step's rows.
    (A stand-in sink: a real writer's encode is too fast to expose the race reliably.)"""

    def append(self, key, data, **options):
        time.sleep(0.002)
        super().append(key, data, **options)


def test_a_slot_is_released_only_after_its_last_record_is_encoded():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    writer = _SlowWriter()
    with attach(model, hooks="resid_post", writer=writer, ring_slots=2, encode_threads=2,
                decode_chunk_steps=1) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               return_dict_in_generate=True)
    pads = (mask == 0).sum(1).tolist()
    for i, rid in enumerate(rids):
        for layer in range(model.config.num_hidden_layers - 1):  # the last hidden state HF returns is normed
            parts = sorted((k.start_token, d) for k, d, _ in writer.records
                           if k.request_id == rid and k.hook == "resid_post" and k.layer == layer)
            got = torch.cat([d for _, d in parts])
            want = torch.cat([ref.hidden_states[0][layer + 1][i, pads[i]:]]
                             + [ref.hidden_states[s][layer + 1][i, -1:] for s in range(1, 6)])
            assert torch.equal(got, want), (rid, layer)


def test_a_failing_append_on_an_encoding_thread_is_a_drain_error():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(DrainError, match="disk on fire"):
        with attach(model, hooks="resid_post", writer=MemoryWriter(fail_after=3), encode_threads=2) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert not [t for t in threading.enumerate() if "encode" in t.name]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_encode_threads_must_be_a_positive_int(bad):
    with pytest.raises(InvalidArgumentError, match="encode_threads must be an int >= 1"):
        with attach(tiny("llama"), writer=MemoryWriter(), encode_threads=bad):
            pass


def _nice_levels_of_threads(prefix: str, running_before: set) -> list[int]:
    """Nice levels of the live threads named ``prefix...`` that are not in ``running_before``
    (an earlier test's drain thread may still be finishing)."""
    return [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
            if t.name.startswith(prefix) and t not in running_before]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice levels are Linux's")
def test_drain_nice_lowers_the_drain_and_its_encoders_below_the_model():
    """The drain thread and its encoding threads run 7 nice levels below the attaching thread;
    the model's thread keeps its own. Records are the same as at full priority."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = MemoryWriter()
    before = set(threading.enumerate())
    with attach(model, hooks="resid_post", writer=writer, encode_threads=2, drain_nice=7) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        cap.flush()
        levels = _nice_levels_of_threads("dmi-drain", before)
    # the drain and the encoders it started: a pool starts its second thread only when no
    # started one is idle, so how many exist depends on timing, never their level
    assert 2 <= len(levels) <= 3 and set(levels) == {min(19, own + 7)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    assert {k.hook for k, _, _ in writer.records} == {"resid_post"} and len(writer.records) > 0


@pytest.mark.parametrize("bad", [-1, 20, 2.0, True])
def test_drain_nice_must_be_a_level_in_0_to_19(bad):
    with pytest.raises(InvalidArgumentError, match="drain_nice must be an int in 0..19"):
        with attach(tiny("llama"), writer=MemoryWriter(), drain_nice=bad):
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice levels are Linux's")
def test_a_model_on_the_cpu_gets_a_drain_below_it_by_default():
    """Unset, ``drain_nice`` is 19 for a model on the CPU that waits for the drain (the drain
    threads run there, the stats say so); 0 where the ring drops instead, or when given."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for options, nice in (({}, 19), ({"drop_policy": "drop"}, 0), ({"drain_nice": 0}, 0)):
        before = set(threading.enumerate())
        with attach(model, hooks="resid_post", writer=MemoryWriter(), **options) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
            cap.flush()
            assert _nice_levels_of_threads("dmi-drain", before) == [min(19, own + nice)]
            assert cap.stats["drain_nice"] == nice


def test_only_a_model_wholly_on_the_cpu_gets_the_lower_drain_by_default():
    from dmi.capture._session import AUTO_DRAIN_NICE, auto_drain_nice

    model = tiny("llama")
    assert auto_drain_nice(model, None, "wait") == (AUTO_DRAIN_NICE if sys.platform.startswith("linux") else 0)
    assert auto_drain_nice(model, None, "drop") == 0
    assert auto_drain_nice(model, 5, "drop") == 5
    model.lm_head.to("meta")  # one module elsewhere than the CPU (no accelerator here: the meta device)
    assert auto_drain_nice(model, None, "wait") == 0


class _ThreadCountingWriter(MemoryWriter):
    """Notes ``torch.get_num_threads()`` on the thread that appends each record (the drain
    thread, or an encoding thread)."""

    def __init__(self):
        super().__init__()
        self.torch_threads: list[int] = []

    def append(self, key, data, **options):
        self.torch_threads.append(torch.get_num_threads())
        super().append(key, data, **options)


@pytest.fixture
def two_model_threads():
    """The model's thread runs torch on two OpenMP threads (also on a one-CPU machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenMP runtimes are found through /proc/self/maps")
@pytest.mark.parametrize("encode_threads", [1, 2])
def test_the_drain_runs_torch_on_one_openmp_thread_and_the_model_keeps_its_own(two_model_threads, encode_threads):
    """Every record is appended by a thread whose torch kernels run on one OpenMP thread (a
    team of the drain's own would shorten the model's barrier spins: ``dmi.capture._omp``);
    the model's thread still runs on two, and the session reports the drain's count."""
    model = tiny("llama")
    ids, mask = left_padded_batch()
    writer = _ThreadCountingWriter()
    with attach(model, hooks="resid_post", writer=writer, encode_threads=encode_threads) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        cap.flush()
        assert cap.stats["drain_torch_threads"] == 1
    assert len(writer.torch_threads) == len(writer.records) > 0
    assert set(writer.torch_threads) == {1}
    assert torch.get_num_threads() == 2


def test_one_openmp_thread_changes_only_the_calling_thread(two_model_threads):
    from dmi.capture._omp import one_openmp_thread

    seen = []
    worker = threading.Thread(target=lambda: seen.append(one_openmp_thread()))
    worker.start()
    worker.join()
    expected = 1 if sys.platform.startswith("linux") else 2
    assert seen == [expected]
    assert torch.get_num_threads() == 2


class _BusyWriter(MemoryWriter):
    """Spends a known CPU time on each append (a busy loop timed by its thread's own clock):
    CPU the drain's figure must count on whichever thread ran the append."""

    CPU_PER_APPEND = 0.01

    def append(self, key, data, **options):
        end = time.thread_time() + self.CPU_PER_APPEND
        while time.thread_time() < end:
            pass
        super().append(key, data, **options)


@pytest.mark.parametrize("encode_threads", [1, 2])
def test_the_drain_s_cpu_seconds_count_the_appends_of_every_encoding_thread(encode_threads):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    writer = _BusyWriter()
    cpu_before = time.process_time()
    with attach(model, hooks="resid_post", writer=writer, encode_threads=encode_threads) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        cap.flush()
        assert cap.stats["drain_cpu_seconds"] >= len(writer.records) * _BusyWriter.CPU_PER_APPEND  # read mid-session
    process_cpu = time.process_time() - cpu_before
    appends_cpu = len(writer.records) * _BusyWriter.CPU_PER_APPEND
    assert len(writer.records) >= 8
    assert appends_cpu <= cap.stats["drain_cpu_seconds"] <= process_cpu
