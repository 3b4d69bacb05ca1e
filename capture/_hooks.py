"""The hook catalogue: every capturable internal, in one table that everything else reads.

Each :class:`HookSpec` says what a hook is (its meaning), its scope (per layer, or global
with ``layer == GLOBAL_LAYER``), the shape of one stored record for a model geometry, its
dtype, and how tensor parallelism splits it (the axis of the stored record along which each
rank holds a contiguous block, or ``None`` when every rank holds the full tensor).

Stored shapes (one record = one request, one contiguous token range):

=================  =========================================  ==================================
hook               stored record shape                        taken from
=================  =========================================  ==================================
``token_ids``      ``[tokens]`` int64                         the model's ``input_ids``
``embed``          ``[tokens, hidden]``                       token embedding output
``resid_pre``      ``[tokens, hidden]``                       decoder layer input
``attn_q/k/v``     ``[tokens, heads, head_dim]``              q/k/v projection output (before any
                                                              q/k norm and before RoPE)
``attn_z``         ``[tokens, heads, head_dim]``              input of the output projection
``attn_pattern``   ``[heads, q_tokens, kv_tokens]``           attention weights (eager only)
``attn_out``       ``[tokens, hidden]``                       attention block output (what the
                                                              layer adds to the residual)
``resid_mid``      ``[tokens, hidden]``                       residual after attention
``mlp_post``       ``[tokens, intermediate]``                 input of the MLP down projection
``mlp_out``        ``[tokens, hidden]``                       MLP / MoE block output (what the
                                                              layer adds to the residual)
``resid_post``     ``[tokens, hidden]``                       decoder layer output
``final_norm``     ``[tokens, hidden]``                       final norm output
``logits``         ``[tokens, vocab]``                        the model's output logits, only the
                                                              positions it materialises
``router_logits``  ``[tokens, experts]``                      MoE router logits
``router_topk``    ``[tokens, top_k]`` int64                  experts chosen by the router
=================  =========================================  ==================================
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch

from dmi.storage.errors import InvalidArgumentError

__all__ = ["ModelGeometry", "HookSpec", "HOOKS", "GROUPS", "hook_names"]


_CONFIG_SIZE_FIELDS = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "num_attention_heads", "n_head",
                       "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "vocab_size",
                       "num_local_experts", "num_experts", "num_experts_per_tok")
"""The config fields :meth:`ModelGeometry.from_config` reads sizes from."""


def _check_sizes(config) -> None:
    """Refuse a size that is not a non-negative integer: a config file's ``"4096"`` would fail
    deep in the shape arithmetic, and a ``2.0`` would give float shapes."""
    for key in _CONFIG_SIZE_FIELDS:
        value = getattr(config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidArgumentError(f"{key} must be a non-negative integer; got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The sizes of a model that determine every hook's shape."""

    model_type: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: torch.dtype
    n_experts: int = 0
    top_k: int = 0

    @classmethod
    def from_config(cls, config, dtype: torch.dtype) -> "ModelGeometry":
        """The geometry a config gives; :class:`InvalidArgumentError` for a size that is not a
        non-negative integer."""
        _check_sizes(config)
        get = lambda *names, default=0: next(  # noqa: E731
            (getattr(config, n) for n in names if getattr(config, n, None) is not None), default
        )
        hidden = get("hidden_size", "n_embd")
        n_heads = get("num_attention_heads", "n_head")
        head_dim = get("head_dim", default=0) or hidden // max(n_heads, 1)
        inter = get("intermediate_size", "n_inner", default=0) or 4 * hidden
        return cls(
            model_type=str(getattr(config, "model_type", "unknown")),
            n_layers=get("num_hidden_layers", "n_layer"),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=get("num_key_value_heads", default=0) or n_heads,
            head_dim=head_dim,
            intermediate=inter,
            vocab=get("vocab_size"),
            dtype=dtype,
            n_experts=get("num_local_experts", "num_experts", default=0),
            top_k=get("num_experts_per_tok", default=0),
        )


@dataclass(frozen=True, slots=True)
class HookSpec:
    """One catalogue entry: what a hook is, and its layout for every stage.

    * scope: ``per_layer`` (one record per layer) or global (layer ``GLOBAL_LAYER``);
    * shape rule: ``feature_shape(g)``, the values of one token, and ``record_shape``;
    * token axis: the axis of a stored record that runs over its tokens (``token_axis``),
      and, for attention patterns, the axis that runs over the keys each token attended to
      (``key_axis``; it grows from one decode step to the next). Both are recorded in every
      pack row and index row, so readers need no hook names;
    * tensor parallelism: ``tp_axis``, the axis of a stored record along which each rank
      holds a contiguous block (``None``: every rank holds the whole tensor), and
      ``kv_heads``: the split axis counts key/value heads, so with fewer of them than ranks
      each rank holds a full copy (GQA) and the tensor is replicated, not split;
    * source: ``"module"`` (a hook on a model module, see ``_arch``) or ``"input_ids"``
      (taken from the model's input before the forward runs).
    """

    name: str
    per_layer: bool
    groups: tuple[str, ...]
    doc: str
    _feature_shape: Callable[[ModelGeometry], tuple[int, ...]]
    fixed_dtype: torch.dtype | None = None
    tp_axis: int | None = None
    needs_eager: bool = False
    moe_only: bool = False
    token_axis: int = 0
    key_axis: int | None = None
    kv_heads: bool = False
    source: str = "module"

    @property
    def scope(self) -> str:
        return "layer" if self.per_layer else "global"

    def feature_shape(self, g: ModelGeometry) -> tuple[int, ...]:
        """Shape of one token's values (``attn_pattern``: ``(heads,)``; q/kv lengths vary)."""
        return self._feature_shape(g)

    def token_shape(self, width: int, g: ModelGeometry) -> tuple[int, ...]:
        """One token's shape from its flat ``width`` (a TP rank holds fewer heads than ``g``)."""
        feature = self._feature_shape(g)
        if len(feature) < 2:
            return (width,) if feature else ()
        inner = 1
        for d in feature[1:]:
            inner *= d
        return (width // inner, *feature[1:])

    def dtype(self, g: ModelGeometry) -> torch.dtype:
        return self.fixed_dtype or g.dtype

    def record_shape(self, g: ModelGeometry, n_tokens: int, kv_tokens: int | None = None) -> tuple[int, ...]:
        """Shape of a stored record covering ``n_tokens`` tokens (``kv_tokens`` keys, default
        ``n_tokens``, where the hook has a key axis)."""
        shape = list(self._feature_shape(g))
        shape.insert(self.token_axis, n_tokens)
        if self.key_axis is not None:
            shape.insert(self.key_axis, n_tokens if kv_tokens is None else kv_tokens)
        return tuple(shape)

    def record_bytes(self, g: ModelGeometry, n_tokens: int, kv_tokens: int | None = None) -> int:
        """Bytes of one record, rounded up to 16 (each hook rounded on its own)."""
        n = 1
        for d in self.record_shape(g, n_tokens, kv_tokens):
            n *= d
        return _round16(n * self.dtype(g).itemsize)

    def replicated(self, g: ModelGeometry, tp_size: int) -> bool:
        """Whether every one of ``tp_size`` ranks holds the whole tensor (nothing to merge)."""
        return tp_size <= 1 or self.tp_axis is None or (self.kv_heads and g.n_kv_heads < tp_size)


def _round16(n: int) -> int:
    return (n + 15) & ~15


_H = lambda g: (g.hidden,)  # noqa: E731


def _spec(name, per_layer, groups, doc, shape, **kw) -> HookSpec:
    return HookSpec(name, per_layer, tuple(groups), doc, shape, **kw)


_SPECS = [
    _spec("token_ids", False, ("tokens",), "input token ids", lambda g: (), fixed_dtype=torch.int64,
          source="input_ids"),
    _spec("embed", False, ("resid",), "token embedding output", _H),
    _spec("resid_pre", True, ("resid",), "decoder layer input (residual stream before the layer)", _H),
    _spec("attn_q", True, ("attn", "qkv"), "query projection, before q-norm and RoPE",
          lambda g: (g.n_heads, g.head_dim), tp_axis=1),
    _spec("attn_k", True, ("attn", "qkv"), "key projection, before k-norm and RoPE",
          lambda g: (g.n_kv_heads, g.head_dim), tp_axis=1, kv_heads=True),
    _spec("attn_v", True, ("attn", "qkv"), "value projection",
          lambda g: (g.n_kv_heads, g.head_dim), tp_axis=1, kv_heads=True),
    _spec("attn_z", True, ("attn",), "attention output per head (input of o_proj)",
          lambda g: (g.n_heads, g.head_dim), tp_axis=1),
    _spec("attn_pattern", True, ("attn_pattern", "patterns"), "attention weights [heads, q, kv]",
          lambda g: (g.n_heads,), tp_axis=0, needs_eager=True, token_axis=1, key_axis=2),
    _spec("attn_out", True, ("attn",), "attention block output: what the layer adds to the residual "
          "(after o_proj; Gemma 2/3: after its post-attention norm)", _H),
    _spec("resid_mid", True, ("resid",), "residual stream after attention, before the MLP", _H),
    _spec("mlp_post", True, ("mlp",), "MLP activation (input of the down projection)",
          lambda g: (g.intermediate,), tp_axis=1),
    _spec("mlp_out", True, ("mlp",), "MLP / MoE block output: what the layer adds to the residual "
          "(Gemma 2/3: after its post-feedforward norm)", _H),
    _spec("resid_post", True, ("resid",), "decoder layer output (residual stream after the layer)", _H),
    _spec("final_norm", False, ("resid",), "final norm output", _H),
    _spec("logits", False, ("logits",), "the model's output logits, at the positions it materialises (Gemma 2: soft-capped)",
          lambda g: (g.vocab,)),
    _spec("router_logits", True, ("router",), "MoE router logits", lambda g: (g.n_experts,), moe_only=True),
    _spec("router_topk", True, ("router",), "experts chosen by the router (indices)",
          lambda g: (g.top_k,), fixed_dtype=torch.int64, moe_only=True),
]

HOOKS: "MappingProxyType[str, HookSpec]" = MappingProxyType({s.name: s for s in _SPECS})
"""Every hook, by name, in canonical order."""


def _group_members() -> dict[str, tuple[str, ...]]:
    groups: dict[str, list[str]] = {}
    for s in _SPECS:
        for grp in s.groups:
            groups.setdefault(grp, []).append(s.name)
    groups["all"] = [s.name for s in _SPECS]
    groups["all_but_patterns"] = [s.name for s in _SPECS if s.name != "attn_pattern"]
    return {k: tuple(v) for k, v in groups.items()}


GROUPS: "MappingProxyType[str, tuple[str, ...]]" = MappingProxyType(_group_members())
"""Group tokens and the hooks each expands to (``all`` includes ``attn_pattern``)."""


def hook_names() -> tuple[str, ...]:
    return tuple(HOOKS)
