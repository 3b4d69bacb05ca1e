"""Selection, schedule, attach ownership, ring and drain guards — each fails without its guard."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

import dmi

from ._models import GatedWriter, MemoryWriter, left_padded_batch, tiny
from dmi.capture import HOOKS, GROUPS, Schedule, attach, resolve_hooks, resolve_layers
from dmi.storage import PackStore
from dmi.capture._drain import Drain
from dmi.capture._session import _next_default_index
from dmi.storage.errors import (
    AttachError,
    AttentionImplementationError,
    CaptureError,
    DrainError,
    HookSelectionError,
    InvalidArgumentError,
    InvalidIdentifierError,
    RingFullError,
)


def n_hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# -- selection ------------------------------------------------------------------------------------
def test_unknown_hook_lists_valid_names_never_all():
    with pytest.raises(HookSelectionError) as e:
        resolve_hooks("resid_post residd")
    msg = str(e.value)
    assert "'residd'" in msg and "resid_post" in msg and "attn_pattern" in msg and "all" in msg
    with pytest.raises(HookSelectionError):
        resolve_hooks("")
    with pytest.raises(HookSelectionError):
        resolve_hooks(["resid", 3])


def test_groups_expand_in_catalogue_order():
    assert resolve_hooks("resid_post, logits") == ("resid_post", "logits")
    assert set(resolve_hooks("all")) == set(HOOKS)
    assert "attn_pattern" not in resolve_hooks("all_but_patterns")
    assert set(resolve_hooks("router")) == {"router_logits", "router_topk"}
    assert set(GROUPS["attn"]) >= {"attn_q", "attn_k", "attn_v", "attn_z", "attn_out"}


def test_layer_ranges_refused_past_the_model_or_empty():
    assert resolve_layers(None, 4) == (0, 1, 2, 3)
    assert resolve_layers(range(1, 3), 4) == (1, 2)
    assert resolve_layers(-1, 4) == (3,)
    assert resolve_layers(slice(2, None), 4) == (2, 3)
    assert resolve_layers((0, 2), 4) == (0, 1)
    for bad in (range(2, 6), 4, [0, 9], range(3, 3), [], slice(0, 9), True, "0"):
        with pytest.raises(HookSelectionError, match="4 layers"):
            resolve_layers(bad, 4)
    with pytest.raises(HookSelectionError) as one:
        resolve_layers([0, 9], 4)
    with pytest.raises(HookSelectionError) as several:
        resolve_layers(range(2, 9), 4)
    assert str(one.value) == "layer selection [0, 9] reaches past the model (layer 9); the model has 4 layers (0..3)"
    assert str(several.value) == ("layer selection range(2, 9) reaches past the model (layers 4..8); "
                                  "the model has 4 layers (0..3)")


def test_attach_refuses_bad_selection_before_touching_the_model():
    model = tiny("llama")
    before = n_hooks(model)
    with pytest.raises(HookSelectionError, match="3 layers"):
        with attach(model, hooks="resid_post", layers=range(0, 5), writer=MemoryWriter()):
            pass
    with pytest.raises(HookSelectionError, match="router_logits"):
        with attach(model, hooks="router_logits", writer=MemoryWriter()):  # dense model: no router
            pass
    with pytest.raises(AttentionImplementationError, match="set_attn_implementation"):
        with attach(model, hooks="attn_pattern", writer=MemoryWriter()):
            pass
    with pytest.raises(InvalidIdentifierError):
        with attach(model, hooks="resid_post", model_id="bad\x00id", writer=MemoryWriter()):
            pass
    assert n_hooks(model) == before
    with attach(model, hooks="resid", writer=MemoryWriter()) as cap:  # groups skip what is absent
        assert "router_logits" not in cap.hooks


def test_attach_refuses_a_store_that_is_not_a_pack_store_before_touching_the_model(tmp_path):
    """Without the check, a dmi.Store or a path given as ``store=`` failed only on the drain
    thread (``'Store' object has no attribute 'create'``), after the model had run."""
    model = tiny("llama")
    before = n_hooks(model)
    with dmi.open(home=tmp_path) as facade:
        with pytest.raises(InvalidArgumentError, match=r"this is a dmi\.Store: pass store=store\.packs, "
                                                       r"catalog=store\.catalog"):
            with attach(model, store=facade):
                pass
    with pytest.raises(InvalidArgumentError, match="store must be a PackStore .* not str"):
        with attach(model, store=str(tmp_path)):
            pass
    assert n_hooks(model) == before


def test_attach_refuses_a_catalog_that_is_not_one_before_touching_the_model(tmp_path):
    """Without the check, a URI or a dmi.Store given as ``catalog=`` failed only on the drain
    thread (``'str' object has no attribute 'publisher'``), after the model had run."""
    model = tiny("llama")
    before = n_hooks(model)
    packs = PackStore.local(tmp_path / "packs")
    with dmi.open(home=tmp_path / "home") as facade:
        with pytest.raises(InvalidArgumentError, match=r"this is a dmi\.Store: pass catalog=store\.catalog"):
            with attach(model, store=packs, catalog=facade):
                pass
    uri = f"chdb://{tmp_path}/catalog"
    with pytest.raises(InvalidArgumentError, match=re.escape(f"not str: open it first, catalog=open_catalog('{uri}')")):
        with attach(model, store=packs, catalog=uri):
            pass
    assert n_hooks(model) == before


# -- attach / detach ------------------------------------------------------------------------------
def test_second_attach_refused_before_anything_is_mutated():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w1 = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w1) as cap:
        installed = n_hooks(model)
        for target in (model, model.model):  # the inner base model shares the layers
            with pytest.raises(AttachError, match="already attached"):
                with attach(target, hooks="all_but_patterns", writer=MemoryWriter()):
                    pass
            assert n_hooks(model) == installed
        cap.forward(ids, attention_mask=mask)
    assert {k.hook for k, _, _ in w1.records} == {"resid_post"}
    with attach(model, hooks="resid_post", writer=MemoryWriter()):  # free again after detach
        pass


def test_detach_removes_every_hook_and_a_forward_afterwards_copies_nothing():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    before = n_hooks(model)
    w = MemoryWriter()
    with attach(model, hooks="all_but_patterns", writer=w) as cap:
        assert n_hooks(model) > before
        cap.forward(ids, attention_mask=mask)
    copies = cap.ring.stats.copies
    n = len(w.records)
    assert n_hooks(model) == before
    model(ids, attention_mask=mask)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert cap.ring.stats.copies == copies and cap.ring.stats.reservations == copies
    assert len(w.records) == n


def test_hooks_removed_when_the_block_raises():
    model = tiny("gpt2")
    before = n_hooks(model)
    with pytest.raises(KeyError):
        with attach(model, hooks="all_but_patterns", writer=MemoryWriter()):
            raise KeyError("user error")
    assert n_hooks(model) == before
    with attach(model, hooks="resid_post", writer=MemoryWriter()):
        pass


def test_direct_model_generate_inside_the_block_is_captured_as_prefill_then_decode():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="resid_post", layers=0, writer=w, decode_chunk_steps=1):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    phases = sorted({(k.step, k.phase) for k, _, _ in w.records})
    assert phases == [(0, "prefill"), (1, "decode"), (2, "decode")]
    assert len({k.request_id for k, _, _ in w.records}) == 3


def test_right_padding_refused():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with attach(model, hooks="resid_post", writer=MemoryWriter()) as cap:
        with pytest.raises(InvalidArgumentError, match="left-padded"):
            cap.generate(ids, attention_mask=mask.flip(1), max_new_tokens=2)


def test_prompts_as_lists_are_left_padded_and_positions_are_real():
    model = tiny("llama")
    w = MemoryWriter()
    with attach(model, hooks="token_ids resid_post", layers=0, writer=w) as cap:
        rids, out = cap.generate([[5, 6, 7, 8], [9, 10]], max_new_tokens=2, do_sample=False)
    toks = {k.request_id: (k.start_token, d.tolist()) for k, d, _ in w.records
            if k.hook == "token_ids" and k.step == 0}
    assert toks[rids[0]] == (0, [5, 6, 7, 8]) and toks[rids[1]] == (0, [9, 10])
    dec = {k.request_id: k.start_token for k, _, _ in w.records if k.phase == "decode"}
    assert dec == {rids[0]: 4, rids[1]: 2}


# -- schedule -------------------------------------------------------------------------------------
def test_refused_steps_dispatch_nothing():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="all_but_patterns", writer=w, schedule=Schedule(phases=("decode",))) as cap:
        cap.forward(ids, attention_mask=mask)  # a scoring pass: refused
        assert cap.ring.stats.reservations == 0 and cap.ring.stats.copies == 0
        cap.generate(ids, attention_mask=mask, max_new_tokens=1)  # prefill only: refused
        assert cap.ring.stats.reservations == 0 and cap.ring.stats.copies == 0
        cap.generate(ids, attention_mask=mask, max_new_tokens=2)
        assert cap.ring.stats.copies > 0
    assert {k.phase for k, _, _ in w.records} == {"decode"}


def test_step_stride_request_stride_and_warmup():
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(5, 3, 4, 2))
    w = MemoryWriter()
    sched = Schedule(phases=("prefill", "decode"), step_stride=2, request_stride=2, warmup=1)
    with attach(model, hooks="resid_post", layers=0, writer=w, schedule=sched) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=1)  # warmup: refused
        assert cap.ring.stats.copies == 0
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    steps = sorted({k.step for k, _, _ in w.records})
    assert steps == [0, 1, 3, 5]
    # requests are numbered over the session: the first call had 4, so rows 0 and 2 are even
    assert {k.request_id for k, _, _ in w.records} == {rids[0], rids[2]}
    with pytest.raises(InvalidArgumentError):
        Schedule(step_stride=0)
    with pytest.raises(InvalidArgumentError):
        Schedule(phases=("prefil",))


def test_step_plan_bytes_rounded_per_hook_match_reservations():
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(7, 4, 6))
    w = MemoryWriter()
    with attach(model, hooks="resid_post attn_k token_ids", writer=w) as cap:
        plans = []
        orig = cap._on_model_pre

        def spy(*a, **k):
            orig(*a, **k)
            plans.append(cap._plan)

        cap._handles[0].remove()
        cap._handles[0] = model.register_forward_pre_hook(spy, with_kwargs=True)
        cap.forward(ids, attention_mask=mask)
        plan = plans[0]
        assert plan.n_rows == 17
        assert [(s.row, s.first_col, s.start, s.n) for s in plan.spans] == [(0, 0, 0, 7), (1, 3, 0, 4), (2, 1, 0, 6)]
        assert plan.hook_bytes("resid_post") == 17 * 32 * 4
        assert plan.hook_bytes("attn_k") == 17 * 2 * 8 * 4
        assert plan.hook_bytes("token_ids") == 17 * 8 + 8  # 136 rounded up to 144
        assert cap.ring.stats.reserved_bytes == plan.total_bytes()


# -- ring and drain -------------------------------------------------------------------------------


def test_full_ring_waits_then_raises_ring_full():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = GatedWriter()  # the drain stays blocked until the error is in hand: no timer, no race
    try:
        with pytest.raises(RingFullError, match="ring"):
            with attach(model, hooks="resid_post", writer=w, ring_slots=2, slot_bytes=1024,
                        ring_timeout=0.3) as cap:
                try:
                    cap.generate(ids, attention_mask=mask, max_new_tokens=4)
                except RingFullError:
                    w.gate.set()  # now let the drain finish so that detaching completes
                    raise
        assert cap.ring.stats.waits >= 1 and cap.ring.stats.wait_seconds >= 0.3
    finally:
        w.gate.set()


def _open_gate_once_the_producer_waits(ring, gate: threading.Event) -> threading.Thread:
    """Unblock the drain only after the model thread has started waiting for a free slot."""

    def watch():
        while ring.stats.waits < 1 and not gate.is_set():
            time.sleep(0.005)
        gate.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def test_full_ring_lossless_by_default_when_the_drain_catches_up():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = GatedWriter()
    with attach(model, hooks="resid_post", writer=w, ring_slots=1, slot_bytes=1024, decode_chunk_steps=1) as cap:
        watcher = _open_gate_once_the_producer_waits(cap.ring, w.gate)
        cap.generate(ids, attention_mask=mask, max_new_tokens=4)
    watcher.join()
    assert cap.ring.stats.waits >= 1
    assert cap.stats["records_lost"] == 0
    assert len(w.records) == 3 * 3 * 4


def test_drain_error_is_surfaced_never_swallowed():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = MemoryWriter(fail_after=5)
    with pytest.raises(DrainError) as e:
        with attach(model, hooks="resid_post", writer=w) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=3)
            cap.flush()
    assert isinstance(e.value.__cause__, RuntimeError)
    assert n_hooks(model) == 0  # all removed


def test_drain_error_surfaces_on_exit_without_flush():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(DrainError):
        with attach(model, hooks="resid_post", writer=MemoryWriter(fail_after=0)) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_drain_error_surfaces_on_the_model_thread_before_more_is_copied():
    import time

    model = tiny("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(DrainError):  # and again at exit
        with attach(model, hooks="resid_post", writer=MemoryWriter(fail_after=0)) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=1)
            deadline = time.monotonic() + 10
            while cap.drain.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            copies = cap.ring.stats.copies
            with pytest.raises(DrainError) as e:
                model(ids, attention_mask=mask)  # a direct forward: only the ring's check stands guard
            assert isinstance(e.value.__cause__, RuntimeError)
            assert cap.ring.stats.copies == copies  # nothing more was copied


class _LoopBroke(Exception):
    """Raised inside the drain's loop, outside the guards around each piece of its work."""


def _break_the_loop(self):
    raise _LoopBroke("the drain's loop broke")


def test_a_drain_crash_outside_its_work_guards_surfaces_with_its_cause(monkeypatch):
    monkeypatch.setattr(Drain, "_check_started", _break_the_loop)  # called on every turn of the loop
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with pytest.raises(DrainError) as at_exit:
        with attach(model, hooks="resid_post", writer=MemoryWriter()) as cap:
            cap.forward(ids, attention_mask=mask)
            with pytest.raises(DrainError) as at_flush:
                cap.flush(timeout=10)
    assert isinstance(at_flush.value.__cause__, _LoopBroke)
    assert at_exit.value.__cause__ is at_flush.value.__cause__
    assert cap.drain.error is at_flush.value.__cause__
    assert not cap.drain._thread.is_alive()
    assert n_hooks(model) == 0


def test_a_model_waiting_for_a_slot_stops_when_the_drain_crashes(monkeypatch):
    monkeypatch.setattr(Drain, "_check_started", _break_the_loop)
    model = tiny("llama")
    ids, mask = left_padded_batch()
    t0 = time.monotonic()
    with pytest.raises(DrainError) as e:
        with attach(model, hooks="resid_post", writer=MemoryWriter(), ring_slots=2, slot_bytes=1024,
                    ring_timeout=30):
            model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert isinstance(e.value.__cause__, _LoopBroke)  # not RingFullError after ring_timeout
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("lease", [-1, -1.0, 0, 0.0, float("inf"), float("nan"), "30", None, True])
def test_lease_seconds_other_than_a_finite_positive_number_is_refused_before_the_model_is_touched(lease):
    model = tiny("llama")
    before = n_hooks(model)
    with pytest.raises(InvalidArgumentError, match="lease_seconds must be a finite number of seconds > 0"):
        with attach(model, hooks="resid_post", writer=MemoryWriter(), lease_seconds=lease):
            pass
    assert n_hooks(model) == before
    with attach(model, hooks="resid_post", writer=MemoryWriter(), lease_seconds=0.5) as cap:  # ownership free
        assert cap.drain._tick_seconds == 0.125


def test_default_request_index_counts_ascii_digits_only():
    # '²' and '٩' are str.isdigit(); int() refuses the first and reads the second as 9
    taken = {"R-\u00b2", "R-\u0669\u0669", "R-000004", "R-x1", "R-", "Q-000009"}
    assert _next_default_index("R", taken) == 5
    assert _next_default_index("R", {"R-\u00b2"}) == 0


def test_token_ids_of_a_model_run_on_inputs_embeds_are_refused_naming_the_hook():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    embeds = model.get_input_embeddings()(ids).detach()
    w = MemoryWriter()
    with attach(model, hooks="token_ids resid_post", layers=0, writer=w) as cap:
        with pytest.raises(CaptureError, match="hook.s. 'token_ids'.*pass input_ids, or leave 'token_ids' out"):
            model(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
        cap.flush()
    assert w.records == []
    with attach(model, hooks="resid_post", layers=0, writer=w) as cap:  # nothing read from input_ids: captured
        model(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
    assert [(k.hook, k.n_tokens) for k, _, _ in w.records] == [("resid_post", 7), ("resid_post", 4), ("resid_post", 6)]


def test_detach_gives_back_a_generate_set_on_the_instance():
    def own_generate(*args, **kwargs):
        return ("own", kwargs)

    model = tiny("llama")
    model.generate = own_generate
    with attach(model, hooks="resid_post", writer=MemoryWriter()):
        assert model.generate is not own_generate  # the guard, in front of it
        assert model.generate(max_new_tokens=1) == ("own", {"max_new_tokens": 1, "disable_compile": True})
    assert model.generate is own_generate
    plain = tiny("llama")
    with attach(plain, hooks="resid_post", writer=MemoryWriter()):
        assert "generate" in vars(plain)
    assert "generate" not in vars(plain)  # the class's generate again


def test_flush_after_detach_raises_the_closed_session_error():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with attach(model, hooks="resid_post", writer=MemoryWriter()) as cap:
        cap.forward(ids, attention_mask=mask)
    for call in (cap.flush, lambda: cap.forward(ids, attention_mask=mask)):
        with pytest.raises(CaptureError) as e:
            call()
        assert type(e.value) is CaptureError
        assert str(e.value) == "this capture session is closed (its `with` block has exited)"


# -- tensor-parallel rank -------------------------------------------------------------------------
@pytest.fixture
def process_group(tmp_path):
    """A real single-process gloo group (world size 1), torn down afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


class _Mesh:
    """A 1-D TP mesh where this process is shard ``rank`` of ``size``. A fake: a real mesh with a
    local rank other than the global rank needs several processes, and in one process the
    global rank is 0, so only a fake can show that the mesh's rank is used and not the global one."""

    mesh_dim_names = ("tp",)
    ndim = 1

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def __getitem__(self, name):
        assert name == "tp"
        return self

    def get_local_rank(self):
        return self._rank

    def size(self):
        return self._size


def test_tp_rank_comes_from_the_tp_mesh_never_the_global_rank(process_group):
    from dmi.capture._tp import resolve_tp

    model = tiny("llama")
    model._device_mesh, model._tp_size = _Mesh(1, 2), 2  # what transformers stores on a model it sharded
    assert process_group.get_rank() == 0
    got = resolve_tp(model)
    assert (got.rank, got.size) == (1, 2)
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w, tp_replicas="all") as cap:  # rank 1 keeps its replica
        cap.forward(ids, attention_mask=mask)
    assert {(k.shard_rank, k.tp_size) for k, _, _ in w.records} == {(1, 2)}


def test_tp_rank_from_real_transformers_meshes(process_group):
    """The real DeviceMesh objects transformers 5.x stores: the mesh manager, the
    ("pp", "fsdp", "tp") mesh, and the legacy 1-D TP mesh (world size 1: shard 0 of 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.utils import TransformersDeviceMesh

    from dmi.capture._tp import resolve_tp, tp_mesh_of

    dense = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    expert = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    for stored in (
        {"_mesh_manager": TransformersDeviceMesh(dense, expert)},
        {"_device_mesh": dense["pp", "fsdp", "tp"]},
        {"_device_mesh": init_device_mesh("cpu", (1,))},
    ):
        model = tiny("llama")
        for name, value in stored.items():
            setattr(model, name, value)
        mesh = tp_mesh_of(model)
        assert mesh is not None and mesh.ndim == 1 and mesh.size() == 1, stored
        got = resolve_tp(model)
        assert (got.rank, got.size) == (0, 1)
    assert tp_mesh_of(tiny("llama")) is None


def test_tp_rank_explicit_arguments_win_and_default_is_rank_0_of_1(process_group):
    from dmi.capture._tp import resolve_tp

    model = tiny("llama")
    assert (resolve_tp(model).rank, resolve_tp(model).size) == (0, 1)
    model._device_mesh = _Mesh(1, 2)
    got = resolve_tp(model, tp_rank=3, tp_size=4)
    assert (got.rank, got.size) == (3, 4)
    got = resolve_tp(model, tp_rank=0)
    assert (got.rank, got.size) == (0, 2)  # the size still from the mesh


def test_tp_sharded_model_without_a_mesh_is_refused_not_guessed():
    from dmi.capture._tp import resolve_tp

    model = tiny("llama")
    model._tp_size = 2  # sharded, but no mesh to say which shard this process holds
    before = n_hooks(model)
    with pytest.raises(InvalidArgumentError, match="pass tp_rank="):
        with attach(model, hooks="resid_post", writer=MemoryWriter()):
            pass
    assert n_hooks(model) == before
    got = resolve_tp(model, tp_rank=1)
    assert (got.rank, got.size) == (1, 2)


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (True, 2), (0, 0), (0, 1.0), ("0", 1)])
def test_tp_rank_and_size_are_checked(rank, size):
    from dmi.capture._tp import resolve_tp

    with pytest.raises(InvalidArgumentError, match="tp_"):
        resolve_tp(tiny("llama"), tp_rank=rank, tp_size=size)


def test_ring_stamps_every_submitted_slot_also_one_that_filled_mid_step():
    """A slot handed over because it filled up (not at the end of a step) must carry the
    copies-done event too, or the drain could read bytes still being copied. The event is a
    stand-in string: a CUDA event needs a GPU, and the ring only passes it along."""
    from dmi.capture import Ring
    from dmi.capture._ring import Entry

    ring = Ring(3, 64, pin=False)
    handed: list = []
    stamps = iter(["event-1", "event-2"])
    ring.connect(handed.append, stamp=lambda: next(stamps))
    for _ in range(2):  # the second reservation does not fit: the first slot is submitted by the ring
        slot, offset = ring.reserve(48)
        slot.entries.append(Entry("resid_post", 0, offset, 48, torch.float32, 12, plan=None))
    assert [s.event for s in handed] == ["event-1"]
    ring.submit()  # the end of the step
    assert [s.event for s in handed] == ["event-1", "event-2"]
    ring.release(handed[0])
    assert handed[0].event is None and handed[0].entries == []
