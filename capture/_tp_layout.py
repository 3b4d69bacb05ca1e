"""What each hook's tensor is on one tensor-parallel rank: a shard of the model's tensor
(with its geometry), or the whole tensor (replicated on every rank).

By default the hook catalogue decides (``HookSpec.tp_axis`` / ``kv_heads``): q/k/v/z,
attention patterns and the MLP's intermediate activations are column-parallel — rank ``r``
of ``n`` holds the ``r``-th contiguous block of heads / features, blocks of
``ceil(full / n)`` as ``torch.chunk`` and DTensor's ``Shard`` cut them — and everything
else (residual stream, block outputs, logits, routers) is replicated. k/v with fewer heads
than ranks are replicated (transformers needs a ``"replicate"`` plan for them there). A
record declared replicated must be the model's whole tensor: one that is not (vLLM's one
head per rank for 2 key/value heads on 4 ranks) is refused, never stored as if whole.

A model sharded by hand may cut differently; its author says how, per hook, with
``tp_layout={hook: TPShard(axis, offset, full) | TPReplicated()}`` (the small interface
documented in docs/capture.md, "Tensor parallel"). ``axis`` is an axis of the stored
record (``attn_q``: ``[tokens, heads, head_dim]``, so heads are axis 1), ``offset`` is
where this rank's block starts on it, and ``full`` the model's size along it. Hooks not
named keep the catalogue's rule.

At attach, :func:`check_model_cut` reads the projections' weights (no forward) and refuses a
model whose cut does not match ``tp_rank`` / ``tp_size``: an unsharded model given
``tp_size=2``, a 2-way shard given ``tp_size=1`` or ``4`` — before the model runs, where the
drain would otherwise refuse every record late, or store shards as whole tensors or at the
wrong offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dmi.storage.errors import AttachError, CaptureError, InvalidArgumentError
from dmi.storage.records import ShardGeometry

from ._arch import Architecture
from ._hooks import HOOKS, ModelGeometry

__all__ = ["TPShard", "TPReplicated", "TPLayout", "TP_REPLICAS", "check_model_cut", "emitted_hooks",
           "whole_by_tp_plan"]

TP_REPLICAS = ("rank0", "all")
"""Who writes a replicated hook: TP rank 0 only (default), or every rank (to check copies)."""


@dataclass(frozen=True, slots=True)
class TPShard:
    """This rank holds ``[offset, offset + local)`` of ``axis`` (``full`` long in the model)."""

    axis: int
    offset: int
    full: int


@dataclass(frozen=True, slots=True)
class TPReplicated:
    """Every rank holds the hook's whole tensor."""


_WHOLE_BY_STYLE = {
    ("self_attn.q_proj", "colwise_gather_output"): ("attn_q",),
    ("self_attn.k_proj", "colwise_gather_output"): ("attn_k",),
    ("self_attn.v_proj", "colwise_gather_output"): ("attn_v",),
    ("self_attn.qkv_proj", "colwise_gather_output"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn.o_proj", "rowwise_split_input"): ("attn_z",),
    ("mlp.down_proj", "rowwise_split_input"): ("mlp_post",),
}
"""(module in a layer, transformers TP style) → the hooks whose tensors that style leaves whole
on every rank: a column-parallel output gathered inside the module (Phi-3's fused ``qkv_proj``
holds three), or a row-parallel input split inside it (its hook is the module's input)."""


def whole_by_tp_plan(tp_plan: Mapping[str, str] | None) -> dict[str, TPReplicated]:
    """The hooks a transformers TP plan (``config.base_model_tp_plan``: ``"layers.*.self_attn.q_proj"``
    → ``"colwise_gather_output"``, ...) leaves whole on every rank, where the catalogue takes them
    for shards — OLMoE's plan gathers q/k/v and splits o_proj's input inside the module. An
    attach under that plan starts from these (``tp_layout=`` still says otherwise per hook)."""
    whole = {}
    for pattern, style in (tp_plan or {}).items():
        for hook in _WHOLE_BY_STYLE.get((pattern.removeprefix("layers.*."), style), ()):
            whole[hook] = TPReplicated()
    return whole


class TPLayout:
    """Per hook: replicated or sharded on this rank, and a shard's geometry in a record."""

    def __init__(self, geometry: ModelGeometry, rank: int, size: int,
                 overrides: Mapping[str, TPShard | TPReplicated] | None = None, *,
                 defaults: Mapping[str, TPReplicated] | None = None):
        """``overrides``: the caller's ``tp_layout``; ``defaults``: what the model's TP plan says
        (:func:`whole_by_tp_plan`), for the hooks ``overrides`` does not name."""
        self.geometry = geometry
        self.rank = rank
        self.size = size
        if overrides is not None and not isinstance(overrides, Mapping):
            raise InvalidArgumentError("tp_layout must be a mapping of hook -> TPShard(axis, offset, full) or "
                                       f"TPReplicated(), not {type(overrides).__name__}")
        self.overrides = {**(defaults or {}), **_checked(dict(overrides or {}), geometry)}

    def replicated(self, hook: str) -> bool:
        """Whether every rank holds ``hook``'s whole tensor (so one rank's copy is enough)."""
        if self.size <= 1:
            return True
        said = self.overrides.get(hook)
        if said is not None:
            return isinstance(said, TPReplicated)
        return HOOKS[hook].replicated(self.geometry, self.size)

    def shard(self, hook: str, shape: tuple[int, ...]) -> ShardGeometry | None:
        """The geometry of a record of ``shape`` this rank stores for ``hook`` (``None``:
        replicated). Raises :class:`CaptureError` when the record does not fit the layout."""
        if self.replicated(hook):
            self._check_whole(hook, shape)
            return None
        said = self.overrides.get(hook)
        if said is None:
            axis = HOOKS[hook].tp_axis
            full = self._catalogue_full(hook, shape, axis)
            offset = self.rank * -(-full // self.size)
        else:
            axis, offset, full = said.axis, said.offset, said.full
        if axis >= len(shape) or offset + shape[axis] > full:
            raise CaptureError(
                f"hook {hook!r} on TP rank {self.rank}: a record of shape {tuple(shape)} does not fit the layout "
                f"(axis {axis}, offset {offset}, full size {full}); say how the model is cut with "
                f"tp_layout={{{hook!r}: TPShard(axis, offset, full)}}"
            )
        full_shape = list(shape)
        full_shape[axis] = full
        return ShardGeometry(axis, offset, tuple(full_shape))

    def _check_whole(self, hook: str, shape: tuple[int, ...]) -> None:
        """A record declared replicated under tensor parallelism must be the model's whole
        tensor: a rank holding only part of it (vLLM gives each rank one of 2 key/value heads
        on 4 ranks) would otherwise be stored without geometry, and read back as if it were all."""
        if self.size <= 1:
            return
        whole = self._catalogue_shape(hook, shape)
        if tuple(shape) != whole:
            raise CaptureError(
                f"hook {hook!r} on TP rank {self.rank} of {self.size} is declared replicated (every rank holds the "
                f"whole tensor, {whole}), but this rank's record has shape {tuple(shape)}: storing it without shard "
                f"geometry would read back as the whole tensor. Say how the model is cut with "
                f"tp_layout={{{hook!r}: TPShard(axis, offset, full)}}, or do not capture {hook!r}"
            )

    def _catalogue_full(self, hook: str, shape: tuple[int, ...], axis: int) -> int:
        """The model's size along ``axis`` of ``hook``'s record, from the catalogue's shape rule."""
        return self._catalogue_shape(hook, shape)[axis]

    def _catalogue_shape(self, hook: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The model's whole record for ``hook`` with ``shape``'s tokens (and keys), from the
        catalogue's shape rule."""
        spec = HOOKS[hook]
        kv = shape[spec.key_axis] if spec.key_axis is not None else None
        return spec.record_shape(self.geometry, shape[spec.token_axis], kv)


def _checked(overrides: dict, geometry: ModelGeometry) -> dict:
    """``overrides`` if every entry names a catalogue hook with a layout that can hold."""
    for hook, said in overrides.items():
        if hook not in HOOKS:
            raise InvalidArgumentError(f"tp_layout names unknown hook {hook!r}; hooks: {', '.join(HOOKS)}")
        if isinstance(said, TPReplicated):
            continue
        if not isinstance(said, TPShard):
            raise InvalidArgumentError(f"tp_layout[{hook!r}] must be TPShard(axis, offset, full) or TPReplicated(), "
                                       f"got {said!r}")
        spec = HOOKS[hook]
        dims = len(spec.record_shape(geometry, 1, 1))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (said.axis, said.offset, said.full)):
            raise InvalidArgumentError(f"tp_layout[{hook!r}]: axis, offset and full must be ints, got {said!r}")
        if said.axis in (spec.token_axis, spec.key_axis) or not 0 <= said.axis < dims:
            raise InvalidArgumentError(
                f"tp_layout[{hook!r}]: axis {said.axis} is not a feature axis of its {dims}-d record "
                f"(token axis {spec.token_axis})")
        if not 0 <= said.offset < said.full:
            raise InvalidArgumentError(f"tp_layout[{hook!r}]: need 0 <= offset < full, got {said!r}")
    return overrides


def emitted_hooks(selected: Mapping[str, tuple[int, ...]], layout: TPLayout, replicas: str) -> dict:
    """The selected hooks this rank writes: all of them on TP rank 0 or with
    ``replicas="all"``, else only the sharded ones (rank 0 writes the replicated ones once)."""
    if replicas not in TP_REPLICAS:
        raise InvalidArgumentError(f"tp_replicas must be one of {', '.join(map(repr, TP_REPLICAS))}, got {replicas!r}")
    if replicas == "all" or layout.rank == 0:
        return dict(selected)
    return {hook: layers for hook, layers in selected.items() if not layout.replicated(hook)}


_PROJECTIONS = {
    "attn_q": ("self_attn.q_proj", 0),
    "attn_k": ("self_attn.k_proj", 0),
    "attn_v": ("self_attn.v_proj", 0),
    "attn_z": ("self_attn.o_proj", 1),
    "mlp_post": ("mlp.down_proj", 1),
}
"""Hook → (its projection in a layer, the weight axis that holds the hook's features): a
column-parallel projection's output (axis 0 of ``[out, in]``) or a row-parallel one's input
(axis 1). On a rank that projection is as wide as the rank's block of the hook's tensor."""


def check_model_cut(arch: Architecture, selected: Mapping[str, tuple[int, ...]], layout: TPLayout) -> None:
    """Refuse, before the model runs, a model whose projections are not cut as ``layout``'s
    rank and size say: each selected hook the catalogue shards (and neither ``tp_layout=`` nor
    the model's TP plan describes) must come from a projection as wide as this rank's block —
    the whole width on one rank. Reads weight shapes only (a DTensor's local shard); hooks of
    other architectures, quantised or missing weights, and a projection wider than the
    catalogue's whole tensor are left to the drain's check.

    Raises :class:`AttachError` naming the projection, its width and the width expected."""
    for hook, layers in selected.items():
        if hook not in _PROJECTIONS or hook in layout.overrides:
            continue
        path, axis = _PROJECTIONS[hook]
        if arch.family.per_layer.get(hook, ("",))[0] != path:
            continue
        unit, full_units = _feature_unit(hook, layout.geometry)
        expected = _block_units(hook, full_units, layout) * unit
        for layer in layers:
            width = _weight_width(arch.layers[layer], path, axis)
            if width is not None and width != expected and width <= full_units * unit:
                raise AttachError(_cut_message(hook, layer, path, width, expected, full_units * unit, layout))


def _feature_unit(hook: str, geometry: ModelGeometry) -> tuple[int, int]:
    """(features per unit a rank holds whole, units in the model): heads of ``head_dim`` for
    attention, single features for the MLP."""
    if hook == "mlp_post":
        return 1, geometry.intermediate
    return geometry.head_dim, geometry.n_kv_heads if HOOKS[hook].kv_heads else geometry.n_heads


def _block_units(hook: str, full_units: int, layout: TPLayout) -> int:
    """How many of ``full_units`` this rank holds: all when ``hook`` is replicated (one rank,
    or fewer kv heads than ranks), else its ``torch.chunk`` block (``ceil(full / size)``, the
    last rank's possibly shorter)."""
    if layout.replicated(hook):
        return full_units
    block = -(-full_units // layout.size)
    return max(0, min(block, full_units - layout.rank * block))


def _weight_width(layer, path: str, axis: int) -> int | None:
    """The width of ``layer``'s projection at ``path`` along ``axis`` of its local weight, or
    ``None`` where it cannot be read as a plain floating ``[out, in]`` matrix."""
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return None
    weight = getattr(module, "weight", None)
    to_local = getattr(weight, "to_local", None)
    if to_local is not None:
        weight = to_local()
    if weight is None or not hasattr(weight, "is_floating_point") or weight.ndim != 2 or not weight.is_floating_point():
        return None
    return int(weight.shape[axis])


def _cut_message(hook: str, layer: int, path: str, width: int, expected: int, full: int, layout: TPLayout) -> str:
    """What was found, what ``tp_size`` expects, and what to do about it."""
    found = (f"hook {hook!r}: layer {layer}'s {path} holds {width} of the model's {full} features, where TP rank "
             f"{layout.rank} of {layout.size} expects {expected}")
    if width == full:
        return (f"{found}: the model is not sharded. Shard it (from_pretrained(..., tp_plan=\"auto\") under "
                f"torchrun, or dmi.capture.load_tensor_parallel), or pass tp_size=1")
    if width and full % width == 0:
        cut = f"looks cut {full // width} ways. Pass this process's tp_rank= and tp_size={full // width}"
    else:
        cut = "is cut otherwise. Pass this process's tp_rank= and tp_size="
    return f"{found}: the model {cut}, or say how it is cut with tp_layout={{{hook!r}: TPShard(axis, offset, full)}}"
