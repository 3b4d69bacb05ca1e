"""Qwen2-MoE, Qwen3-MoE and OLMoE through the paths Mixtral takes: ``store.audit`` (exact and batched,
honest and tampered), ``dmi describe-model`` on configs that mix dense and sparse layers, and
capture under transformers' own tensor parallelism (2 gloo ranks) read back merged."""

from __future__ import annotations

import dataclasses
import json

import pytest

import dmi
from dmi._describe import describe_model
from dmi.capture import HOOKS, resolve_architecture
from dmi.storage.errors import InvalidArgumentError

from ._models import left_padded_batch, tiny
from .test_audit import HOOKS as AUDIT_HOOKS
from .test_audit import Tamper, _capture

MOE = ["qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture
def store(tmp_path):
    with dmi.open(home=tmp_path) as s:
        yield s


@pytest.mark.parametrize("kind", MOE)
def test_a_capture_alone_is_bit_exact(store, kind):
    model = tiny(kind, attn="eager")
    ids, mask = left_padded_batch(lengths=(6,))
    model_id, rids = _capture(store, model, ids, mask, hooks="all token_ids")
    report = store.audit(model_id, model=model, request_ids=rids, exact=True)
    assert report.passed and report.tolerance == "exact", [c.describe() for c in report.failures]
    assert all(c.verdict == "exact" for c in report.checks)
    checked = {(c.hook, c.layer) for c in report.checks}
    per_layer = {h for h, spec in HOOKS.items() if spec.per_layer} - {"mlp_post"}
    assert checked == {(h, l) for h in per_layer for l in range(3)} | {
        (h, -1) for h in ("token_ids", "embed", "final_norm", "logits")}
    assert len(report.checks) == 4 + 3 * 12


@pytest.mark.parametrize("kind", MOE)
@pytest.mark.parametrize("generate", [True, False], ids=["generate", "forward"])
def test_an_honest_batched_left_padded_capture_passes(store, kind, generate):
    model = tiny(kind)
    ids, mask = left_padded_batch()
    model_id, rids = _capture(store, model, ids, mask, generate=generate)
    report = store.audit(model_id, model=model, requests=3)
    assert report.passed, [c.describe() for c in report.failures]
    assert sorted(r for _, r in report.requests) == sorted(rids)
    assert {"router_logits", "router_topk"} <= {c.hook for c in report.checks}
    assert all(c.verdict in ("exact", "noise") for c in report.checks)


def _swap_topk(key, data):
    # Injected before writing: router_topk of layer 1 has its two chosen experts swapped
    # on every token (a capture writing the choices in the wrong order).
    if key.hook == "router_topk" and key.layer == 1:
        data = data.flip(-1)
    return key, data


def _scale_logits(key, data):
    # Injected before writing: router_logits of layer 2 is written doubled.
    if key.hook == "router_logits" and key.layer == 2:
        data = data * 2
    return key, data


@pytest.mark.parametrize("kind", MOE)
@pytest.mark.parametrize(("change", "hook", "layer"), [(_swap_topk, "router_topk", 1),
                                                       (_scale_logits, "router_logits", 2)])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "batched"])
def test_tampered_router_records_fail(store, kind, change, hook, layer, exact):
    """Exact audits a request captured alone (a batch moves values by kernel noise); the
    batched tolerance audits a left-padded batch."""
    model = tiny(kind)
    ids, mask = left_padded_batch(lengths=(6,) if exact else (7, 4, 6))
    model_id, rids = _capture(store, model, ids, mask, writer=Tamper(change))
    report = store.audit(model_id, model=model, request_ids=rids, exact=exact)
    failed = {(c.request_id, c.hook, c.layer) for c in report.checks if c.verdict == "fail"}
    assert not report.passed
    assert failed == {(r, hook, layer) for r in rids}
    assert all(c.first_fail == 0 for c in report.checks if c.verdict == "fail")


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize(("over", "sparse"), [(dict(mlp_only_layers=[0]), 2), (dict(decoder_sparse_step=2), 1),
                                             (dict(decoder_sparse_step=3), 1), (dict(mlp_only_layers=[0, 1, 2]), 0),
                                             ({}, 3)])
def test_describe_matches_the_runtime_when_dense_and_sparse_layers_mix(kind, over, sparse, tmp_path):
    """Router hooks need a router on every layer, ``mlp_post`` a dense MLP on every layer:
    describe-model reads ``mlp_only_layers`` / ``decoder_sparse_step`` and offers what the
    runtime finds on the modules of the same model."""
    model = tiny(kind, **over)
    block = {"qwen2_moe": "Qwen2MoeSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock"}[kind]
    assert sum(type(layer.mlp).__name__ == block for layer in model.model.layers) == sparse
    model.config.save_pretrained(tmp_path)
    names = [h.name for h in describe_model(str(tmp_path)).hooks]
    arch = resolve_architecture(model)
    assert names == [h for h in HOOKS if arch.available(h)]
    assert ("router_logits" in names, "router_topk" in names, "mlp_post" in names) == (
        sparse == 3, sparse == 3, sparse == 0)


_QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize(("field", "value", "words"), [
    ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer; got 0"),
    ("decoder_sparse_step", "2", "decoder_sparse_step must be a positive integer; got '2'"),
    ("mlp_only_layers", 0, "mlp_only_layers must be a list of layer indices; got 0"),
    ("mlp_only_layers", [0.0], "mlp_only_layers must be a list of layer indices; got [0.0]"),
])
def test_a_malformed_sparse_layout_is_refused_by_name(field, value, words, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_QWEN3_MOE, field: value}))
    with pytest.raises(InvalidArgumentError) as info:
        describe_model(str(path))
    assert str(info.value) == f"{path}: {words}"


# --------------------------------------------------------------------------- tensor parallel

TP_GEN = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
TP_HOOKS = ["token_ids", "resid_pre", "resid_mid", "attn_q", "attn_k", "attn_v", "attn_z", "attn_out", "mlp_out", "resid_post",
            "logits", "router_logits", "router_topk"]


def _tp_capture(rank: int, world: int, home: str, path: str, name: str, gathered: bool, hooks: list) -> dict:
    """On one rank: load ``path`` with transformers' own TP plan and capture ``hooks`` over a
    generate; ``gathered`` says the attention hooks are whole on every rank (``tp_layout``)."""
    import torch

    from dmi.capture import TPReplicated, load_tensor_parallel

    layout = {h: TPReplicated() for h in ("attn_q", "attn_k", "attn_v", "attn_z")} if gathered else None

    model = load_tensor_parallel(path, world, dtype=torch.float32).eval()
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store, torch.no_grad():
        with store.capture(model, hooks=hooks, model_id=name, run_id="tp2", tp_layout=layout) as cap:
            rids, seq = cap.generate(ids, attention_mask=mask, **TP_GEN)
    return dict(request_ids=list(rids), tokens=seq, ranks=(cap.tp_rank, cap.tp_size))


DENSE_THEN_SPARSE = dict(decoder_sparse_step=2)
"""Qwen2-MoE with layers 0 and 2 dense, their MLPs cut by the TP plan; no router hook."""


@pytest.mark.parametrize(("kind", "over", "gathered"), [
    ("qwen2_moe", {}, False),
    ("qwen2_moe", DENSE_THEN_SPARSE, False),
    ("qwen3_moe", {}, False),
    ("olmoe", {}, False),
    ("olmoe", {}, True),
    ("phi3", {}, False),
], ids=["qwen2_moe", "qwen2_moe-dense-then-sparse", "qwen3_moe", "olmoe", "olmoe-gathered", "phi3"])
def test_transformers_tp_capture_merges_to_the_tp1_capture(kind, over, gathered, tmp_path):
    """Two gloo ranks with transformers' TP plan: tokens equal TP=1, ``router_topk`` bit for
    bit (and ``token_ids``), float hooks merged to the reduction-order noise of the mixtral TP test (1e-4). The
    vocabulary is even: transformers 5.19 refuses to gather an lm_head of 97 rows over 2 ranks.
    OLMoE's plan gathers q/k/v and splits o_proj's input inside the module: its attention hooks
    are whole on every rank, which the session reads from the plan (``gathered=False``) or the
    caller declares (``gathered``). Qwen2-MoE's plan cuts only dense MLPs: with every layer
    sparse nothing in the MoE block is cut, with dense layers among sparse ones (no router hook)
    their MLPs are, and ``mlp_out`` is still whole on every rank. Phi-3's plan gathers its fused
    ``qkv_proj`` (q, k and v whole on every rank) and splits ``o_proj``'s and ``down_proj``'s
    inputs inside the modules."""
    import torch
    import transformers

    from ._tp_harness import RankFailed, run_ranks

    path = str(tmp_path / kind)
    tiny(kind, num_key_value_heads=2, vocab_size=98, **over).save_pretrained(path)
    routers = () if over or kind == "phi3" else ("router_logits", "router_topk")
    hooks = [h for h in TP_HOOKS if h in routers or not h.startswith("router_")]
    home = str(tmp_path / "home")
    results = run_ranks(_tp_capture, 2, tmp_path / "ranks", home, path, kind, gathered, hooks, timeout=300)
    failed = [r for r in results if isinstance(r, (RankFailed, int))]
    assert not failed, failed[0].traceback if isinstance(failed[0], RankFailed) else failed
    assert [r["ranks"] for r in results] == [(0, 2), (1, 2)]
    full = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store:
        with torch.no_grad(), store.capture(full, hooks=hooks, model_id=kind, run_id="tp1") as cap:
            rids1, tokens = cap.generate(ids, attention_mask=mask, **TP_GEN)
        assert all(torch.equal(r["tokens"], tokens) for r in results)
        for rid2, rid1 in zip(results[0]["request_ids"], rids1):
            for hook in hooks:
                tp2 = store.get_internal(kind, rid2, hook, run_id="tp2")
                tp1 = store.get_internal(kind, rid1, hook, run_id="tp1")
                if hook in ("token_ids", "router_topk"):
                    assert torch.equal(tp2, tp1)
                else:
                    torch.testing.assert_close(tp2, tp1, atol=1e-4, rtol=1e-4, msg=lambda m: f"{hook}: {m}")
        report = store.audit(kind, model=full, request_ids=results[0]["request_ids"], run_id="tp2")
        assert report.passed, [c.describe() for c in report.failures]
        assert {*routers, "attn_q", "mlp_out"} <= {c.hook for c in report.checks}


def test_the_tp_plan_styles_that_leave_a_hook_whole_on_every_rank():
    """Read from ``config.base_model_tp_plan``: a gathered column-parallel output, or a
    row-parallel input split inside the module, is whole on every rank; plain ``colwise`` /
    ``rowwise`` leave the catalogue's shards."""
    import transformers as tf

    from dmi.capture import TPReplicated
    from dmi.capture._tp_layout import whole_by_tp_plan

    assert whole_by_tp_plan(tf.OlmoeConfig.base_model_tp_plan) == {
        h: TPReplicated() for h in ("attn_q", "attn_k", "attn_v", "attn_z")}
    assert whole_by_tp_plan(tf.Phi3Config.base_model_tp_plan) == {  # its fused qkv_proj gathered: q, k and v
        h: TPReplicated() for h in ("attn_q", "attn_k", "attn_v", "attn_z", "mlp_post")}
    assert whole_by_tp_plan(tf.Qwen3MoeConfig.base_model_tp_plan) == {}
    assert whole_by_tp_plan(tf.Qwen2MoeConfig.base_model_tp_plan) == {}
    assert whole_by_tp_plan({"layers.*.mlp.down_proj": "rowwise_split_input"}) == {"mlp_post": TPReplicated()}
    assert whole_by_tp_plan(None) == {}


def test_a_tp_layout_that_is_no_mapping_is_refused_by_name():
    import torch

    from dmi.capture import ModelGeometry
    from dmi.capture._tp_layout import TPLayout

    geometry = ModelGeometry.from_config(tiny("olmoe").config, torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"^tp_layout must be a mapping of hook -> TPShard\(axis, offset, "
                                                   r"full\) or TPReplicated\(\), not str$"):
        TPLayout(geometry, 0, 2, "attn_q")
