"""TransformerLens hook names as aliases: resolved by the catalogue to (hook, layer), accepted
in capture selection and in reads (Python and CLI), refused with their name when DMI has no
such hook."""

from __future__ import annotations

import json
import re

import pytest
import torch

import dmi
from dmi.capture import ALIASES, HOOKS, attach, resolve_alias
from dmi.cli import main
from dmi.storage.errors import AttentionImplementationError, HookSelectionError, InvalidArgumentError

from ._models import MemoryWriter, left_padded_batch, tiny

EXPECTED = {
    "hook_embed": "embed",
    "blocks.{layer}.hook_resid_pre": "resid_pre",
    "blocks.{layer}.attn.hook_q": "attn_q",
    "blocks.{layer}.attn.hook_k": "attn_k",
    "blocks.{layer}.attn.hook_v": "attn_v",
    "blocks.{layer}.attn.hook_z": "attn_z",
    "blocks.{layer}.attn.hook_pattern": "attn_pattern",
    "blocks.{layer}.hook_attn_out": "attn_out",
    "blocks.{layer}.hook_resid_mid": "resid_mid",
    "blocks.{layer}.mlp.hook_post": "mlp_post",
    "blocks.{layer}.hook_mlp_out": "mlp_out",
    "blocks.{layer}.hook_resid_post": "resid_post",
    "blocks.{layer}.mlp.hook_expert_indices": "router_topk",
    "ln_final.hook_normalized": "final_norm",
}


def test_alias_table_maps_each_transformerlens_name_to_its_hook_and_layer():
    assert dict(ALIASES) == EXPECTED
    for pattern, hook in ALIASES.items():
        alias = resolve_alias(pattern.format(layer=7))
        assert (alias.hook, alias.layer) == (hook, 7 if HOOKS[hook].per_layer else -1)
    assert resolve_alias("resid_post") is None and resolve_alias("attn") is None


@pytest.mark.parametrize("name, says", [
    ("blocks.2.ln1.hook_normalized", "DMI has no hook for TransformerLens's 'blocks.2.ln1.hook_normalized'"),
    ("blocks.0.attn.hook_attn_scores", "softmaxed pattern only"),
    ("hook_pos_embed", "DMI has no hook for TransformerLens's 'hook_pos_embed'"),
    ("blocks.1.hook_frobnicate", "unknown TransformerLens hook name 'blocks.1.hook_frobnicate'"),
    ("blocks.hook_resid_post", "unknown TransformerLens hook name 'blocks.hook_resid_post'"),
    ("blocks.1.hook_embed", "unknown TransformerLens hook name 'blocks.1.hook_embed'"),  # embed is global
    ("hook_resid_post", "unknown TransformerLens hook name 'hook_resid_post'"),  # needs its block
])
def test_a_name_dmi_does_not_capture_is_an_error_naming_it(name, says):
    with pytest.raises(HookSelectionError, match=_escape(says)):
        resolve_alias(name)


def _escape(text: str) -> str:
    return re.escape(text)


def test_capture_by_aliases_selects_each_hook_at_its_layer_with_the_same_values():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    by_alias, by_name = MemoryWriter(), MemoryWriter()
    hooks = "hook_embed blocks.0.attn.hook_q blocks.2.hook_resid_post blocks.1.mlp.hook_post ln_final.hook_normalized"
    with attach(model, hooks=hooks, writer=by_alias) as cap:
        assert cap.hooks == {"embed": (-1,), "attn_q": (0,), "mlp_post": (1,), "resid_post": (2,), "final_norm": (-1,)}
        cap.forward(ids, attention_mask=mask, request_ids=["a", "b", "c"])
    with attach(model, hooks="embed attn_q mlp_post resid_post final_norm", writer=by_name) as cap:
        cap.forward(ids, attention_mask=mask, request_ids=["a", "b", "c"])
    wanted = {(k.request_id, k.hook, k.layer): d for k, d, _ in by_name.records
              if (k.hook, k.layer) in {("embed", -1), ("attn_q", 0), ("mlp_post", 1), ("resid_post", 2), ("final_norm", -1)}}
    got = {(k.request_id, k.hook, k.layer): d for k, d, _ in by_alias.records}
    assert got.keys() == wanted.keys() and len(got) == 15
    for key, data in got.items():
        assert torch.equal(data, wanted[key]), key


def test_aliases_and_names_combine_layers_apply_to_names_only():
    model = tiny("llama")
    with attach(model, hooks="resid_pre, blocks.2.hook_resid_pre, blocks.1.hook_resid_post", layers=[0],
                writer=MemoryWriter()) as cap:
        assert cap.hooks == {"resid_pre": (0, 2), "resid_post": (1,)}


@pytest.mark.parametrize("hooks, layers, error, says", [
    ("blocks.9.hook_resid_post", None, HookSelectionError, "blocks.9.hook_resid_post (DMI hook 'resid_post', layer 9)"),
    ("blocks.0.mlp.hook_expert_indices", None, HookSelectionError, "does not exist on model type 'llama'"),
    ("blocks.0.attn.hook_pattern", None, AttentionImplementationError, "blocks.0.attn.hook_pattern (DMI hook 'attn_pattern', layer 0): 'attn_pattern' needs eager attention"),
    ("blocks.0.ln2.hook_scale", None, HookSelectionError, "blocks.0.ln2.hook_scale"),
    ("blocks.1.hook_resid_post", [0], HookSelectionError, "blocks.1.hook_resid_post name their own layer"),
])
def test_capture_refuses_an_alias_it_cannot_honour_before_touching_the_model(hooks, layers, error, says):
    model = tiny("llama")
    with pytest.raises(error, match=_escape(says)):
        with attach(model, hooks=hooks, layers=layers, writer=MemoryWriter()):
            pass
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    home = tmp_path_factory.mktemp("aliases")
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store:
        with store.capture(model, hooks="resid_post final_norm", model_id="m") as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, request_ids=["r0", "r1", "r2"])
    return home


def test_reads_accept_aliases(captured):
    with dmi.open(home=captured) as store:
        every = store.get_internal("m", "r1", "resid_post")
        assert torch.equal(store.get_internal("m", "r1", "blocks.2.hook_resid_post"), every[2:3])
        assert torch.equal(store.get_internal("m", "r1", "ln_final.hook_normalized"),
                           store.get_internal("m", "r1", "final_norm"))
        view = store.lazy("m", "r1", "blocks.1.hook_resid_post")
        assert (view.hook, view.layers) == ("resid_post", (1,))
        assert torch.equal(view[0], every[1])
        with pytest.raises(InvalidArgumentError, match="names its layer"):
            store.get_internal("m", "r1", "blocks.1.hook_resid_post", layers=[0])
        with pytest.raises(HookSelectionError, match=_escape("'blocks.1.ln1.hook_scale'")):
            store.get_internal("m", "r1", "blocks.1.ln1.hook_scale")


def test_cli_get_and_plot_accept_aliases(captured, tmp_path, capsys):
    with dmi.open(home=captured) as store:
        want = store.get_internal("m", "r0", "resid_post", layers=[1])
    out = tmp_path / "x.pt"
    assert main(["get", "m", "r0", "blocks.1.hook_resid_post", "-o", str(out), "-q", "--home", str(captured)]) == 0
    assert torch.equal(torch.load(out), want)
    png = tmp_path / "p.png"
    assert main(["plot", "m", "r0", "--hook", "blocks.1.hook_resid_post",
                 "-o", str(png), "--json", "--home", str(captured)]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == [1]
    assert main(["get", "m", "r0", "blocks.1.ln1.hook_scale", "-o", str(out), "--home", str(captured)]) == 2
    assert "blocks.1.ln1.hook_scale" in capsys.readouterr().err
