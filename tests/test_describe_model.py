"""``dmi describe-model``: geometry and hooks from a config alone, across the supported families
(real ``transformers`` configs and hand-written ones in each family's naming), refusals by name,
and the command's YAML / JSON output."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
import yaml

from dmi._describe import describe_model, offered_hooks
from dmi.capture import HOOKS, ModelGeometry, resolve_architecture
from dmi.storage.errors import InvalidArgumentError
from tests._models import tiny

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gemma", "gemma2",
            "gemma3_text", "gpt_neox", "phi3", "gpt2", "olmo2", "olmo3", "gpt_oss", "smollm3", "granite"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_describe_matches_the_runtime_on_a_real_model(kind, tmp_path):
    """The config written by ``save_pretrained`` describes the same geometry the capture
    runtime reads from the live model, and exactly the hooks that model offers."""
    model = tiny(kind)
    model.config.save_pretrained(tmp_path)
    desc = describe_model(str(tmp_path))
    assert desc.geometry == ModelGeometry.from_config(model.config, torch.float32)
    arch = resolve_architecture(model)
    assert [h.name for h in desc.hooks] == [h for h in HOOKS if arch.available(h)]
    for h in desc.hooks:
        spec = HOOKS[h.name]
        assert h.shape_per_token == spec.feature_shape(desc.geometry)
        assert h.tp_axis == spec.tp_axis
        assert h.scope == ("layer" if spec.per_layer else "global")
    assert desc.source == str(tmp_path / "config.json")


def test_it_says_which_model_types_vllm_capture_maps(tmp_path):
    """``vllm_capture``: the types whose vLLM layers ``dmi.capture_vllm`` has mapped (the others
    are refused there, and captured through transformers)."""
    mapped = []
    for kind in FAMILIES:
        tiny(kind).config.save_pretrained(tmp_path / kind)
        if describe_model(str(tmp_path / kind)).as_dict()["vllm_capture"]:
            mapped.append(kind)
    assert mapped == ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gemma",
                      "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_oss", "granite"]


# Hand-written configs in each family's own naming (values of the published models).
CONFIGS = {
    "llama-3-8b": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                    "torch_dtype": "bfloat16"},
                   dict(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=14336,
                        vocab=128256, dtype=torch.bfloat16, n_experts=0, top_k=0)),
    "qwen2-7b": ({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                  "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "torch_dtype": "bfloat16"},
                 dict(n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, head_dim=128, intermediate=18944,
                      vocab=152064, dtype=torch.bfloat16, n_experts=0, top_k=0)),
    "qwen3-8b": ({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                  "dtype": "bfloat16"},
                 dict(n_layers=36, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=12288,
                      vocab=151936, dtype=torch.bfloat16, n_experts=0, top_k=0)),
    "mistral-7b": ({"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "vocab_size": 32000,
                    "torch_dtype": "bfloat16"},
                   dict(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=14336,
                        vocab=32000, dtype=torch.bfloat16, n_experts=0, top_k=0)),
    "mixtral-8x7b": ({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16"},
                     dict(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=14336,
                          vocab=32000, dtype=torch.bfloat16, n_experts=8, top_k=2)),
    "qwen1.5-moe-a2.7b": ({"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                           "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                           "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "vocab_size": 151936, "torch_dtype": "bfloat16"},
                          dict(n_layers=24, hidden=2048, n_heads=16, n_kv_heads=16, head_dim=128, intermediate=5632,
                               vocab=151936, dtype=torch.bfloat16, n_experts=60, top_k=4)),
    "qwen2-57b-a14b": ({"model_type": "qwen2_moe", "hidden_size": 3584, "intermediate_size": 18944,
                        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                        "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 2560,
                        "shared_expert_intermediate_size": 20480, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "vocab_size": 151936, "torch_dtype": "bfloat16"},
                       dict(n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, head_dim=128, intermediate=18944,
                            vocab=151936, dtype=torch.bfloat16, n_experts=64, top_k=8)),
    "gpt2": ({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
              "n_positions": 1024},
             dict(n_layers=12, hidden=768, n_heads=12, n_kv_heads=12, head_dim=64, intermediate=3072, vocab=50257,
                  dtype=torch.float32, n_experts=0, top_k=0)),
    "gpt2-inner": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 100, "vocab_size": 10},
                   dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=4, head_dim=16, intermediate=100, vocab=10,
                        dtype=torch.float32, n_experts=0, top_k=0)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_geometry_from_each_familys_config_json(name, tmp_path):
    config, expected = CONFIGS[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    desc = describe_model(str(path))
    assert desc.geometry == ModelGeometry(model_type=config["model_type"], **expected)
    names = [h.name for h in desc.hooks]
    assert ("router_logits" in names) == (expected["n_experts"] > 0) == ("mlp_post" not in names)


def test_mixtral_router_hooks_have_expert_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["mixtral-8x7b"][0]))
    hooks = {h.name: h for h in describe_model(str(tmp_path)).hooks}
    assert hooks["router_logits"].shape_per_token == (8,) and hooks["router_logits"].dtype == "bfloat16"
    assert hooks["router_topk"].shape_per_token == (2,) and hooks["router_topk"].dtype == "int64"
    assert hooks["attn_k"].shape_per_token == (8, 128) and hooks["attn_k"].tp_axis == 1
    assert hooks["attn_pattern"].record_shape == "heads x q_tokens x kv_tokens"
    assert "mlp_post" not in hooks and hooks["mlp_out"].record_shape == "tokens x 4096"


def test_dtype_override_sizes_in_that_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["llama-3-8b"][0]))
    desc = describe_model(str(tmp_path), dtype="float16")
    assert desc.geometry.dtype == torch.float16
    assert {h.dtype for h in desc.hooks} == {"float16", "int64"}


def test_offered_hooks_leave_out_routers_on_dense_models():
    dense = ModelGeometry("llama", 2, 8, 2, 2, 4, 16, 10, torch.float32)
    assert "router_logits" not in offered_hooks(dense) and "mlp_post" in offered_hooks(dense)


_LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}


@pytest.mark.parametrize(("field", "value"), [("hidden_size", "4096"), ("num_hidden_layers", 2.0),
                                              ("num_attention_heads", True), ("vocab_size", -1),
                                              ("num_key_value_heads", [2]), ("intermediate_size", 1.5),
                                              ("n_embd", "32"), ("num_experts_per_tok", 2.0)])
def test_sizes_must_be_integers(field, value, tmp_path):
    """A size the config gives as a string, float or bool is refused naming the field — not a
    raw TypeError from the shape arithmetic, nor a float layer count taken as given."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_LLAMA, field: value}))
    with pytest.raises(InvalidArgumentError) as info:
        describe_model(str(path))
    assert str(info.value) == f"{path}: {field} must be a non-negative integer; got {value!r}"


@pytest.mark.parametrize(("config", "words"), [
    ({"model_type": "t5", "is_encoder_decoder": True, "d_model": 512}, "model type 't5' is an encoder-decoder"),
    ({"model_type": "bart", "d_model": 16}, "model type 'bart' is an encoder-decoder"),
    ({"model_type": "falcon", "hidden_size": 64}, "model type 'falcon' is not supported; supported: gemma, gemma2, gemma3_text, gpt2, gpt_neox, gpt_oss, granite, llama, mistral, mixtral, olmo2, olmo3, olmoe, phi3"),
    ({"hidden_size": 64}, "model type None is not supported"),
    ({"model_type": "llama", "hidden_size": 64, "torch_dtype": "int8"}, "dtype 'int8' is not one of"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10},
     "gives no n_layers for a llama model"),
])
def test_refused_by_name(config, words, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(InvalidArgumentError) as info:
        describe_model(str(path))
    assert words in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(("content", "words"), [(None, "no model config at"), ("{not json", "is not JSON"),
                                                ("[1, 2]", "is not a model config")])
def test_unreadable_configs(content, words, tmp_path):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InvalidArgumentError, match=words):
        describe_model(str(tmp_path))


def test_no_transformers_needed(tmp_path):
    """A config.json is described with ``transformers`` unimportable (and no weights)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen3-8b"][0]))
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from dmi._describe import describe_model\n"
            f"print(describe_model({str(tmp_path)!r}).geometry.head_dim)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "128"


def _cli(*argv: str) -> tuple[int, str, str]:
    from dmi.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_yaml_and_json_say_the_same(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["mixtral-8x7b"][0]))
    rc, as_yaml, err = _cli("describe-model", str(tmp_path))
    assert (rc, err) == (0, "")
    rc, as_json, err = _cli("describe-model", str(tmp_path / "config.json"), "--json")
    assert (rc, err) == (0, "")
    doc = json.loads(as_json)
    assert yaml.safe_load(as_yaml) == doc
    assert doc["geometry"] == {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                               "intermediate": 14336, "experts": 8, "experts_per_token": 2, "vocab": 32000,
                               "dtype": "bfloat16"}
    assert doc["hooks"][0] == {"name": "token_ids", "scope": "global", "shape_per_token": [], "record_shape": "tokens",
                               "dtype": "int64", "tp_axis": None, "doc": "input token ids"}
    assert [h["name"] for h in doc["hooks"]] == [h for h in HOOKS if h != "mlp_post"]


def test_cli_builtin_model_and_refusal(tmp_path):
    rc, out, _ = _cli("describe-model", "tiny-llama", "--json")
    assert rc == 0 and json.loads(out)["geometry"]["vocab"] == 259
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    rc, out, err = _cli("describe-model", str(tmp_path))
    assert rc == 2 and out == "" and "encoder-decoder" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, "hidden_size": "4096"}))
    rc, out, err = _cli("describe-model", str(tmp_path))
    assert (rc, out) == (2, "") and err == f"dmi: error: {tmp_path / 'config.json'}: hidden_size must be a " \
                                          "non-negative integer; got '4096'\n"


def test_cli_yaml_writes_hooks_as_blocks_and_shapes_on_one_line():
    """Each hook is a block entry (``- name: ...`` then one field a line), as docs/plans.md shows;
    a list of plain values (a shape) stays on one line."""
    rc, out, err = _cli("describe-model", "tiny-llama")
    assert (rc, err) == (0, "")
    assert "\nhooks:\n- name: token_ids\n  scope: global\n  shape_per_token: []\n" in out
    assert "\n- name: embed\n  scope: global\n  shape_per_token: [64]\n  record_shape: tokens x 64\n" in out


@pytest.mark.parametrize("parallel", [True, False])
def test_gpt_neox_offers_resid_mid_only_without_its_parallel_residual(parallel, tmp_path):
    """Described from its config.json alone, as the runtime finds it on the built model."""
    model = tiny("gpt_neox", use_parallel_residual=parallel)
    model.config.save_pretrained(tmp_path)
    offered = [h.name for h in describe_model(str(tmp_path)).hooks]
    assert ("resid_mid" in offered) == (not parallel)
    assert offered == [h for h in HOOKS if resolve_architecture(model).available(h)]
