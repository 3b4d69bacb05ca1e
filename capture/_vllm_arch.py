"""Where each hook lives in a model vLLM built: the Llama family's module layout, Gemma's,
Granite's, gpt-oss', GPT-2's.

vLLM runs its own model classes, not ``transformers``': tokens of every scheduled request are
flattened into one ``[num_tokens, ...]`` axis, q/k/v come out of one fused projection, and a
decoder layer returns ``(hidden_states, residual)`` with the residual added inside the *next*
layer's input norm (a fused, in-place add + RMSNorm). The catalogue's hooks map onto it so that
every value is one vLLM computes anyway — nothing is added or recomputed on the model's thread:

==============  ===========================================================================
hook            taken from (layer ``L`` of ``n``)
==============  ===========================================================================
``embed``       ``embed_tokens`` output (Gemma: layer 0's ``hidden_states`` input, see below)
``resid_pre``   ``L = 0``: the layer's ``hidden_states`` input (the embeddings);
                ``L > 0``: the residual ``input_layernorm`` returns (``h + residual``)
``attn_q/k/v``  ``qkv_proj`` output, split by the layer's own q/kv sizes (before RoPE and any
                q/k norm, as in the catalogue)
``attn_z``      ``o_proj`` input
``attn_out``    ``o_proj`` output
``resid_mid``   the residual ``post_attention_layernorm`` returns
``mlp_post``    ``down_proj`` input
``mlp_out``     the MLP block's output (the MoE block's, on a mixture-of-experts model: on
                Qwen2-MoE with its sigmoid-gated shared expert, which vLLM's fused experts run)
``router_logits``  the MoE gate's output
``router_topk``    the ``top_k`` experts with the largest router logits (one ``topk`` on the
                model's thread: vLLM's fused kernel keeps its choice to itself; offered only
                where that choice is the plain top-k — softmax or sigmoid scoring, no grouped
                routing, no score-correction bias, no custom routing function)
``resid_post``  the residual the next layer's ``input_layernorm`` returns (the final ``norm``'s
                for the last layer): exactly ``hidden_states + residual`` as vLLM sums it
``final_norm``  the final ``norm`` output
``logits``      ``logits_processor`` output: one row per scheduled request, at its step's last
                token (the only positions vLLM materialises)
==============  ===========================================================================

Gemma, Gemma 2 and Gemma 3 (text) multiply ``embed_tokens``' output by ``sqrt(hidden)`` in the
model's forward, so ``embed`` is taken where that product enters layer 0. Gemma 2 and 3 also
normalise each block's output before the residual add (``post_attention_layernorm``,
``post_feedforward_layernorm``) and normalise the MLP's input with ``pre_feedforward_layernorm``,
which does the fused add: ``attn_out`` and ``mlp_out`` are the post norms' outputs (what the
layer adds, as on the Hugging Face path) and ``resid_mid`` the residual
``pre_feedforward_layernorm`` returns. Their final soft cap is inside ``logits_processor``.
Phi-3 is vLLM's Llama class. Granite scales ``embed_tokens``' output (``embedding_multiplier``,
in place) before layer 0, and its layers add each block's output times ``residual_multiplier``
themselves and return the sum, with no residual handed to the next norm: ``resid_pre`` and
``resid_post`` are the layer's input and output, ``resid_mid`` ``post_attention_layernorm``'s
input, and ``attn_out``/``mlp_out`` the blocks' outputs times that multiplier (the one product
taken on the model's thread, the op the layer itself runs). Its ``logits_scaling`` is inside
``logits_processor``. gpt-oss is the Llama layout under other names (``attn``, ``embedding``,
``hidden_states`` first among a layer's arguments) with its router at ``mlp.router``. GPT-2's
blocks (``transformer.h``) add their own residuals and return the sum, as Granite's do, unscaled:
``resid_pre``/``resid_post`` are a block's input and output, ``resid_mid`` ``ln_2``'s input,
``attn_q/k/v`` the thirds of ``attn.c_attn``'s output, ``attn_z`` and ``mlp_post`` the inputs of
``attn.c_proj`` and ``mlp.c_proj``, ``attn_out`` and ``mlp_out`` the blocks' outputs (biases
included), ``embed`` the token embeddings ``wte`` returns (before the position embeddings are
added, as on the Hugging Face path) and ``final_norm`` ``ln_f``'s output.

A per-layer hook is offered only where every decoder layer has its module (as on the Hugging
Face path): a model mixing dense and sparse layers offers neither ``mlp_post`` nor the router hooks.
``attn_pattern`` does not exist here (vLLM's attention kernels never materialise weights).
Several values are buffers vLLM later overwrites in place: the residual (the next fused
add + RMSNorm adds into it; layer 0's residual is the embeddings themselves), the attention
and MLP blocks' outputs (that same fused op may write the normalised sum over its input,
``fused_add_rms_norm.maybe_inplace``), and the q and k slices of ``qkv_proj``'s output (the
rotary embedding's CUDA kernel rotates them in place). :data:`MUTATED_IN_PLACE` names them so
the session copies them before that happens on an asynchronous device (the step's
``input_ids``, a persistent buffer refilled every step, is copied the same way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from dmi.storage.errors import AttachError
from dmi.storage.records import GLOBAL_LAYER

from ._arch import Emission, Tap

__all__ = ["VLLMArchitecture", "resolve_vllm_architecture", "MUTATED_IN_PLACE", "STEP_HOOKS", "VLLM_MODEL_TYPES"]

MUTATED_IN_PLACE = frozenset({"embed", "resid_pre", "resid_mid", "resid_post", "attn_q", "attn_k", "attn_out",
                              "mlp_out"})
"""Hooks whose tensor vLLM overwrites in place later in the step: the residual and the blocks'
outputs (the next fused add + RMSNorm; the embeddings are layer 0's residual), q and k (the
rotary embedding's in-place kernel). An emission marked ``fresh`` is not copied whatever its
hook: Granite's ``attn_out``/``mlp_out`` are products the tap computes itself."""

STEP_HOOKS = frozenset({"token_ids", "logits"})
"""Hooks the session emits itself (from the step's ``input_ids`` and the logits processor)."""

_LAYER_MODULES = {
    "attn_q": "self_attn.qkv_proj",
    "attn_k": "self_attn.qkv_proj",
    "attn_v": "self_attn.qkv_proj",
    "attn_z": "self_attn.o_proj",
    "attn_out": "self_attn.o_proj",
    "resid_mid": "post_attention_layernorm",
    "mlp_post": "mlp.down_proj",
    "mlp_out": "mlp",
    "router_logits": "mlp.gate",
    "router_topk": "mlp.gate",
    "resid_pre": "input_layernorm",
    "resid_post": "input_layernorm",
}


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one model type's vLLM layers compute:

    * ``modules``: the module of each per-layer hook;
    * ``embed_scaled_after``: the model scales the embedding's output before layer 0, so
      ``embed`` is layer 0's input (Gemma, Granite);
    * ``residual_in_norms``: a layer returns ``(hidden_states, residual)`` for the next layer's
      fused add + norm (Llama), not the sum itself (Granite);
    * ``block_scale``: the config attribute by which a layer multiplies each block's output
      before adding it (Granite's ``residual_multiplier``);
    * ``embedding``: the embedding module's name on the decoder stack;
    * ``hidden_index``: where ``hidden_states`` is among a layer's positional arguments (Llama:
      ``(positions, hidden_states, residual)``; gpt-oss: ``(hidden_states, positions, residual)``);
    * ``stack``, ``layer_list``, ``final_norm``: the names of the decoder stack on the model, of
      the layer list on the stack and of the final norm on it (Llama: ``model``, ``layers``,
      ``norm``; GPT-2: ``transformer``, ``h``, ``ln_f``);
    * ``norms``: a layer's two norms, before attention and before the MLP.
    """

    modules: Mapping[str, str]
    embed_scaled_after: bool = False
    residual_in_norms: bool = True
    block_scale: str | None = None
    embedding: str = "embed_tokens"
    hidden_index: int = 1
    stack: str = "model"
    layer_list: str = "layers"
    final_norm: str = "norm"
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")


_LLAMA = _Layout(_LAYER_MODULES)
_GEMMA = replace(_LLAMA, embed_scaled_after=True)
_GEMMA2 = replace(_GEMMA, modules={**_LAYER_MODULES, "attn_out": "post_attention_layernorm",
                                   "resid_mid": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"})
_GRANITE = replace(_GEMMA, residual_in_norms=False, block_scale="residual_multiplier")
_GPT_OSS = _Layout({**{h: p.replace("self_attn", "attn") for h, p in _LAYER_MODULES.items() if h != "mlp_post"},
                    "router_logits": "mlp.router", "router_topk": "mlp.router"}, embedding="embedding", hidden_index=0)

_GPT2 = _Layout(
    {"attn_q": "attn.c_attn", "attn_k": "attn.c_attn", "attn_v": "attn.c_attn", "attn_z": "attn.c_proj",
     "attn_out": "attn", "resid_mid": "ln_2", "mlp_post": "mlp.c_proj", "mlp_out": "mlp", "resid_pre": "ln_1",
     "resid_post": "ln_1"},
    residual_in_norms=False, embedding="wte", hidden_index=0, stack="transformer", layer_list="h",
    final_norm="ln_f", norms=("ln_1", "ln_2"))

_LAYOUTS = {
    "gemma": _GEMMA, "gemma2": _GEMMA2, "gemma3_text": _GEMMA2, "gpt2": _GPT2, "gpt_oss": _GPT_OSS,
    "granite": _GRANITE, "llama": _LLAMA, "mistral": _LLAMA, "mixtral": _LLAMA, "olmoe": _LLAMA, "phi3": _LLAMA,
    "qwen2": _LLAMA, "qwen2_moe": _LLAMA, "qwen3": _LLAMA, "qwen3_moe": _LLAMA,
}

VLLM_MODEL_TYPES = tuple(_LAYOUTS)
"""The model types whose vLLM layers DMI has mapped (see the module docstring). Others may have
the same module names and compute otherwise — GPT-NeoX adds both blocks to one residual in
parallel; vLLM 0.32 runs it, and OLMo 2/3, through its Transformers backend, a layout of its own
— so hooks found by name could store other values than the catalogue's: they are refused by
type, not mapped by name."""


def _hidden_arg(index: int):
    """The layer's ``hidden_states`` argument, the ``index``-th positional one or by name."""
    def extract(args, kwargs, output):
        return args[index] if len(args) > index else kwargs["hidden_states"]

    return extract


def _residual_out(args, kwargs, output):
    return output[1] if isinstance(output, tuple) else None


def _first_out(args, kwargs, output):
    return output[0] if isinstance(output, tuple) else output


def _arg0(args, kwargs, output):
    return args[0] if args else next(iter(kwargs.values()))


def _qkv_part(attn, qkv, part: int):
    """The q, k or v columns of the fused projection's output: by the attention's own sizes, or
    (GPT-2's attention keeps none) by the projection's heads on this rank."""
    q = getattr(attn, "q_size", None) or qkv.num_heads * qkv.head_size
    kv = getattr(attn, "kv_size", None) or qkv.num_kv_heads * qkv.head_size
    lo, hi = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))[part]

    def extract(args, kwargs, output):
        out = output[0] if isinstance(output, tuple) else output
        return out[:, lo:hi]

    return extract


def _scaled(extract, factor: float):
    """``extract``'s tensor times ``factor``: the product the layer computes before its add."""
    def scaled(args, kwargs, output):
        return extract(args, kwargs, output) * factor

    return scaled


def _router_topk(k: int):
    def extract(args, kwargs, output):
        logits = output[0] if isinstance(output, tuple) else output
        return torch.topk(logits, k, dim=-1).indices

    return extract


def _moe_block(layer: nn.Module) -> str | None:
    """Where a decoder layer keeps its mixture of experts, the block with ``experts`` (Mixtral:
    ``block_sparse_moe``; its router is ``gate``, gpt-oss's ``router``)."""
    for name in ("block_sparse_moe", "mlp"):
        block = getattr(layer, name, None)
        if isinstance(getattr(block, "experts", None), nn.Module):
            return name
    return None


def _plain_topk(layer: nn.Module) -> int | None:
    """``top_k`` when the layer's experts are chosen as the ``top_k`` largest router logits."""
    name = _moe_block(layer)
    router = getattr(getattr(getattr(layer, name, None), "experts", None), "router", None) if name else None
    if router is None or getattr(router, "use_grouped_topk", True) or router.custom_routing_function is not None:
        return None
    if router.e_score_correction_bias is not None or router.scoring_func not in ("softmax", "sigmoid"):
        return None
    return int(router.top_k)


def _path(layer: nn.Module, hook: str, layout: _Layout) -> str | None:
    """The module path of a per-layer hook on ``layer``, with the MoE block's name resolved."""
    path = layout.modules.get(hook)
    moe = _moe_block(layer)
    if path is None or (moe is None and hook.startswith("router_")):
        return None
    return path.replace("mlp", moe, 1) if moe is not None and path.split(".")[0] == "mlp" else path


def _layer_has(layer: nn.Module, hook: str, layout: _Layout) -> bool:
    """Whether ``layer`` has the module of a per-layer hook (and, for ``router_topk``, plain top-k routing)."""
    path = _path(layer, hook, layout)
    if hook == "router_topk" and _plain_topk(layer) is None:
        return False
    return path is not None and _get(layer, path) is not None


def _get(root: nn.Module, path: str) -> nn.Module | None:
    mod = root
    for part in path.split("."):
        mod = getattr(mod, part, None)
        if not isinstance(mod, nn.Module):
            return None
    return mod


@dataclass(slots=True)
class VLLMArchitecture:
    """A vLLM model's decoder stack and where each hook is tapped (see the module docstring)."""

    model_type: str
    model: nn.Module  # the *ForCausalLM vLLM runs
    base: nn.Module  # its decoder stack (the embedding, layers, norm)
    layers: nn.ModuleList
    layout: _Layout

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def available(self, hook: str) -> bool:
        """Whether the hook can be tapped on every decoder layer: a model mixing dense and sparse
        layers (Qwen2-MoE's ``decoder_sparse_step``, ``mlp_only_layers``) offers neither
        ``mlp_post`` nor the router hooks, as on the Hugging Face path."""
        if hook in STEP_HOOKS:
            return hook != "logits" or isinstance(getattr(self.model, "logits_processor", None), nn.Module)
        if hook in ("embed", "final_norm"):
            return _get(self.base, self.layout.embedding if hook == "embed" else self.layout.final_norm) is not None
        return all(_layer_has(layer, hook, self.layout) for layer in self.layers)

    def taps(self, selected: dict[str, tuple[int, ...]]) -> list[Tap]:
        """One :class:`Tap` per (module, pre/post) that serves the selected hooks."""
        taps: dict[tuple[int, str], Tap] = {}

        def add(module: nn.Module | None, kind: str, hook: str, layer: int, extract, fresh: bool = False) -> None:
            if module is None:
                raise AttachError(f"vLLM model {type(self.model).__name__} has no module for {hook} (layer {layer})")
            tap = taps.setdefault((id(module), kind), Tap(module, kind))
            tap.emissions.append(Emission(hook, layer, extract, "flat", fresh))

        n = self.n_layers
        for hook, layers in selected.items():
            if hook in STEP_HOOKS:
                continue
            if hook == "embed" and self.layout.embed_scaled_after:
                add(self.layers[0], "pre", hook, GLOBAL_LAYER, _hidden_arg(self.layout.hidden_index))
            elif hook == "embed":
                add(_get(self.base, self.layout.embedding), "post", hook, GLOBAL_LAYER, _first_out)
            elif hook == "final_norm":
                add(_get(self.base, self.layout.final_norm), "post", hook, GLOBAL_LAYER, _first_out)
            elif hook in self.layout.modules:
                for layer in layers:
                    self._add_layer_hook(add, hook, layer, n)
        return list(taps.values())

    def _add_layer_hook(self, add, hook: str, layer: int, n: int) -> None:
        block = self.layers[layer]
        path = _path(block, hook, self.layout)
        if hook == "resid_pre" and (layer == 0 or not self.layout.residual_in_norms):
            add(block, "pre", hook, layer, _hidden_arg(self.layout.hidden_index))
        elif hook == "resid_post" and not self.layout.residual_in_norms:
            add(block, "post", hook, layer, _first_out)
        elif hook == "resid_mid" and not self.layout.residual_in_norms:
            add(_get(block, path), "pre", hook, layer, _arg0)
        elif hook in ("attn_out", "mlp_out") and self.layout.block_scale:
            factor = float(getattr(self.model.config, self.layout.block_scale))
            add(_get(block, path), "post", hook, layer, _scaled(_first_out, factor), fresh=True)
        elif hook == "resid_pre":
            add(_get(block, self.layout.norms[0]), "post", hook, layer, _residual_out)
        elif hook == "resid_post":
            module = (_get(self.base, self.layout.final_norm) if layer == n - 1
                      else _get(self.layers[layer + 1], self.layout.norms[0]))
            add(module, "post", hook, layer, _residual_out)
        elif hook in ("attn_q", "attn_k", "attn_v"):
            qkv, attn = _get(block, path), _get(block, path.rsplit(".", 1)[0])
            add(qkv, "post", hook, layer, _qkv_part(attn, qkv, "qkv".index(hook[-1])))
        elif hook in ("attn_z", "mlp_post"):
            add(_get(block, path), "pre", hook, layer, _arg0)
        elif hook == "resid_mid":
            add(_get(block, path), "post", hook, layer, _residual_out)
        elif hook == "router_topk":
            add(_get(block, path), "post", hook, layer, _router_topk(_plain_topk(block)))
        else:  # attn_out, mlp_out, router_logits
            add(_get(block, path), "post", hook, layer, _first_out)


def resolve_vllm_architecture(model: nn.Module) -> VLLMArchitecture:
    """The layout of a vLLM ``*ForCausalLM`` of a type in :data:`VLLM_MODEL_TYPES`;
    :class:`AttachError` where its modules are not where that type's layout has them."""
    config = getattr(model, "config", None)
    layout = _LAYOUTS.get(str(getattr(config, "model_type", "")))  # check_engine_config refused the others
    base = getattr(model, layout.stack if layout else "model", None)
    layers = getattr(base, layout.layer_list if layout else "layers", None)
    if layout is None or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        where = f".{layout.stack}.{layout.layer_list}" if layout else ".model.layers"
        raise AttachError(
            f"vLLM model {type(model).__name__} has no decoder layer list at {where}; DMI's vLLM "
            "capture supports the Llama family's layout (Llama, Mistral, Qwen2, Qwen3 and the like) and "
            f"those of {', '.join(t for t in VLLM_MODEL_TYPES if _LAYOUTS[t] is not _LLAMA)}"
        )
    model_type, first = str(config.model_type), layers[0]
    missing = [p for p in (*layout.norms, layout.modules["attn_q"], layout.modules["attn_z"])
               if _get(first, p) is None]
    if missing:
        raise AttachError(
            f"vLLM model {type(model).__name__}: decoder layer {type(first).__name__} lacks {', '.join(missing)}; "
            f"DMI's vLLM capture maps {model_type}'s layers with them (a vLLM version that moved them is not mapped)"
        )
    return VLLMArchitecture(model_type, model, base, layers, layout)
