"""MoE routing capture at its edges, bit-exact against the model's own routing: generation
(prefill and decode) from a left-padded batch through a real store, top-k ties, the model's
``output_router_logits=True`` — for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE; Qwen2-MoE's shared
expert inside ``mlp_out``; models mixing dense and sparse layers (no router hook, every other
hook bit-exact); and the architectures DMI refuses."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.capture import HOOKS, SUPPORTED_MODEL_TYPES, attach
from dmi.storage.errors import AttachError, HookSelectionError

from ._models import MemoryWriter, left_padded_batch, tiny

N_NEW = 4


def _tiny_mixtral(dtype):
    return tiny("mixtral", dtype=dtype, num_hidden_layers=2)


def _tiny_moe(kind, dtype):
    """A 2-layer, 4-expert, top-2 model of ``kind``, every layer sparse, generating every token
    asked for (no end-of-sequence id)."""
    if kind == "mixtral":
        return _tiny_mixtral(dtype)
    torch.manual_seed(0)
    model = _moe(kind).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _gate_outputs(model, ids, mask):
    """Per layer, per forward call of an uncaptured generate: what each ``mlp.gate`` returned
    (router logits, top-k weights, top-k experts), seen by a plain forward hook."""
    seen = {layer: [] for layer in range(len(model.model.layers))}

    def keep(layer):
        return lambda module, args, out: seen[layer].append(tuple(o.detach().clone() for o in out))

    handles = [blk.mlp.gate.register_forward_hook(keep(i)) for i, blk in enumerate(model.model.layers)]
    try:
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    return seen, tokens


def _request_rows(calls, part: int, row: int, pad: int, width: int) -> torch.Tensor:
    """One request's rows of gate output ``part`` over prefill (``[b * t, ...]``, padding
    dropped) and the decode calls (``[b, ...]``)."""
    prefill = calls[0][part][row * width + pad : (row + 1) * width]
    return torch.cat([prefill] + [c[part][row : row + 1] for c in calls[1:]])


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_records_equal_the_gate_over_prefill_and_decode_through_the_store(tmp_path, dtype, kind):
    model = _tiny_moe(kind, dtype)
    ids, mask = left_padded_batch()
    pads, width = mask.eq(0).sum(1).tolist(), ids.shape[1]
    seen, tokens = _gate_outputs(model, ids, mask)
    with dmi.open(home=str(tmp_path)) as store:
        with store.capture(model, hooks="router", model_id="mx", run_id="r") as cap:
            rids, captured = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
        assert torch.equal(captured, tokens)
        for row, rid in enumerate(rids):
            logits = store.get_internal("mx", rid, "router_logits", run_id="r")
            experts = store.get_internal("mx", rid, "router_topk", run_id="r")
            n = width - pads[row] + N_NEW - 1  # the last new token is sampled, never fed
            assert logits.dtype == dtype and logits.shape == (2, n, 4)
            assert experts.dtype == torch.int64 and experts.shape == (2, n, 2)
            for layer in range(2):
                assert torch.equal(logits[layer], _request_rows(seen[layer], 0, row, pads[row], width))
                assert torch.equal(experts[layer], _request_rows(seen[layer], 2, row, pads[row], width))


def test_tied_router_logits_record_the_experts_the_model_chose():
    """Experts 0 and 1 have one gate row, 2 and 3 a zero row: every token's top two is a tie."""
    model = _tiny_mixtral(torch.float32)
    with torch.no_grad():
        for blk in model.model.layers:
            blk.mlp.gate.weight[1] = blk.mlp.gate.weight[0]
            blk.mlp.gate.weight[2:] = 0
    ids, mask = left_padded_batch()
    pads, width = mask.eq(0).sum(1).tolist(), ids.shape[1]
    seen, _ = _gate_outputs(model, ids, mask)
    w = MemoryWriter()
    with attach(model, hooks="router_topk", writer=w, decode_chunk_steps=1) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    for row, rid in enumerate(rids):
        for layer in range(2):
            got = torch.cat([d for _, d in sorted(((k.start_token, d) for k, d in w.by("router_topk", rid)
                                                   if k.layer == layer), key=lambda p: p[0])])
            assert torch.equal(got, _request_rows(seen[layer], 2, row, pads[row], width))
            assert {frozenset(pair) for pair in got.tolist()} <= {frozenset({0, 1}), frozenset({2, 3})}


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_router_logits_equal_the_models_own_output_router_logits(kind):
    model = _tiny_moe(kind, torch.float32)
    ids, mask = left_padded_batch()
    pads, width = mask.eq(0).sum(1).tolist(), ids.shape[1]
    own = model(ids, attention_mask=mask, output_router_logits=True).router_logits
    w = MemoryWriter()
    with attach(model, hooks="router_logits", writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask, output_router_logits=True)
    for row, rid in enumerate(rids):
        for layer in range(2):
            (got,) = [d for k, d in w.by("router_logits", rid) if k.layer == layer]
            assert torch.equal(got, own[layer][row * width + pads[row] : (row + 1) * width])


def _moe(kind: str, **over):
    """A 2-layer, 4-expert, top-2 model of ``kind``, every layer sparse unless ``over`` says
    otherwise (``decoder_sparse_step``, ``mlp_only_layers``)."""
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, num_experts=4, **over)
    if kind == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                         **common))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=16, head_dim=8, **common))
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(eos_token_id=1, **common))


def test_the_supported_model_types_and_the_refusal_naming_them():
    """Qwen2-MoE is among them; an MoE type with no module map is refused listing them all."""

    class Unmapped(torch.nn.Module):
        config = type("Config", (), {"model_type": "phimoe"})()

    assert SUPPORTED_MODEL_TYPES == ("gemma", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "gpt_oss", "granite",
                                     "llama", "mistral", "mixtral", "olmo2", "olmo3", "olmoe", "phi3", "qwen2",
                                     "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")
    with pytest.raises(AttachError) as info:
        with attach(Unmapped(), hooks="router", writer=MemoryWriter()):
            pass
    assert str(info.value) == ("cannot attach to a model of type 'phimoe' (Unmapped); supported model types: "
                               "gemma, gemma2, gemma3_text, gpt2, gpt_neox, gpt_oss, granite, llama, mistral, mixtral, "
                               "olmo2, olmo3, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, smollm3")


def _dense_then_sparse(kind):
    """Layer 0 dense (a plain MLP, no gate), layer 1 sparse: ``decoder_sparse_step=2`` for
    Qwen2-MoE, ``mlp_only_layers=[0]`` for Qwen3-MoE."""
    over = dict(decoder_sparse_step=2) if kind == "qwen2_moe" else dict(mlp_only_layers=[0])
    torch.manual_seed(0)
    model = _moe(kind, **over).eval()
    assert [hasattr(layer.mlp, "gate") for layer in model.model.layers] == [False, True]
    return model


HOOKS_BUT_ROUTERS_AND_MLP_POST = ("token_ids", "embed", "resid_pre", "attn_q", "attn_k", "attn_v", "attn_z",
                                  "attn_pattern", "attn_out", "resid_mid", "mlp_out", "resid_post", "final_norm",
                                  "logits")


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_dense_layers_among_sparse_ones_refuse_the_router_hooks_by_name(kind):
    """No router hook is on every layer: the group leaves nothing, a hook named alone is refused
    listing what the model has, and ``all`` holds everything else (no ``mlp_post`` either: the
    sparse layer has no dense down projection)."""
    model = _dense_then_sparse(kind)
    with pytest.raises(HookSelectionError) as info:
        with attach(model, hooks="router", writer=MemoryWriter()):
            pass
    assert str(info.value) == f"selection 'router' leaves no hook available on model type {kind!r}"
    with pytest.raises(HookSelectionError) as info:
        with attach(model, hooks="router_topk", writer=MemoryWriter()):
            pass
    assert str(info.value) == (f"hook 'router_topk' does not exist on model type {kind!r}; available: "
                               + ", ".join(HOOKS_BUT_ROUTERS_AND_MLP_POST))
    model.set_attn_implementation("eager")
    with attach(model, hooks="all", writer=MemoryWriter()) as cap:
        pass
    assert cap.hooks == {h: ((0, 1) if HOOKS[h].per_layer else (-1,)) for h in HOOKS_BUT_ROUTERS_AND_MLP_POST}


def _block_outputs(model, ids, mask):
    """Per layer, what an uncaptured forward's ``mlp`` (dense MLP or MoE block) returned, seen by
    a plain forward hook; and the forward's own hidden states."""
    seen = {}

    def keep(layer):
        return lambda module, args, out: seen.__setitem__(layer, out.detach().clone())

    handles = [blk.mlp.register_forward_hook(keep(i)) for i, blk in enumerate(model.model.layers)]
    try:
        ref = model(ids, attention_mask=mask, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return seen, ref.hidden_states


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_dense_layers_among_sparse_ones_capture_the_other_hooks_bit_exact(kind):
    """The residual stream against ``output_hidden_states``, ``mlp_out`` against the block's
    own output on the dense layer and the sparse one, and each layer's residual add."""
    model = _dense_then_sparse(kind)
    ids, mask = left_padded_batch()
    pads = mask.eq(0).sum(1).tolist()
    blocks, hidden = _block_outputs(model, ids, mask)
    w = MemoryWriter()
    with attach(model, hooks="resid_pre resid_mid mlp_out resid_post", writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    for row, rid in enumerate(rids):
        got = {(k.hook, k.layer): d for k, d, _ in w.records if k.request_id == rid}
        assert set(got) == {(h, layer) for h in ("resid_pre", "resid_mid", "mlp_out", "resid_post") for layer in (0, 1)}
        for layer in (0, 1):
            assert torch.equal(got["resid_pre", layer], hidden[layer][row, pads[row]:])
            assert torch.equal(got["mlp_out", layer], blocks[layer][row, pads[row]:])
            assert torch.equal(got["resid_post", layer], got["resid_mid", layer] + got["mlp_out", layer])
        assert torch.equal(got["resid_post", 0], hidden[1][row, pads[row]:])


@pytest.mark.parametrize("over", [{}, dict(decoder_sparse_step=2)], ids=["all-sparse", "dense-then-sparse"])
def test_qwen2_moe_mlp_out_is_the_routed_experts_plus_the_gated_shared_expert(over):
    """On a sparse layer ``mlp_out`` is the whole block: the routed experts' sum plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, each part seen by a plain hook on its
    own module in an uncaptured forward."""
    torch.manual_seed(0)
    model = _moe("qwen2_moe", **over).eval()
    ids, mask = left_padded_batch()
    pads, width = mask.eq(0).sum(1).tolist(), ids.shape[1]
    sparse = [i for i, blk in enumerate(model.model.layers) if hasattr(blk.mlp, "shared_expert")]
    assert sparse == ([0, 1] if not over else [1])
    parts = {}

    def keep(layer, name):
        return lambda module, args, out: parts.__setitem__((layer, name), out.detach().clone())

    handles = [getattr(model.model.layers[i].mlp, name).register_forward_hook(keep(i, name))
               for i in sparse for name in ("experts", "shared_expert", "shared_expert_gate")]
    try:
        model(ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    w = MemoryWriter()
    with attach(model, hooks="mlp_out", writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    for layer in sparse:
        whole = parts[layer, "experts"] + torch.sigmoid(parts[layer, "shared_expert_gate"]) * parts[
            layer, "shared_expert"]
        assert not torch.equal(whole, parts[layer, "experts"])
        for row, rid in enumerate(rids):
            (got,) = [d for k, d in w.by("mlp_out", rid) if k.layer == layer]
            assert torch.equal(got, whole[row * width + pads[row] : (row + 1) * width])
