"""``dmi describe-model``: a model's geometry and every hook DMI offers on it, from its config alone.

No weights are loaded and ``transformers`` is not needed: ``config.json`` is read as JSON,
for the families capture supports (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
GPT-2 and its ``n_embd``/``n_layer``/``n_head``/``n_inner`` naming). The geometry is
``dmi.capture.ModelGeometry.from_config`` — the same reading of the config the capture
runtime does — and every shape, dtype, scope and tensor-parallel axis comes from the hook
catalogue (``dmi.capture.HOOKS``). Encoder-decoder and unknown architectures are refused
by name. A built-in model name (``tiny-llama``) is described from its built-in config; the
real model ``smollm2`` from its cache's ``config.json`` when it was converted, else from its
package's GGUF header (read by ``transformers``, no tensor loaded).

Reference: ``docs/plans.md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from dmi.storage.errors import InvalidArgumentError, ModelError

__all__ = ["HookDescription", "ModelDescription", "read_model_config", "model_geometry", "offered_hooks",
           "sparse_layer_count", "describe_model"]

_ENCODER_DECODER = ("t5", "mt5", "umt5", "longt5", "bart", "mbart", "marian", "pegasus", "pegasus_x", "led",
                    "bigbird_pegasus", "blenderbot", "blenderbot-small", "fsmt", "prophetnet", "switch_transformers",
                    "whisper", "encoder-decoder", "speech-encoder-decoder", "vision-encoder-decoder", "seamless_m4t")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class HookDescription:
    """One catalogue hook as it exists on one model."""

    name: str
    scope: str  # "layer" (one record per layer) or "global"
    shape_per_token: tuple[int, ...]  # attn_pattern: (heads,) per (query, key) pair
    record_shape: str  # the stored record's shape, symbolically
    dtype: str
    tp_axis: int | None  # axis of the stored record split across tensor-parallel ranks
    doc: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scope": self.scope, "shape_per_token": list(self.shape_per_token),
                "record_shape": self.record_shape, "dtype": self.dtype, "tp_axis": self.tp_axis, "doc": self.doc}


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What ``dmi describe-model`` prints."""

    source: str
    model_type: str
    geometry: Any  # dmi.capture.ModelGeometry
    hooks: tuple[HookDescription, ...]
    vllm_capture: bool  # whether dmi.capture_vllm has mapped this model type's vLLM layers

    def as_dict(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "source": self.source,
            "model_type": self.model_type,
            "vllm_capture": self.vllm_capture,
            "geometry": {"layers": g.n_layers, "hidden": g.hidden, "heads": g.n_heads, "kv_heads": g.n_kv_heads,
                         "head_dim": g.head_dim, "intermediate": g.intermediate, "experts": g.n_experts,
                         "experts_per_token": g.top_k, "vocab": g.vocab, "dtype": _dtype_name(g.dtype)},
            "hooks": [h.as_dict() for h in self.hooks],
        }


def read_model_config(source: str, *, home: str | os.PathLike[str] | None = None) -> tuple[str, dict[str, Any]]:
    """``(where, config)`` for a model directory, a ``config.json`` path, a built-in model name
    or a real model's name, cached in the DMI home ``home`` (default: ``$DMI_HOME``, else
    ``~/.local/share/dmi``) or read from its package (``ModelNotInstalledError`` with the
    install hint when it is neither, ``ModelError`` when the package's file does not read)."""
    from dmi._models import BUILTIN_MODELS
    from dmi._real_model import REAL_MODELS

    if source in BUILTIN_MODELS:
        return source, _builtin_config(BUILTIN_MODELS[source])
    if source in REAL_MODELS:
        return _real_config(REAL_MODELS[source], home)
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except FileNotFoundError as exc:
        raise InvalidArgumentError(
            f"no model config at {path}: give a model directory (with config.json), a config.json file, "
            f"or a model name ({', '.join([*BUILTIN_MODELS, *REAL_MODELS])})") from exc
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{path} is not a model config (a JSON object)")
    return path, config


def _real_config(spec: Any, home: str | os.PathLike[str] | None) -> tuple[str, dict[str, Any]]:
    """A real model's config: its cache's, else its GGUF file's header, as float32 (what the
    conversion stores)."""
    from dmi._real_model import cache_dir, locate_gguf

    cached = cache_dir(spec, home) / "config.json"
    if cached.is_file():
        return read_model_config(str(cached))
    from transformers import AutoConfig

    gguf = locate_gguf(spec)
    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    except Exception as exc:  # noqa: BLE001 - whatever transformers' GGUF reader raises, the header did not read
        raise ModelError(f"transformers could not read the header of {gguf}: {type(exc).__name__}: {exc}") from exc
    return str(gguf), {**config, "torch_dtype": "float32"}


def _builtin_config(spec: Any) -> dict[str, Any]:
    from dmi._models import byte_tokenizer

    return {"model_type": "llama", "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads, "vocab_size": len(byte_tokenizer()),
            "torch_dtype": spec.dtype}


def model_geometry(config: dict[str, Any], *, where: str = "the config", dtype: str | None = None) -> Any:
    """The capture runtime's ``ModelGeometry`` for a config dict (``dtype`` overrides the
    config's ``torch_dtype``; float32 when neither says)."""
    import torch

    from dmi.capture import SUPPORTED_MODEL_TYPES, ModelGeometry

    model_type = config.get("model_type")
    if config.get("is_encoder_decoder") or model_type in _ENCODER_DECODER:
        raise InvalidArgumentError(
            f"{where}: model type {model_type!r} is an encoder-decoder; DMI captures decoder-only models "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgumentError(
            f"{where}: model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    name = dtype or config.get("torch_dtype") or config.get("dtype") or "float32"
    if name not in _DTYPES:
        raise InvalidArgumentError(f"{where}: dtype {name!r} is not one of {', '.join(_DTYPES)}")
    try:
        geometry = ModelGeometry.from_config(SimpleNamespace(**config), getattr(torch, name))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from exc
    missing = [f for f in ("n_layers", "hidden", "n_heads", "vocab") if getattr(geometry, f) <= 0]
    if missing:
        raise InvalidArgumentError(f"{where}: the config gives no {', '.join(missing)} for a {model_type} model")
    return geometry


def offered_hooks(geometry: Any, config: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The catalogue hooks a model of this geometry has. The router hooks need a router on
    every layer and ``mlp_post`` a dense MLP on every layer (the experts share no down
    projection to hook), so a model mixing dense and sparse layers (Qwen2-MoE's and Qwen3-MoE's
    ``mlp_only_layers`` or ``decoder_sparse_step``, read from ``config``) has neither; without
    ``config`` every layer of an MoE model is taken as sparse. A hook the config rules out
    (GPT-NeoX's ``resid_mid`` under its parallel residual) is left out too. The test over real
    models of every family checks this agrees with what the runtime finds on the modules."""
    from dmi.capture import HOOKS, hooks_ruled_out

    sparse = sparse_layer_count(geometry, config or {})
    routers, dense_mlp = sparse == geometry.n_layers > 0, sparse == 0
    ruled_out = hooks_ruled_out(geometry.model_type, config or {})
    return tuple(name for name, spec in HOOKS.items()
                 if (routers or not spec.moe_only) and (dense_mlp or name != "mlp_post") and name not in ruled_out)


def sparse_layer_count(geometry: Any, config: dict[str, Any]) -> int:
    """How many layers have a sparse MoE block, as ``transformers`` builds them: with experts,
    every ``decoder_sparse_step``-th layer (counting from 1) not listed in ``mlp_only_layers``
    (both default to every layer). A field of the wrong type is refused naming it."""
    if geometry.n_experts <= 0:
        return 0
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise InvalidArgumentError(f"decoder_sparse_step must be a positive integer; got {step!r}")
    dense = config.get("mlp_only_layers")
    dense = [] if dense is None else dense
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise InvalidArgumentError(f"mlp_only_layers must be a list of layer indices; got {dense!r}")
    return sum(1 for i in range(geometry.n_layers) if i not in dense and (i + 1) % step == 0)


def describe_model(source: str, *, dtype: str | None = None,
                   home: str | os.PathLike[str] | None = None) -> ModelDescription:
    """Describe the model at ``source`` (directory, config.json, built-in or real model name;
    ``home``: see :func:`read_model_config`)."""
    from dmi.capture import HOOKS, VLLM_MODEL_TYPES

    where, config = read_model_config(source, home=home)
    g = model_geometry(config, where=where, dtype=dtype)
    try:
        offered = offered_hooks(g, config)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from exc
    hooks = []
    for name in offered:
        spec = HOOKS[name]
        shape = spec.feature_shape(g)
        record = "heads x q_tokens x kv_tokens" if name == "attn_pattern" else " x ".join(
            ["tokens", *map(str, shape)])
        hooks.append(HookDescription(name, "layer" if spec.per_layer else "global", tuple(shape), record,
                                     _dtype_name(spec.dtype(g)), spec.tp_axis, spec.doc))
    return ModelDescription(where, g.model_type, g, tuple(hooks), g.model_type in VLLM_MODEL_TYPES)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
