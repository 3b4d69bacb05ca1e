"""Where each hook lives in an unmodified ``transformers`` model, per architecture.

Nothing is re-implemented: every hook is a PyTorch forward (pre-)hook on a module found by
name, and an *extractor* that picks the tensor out of that module's inputs or outputs.

A :class:`Tap` is one module hook; it may serve several catalogue hooks (GPT-2's fused
``c_attn`` projection serves ``attn_q``, ``attn_k`` and ``attn_v``). Extractors return the
tensor in one of three layouts:

* ``"bt"``: ``[batch, tokens, ...]`` (most hooks)
* ``"flat"``: ``[batch * tokens, ...]`` (MoE routers flatten tokens)
* ``"pattern"``: ``[batch, heads, q_tokens, kv_tokens]``

Gemma keeps the Llama-like table (its embedding module scales by ``sqrt(hidden)`` itself, so
``embed`` is the first layer's input). Gemma 2 and 3 normalise each block's output again before
adding it to the residual, so their table takes ``attn_out``/``mlp_out`` after those norms and
``resid_mid`` before ``pre_feedforward_layernorm``; Gemma 2 soft-caps its logits after the LM head.
OLMo 2 and 3 have only those post norms (no norm before either block): ``attn_out``/``mlp_out``
after them, and ``resid_mid`` as the MLP's input.

Granite keeps Llama's modules; its multipliers (embeddings, block outputs, logits) are applied
to the taken tensors as the model applies them.

Phi-3 keeps Llama's table but cuts q/k/v out of its fused ``qkv_proj`` by size. GPT-NeoX
(Pythia) has its own table: q/k/v per head out of one fused projection, and no
``resid_mid`` under its parallel residual (:func:`hooks_ruled_out`).

MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; gpt-oss with its router at ``mlp.router``)
share the Llama-like table: ``mlp_out`` is
the whole MoE block's output (Qwen2-MoE's includes its sigmoid-gated shared expert), the
router hooks are ``mlp.gate``'s outputs, and ``mlp_post`` does not exist (no dense
``mlp.down_proj``). A hook is available only if every layer has its module, so a model with
dense layers among sparse ones (``decoder_sparse_step``, ``mlp_only_layers``) offers neither
router hooks nor ``mlp_post``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from dmi.storage.errors import AttachError

from ._hooks import ModelGeometry

__all__ = ["Tap", "Emission", "Architecture", "resolve_architecture", "SUPPORTED_MODEL_TYPES", "hooks_ruled_out"]

Extractor = Callable[[tuple, dict, Any], torch.Tensor | None]


@dataclass(slots=True)
class Emission:
    """One catalogue hook produced by a tap. ``fresh``: its extractor returns a tensor it made
    itself (a product taken on the model's thread), which the model neither holds nor writes
    over later, so it needs no protective copy."""

    hook: str
    layer: int
    extract: Extractor
    layout: str = "bt"
    fresh: bool = False


@dataclass(slots=True)
class Tap:
    """One PyTorch hook on one module: ``kind`` is ``"pre"`` (inputs) or ``"post"`` (outputs)."""

    module: nn.Module
    kind: str
    emissions: list[Emission] = field(default_factory=list)


def _arg0(name: str = "hidden_states") -> Extractor:
    def extract(args, kwargs, output):
        return args[0] if args else kwargs[name]

    return extract


def _out(index: int | None = None) -> Extractor:
    def extract(args, kwargs, output):
        if isinstance(output, torch.Tensor):
            return output if index in (None, 0) else None
        return output[0 if index is None else index]

    return extract


@dataclass(frozen=True, slots=True)
class _PerConfig:
    """An extractor that depends on the model's config (a head size, a soft cap), built at
    :meth:`Architecture.taps`."""

    build: Callable[[Any], Extractor]


def _built(extract: Extractor | _PerConfig, config) -> Extractor:
    return extract.build(config) if isinstance(extract, _PerConfig) else extract


def _final_softcapped(config) -> Extractor:
    """The LM head's output soft-capped as Gemma 2 returns its logits (``cap * tanh(x / cap)``,
    the model's own three operations in its order, so the values are bit-exact with its
    output); the output itself where the config sets no cap (Gemma 3's)."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return _out(0)

    def extract(args, kwargs, output):
        return torch.tanh(output / cap) * cap

    return extract


def _scaled_by(field: str, *, divide: bool = False) -> _PerConfig:
    """A module's first output times (or divided by) the config's ``field``, as Granite's layers
    scale each block's output before the residual add and its logits after the LM head: the
    model's own operation on the same tensor, so the values are bit-exact with what it adds."""

    def build(config) -> Extractor:
        factor, first = getattr(config, field), _out(0)

        def extract(args, kwargs, output):
            x = first(args, kwargs, output)
            return x / factor if divide else x * factor

        return extract

    return _PerConfig(build)


def _neox_qkv(part: int) -> _PerConfig:
    """q, k or v out of GPT-NeoX's fused ``query_key_value``, whose output holds each head's q, k
    and v side by side (``[..., heads, 3 * head_dim]``) — a tensor-parallel rank's block of heads too."""

    def build(config) -> Extractor:
        head_dim = ModelGeometry.from_config(config, torch.float32).head_dim

        def extract(args, kwargs, output):
            return output.unflatten(-1, (-1, 3 * head_dim))[..., part * head_dim : (part + 1) * head_dim]

        return extract

    return _PerConfig(build)


def _phi3_qkv(part: int) -> _PerConfig:
    """q, k or v out of Phi-3's fused ``qkv_proj``, whose output is every head's q, then every
    key/value head's k, then v (``[..., heads * head_dim | kv_heads * head_dim | kv_heads * head_dim]``)."""

    def build(config) -> Extractor:
        g = ModelGeometry.from_config(config, torch.float32)
        q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
        lo, hi = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))[part]

        def extract(args, kwargs, output):
            return output[..., lo:hi]

        return extract

    return _PerConfig(build)


def _no_hooks_ruled_out(config) -> frozenset[str]:
    return frozenset()


def _neox_ruled_out(config) -> frozenset[str]:
    """A parallel residual (Pythia's, transformers' default) adds attention and MLP to the same
    input: no ``resid_mid``."""
    parallel = config.get("use_parallel_residual", True) if isinstance(config, dict) else \
        getattr(config, "use_parallel_residual", True)
    return frozenset({"resid_mid"}) if parallel else frozenset()


def _split3(part: int) -> Extractor:
    def extract(args, kwargs, output):
        width = output.shape[-1] // 3
        return output[..., part * width : (part + 1) * width]

    return extract


@dataclass(frozen=True, slots=True)
class _Family:
    """Module paths of one architecture family, relative to the decoder stack / a layer."""

    base: tuple[str, ...]  # candidate paths of the decoder stack module (has layers, embed, norm)
    layers: str
    embed: str
    final_norm: str
    lm_head: str
    per_layer: dict[str, tuple[str, str, Extractor | _PerConfig, str]]  # hook -> (module path, kind, extractor, layout)
    logits: Extractor | _PerConfig = _out(0)  # the lm_head's output -> the model's logits
    embed_scaled_after: bool = False  # the model scales the embeddings: embed is layer 0's input
    ruled_out: Callable[[Any], frozenset[str]] = _no_hooks_ruled_out  # a config (object or dict) -> hooks its layers lack


_LLAMA_LIKE = _Family(
    base=("model", ""),
    layers="layers",
    embed="embed_tokens",
    final_norm="norm",
    lm_head="lm_head",
    per_layer={
        "resid_pre": ("", "pre", _arg0(), "bt"),
        "attn_q": ("self_attn.q_proj", "post", _out(), "bt"),
        "attn_k": ("self_attn.k_proj", "post", _out(), "bt"),
        "attn_v": ("self_attn.v_proj", "post", _out(), "bt"),
        "attn_z": ("self_attn.o_proj", "pre", _arg0("input"), "bt"),
        "attn_pattern": ("self_attn", "post", _out(1), "pattern"),
        "attn_out": ("self_attn", "post", _out(0), "bt"),
        "resid_mid": ("post_attention_layernorm", "pre", _arg0(), "bt"),
        "mlp_post": ("mlp.down_proj", "pre", _arg0("input"), "bt"),
        "mlp_out": ("mlp", "post", _out(0), "bt"),
        "resid_post": ("", "post", _out(0), "bt"),
        "router_logits": ("mlp.gate", "post", _out(0), "flat"),
        "router_topk": ("mlp.gate", "post", _out(2), "flat"),
    },
)

_POST_NORMS = replace(
    _LLAMA_LIKE,
    per_layer={
        **_LLAMA_LIKE.per_layer,
        "attn_out": ("post_attention_layernorm", "post", _out(0), "bt"),
        "resid_mid": ("mlp", "pre", _arg0(), "bt"),
        "mlp_out": ("post_feedforward_layernorm", "post", _out(0), "bt"),
    },
)
"""OLMo 2 and 3: each block's output is normalised before the residual add and neither block's
input is (``h = x + post_attention_layernorm(attn(x))``, ``out = h +
post_feedforward_layernorm(mlp(h))``), so ``attn_out`` and ``mlp_out`` are the post norms'
outputs and ``resid_mid`` is the MLP's input. q and k are taken before the norms OLMo applies
over the whole projection (``q_norm``, ``k_norm``), as the catalogue takes them before RoPE."""

_SANDWICH_NORMS = replace(
    _POST_NORMS,
    per_layer={**_POST_NORMS.per_layer, "resid_mid": ("pre_feedforward_layernorm", "pre", _arg0(), "bt")},
    logits=_PerConfig(_final_softcapped),
)
"""Gemma 2 and 3: OLMo 2's norms after each block, and norms before each block too, so
``resid_mid`` is the input of ``pre_feedforward_layernorm``; the logits are soft-capped after the
LM head."""

_GPT_OSS = replace(
    _LLAMA_LIKE,
    per_layer={
        **_LLAMA_LIKE.per_layer,
        "router_logits": ("mlp.router", "post", _out(0), "flat"),
        "router_topk": ("mlp.router", "post", _out(2), "flat"),
    },
)
"""gpt-oss: Llama's table, with its router at ``mlp.router`` (logits with the router's bias, and
the experts its ``topk`` chose); its MoE block returns ``(output, router scores)``, so
``mlp_out`` is the block's first output, and its experts are fused parameters (no ``mlp_post``).
``attn_pattern`` is the model's own weights: the softmax over the keys and the head's sink,
with the sink's column dropped, so a row sums to less than one."""

_GRANITE = replace(
    _LLAMA_LIKE,
    per_layer={
        **_LLAMA_LIKE.per_layer,
        "attn_out": ("self_attn", "post", _scaled_by("residual_multiplier"), "bt"),
        "mlp_out": ("mlp", "post", _scaled_by("residual_multiplier"), "bt"),
    },
    logits=_scaled_by("logits_scaling", divide=True),
    embed_scaled_after=True,
)
"""Granite: Llama's modules, with multipliers outside them: the model scales the embeddings
(``embedding_multiplier``) before layer 0, each block's output (``residual_multiplier``) before
the residual add, and divides the LM head's output by ``logits_scaling``. So ``embed`` is layer
0's input, ``attn_out``/``mlp_out`` are the scaled outputs the layer adds, and ``logits`` are
what the model returns."""

_GPT2 = _Family(
    base=("transformer", ""),
    layers="h",
    embed="wte",
    final_norm="ln_f",
    lm_head="lm_head",
    per_layer={
        "resid_pre": ("", "pre", _arg0(), "bt"),
        "attn_q": ("attn.c_attn", "post", _split3(0), "bt"),
        "attn_k": ("attn.c_attn", "post", _split3(1), "bt"),
        "attn_v": ("attn.c_attn", "post", _split3(2), "bt"),
        "attn_z": ("attn.c_proj", "pre", _arg0("input"), "bt"),
        "attn_pattern": ("attn", "post", _out(1), "pattern"),
        "attn_out": ("attn", "post", _out(0), "bt"),
        "resid_mid": ("ln_2", "pre", _arg0("input"), "bt"),
        "mlp_post": ("mlp.c_proj", "pre", _arg0("input"), "bt"),
        "mlp_out": ("mlp", "post", _out(0), "bt"),
        "resid_post": ("", "post", _out(0), "bt"),
    },
)

_PHI3 = replace(
    _LLAMA_LIKE,
    per_layer={
        **_LLAMA_LIKE.per_layer,
        "attn_q": ("self_attn.qkv_proj", "post", _phi3_qkv(0), "bt"),
        "attn_k": ("self_attn.qkv_proj", "post", _phi3_qkv(1), "bt"),
        "attn_v": ("self_attn.qkv_proj", "post", _phi3_qkv(2), "bt"),
    },
)
"""Phi-3: Llama's table but for q/k/v, which are cut by size out of one fused projection (its
MLP's fused ``gate_up_proj`` changes nothing: ``mlp_post`` is ``down_proj``'s input)."""

_GPT_NEOX = _Family(
    base=("gpt_neox", ""),
    layers="layers",
    embed="embed_in",
    final_norm="final_layer_norm",
    lm_head="lm_head",
    per_layer={
        "resid_pre": ("", "pre", _arg0(), "bt"),
        "attn_q": ("attention.query_key_value", "post", _neox_qkv(0), "bt"),
        "attn_k": ("attention.query_key_value", "post", _neox_qkv(1), "bt"),
        "attn_v": ("attention.query_key_value", "post", _neox_qkv(2), "bt"),
        "attn_z": ("attention.dense", "pre", _arg0("input"), "bt"),
        "attn_pattern": ("attention", "post", _out(1), "pattern"),
        "attn_out": ("attention", "post", _out(0), "bt"),
        "resid_mid": ("post_attention_layernorm", "pre", _arg0("input"), "bt"),
        "mlp_post": ("mlp.dense_4h_to_h", "pre", _arg0("input"), "bt"),
        "mlp_out": ("mlp", "post", _out(0), "bt"),
        "resid_post": ("", "post", _out(0), "bt"),
    },
    ruled_out=_neox_ruled_out,
)
"""GPT-NeoX (Pythia): q/k/v are cut per head out of the fused projection; with its parallel
residual (``use_parallel_residual``, Pythia's) the layer adds ``attn_out`` and ``mlp_out`` to
``resid_pre`` at once, so there is no ``resid_mid`` (``post_attention_layernorm``'s input is then
``resid_pre``, not a mid-layer residual); without it, ``resid_mid`` is that norm's input."""

_FAMILIES: dict[str, _Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "mixtral": _LLAMA_LIKE,
    "qwen2_moe": _LLAMA_LIKE,
    "qwen3_moe": _LLAMA_LIKE,
    "olmoe": _LLAMA_LIKE,
    "smollm3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _SANDWICH_NORMS,
    "gemma3_text": _SANDWICH_NORMS,
    "olmo2": _POST_NORMS,
    "olmo3": _POST_NORMS,
    "gpt_neox": _GPT_NEOX,
    "phi3": _PHI3,
    "gpt2": _GPT2,
    "gpt_oss": _GPT_OSS,
    "granite": _GRANITE,
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))


def hooks_ruled_out(model_type: str, config: dict[str, Any]) -> frozenset[str]:
    """The per-layer hooks a supported model type has modules for but its config rules out
    (GPT-NeoX's parallel residual: ``resid_mid``), read from a ``config.json``'s fields — what
    ``describe-model`` and ``estimate`` leave out without building the model."""
    family = _FAMILIES.get(model_type)
    return family.ruled_out(config) if family is not None else frozenset()


def _get(root: nn.Module, path: str) -> nn.Module | None:
    mod: Any = root
    for part in filter(None, path.split(".")):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod if isinstance(mod, nn.Module) else None


@dataclass(slots=True)
class Architecture:
    """The resolved module map of one model instance."""

    model_type: str
    model: nn.Module
    base: nn.Module
    layers: nn.ModuleList
    family: _Family

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def available(self, hook: str) -> bool:
        """Whether this model instance has the module the hook needs."""
        f = self.family
        if hook == "token_ids":
            return True
        if hook == "embed":
            return _get(self.base, f.embed) is not None
        if hook == "final_norm":
            return _get(self.base, f.final_norm) is not None
        if hook == "logits":
            return _get(self.model, f.lm_head) is not None
        if hook not in f.per_layer or hook in f.ruled_out(self.model.config):
            return False
        path = f.per_layer[hook][0]
        return all(_get(layer, path) is not None for layer in self.layers)

    def taps(self, selected: dict[str, tuple[int, ...]]) -> list[Tap]:
        """Group the selected (hook, layers) into one tap per (module, kind).

        ``token_ids`` is not a tap: the session takes it from the model's own inputs.
        """
        taps: dict[tuple[int, str], Tap] = {}

        def add(module: nn.Module, kind: str, em: Emission) -> None:
            tap = taps.setdefault((id(module), kind), Tap(module, kind))
            tap.emissions.append(em)

        f = self.family
        for hook, layers in selected.items():
            if hook == "token_ids":
                continue
            if hook == "embed" and f.embed_scaled_after:
                add(self.layers[0], "pre", Emission(hook, -1, _arg0()))
            elif hook == "embed":
                add(_get(self.base, f.embed), "post", Emission(hook, -1, _out(0)))
            elif hook == "final_norm":
                add(_get(self.base, f.final_norm), "post", Emission(hook, -1, _out(0)))
            elif hook == "logits":
                add(_get(self.model, f.lm_head), "post", Emission(hook, -1, _built(f.logits, self.model.config)))
            else:
                path, kind, extract, layout = f.per_layer[hook]
                extract = _built(extract, self.model.config)
                for layer in layers:
                    add(_get(self.layers[layer], path), kind, Emission(hook, layer, extract, layout))
        return list(taps.values())


def resolve_architecture(model: nn.Module) -> Architecture:
    """Find the decoder stack of a supported model, or raise :class:`AttachError`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = _FAMILIES.get(model_type)
    if family is None:
        raise AttachError(
            f"cannot attach to a model of type {model_type!r} ({type(model).__name__}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for path in family.base:
        base = _get(model, path)
        if base is not None and isinstance(getattr(base, family.layers, None), nn.ModuleList):
            return Architecture(model_type, model, base, getattr(base, family.layers), family)
    raise AttachError(
        f"{type(model).__name__} (model type {model_type!r}) has no decoder layer list at "
        f"{' or '.join(repr(p + '.' + family.layers if p else family.layers) for p in family.base)}"
    )
