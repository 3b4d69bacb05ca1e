"""One shape everywhere for attention patterns, from the recorded layout.

``get_internal`` returns ``[layers, heads, T, T]`` (T = prompt + decoded tokens); the lazy
view's ``shape``, ``contents().feature_shape``, ``dmi show`` and ``dmi plot`` must say the
same, and the plot must put tokens (not heads) on its token axis.
"""

from __future__ import annotations

import json

import pytest
import torch

import dmi
from dmi.cli import main

MODEL, REQUEST = "m", "a"


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    from dmi._models import load_model

    tiny = load_model("tiny-llama")  # built-in models use eager attention
    home = tmp_path_factory.mktemp("layout-home")
    enc = tiny.tokenizer(["the quick brown fox jumps"], return_tensors="pt")
    with dmi.open(home=home) as store:
        with store.capture(tiny.model, hooks="attn_pattern,resid_post", model_id=MODEL, run_id="r") as cap:
            with torch.inference_mode():
                cap.generate(enc["input_ids"], enc["attention_mask"], request_ids=[REQUEST],
                             max_new_tokens=4, do_sample=False)
        pattern = store.get_internal(MODEL, REQUEST, "attn_pattern")
        yield store, home, pattern, tiny.model.config


def test_get_internal_is_layers_heads_tokens_tokens(captured):
    store, _, pattern, config = captured
    prompt = store.get_internal(MODEL, REQUEST, "resid_post").shape[1]
    assert pattern.shape[:2] == (config.num_hidden_layers, config.num_attention_heads)
    assert pattern.shape[2] == pattern.shape[3] == prompt  # every captured token, queries and keys
    assert pattern.shape[2] > 5  # the prompt plus decoded tokens


def test_lazy_view_says_and_reads_the_same_shape(captured):
    store, _, pattern, _ = captured
    view = store.lazy(MODEL, REQUEST, "attn_pattern")
    assert view.shape == pattern.shape and view.token_axis == 2
    assert torch.equal(view[:, 1], pattern[:, 1])  # a head, not a token range
    assert torch.equal(view[0, :, 2:4], pattern[0, :, 2:4])


def test_contents_feature_shape_is_per_query_token(captured):
    store, _, pattern, _ = captured
    (summary,) = [h for h in store.contents(MODEL, REQUEST).hooks if h.hook == "attn_pattern"]
    assert summary.n_tokens == pattern.shape[2]
    assert summary.feature_shape == (pattern.shape[1], pattern.shape[3])


def test_dmi_show_says_the_same(captured, capsys):
    _, home, pattern, _ = captured
    assert main(["show", MODEL, REQUEST, "--home", str(home), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    (hook,) = [h for h in shown["hooks"] if h["hook"] == "attn_pattern"]
    assert hook["n_tokens"] == pattern.shape[2] and tuple(hook["feature_shape"]) == (pattern.shape[1], pattern.shape[3])


def test_dmi_plot_puts_tokens_on_the_token_axis(captured, capsys, tmp_path):
    _, home, pattern, _ = captured
    out = tmp_path / "p.png"
    assert main(["plot", MODEL, REQUEST, "--hook", "attn_pattern", "-o", str(out), "--home", str(home), "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert drawn["n_tokens"] == pattern.shape[2] and len(drawn["layers"]) == pattern.shape[0]
    per_token = torch.linalg.vector_norm(pattern.to(torch.float64).movedim(2, 1).flatten(2), dim=-1)
    assert drawn["mean_norm_per_layer"] == pytest.approx(per_token.mean(dim=1).tolist())


def test_records_carry_the_layout_the_catalogue_declares(captured):
    from dmi.capture import HOOKS

    store, _, _, _ = captured
    entries = store.catalog.find_records(MODEL, REQUEST)
    assert {e.meta.key.hook for e in entries} == {"attn_pattern", "resid_post"}
    for e in entries:
        spec = HOOKS[e.meta.key.hook]
        assert (e.meta.token_axis, e.meta.key_axis) == (spec.token_axis, spec.key_axis)
        assert e.meta.shape[e.meta.token_axis] == e.meta.key.n_tokens


def test_catalogue_says_what_tensor_parallelism_replicates():
    import dataclasses

    from dmi.capture import HOOKS, ModelGeometry

    g = ModelGeometry("llama", 2, 64, n_heads=8, n_kv_heads=2, head_dim=8, intermediate=128, vocab=100,
                      dtype=torch.float32)
    assert not HOOKS["attn_k"].replicated(g, 2) and not HOOKS["attn_q"].replicated(g, 4)
    assert HOOKS["attn_k"].replicated(g, 4) and HOOKS["attn_v"].replicated(g, 4)  # 2 kv heads, 4 ranks
    assert HOOKS["resid_post"].replicated(g, 4) and HOOKS["attn_q"].replicated(g, 1)
    assert not HOOKS["attn_k"].replicated(dataclasses.replace(g, n_kv_heads=4), 4)
    assert HOOKS["attn_q"].token_shape(32, g) == (4, 8)  # a rank holding half the heads
    assert HOOKS["token_ids"].token_shape(1, g) == () and HOOKS["mlp_post"].token_shape(64, g) == (64,)
    assert HOOKS["attn_pattern"].record_shape(g, 3, 5) == (8, 3, 5)
