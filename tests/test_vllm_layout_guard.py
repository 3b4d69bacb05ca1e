"""The vLLM layouts' last check: a model of a mapped type whose decoder layer lacks a module its
type's layout names (a vLLM version that moved it) is refused, naming what is missing. And which
emissions the session copies before vLLM writes over their buffers on a GPU: all of
``MUTATED_IN_PLACE``'s but the products a tap computes itself (Granite's scaled block outputs).

vLLM 0.32's own classes all have their modules, so no real engine can produce this case; the
model here is a stand-in ``nn.Module`` with a vLLM model's attributes (``model.layers``,
``config.model_type``), and vLLM is not needed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from dmi.capture._vllm_arch import resolve_vllm_architecture
from dmi.storage.errors import AttachError


def _model_with_llama_names(model_type: str) -> nn.Module:
    """One decoder layer with the Llama names (``self_attn.qkv_proj``, ``self_attn.o_proj``)."""
    layer = nn.Module()
    layer.input_layernorm, layer.post_attention_layernorm = nn.Identity(), nn.Identity()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = nn.Linear(2, 6), nn.Linear(2, 2)
    layer.mlp = nn.Identity()
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers, model.model.norm = nn.ModuleList([layer]), nn.Identity()
    model.config = SimpleNamespace(model_type=model_type, residual_multiplier=0.22)
    return model


def test_a_layer_with_its_types_modules_resolves_to_that_types_layout():
    arch = resolve_vllm_architecture(_model_with_llama_names("llama"))
    assert (arch.model_type, arch.n_layers, arch.layout.modules["attn_q"]) == ("llama", 1, "self_attn.qkv_proj")


def test_a_mapped_type_whose_layer_lacks_its_layouts_modules_is_refused_naming_them():
    """gpt-oss's layout has its attention at ``attn``: the Llama names do not satisfy it."""
    with pytest.raises(AttachError) as info:
        resolve_vllm_architecture(_model_with_llama_names("gpt_oss"))
    assert str(info.value) == (
        "vLLM model Module: decoder layer Module lacks attn.qkv_proj, attn.o_proj; DMI's vLLM capture maps "
        "gpt_oss's layers with them (a vLLM version that moved them is not mapped)")


@pytest.mark.parametrize(("model_type", "fresh"), [("llama", False), ("granite", True)])
def test_only_what_a_tap_computes_itself_is_marked_fresh(model_type, fresh):
    """On a GPU the session clones a ``MUTATED_IN_PLACE`` hook's tensor unless its emission is
    ``fresh``: Llama's block outputs are vLLM's own buffers (the next fused add + norm writes
    over them); Granite's are ``output * residual_multiplier``, made by the tap, held by no one."""
    arch = resolve_vllm_architecture(_model_with_llama_names(model_type))
    emissions = [e for tap in arch.taps({"attn_out": (0,), "mlp_out": (0,), "resid_post": (0,)}) for e in tap.emissions]
    assert {(e.hook, e.fresh) for e in emissions} == {("attn_out", fresh), ("mlp_out", fresh), ("resid_post", False)}
