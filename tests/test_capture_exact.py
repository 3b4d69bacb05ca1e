"""Bit-exact capture against independent references (uncaptured runs, recomputed projections)."""

from __future__ import annotations

import pytest
import torch

from ._models import MemoryWriter, left_padded_batch, tiny
from dmi.capture import attach

N_NEW = 4


def collect(writer, rid, hook, layer):
    recs = sorted((k.start_token, k, d) for k, d, _ in writer.records
                  if k.request_id == rid and k.hook == hook and k.layer == layer)
    starts = [s for s, _, _ in recs]
    assert starts == sorted(set(starts)), f"duplicate chunks for {hook} {layer}"
    return torch.cat([d for _, _, d in recs]) if recs else None


def _reference(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                          output_hidden_states=True, output_logits=True, return_dict_in_generate=True)


def _per_row(ref_steps, layer_index, row, pad):
    """Concatenate one row's real tokens over prefill and decode steps of a hidden-state list."""
    parts = [ref_steps[0][layer_index][row, pad:]]
    parts += [ref_steps[s][layer_index][row, -1:] for s in range(1, len(ref_steps))]
    return torch.cat(parts)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gemma", "gemma2", "gemma3_text", "gpt_neox", "phi3", "gpt2", "olmo2", "olmo3",
                                  "gpt_oss", "smollm3", "granite"])
def test_resid_stream_bit_exact_over_prefill_and_decode(kind):
    model = tiny(kind)
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    ref = _reference(model, ids, mask)
    w = MemoryWriter()
    with attach(model, hooks="resid_pre resid_post final_norm logits token_ids", writer=w) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
    # generation unchanged by capture
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert torch.equal(a, b)
    n_layers = model.config.num_hidden_layers
    steps = ref.hidden_states
    assert len(steps) == N_NEW
    for i, rid in enumerate(rids):
        real = ids.shape[1] - pads[i]
        toks = collect(w, rid, "token_ids", -1)
        # every token fed to the model: the prompt, then each generated token but the last
        assert torch.equal(toks, ref.sequences[i, pads[i]:-1])
        for layer in range(n_layers):
            assert torch.equal(collect(w, rid, "resid_pre", layer), _per_row(steps, layer, i, pads[i])), layer
            got = collect(w, rid, "resid_post", layer)
            assert got.shape == (real + N_NEW - 1, model.config.hidden_size)
            if layer < n_layers - 1:  # the last hidden state HF returns is the normed one
                assert torch.equal(got, _per_row(steps, layer + 1, i, pads[i])), layer
        assert torch.equal(collect(w, rid, "final_norm", -1), _per_row(steps, n_layers, i, pads[i]))
        # logits: the model materialises only the last position per step (logits_to_keep)
        logits = collect(w, rid, "logits", -1)
        assert torch.equal(logits, torch.stack([ref.logits[s][i] for s in range(N_NEW)]))
        spans = sorted((k.start_token, k.n_tokens) for k, _, _ in w.records
                       if k.request_id == rid and k.hook == "logits")
        assert spans[0][0] == real - 1  # the prompt's last position, then one per decode step
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
        assert sum(n for _, n in spans) == N_NEW


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gpt_neox", "phi3", "gpt2", "olmo2", "gpt_oss"])
def test_qkv_equal_projections_recomputed_from_resid_pre(kind):
    model = tiny(kind)
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    ref = model(ids, attention_mask=mask, output_hidden_states=True)
    w = MemoryWriter()
    with attach(model, hooks="resid_pre attn_q attn_k attn_v", writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    for layer in range(model.config.num_hidden_layers):
        if kind == "gpt2":
            blk = model.transformer.h[layer]
            qkv = blk.attn.c_attn(blk.ln_1(ref.hidden_states[layer]))
            q, k, v = qkv.split(model.config.n_embd, dim=2)
            hd = model.config.n_embd // model.config.n_head
        elif kind == "gpt_neox":  # one fused projection: each head's q, k, v side by side
            blk = model.gpt_neox.layers[layer]
            qkv = blk.attention.query_key_value(blk.input_layernorm(ref.hidden_states[layer]))
            hd = blk.attention.head_size
            q, k, v = (part.flatten(2) for part in qkv.unflatten(-1, (-1, 3 * hd)).chunk(3, dim=-1))
        elif kind == "phi3":  # one fused projection: all q, then all k, then all v
            blk = model.model.layers[layer]
            a = blk.self_attn
            hd = a.head_dim
            sizes = [model.config.num_attention_heads * hd] + [model.config.num_key_value_heads * hd] * 2
            q, k, v = a.qkv_proj(blk.input_layernorm(ref.hidden_states[layer])).split(sizes, dim=-1)
        else:
            blk = model.model.layers[layer]
            x = ref.hidden_states[layer] if kind == "olmo2" else blk.input_layernorm(ref.hidden_states[layer])
            a = blk.self_attn
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
            hd = a.head_dim
        for i, rid in enumerate(rids):
            assert torch.equal(collect(w, rid, "resid_pre", layer), ref.hidden_states[layer][i, pads[i]:])
            for name, ref_t in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
                got = collect(w, rid, name, layer)
                want = ref_t[i, pads[i]:].reshape(-1, ref_t.shape[-1] // hd, hd)
                assert got.shape == want.shape
                assert torch.equal(got, want), (name, layer)


def test_router_topk_equals_gate_topk():
    model = tiny("mixtral")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    w = MemoryWriter()
    with attach(model, hooks="router", writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    b, t = ids.shape
    for layer, blk in enumerate(model.model.layers):
        # independent: the gate applied to the MoE block's own input, captured by a plain hook
        seen = {}
        h = blk.mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
        try:
            model(ids, attention_mask=mask)
        finally:
            h.remove()
        flat = seen["x"].reshape(b * t, -1)
        logits = torch.nn.functional.linear(flat, blk.mlp.gate.weight)
        top = torch.topk(torch.softmax(logits.float(), -1), model.config.num_experts_per_tok, dim=-1).indices
        for i, rid in enumerate(rids):
            rows = slice(i * t + pads[i], (i + 1) * t)
            assert torch.equal(collect(w, rid, "router_logits", layer), logits[rows])
            assert torch.equal(collect(w, rid, "router_topk", layer), top[rows])


@pytest.mark.parametrize(("kind", "over"), [("llama", {}), ("mistral", {"sliding_window": 4}), ("gemma2", {}),
                                             ("olmo3", {}), ("gpt_oss", {})],
                         ids=["llama", "mistral-window-4", "gemma2-window-5-every-other-layer",
                              "olmo3-window-5-every-other-layer", "gpt-oss-window-5-and-sinks"])
def test_attn_pattern_equals_eager_attentions_with_padding_stripped(kind, over):
    """Each record is the model's attention weights for the request's real queries and keys.
    Under a sliding window the decode steps' cache holds only the last keys: the padding that
    slid out of it is not stripped again (a row padded by 3 keeps all 4 keys of a window of 4)."""
    model = tiny(kind, attn="eager", eos_token_id=None, **over)  # every request runs all N_NEW steps
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    ref = _reference(model, ids, mask)
    ref_att = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                             output_attentions=True, return_dict_in_generate=True).attentions
    w = MemoryWriter()
    with attach(model, hooks="attn_pattern", layers=[0, 2], writer=w) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    for i, rid in enumerate(rids):
        for layer in (0, 2):
            recs = sorted((k.step, k, d) for k, d, _ in w.records
                          if k.request_id == rid and k.layer == layer)
            assert len(recs) == N_NEW
            for step, k, d in recs:
                att = ref_att[step][layer][i]
                if step == 0:
                    want = att[:, pads[i]:, pads[i]:]
                else:  # the key columns are the last of the padded sequence so far: keep the real ones
                    real = torch.cat([mask[i], torch.ones(step, dtype=mask.dtype)])[-att.shape[-1]:].bool()
                    want = att[..., real]
                assert torch.equal(d, want)


def _forward_captured(kind: str, hooks: str):
    """A tiny ``kind`` model, and what a capture of ``hooks`` over one forward of the left-padded
    batch wrote: ``(model, writer, request ids)``."""
    model = tiny(kind)
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks=hooks, writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    return model, w, rids


SEQUENTIAL = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gemma", "gemma2",
              "gemma3_text", "phi3", "gpt2", "olmo2", "olmo3", "gpt_oss", "smollm3", "granite"]
"""Every supported family whose layer adds its attention block, then its MLP block, to the
residual stream (GPT-NeoX's parallel residual adds both at once: its own test below)."""


@pytest.mark.parametrize("kind", SEQUENTIAL)
def test_each_layer_adds_its_attn_out_then_its_mlp_out_to_the_residual_stream(kind):
    """``attn_out`` and ``mlp_out`` are what the layer adds (TransformerLens's definition),
    whatever a family does around its blocks — norms after them, a gated shared expert:
    ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out``, bit for bit,
    at every layer; and ``embed`` is layer 0's input (but on GPT-2, whose positions are added
    after the token embedding it stores)."""
    model, w, rids = _forward_captured(kind, "embed resid_pre attn_out resid_mid mlp_out resid_post")
    for rid in rids:
        if kind != "gpt2":
            assert torch.equal(collect(w, rid, "embed", -1), collect(w, rid, "resid_pre", 0))
        for layer in range(model.config.num_hidden_layers):
            got = {h: collect(w, rid, h, layer) for h in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")}
            assert torch.equal(got["resid_mid"], got["resid_pre"] + got["attn_out"]), layer
            assert torch.equal(got["resid_post"], got["resid_mid"] + got["mlp_out"]), layer


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text", "olmo2", "olmo3"])
def test_post_normed_blocks_store_their_outputs_after_the_norms(kind):
    """Gemma 2/3 and OLMo 2/3 norm each block's output before the residual add: ``attn_out`` is
    ``post_attention_layernorm(o_proj(attn_z))`` and ``mlp_out`` ``post_feedforward_layernorm
    (down_proj(mlp_post))``, recomputed here from the captured inputs (one request's rows, not the
    batch's: the matrix products may round differently, so to 1e-5). That they are what the layer
    adds is the test above."""
    model, w, rids = _forward_captured(kind, "attn_z attn_out mlp_post mlp_out")
    for rid in rids:
        for layer, blk in enumerate(model.model.layers):
            got = {h: collect(w, rid, h, layer) for h in ("attn_z", "attn_out", "mlp_post", "mlp_out")}
            with torch.no_grad():
                attn_out = blk.post_attention_layernorm(blk.self_attn.o_proj(got["attn_z"].flatten(1)))
                mlp_out = blk.post_feedforward_layernorm(blk.mlp.down_proj(got["mlp_post"]))
            torch.testing.assert_close(got["attn_out"], attn_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["mlp_out"], mlp_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-residual", "sequential"])
def test_gpt_neox_residual_stream_sums_its_blocks(parallel):
    """GPT-NeoX (Pythia) with its parallel residual adds both blocks to the layer's input at once:
    ``resid_post = mlp_out + attn_out + resid_pre`` (the model's own order of additions, so bit
    for bit) and there is no ``resid_mid`` — naming it is refused, not answered with the MLP norm's
    input (which is ``resid_pre`` there). Sequential, ``resid_mid = resid_pre + attn_out`` and
    ``resid_post = resid_mid + mlp_out``."""
    from dmi.storage.errors import HookSelectionError

    model = tiny("gpt_neox", use_parallel_residual=parallel)
    ids, mask = left_padded_batch()
    hooks = "resid_pre attn_out mlp_out resid_post" + ("" if parallel else " resid_mid")
    w = MemoryWriter()
    with attach(model, hooks=hooks, writer=w) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    for rid in rids:
        for layer in range(model.config.num_hidden_layers):
            got = {h: collect(w, rid, h, layer) for h in hooks.split()}
            if parallel:
                assert torch.equal(got["resid_post"], got["mlp_out"] + got["attn_out"] + got["resid_pre"]), layer
            else:
                assert torch.equal(got["resid_mid"], got["attn_out"] + got["resid_pre"]), layer
                assert torch.equal(got["resid_post"], got["mlp_out"] + got["resid_mid"]), layer
    if parallel:
        with pytest.raises(HookSelectionError, match="hook 'resid_mid' does not exist on model type 'gpt_neox'"):
            with attach(model, hooks="resid_mid", writer=MemoryWriter()):
                pass
