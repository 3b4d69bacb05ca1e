"""Selection: which hooks, which layers, which ranks.

``resolve_hooks`` turns what a user writes (``"resid_post"``, ``"attn"``, ``["resid", "logits"]``,
``"all"``) into catalogue names; an unknown token is an error that lists every valid one —
never a silent "everything". ``layer_numbers`` is the one layer-selection rule, for capture
and read alike: ``None``, an int, a ``range``, a slice, a ``(start, stop)`` pair or an
iterable become layer numbers, negative ones counting from the end. ``resolve_layers``
applies it to a model and refuses a selection that is empty or reaches past the model,
naming the model's layers; the reader (``Store.get_internal``) applies it to the layers a
request holds and refuses layers that were not captured, naming the captured ones. TransformerLens names (``blocks.3.hook_resid_post``) select
their one hook at their one layer (see ``_aliases``).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from dmi.storage.errors import AttentionImplementationError, HookSelectionError

from ._aliases import HookAlias, resolve_alias
from ._arch import Architecture
from ._hooks import GROUPS, HOOKS

__all__ = ["MAX_SELECTED_LAYERS", "Selection", "layer_numbers", "resolve_hooks", "resolve_layers", "select"]

MAX_SELECTED_LAYERS = 1 << 16
"""The most layer numbers one selection may name: hundreds of times any model's depth, and few
enough that a slip such as ``range(0, 999999999)`` is refused at once instead of enumerated (a
billion Python ints: some 36 GB before the layers are even checked)."""


def _tokens(hooks) -> list[str]:
    """The names and group tokens ``hooks`` lists, each once: the same token written twice is
    refused (most likely a typo for another hook, which a silent dedupe would hide). A hook
    that is also a member of a listed group is not a repeat: groups and names add up."""
    parts = _split(hooks)
    repeated = sorted({p for p in parts if parts.count(p) > 1})
    if repeated:
        raise HookSelectionError(f"hooks {hooks!r} lists {', '.join(map(repr, repeated))} more than once; "
                                 "name each hook or group once")
    return parts


def _split(hooks) -> list[str]:
    if isinstance(hooks, str):
        parts = [p.strip() for p in hooks.replace(",", " ").split()]
    elif isinstance(hooks, Iterable):
        parts = []
        for h in hooks:
            if not isinstance(h, str):
                raise HookSelectionError(f"hook names must be strings, got {h!r}")
            parts.extend(_split(h))
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
            near = difflib.get_close_matches(p, (*HOOKS, *GROUPS), n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise HookSelectionError(
                f"unknown hook or group {p!r}{hint}; valid hooks: {', '.join(HOOKS)}; "
                f"groups: {', '.join(GROUPS)}"
            )
    return tuple(h for h in HOOKS if h in chosen)


def _explicit(hooks) -> set[str]:
    return {p for p in _tokens(hooks) if p in HOOKS}


def layer_numbers(layers, end: int, what: str) -> tuple[int, ...] | None:
    """The one layer-selection rule, shared by capture and read: layer numbers, sorted, unique.

    ``None`` means every layer (returned as ``None``). An int, a ``range``, a ``slice``, a
    ``(start, stop)`` pair (half-open, like ``range``) or an iterable of ints name layer
    numbers; a negative number counts back from ``end`` (``-1`` is ``end - 1``), in a
    slice's bounds too; a slice without a stop runs to ``end``. Nothing is clipped: the
    caller checks every number against the layers that exist. ``end`` is the model's layer
    count when capturing, one past the last captured layer when reading. Raises
    ``HookSelectionError`` (naming ``what``) for anything else — a 0-d tensor or array too:
    it claims to be iterable but is one value, and its type is not an int's (``int(t)``
    says which layer is meant) —, a non-positive slice step, a selection of no layer, or one of
    more than :data:`MAX_SELECTED_LAYERS` numbers (counted without listing a range).
    """
    if layers is None:
        return None
    if isinstance(layers, (bool, str, bytes)):
        raise HookSelectionError(f"layers must be an int, range, slice or list of ints, got {layers!r}; {what}")
    if isinstance(layers, int):
        seq = [layers]
    elif isinstance(layers, slice):
        seq = _slice_numbers(layers, end, what)
    elif isinstance(layers, tuple) and len(layers) == 2 and all(type(v) is int for v in layers):
        seq = range(*layers)
    elif isinstance(layers, Iterable) and getattr(layers, "ndim", None) != 0:
        seq = layers if isinstance(layers, range) else list(itertools.islice(layers, MAX_SELECTED_LAYERS + 1))
    else:
        raise HookSelectionError(f"layers must be an int, range, slice or list of ints, got {layers!r}; {what}")
    if len(seq) > MAX_SELECTED_LAYERS:
        raise HookSelectionError(f"layer selection {layers!r:.100} names more than {MAX_SELECTED_LAYERS} layers, "
                                 f"more than any model has; {what}")
    for v in seq:
        if isinstance(v, bool) or not isinstance(v, int):
            raise HookSelectionError(f"layer {v!r} is not an int; {what}")
    if not seq:
        raise HookSelectionError(f"layer selection {layers!r} selects no layer; {what}")
    return tuple(sorted({v + end if v < 0 else v for v in seq}))


def _slice_numbers(layers: slice, end: int, what: str) -> range:
    for bound in (layers.start, layers.stop, layers.step):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise HookSelectionError(f"layer slice {layers} needs int bounds; {what}")
    if layers.step is not None and layers.step < 1:
        raise HookSelectionError(f"layer slice {layers} needs a positive step; {what}")
    start = 0 if layers.start is None else layers.start
    stop = end if layers.stop is None else layers.stop
    return range(start + end if start < 0 else start, stop + end if stop < 0 else stop, layers.step or 1)


def resolve_layers(layers, n_layers: int) -> tuple[int, ...]:
    """Capture's side of :func:`layer_numbers`: layer numbers ``0 <= l < n_layers`` (``None``:
    all); a selection reaching past the model is refused, never clipped."""
    what = f"the model has {n_layers} layers (0..{n_layers - 1})"
    numbers = layer_numbers(layers, n_layers, what)
    if numbers is None:
        return tuple(range(n_layers))
    outside = [v for v in numbers if not 0 <= v < n_layers]
    if outside:
        raise HookSelectionError(
            f"layer selection {layers!r} reaches past the model ({'layer' if len(outside) == 1 else 'layers'} "
            f"{_span(outside)}); {what}"
        )
    return numbers


def _span(numbers: list[int]) -> str:
    """``[4, 5, 6, 7]`` → ``'4..7'`` (a long run of numbers stays one short phrase)."""
    if len(numbers) > 3 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}..{numbers[-1]}"
    return ", ".join(map(str, numbers))


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
