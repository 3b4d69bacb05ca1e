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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dmi.storage.errors import CaptureError, InvalidArgumentError
from dmi.storage.records import ShardGeometry

from ._hooks import HOOKS, ModelGeometry

__all__ = ["TPShard", "TPReplicated", "TPLayout", "TP_REPLICAS", "emitted_hooks", "whole_by_tp_plan"]

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
    ("self_attn.q_proj", "colwise_gather_output"): "attn_q",
    ("self_attn.k_proj", "colwise_gather_output"): "attn_k",
    ("self_attn.v_proj", "colwise_gather_output"): "attn_v",
    ("self_attn.o_proj", "rowwise_split_input"): "attn_z",
    ("mlp.down_proj", "rowwise_split_input"): "mlp_post",
}
"""(module in a layer, transformers TP style) → the hook whose tensor that style leaves whole on
every rank: a column-parallel output gathered inside the module, or a row-parallel input split
inside it (its hook is the module's input)."""


def whole_by_tp_plan(tp_plan: Mapping[str, str] | None) -> dict[str, TPReplicated]:
    """The hooks a transformers TP plan (``config.base_model_tp_plan``: ``"layers.*.self_attn.q_proj"``
    → ``"colwise_gather_output"``, ...) leaves whole on every rank, where the catalogue takes them
    for shards — OLMoE's plan gathers q/k/v and splits o_proj's input inside the module. An
    attach under that plan starts from these (``tp_layout=`` still says otherwise per hook)."""
    whole = {}
    for pattern, style in (tp_plan or {}).items():
        hook = _WHOLE_BY_STYLE.get((pattern.removeprefix("layers.*."), style))
        if hook is not None:
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
