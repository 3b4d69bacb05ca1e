"""Every architecture attaches with every hook it has; stored shapes match the catalogue."""

from __future__ import annotations

import pytest
import torch

from dmi.capture import HOOKS, ModelGeometry, attach, derive_model_id

from ._models import MemoryWriter, left_padded_batch, tiny


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gemma", "gemma2", "gemma3_text", "gpt_neox", "phi3", "gpt2", "olmo2", "olmo3", "gpt_oss", "smollm3",
                                  "granite"])
def test_all_hooks_match_catalogue_shapes(kind):
    model = tiny(kind, attn="eager")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    g = ModelGeometry.from_config(model.config, torch.float32)
    w = MemoryWriter()
    with attach(model, hooks="all", writer=w, decode_chunk_steps=1) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    got = {k.hook for k, _, _ in w.records}
    assert got == set(cap.hooks)
    moe = kind in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
    assert ("router_topk" in got) == moe and ("mlp_post" in got) == (not moe)
    for key, data, shard in w.records:
        spec = HOOKS[key.hook]
        assert shard is None
        assert (key.layer == -1) == (not spec.per_layer)
        assert data.dtype == spec.dtype(g), key.hook
        real = ids.shape[1] - pads[rids.index(key.request_id)]
        if key.hook == "attn_pattern":
            kv = real if key.step == 0 else real + key.step
            if key.step > 0 and getattr(model.config, "layer_types", None) and \
                    model.config.layer_types[key.layer] == "sliding_attention":
                kv = min(kv, model.config.sliding_window)  # a decode step sees the window's keys
            assert tuple(data.shape) == spec.record_shape(g, key.n_tokens, kv)
        else:
            assert tuple(data.shape) == spec.record_shape(g, key.n_tokens), key.hook
        if key.phase == "prefill" and key.hook != "logits":
            assert key.start_token == 0 and key.n_tokens == real


def test_model_from_a_directory_keeps_its_path_as_model_id(tmp_path):
    import transformers as tf

    tiny("llama").save_pretrained(tmp_path / "my-model")
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "my-model").eval()
    assert derive_model_id(model) == str(tmp_path / "my-model")
    w = MemoryWriter()
    ids, mask = left_padded_batch()
    with attach(model, hooks="resid_post", layers=-1, writer=w) as cap:
        cap.forward(ids, attention_mask=mask)
    assert cap.model_id == str(tmp_path / "my-model")
    assert {k.model_id for k, _, _ in w.records} == {cap.model_id}
    assert {k.layer for k, _, _ in w.records} == {model.config.num_hidden_layers - 1}


def test_config_built_models_get_a_stable_id():
    a, b = tiny("llama"), tiny("llama", seed=5)
    assert derive_model_id(a) == derive_model_id(b)  # same config, same id
    assert derive_model_id(a) != derive_model_id(tiny("qwen2"))
    assert derive_model_id(a).startswith("llama-")


def test_unsupported_model_refused_naming_the_supported_ones():
    from dmi.storage.errors import AttachError

    class Odd(torch.nn.Module):
        config = type("C", (), {"model_type": "bert"})()

    with pytest.raises(AttachError, match="llama"):
        with attach(Odd(), writer=MemoryWriter()):
            pass
