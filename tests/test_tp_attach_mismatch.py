"""A model whose tensor-parallel cut does not match ``tp_rank`` / ``tp_size`` is refused at
attach, from its projections' weight shapes, before the model runs: an unsharded model given
``tp_size=2`` (which the drain used to refuse only after the forward), a 2-way shard given
``tp_size=1`` (stored as whole tensors) or ``tp_size=4`` (stored at the wrong offset). Models
cut as said, replicated hooks, and hooks that ``tp_layout=`` or the model's TP plan describe
still attach. (Real sharded ranks are in tests/test_tp_capture.py and tests/test_moe_paths.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmi.capture import TPReplicated, attach
from dmi.capture._arch import resolve_architecture
from dmi.capture._hooks import ModelGeometry
from dmi.capture._tp_layout import TPLayout, check_model_cut
from dmi.storage import ShardGeometry
from dmi.storage.errors import AttachError
from tests._models import MemoryWriter, left_padded_batch, tiny


def _cut(model, rank: int, world: int):
    """This rank's block of every layer's q/k/v and MLP, in one process (no all-reduce: only
    the shapes matter here, and the forward still runs)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            block = proj.out_features // world
            proj.weight = nn.Parameter(proj.weight.detach()[rank * block:(rank + 1) * block].clone())
            proj.out_features = block
        for proj in (attn.o_proj, mlp.down_proj):
            block = proj.in_features // world
            proj.weight = nn.Parameter(proj.weight.detach()[:, rank * block:(rank + 1) * block].clone())
            proj.in_features = block
    return model


def _refused(model, hooks, **options) -> str:
    """The message of the ``AttachError`` attach raises, asserting the model never ran."""
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    ids, mask = left_padded_batch()
    with pytest.raises(AttachError) as info:
        with attach(model, hooks=hooks, writer=MemoryWriter(), **options) as cap:
            cap.forward(ids, attention_mask=mask)
    assert type(info.value) is AttachError and forwards == []
    return str(info.value)


def _records(model, hooks, **options) -> list:
    writer = MemoryWriter()
    ids, mask = left_padded_batch()
    with torch.no_grad(), attach(model, hooks=hooks, writer=writer, **options) as cap:
        cap.forward(ids, attention_mask=mask)
        cap.flush()
    return writer.records


def test_an_unsharded_model_given_tp_size_2_is_refused_before_it_runs():
    model = tiny("llama")
    message = _refused(model, "resid_post mlp_post", tp_rank=1, tp_size=2)
    assert message.startswith(
        "hook 'mlp_post': layer 0's mlp.down_proj holds 48 of the model's 48 features, where TP rank 1 of 2 "
        "expects 24: the model is not sharded. Shard it (from_pretrained(..., tp_plan=\"auto\") under torchrun, "
        "or dmi.capture.load_tensor_parallel), or pass tp_size=1")
    # nothing was left attached: the same model attaches as the one rank it is
    assert {k.hook for k, _, _ in _records(model, "resid_post mlp_post")} == {"resid_post", "mlp_post"}


def test_the_query_projection_of_an_unsharded_model_is_named():
    message = _refused(tiny("llama"), "attn_q", tp_rank=0, tp_size=2)
    assert message.startswith("hook 'attn_q': layer 0's self_attn.q_proj holds 32 of the model's 32 features, "
                              "where TP rank 0 of 2 expects 16: the model is not sharded.")


def test_a_2_way_shard_given_no_tp_size_is_refused_not_stored_as_whole():
    message = _refused(_cut(tiny("llama"), 1, 2), "resid_post mlp_post")
    assert message == (
        "hook 'mlp_post': layer 0's mlp.down_proj holds 24 of the model's 48 features, where TP rank 0 of 1 expects "
        "48: the model looks cut 2 ways. Pass this process's tp_rank= and tp_size=2, or say how it is cut with "
        "tp_layout={'mlp_post': TPShard(axis, offset, full)}")


def test_a_2_way_shard_given_tp_size_4_is_refused_not_stored_at_the_wrong_offset():
    message = _refused(_cut(tiny("llama"), 1, 2), ["attn_q"], tp_rank=1, tp_size=4)
    assert message.startswith("hook 'attn_q': layer 0's self_attn.q_proj holds 16 of the model's 32 features, "
                              "where TP rank 1 of 4 expects 8: the model looks cut 2 ways. Pass this process's "
                              "tp_rank= and tp_size=2")


def test_a_2_way_shard_given_its_rank_attaches_and_stores_its_slice():
    records = _records(_cut(tiny("llama"), 1, 2), "mlp_post", tp_rank=1, tp_size=2, tp_replicas="all")
    first = next((data, shard) for key, data, shard in records if key.layer == 0)
    assert tuple(first[0].shape) == (7, 24)
    assert first[1] == ShardGeometry(1, 24, (7, 48))


def test_replicated_hooks_of_an_unsharded_model_still_attach_on_rank_1():
    records = _records(tiny("llama"), "resid_post", tp_rank=1, tp_size=2, tp_replicas="all")
    assert {(k.hook, k.shard_rank, k.tp_size, s) for k, _, s in records} == {("resid_post", 1, 2, None)}


def test_a_hook_tp_layout_declares_whole_is_left_to_the_layout():
    records = _records(tiny("llama"), "mlp_post", tp_rank=1, tp_size=2, tp_replicas="all",
                       tp_layout={"mlp_post": TPReplicated()})
    assert {tuple(d.shape) for k, d, _ in records if k.request_id == records[0][0].request_id} == {(7, 48)}


def test_a_hook_the_models_tp_plan_gathers_is_left_to_the_plan():
    model = tiny("llama")
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise_gather_output"}
    records = _records(model, "attn_q", tp_rank=1, tp_size=2, tp_replicas="all")
    assert {s for _, _, s in records} == {None} and tuple(records[0][1].shape)[1:] == (4, 8)


def test_kv_heads_fewer_than_ranks_are_whole_on_every_rank():
    """2 kv heads on 4 ranks: k/v are replicated, so an unsharded k_proj is what each rank holds;
    q (4 heads, one per rank) is not."""
    model = tiny("llama")
    arch = resolve_architecture(model)
    layout = TPLayout(ModelGeometry.from_config(model.config, torch.float32), 3, 4)
    check_model_cut(arch, {"attn_k": (0, 1, 2), "attn_v": (2,)}, layout)
    with pytest.raises(AttachError, match=r"^hook 'attn_q': layer 1's self_attn\.q_proj holds 32 of the model's 32 "
                                          r"features, where TP rank 3 of 4 expects 8: the model is not sharded\."):
        check_model_cut(arch, {"attn_q": (1,)}, layout)


def test_other_architectures_are_left_to_the_drain():
    """GPT-2 fuses q/k/v in one ``Conv1D``: no projection of its own to read, no refusal here."""
    model = tiny("gpt2")
    layout = TPLayout(ModelGeometry.from_config(model.config, torch.float32), 1, 2)
    assert check_model_cut(resolve_architecture(model), {"attn_q": (0,), "mlp_post": (0,)}, layout) is None
