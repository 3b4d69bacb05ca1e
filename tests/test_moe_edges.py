"""MoE routing capture at its edges, bit-exact against the model's own routing: generation
(prefill and decode) from a left-padded batch through a real store, top-k ties, the model's
``output_router_logits=True`` — for Mixtral, Qwen3-MoE and OLMoE — and the MoE architecture
DMI refuses."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.capture import attach
from dmi.storage.errors import AttachError

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


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe"])
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


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe"])
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


def _moe(kind: str):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, num_experts=4)
    if kind == "qwen2_moe":  # a shared expert, and layer 0 dense (sparse every 2nd layer)
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(decoder_sparse_step=2, moe_intermediate_size=16,
                                                         shared_expert_intermediate_size=16, **common))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=16, head_dim=8, **common))
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(eos_token_id=1, **common))


def test_qwen2_moe_is_refused_naming_the_supported_ones():
    """Its shared expert and its dense layers among sparse ones are not mapped."""
    model = _moe("qwen2_moe").eval()
    with pytest.raises(AttachError, match=r"^cannot attach to a model of type 'qwen2_moe' .*supported model types: "
                                          r"gpt2, llama, mistral, mixtral, olmoe, qwen2, qwen3, qwen3_moe$"):
        with attach(model, hooks="router", writer=MemoryWriter()):
            pass


def test_a_qwen3_moe_with_dense_layers_among_sparse_ones_refuses_the_router_hooks():
    """``mlp_only_layers``: layer 0 has no gate, so no router hook is on every layer."""
    import transformers as tf

    from dmi.storage.errors import HookSelectionError

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, num_experts=4)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=16, head_dim=8, mlp_only_layers=[0],
                                                     **common)).eval()
    with pytest.raises(HookSelectionError, match=r"^selection 'router' leaves no hook available on model type "
                                                 r"'qwen3_moe'"):
        with attach(model, hooks="router", writer=MemoryWriter()):
            pass
