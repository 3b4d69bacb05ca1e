"""Selection: which hooks, which layers, which ranks.

``resolve_hooks`` turns what a user writes (``"resid_post"``, ``"attn"``, ``["resid", "logits"]``,
``"all"``) into catalogue names; an unknown token is an error that lists every valid one —
never a silent "everything". ``resolve_layers`` turns ``None``, an int, a ``range``, a slice,
a ``(start, stop)`` pair or an iterable into layer numbers, and refuses a selection that is
empty or reaches past the model, naming the model's layers. TransformerLens names
(``blocks.3.hook_resid_post``) select their one hook at their one layer (see ``_aliases``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dmi.storage.errors import AttentionImplementationError, HookSelectionError

from ._aliases import HookAlias, resolve_alias
from ._arch import Architecture
from ._hooks import GROUPS, HOOKS

__all__ = ["Selection", "resolve_hooks", "resolve_layers", "select"]


def _tokens(hooks) -> list[str]:
    if isinstance(hooks, str):
        parts = [p.strip() for p in hooks.replace(",", " ").split()]
    elif isinstance(hooks, Iterable):
        parts = []
        for h in hooks:
            if not isinstance(h, str):
                raise HookSelectionError(f"hook names must be strings, got {h!r}")
            parts.extend(_tokens(h))
    else:
        raise HookSelectionError(f"hooks must be a name, a group or a list of them, got {hooks!r}")
    return parts


def resolve_hooks(hooks) -> tuple[str, ...]:
    """Expand hook names and group tokens into catalogue names, in catalogue order.

    >>> resolve_hooks("resid_post logits")
    ('resid_post', 'logits')
    """
    parts = _tokens(hooks)
    if not parts:
        raise HookSelectionError(
            "no hook selected; valid hooks: " + ", ".join(HOOKS) + "; groups: " + ", ".join(GROUPS)
        )
    chosen: set[str] = set()
    for p in parts:
        if p in HOOKS:
            chosen.add(p)
        elif p in GROUPS:
            chosen.update(GROUPS[p])
        else:
            raise HookSelectionError(
                f"unknown hook or group {p!r}; valid hooks: {', '.join(HOOKS)}; "
                f"groups: {', '.join(GROUPS)}"
            )
    return tuple(h for h in HOOKS if h in chosen)


def _explicit(hooks) -> set[str]:
    return {p for p in _tokens(hooks) if p in HOOKS}


def resolve_layers(layers, n_layers: int) -> tuple[int, ...]:
    """Layer numbers ``0 <= l < n_layers``; negative ints count from the end (``-1`` = last)."""
    what = f"the model has {n_layers} layers (0..{n_layers - 1})"
    if layers is None:
        return tuple(range(n_layers))
    if isinstance(layers, bool):
        raise HookSelectionError(f"layers must be an int, range, slice or list, got {layers!r}; {what}")
    if isinstance(layers, int):
        seq = [layers]
    elif isinstance(layers, slice):
        if (layers.stop is not None and layers.stop > n_layers) or (
            layers.start is not None and layers.start >= n_layers
        ):
            raise HookSelectionError(f"layer slice {layers} reaches past the model; {what}")
        seq = list(range(n_layers))[layers]
    elif isinstance(layers, range):
        seq = list(layers)
    elif isinstance(layers, tuple) and len(layers) == 2 and all(isinstance(v, int) for v in layers):
        start, stop = layers  # (start, stop) half-open, like range
        seq = list(range(start, stop))
    elif isinstance(layers, Iterable):
        seq = list(layers)
    else:
        raise HookSelectionError(f"layers must be an int, range, slice or list, got {layers!r}; {what}")
    out = []
    for v in seq:
        if isinstance(v, bool) or not isinstance(v, int):
            raise HookSelectionError(f"layer {v!r} is not an int; {what}")
        if not -n_layers <= v < n_layers:
            raise HookSelectionError(f"layer {v} is out of range; {what}")
        out.append(v % n_layers)
    if not out:
        raise HookSelectionError(f"layer selection {layers!r} selects no layer; {what}")
    return tuple(sorted(set(out)))


@dataclass(frozen=True, slots=True)
class Selection:
    """The resolved selection: per hook, the layers it is captured at (``(-1,)`` for globals)."""

    hooks: dict[str, tuple[int, ...]]
    layers: tuple[int, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.hooks)


def select(arch: Architecture, hooks, layers, *, attn_implementation: str | None) -> Selection:
    """Resolve hooks and layers against one model; raises before anything is installed.

    ``layers`` applies to hook and group names; a TransformerLens alias brings its own layer."""
    aliases = [alias for alias in map(resolve_alias, _tokens(hooks)) if alias is not None]
    if aliases:
        return _select_with_aliases(arch, hooks, aliases, layers, attn_implementation=attn_implementation)
    names = resolve_hooks(hooks)
    explicit = _explicit(hooks)
    layer_nums = resolve_layers(layers, arch.n_layers)
    chosen: dict[str, tuple[int, ...]] = {}
    for name in names:
        if not arch.available(name):
            if name in explicit:
                have = [h for h in HOOKS if arch.available(h)]
                raise HookSelectionError(
                    f"hook {name!r} does not exist on model type {arch.model_type!r}; "
                    f"available: {', '.join(have)}"
                )
            continue  # a group member this architecture does not have (e.g. router on a dense model)
        if HOOKS[name].needs_eager and attn_implementation != "eager":
            raise AttentionImplementationError(
                f"{name!r} needs eager attention, but the model uses {attn_implementation!r} "
                "(which never materialises the attention weights). Switch with "
                "model.set_attn_implementation('eager'), or load with "
                "from_pretrained(..., attn_implementation='eager'); or drop 'attn_pattern' "
                "(the 'all_but_patterns' group)."
            )
        chosen[name] = layer_nums if HOOKS[name].per_layer else (-1,)
    if not chosen:
        raise HookSelectionError(
            f"selection {hooks!r} leaves no hook available on model type {arch.model_type!r}"
        )
    return Selection(chosen, layer_nums)


def _select_with_aliases(arch: Architecture, hooks, aliases: list[HookAlias], layers, *,
                         attn_implementation: str | None) -> Selection:
    """The union of the plain names' selection and each alias's (hook, layer), every part
    checked by :func:`select` itself (availability, eager attention, layer range)."""
    named = {alias.name for alias in aliases}
    plain = [token for token in _tokens(hooks) if token not in named]
    if not plain and layers is not None:
        raise HookSelectionError(
            f"layers={layers!r} selects layers of hook names, but {', '.join(sorted(named))} name their own "
            "layer; drop layers= or add the DMI hook name (e.g. resid_post) it should apply to"
        )
    parts = [select(arch, plain, layers, attn_implementation=attn_implementation)] if plain else []
    for alias in aliases:
        try:
            parts.append(select(arch, alias.hook, None if alias.layer < 0 else alias.layer,
                                attn_implementation=attn_implementation))
        except (HookSelectionError, AttentionImplementationError) as exc:
            raise type(exc)(f"{alias.name} (DMI hook {alias.hook!r}, layer {alias.layer}): {exc}") from exc
    merged: dict[str, set[int]] = {}
    for part in parts:
        for name, nums in part.hooks.items():
            merged.setdefault(name, set()).update(nums)
    chosen = {name: tuple(sorted(merged[name])) for name in HOOKS if name in merged}
    layer_nums = tuple(sorted({n for nums in chosen.values() for n in nums if n >= 0}))
    return Selection(chosen, layer_nums)
