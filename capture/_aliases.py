"""TransformerLens hook names as aliases of the catalogue's (hook, layer) pairs.

A TransformerLens user names one hook point at one layer (``blocks.3.hook_resid_post``);
DMI names the hook and selects layers separately (``resid_post``, ``layers=[3]``). The
table below maps each TransformerLens name, without its ``blocks.<layer>.`` prefix, to a
catalogue hook; whether the name takes the prefix follows the catalogue's own scope
(``HOOKS[hook].per_layer``), so the two can never disagree.

TransformerLens points DMI does not capture (layer-norm scales, pre-softmax scores,
rotated q/k, per-head results, ...) are listed too, so that asking for one is an error
naming it rather than "unknown hook".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from dmi.storage.errors import HookSelectionError

from ._hooks import HOOKS

__all__ = ["ALIASES", "HookAlias", "resolve_alias"]

_GLOBAL_LAYER = -1

_TRANSFORMERLENS = {
    "hook_embed": "embed",
    "hook_resid_pre": "resid_pre",
    "attn.hook_q": "attn_q",
    "attn.hook_k": "attn_k",
    "attn.hook_v": "attn_v",
    "attn.hook_z": "attn_z",
    "attn.hook_pattern": "attn_pattern",
    "hook_attn_out": "attn_out",
    "hook_resid_mid": "resid_mid",
    "mlp.hook_post": "mlp_post",
    "hook_mlp_out": "mlp_out",
    "hook_resid_post": "resid_post",
    "mlp.hook_expert_indices": "router_topk",
    "ln_final.hook_normalized": "final_norm",
}

_NOT_CAPTURED = {
    "hook_pos_embed": "positional embeddings are part of resid_pre at layer 0",
    "hook_tokens": "use token_ids",
    "ln_final.hook_scale": "DMI stores the normalised output only (final_norm)",
    "ln1.hook_scale": "DMI does not capture layer-norm internals",
    "ln1.hook_normalized": "DMI does not capture layer-norm internals",
    "ln2.hook_scale": "DMI does not capture layer-norm internals",
    "ln2.hook_normalized": "DMI does not capture layer-norm internals",
    "hook_q_input": "DMI does not capture per-head attention inputs",
    "hook_k_input": "DMI does not capture per-head attention inputs",
    "hook_v_input": "DMI does not capture per-head attention inputs",
    "hook_attn_in": "DMI does not capture per-head attention inputs",
    "hook_mlp_in": "use resid_mid (the MLP's input before its norm)",
    "attn.hook_attn_scores": "DMI captures the softmaxed pattern only (attn_pattern)",
    "attn.hook_rot_q": "DMI captures q before RoPE only (attn_q)",
    "attn.hook_rot_k": "DMI captures k before RoPE only (attn_k)",
    "attn.hook_result": "DMI does not capture per-head outputs after W_O",
    "mlp.hook_pre": "DMI captures the MLP activation after the nonlinearity only (mlp_post)",
    "mlp.hook_pre_linear": "DMI captures the MLP activation after the nonlinearity only (mlp_post)",
    "mlp.hook_expert_weights": "use router_logits (before the softmax)",
}

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _pattern(local: str, hook: str) -> str:
    return f"blocks.{{layer}}.{local}" if HOOKS[hook].per_layer else local


ALIASES: "MappingProxyType[str, str]" = MappingProxyType(
    {_pattern(local, hook): hook for local, hook in _TRANSFORMERLENS.items()}
)
"""Every accepted TransformerLens name (``{layer}`` stands for the layer number) → DMI hook."""


@dataclass(frozen=True, slots=True)
class HookAlias:
    """A TransformerLens name resolved: the catalogue hook and its layer (``-1``: global)."""

    name: str
    hook: str
    layer: int


def resolve_alias(name: str) -> HookAlias | None:
    """``blocks.3.hook_resid_post`` → ``HookAlias(name, "resid_post", 3)``; ``None`` for a name
    that is not TransformerLens-shaped (a DMI hook or group, left to the caller).

    Raises :class:`HookSelectionError` for a TransformerLens name DMI does not capture
    (naming it and saying what to use instead) or does not know.
    """
    if not _looks_like_transformerlens(name):
        return None
    block = _BLOCK.fullmatch(name)
    layer, local = (int(block.group(1)), block.group(2)) if block else (_GLOBAL_LAYER, name)
    hook = _TRANSFORMERLENS.get(local)
    if hook is not None and HOOKS[hook].per_layer == (block is not None):
        return HookAlias(name, hook, layer)
    if local in _NOT_CAPTURED:
        raise HookSelectionError(f"DMI has no hook for TransformerLens's {name!r}: {_NOT_CAPTURED[local]}")
    raise HookSelectionError(
        f"unknown TransformerLens hook name {name!r}; accepted: {', '.join(ALIASES)} "
        "({layer} is a layer number)"
    )


def _looks_like_transformerlens(name: str) -> bool:
    return name.startswith(("blocks.", "hook_", "ln_final.")) or "." in name
