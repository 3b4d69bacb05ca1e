"""Reassembly: the records of one (request, hook) back into one tensor.

Each record says which of its axes runs over its tokens (``token_axis``, recorded at
capture time from the hook catalogue). Per layer, chunks are ordered by ``start_token``
and joined along that axis; they must tile the token range without gaps or overlaps.
Layers are stacked in ascending order as ``[n_layers, ...]``; global hooks (layer
``GLOBAL_LAYER``) get no layer axis.

Tensor parallelism (records with ``tp_size > 1`` from one run and one DP/PP replica): by
default the shards of one chunk are merged into the model's tensor by their recorded
geometry (axis, offset, full shape), and every one of the ``tp_size`` ranks must be there —
a missing rank is a :class:`MissingShardError` naming the ranks present and missing, never a
narrower tensor. Records without geometry are replicated (every rank holds the whole
tensor, e.g. the residual stream, or GQA k/v with fewer heads than ranks): their copies are
de-duplicated, after checking they agree (same dtype, shape and values, NaN in the same
places). Shards of one chunk must share a dtype: a mixed group is a :class:`ShardMergeError`,
never promoted to the widest. ``shard_rank=`` selects one rank's records
instead; ``merge_shards=True`` is accepted and means the default. Anything else that puts two
records on the same (layer, start token) — two runs, two DP replicas, TP and non-TP records —
is a :class:`DuplicateChunkError`.

Records with a key axis (attention patterns, ``[heads, q_tokens, kv_tokens]``) see one
more key at each decode step. Their chunks are zero-filled on the key axis up to the
longest before joining: the result is the request's full causal pattern, whose entries
beyond each query's keys are the zeros causal attention puts there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from dmi.storage.errors import (
    DuplicateChunkError,
    InvalidArgumentError,
    MissingShardError,
    ReaderError,
    RecordNotFoundError,
    ShardMergeError,
)
from dmi.storage.records import GLOBAL_LAYER, RecordEntry

__all__ = ["assemble"]

def assemble(
    entries: Sequence[RecordEntry],
    tensors: Sequence[torch.Tensor],
    *,
    shard_rank: int | None = None,
    merge_shards: bool = False,
) -> torch.Tensor:
    """One tensor for one (request, hook): token order, stacked per layer; tensor-parallel
    records merged into the model's tensor unless ``shard_rank`` selects one rank's (see
    the module docstring). Raises :class:`MissingShardError` when a rank's shard is absent."""
    if len(entries) != len(tensors):
        raise InvalidArgumentError(f"{len(entries)} entries but {len(tensors)} tensors")
    if not entries:
        raise RecordNotFoundError("no records to assemble")
    if shard_rank is not None and merge_shards:
        raise InvalidArgumentError("pass shard_rank= or merge_shards=True, not both")
    request, hook = _single_scope(entries)
    pairs = list(zip(entries, tensors))
    if shard_rank is not None:
        pairs = [(e, t) for e, t in pairs if e.meta.key.shard_rank == shard_rank]
        if not pairs:
            ranks = sorted({e.meta.key.shard_rank for e in entries})
            raise RecordNotFoundError(f"request {request} hook {hook}: no records of shard rank {shard_rank} (ranks present: {ranks})")
    chunks: dict[int, dict[int, list[tuple[RecordEntry, torch.Tensor]]]] = defaultdict(lambda: defaultdict(list))
    for e, t in pairs:
        chunks[e.meta.key.layer][e.meta.key.start_token].append((e, t))
    layers = sorted(chunks)
    if GLOBAL_LAYER in layers and len(layers) > 1:
        raise ReaderError(f"request {request} hook {hook}: mixes the global layer with layers {layers[1:]}")
    merge = shard_rank is None  # one rank's records are returned as that rank stored them
    per_layer = [_layer_tensor(request, hook, layer, chunks[layer], merge) for layer in layers]
    if layers == [GLOBAL_LAYER]:
        return per_layer[0]
    shapes = {tuple(t.shape) for t in per_layer}
    if len(shapes) > 1:
        raise ReaderError(f"request {request} hook {hook}: layers have different shapes {sorted(shapes)}; cannot stack"
                          + _unpublished_tail(layers, chunks))
    _require_one_span_and_dtype(request, hook, layers, [min(chunks[layer]) for layer in layers], per_layer)
    return torch.stack(per_layer)


def _unpublished_tail(layers: list[int], chunks: dict) -> str:
    """What to say when the layers start at one token and end at different ones, as where the
    request is still being captured and its latest records are not all published (a capture
    publishes whole steps of every layer, so this is a sign of it, not a rule). Empty otherwise."""
    starts = {min(chunks[layer]) for layer in layers}
    ends = {layer: max(s + c[0][0].meta.key.n_tokens for s, c in chunks[layer].items()) for layer in layers}
    if len(starts) > 1 or len(set(ends.values())) == 1:
        return ""
    return (f". The layers end at different tokens ({', '.join(f'layer {k}: {v}' for k, v in ends.items())}), as "
            "while this request is still being captured and its latest records are not all published yet: "
            "read it again once the capture's `with` block has ended, or one layer at a time")


def _require_one_span_and_dtype(request: str, hook: str, layers: list[int], starts: list[int], per_layer: list) -> None:
    """Layers stack only where row ``t`` of each is the same token and the values one dtype:
    layers of equal shapes can still start at other tokens, and ``torch.stack`` would promote
    mixed dtypes without a word."""
    if len(set(starts)) > 1:
        spans = {layer: start for layer, start in zip(layers, starts)}
        raise ReaderError(f"request {request} hook {hook}: layers start at different tokens {spans}; "
                          "cannot stack them row for row, read them one layer at a time")
    dtypes = sorted({str(t.dtype) for t in per_layer})
    if len(dtypes) > 1:
        raise ReaderError(f"request {request} hook {hook}: layers hold different dtypes {dtypes}; "
                          "read them one layer at a time")


def _single_scope(entries: Sequence[RecordEntry]) -> tuple[str, str]:
    scopes = {(e.meta.key.request_id, e.meta.key.hook) for e in entries}
    if len(scopes) != 1:
        raise InvalidArgumentError(f"assemble takes the records of one (request, hook); got {sorted(scopes)}")
    return next(iter(scopes))


def _layer_tensor(request: str, hook: str, layer: int, by_start: dict, merge: bool) -> torch.Tensor:
    duplicated = sorted(s for s, group in by_start.items() if len(group) > 1 and not (merge and _one_tp_group(group)))
    if duplicated:
        group = by_start[duplicated[0]]
        ranks = sorted({e.meta.key.shard_rank for e, _ in group})
        runs = sorted({e.meta.key.run_id for e, _ in group})
        raise DuplicateChunkError(
            f"request {request} hook {hook} layer {layer}: more than one record starts at token(s) "
            f"{duplicated} (shard ranks {ranks}, runs {runs}, data/pipeline-parallel ranks {_replicas(group)}). "
            f"Choose one with shard_rank=<rank> or select a single run_id"
        )
    ordered = []
    for start in sorted(by_start):
        group = by_start[start]
        tensor = _tp_tensor(request, hook, layer, start, group) if merge and _one_tp_group(group) else group[0][1]
        ordered.append((group[0][0], tensor))
    return _concat_tokens(request, hook, layer, ordered)


def _replicas(group: list) -> list[tuple[int, int]]:
    return sorted({(e.meta.key.dp_rank, e.meta.key.pp_rank) for e, _ in group})


def _one_tp_group(group: list) -> bool:
    """Whether ``group`` holds tensor-parallel records of one run, one DP/PP replica and
    one TP degree (the records :func:`_tp_tensor` turns into the model's tensor)."""
    keys = [e.meta.key for e, _ in group]
    return keys[0].tp_size > 1 and len({(k.run_id, k.dp_rank, k.pp_rank, k.tp_size) for k in keys}) == 1


def _tp_tensor(request: str, hook: str, layer: int, start: int, group: list) -> torch.Tensor:
    """The model's tensor for one chunk from its TP ranks' records: shards merged, replicas
    de-duplicated."""
    where = f"request {request} hook {hook} layer {layer} token {start}"
    ranks = sorted(e.meta.key.shard_rank for e, _ in group)
    if len(set(ranks)) != len(ranks):
        raise DuplicateChunkError(f"{where}: shard rank(s) appear twice {ranks}; select a single run_id")
    sharded = [e.meta.shard is not None for e, _ in group]
    if not any(sharded):
        return _deduplicate(where, group)
    if not all(sharded):
        plain = sorted(e.meta.key.shard_rank for e, _ in group if e.meta.shard is None)
        raise ShardMergeError(f"{where}: ranks {plain} recorded no shard geometry while the others did; "
                              "read one rank with shard_rank=")
    _require_every_rank(where, ranks, group[0][0].meta.key.tp_size)
    return _merge(where, group)


def _require_every_rank(where: str, present: list[int], tp_size: int) -> None:
    missing = sorted(set(range(tp_size)) - set(present))
    if missing:
        raise MissingShardError(
            f"{where}: the shards of TP rank(s) {missing} of {tp_size} are missing (present: {present}), so the "
            f"full tensor cannot be formed; if a rank died, publish its sealed packs with `dmi recover`, or "
            f"read one rank with shard_rank=",
            present=tuple(present), missing=tuple(missing),
        )


def _deduplicate(where: str, group: list) -> torch.Tensor:
    """One copy of a tensor every rank holds whole; refused when the copies differ."""
    pieces = sorted(group, key=lambda p: p[0].meta.key.shard_rank)
    first = pieces[0][1]
    differing = [e.meta.key.shard_rank for e, t in pieces[1:] if not _same_copy(t, first)]
    if differing:
        raise ShardMergeError(f"{where}: the copies of this replicated tensor differ between TP rank "
                              f"{pieces[0][0].meta.key.shard_rank} and rank(s) {differing}; read each with shard_rank=")
    return first


def _same_copy(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor: same dtype, shape and values, NaN where the
    other has NaN. ``torch.equal`` alone would call identical copies holding a NaN different
    (NaN != NaN), and copies of different dtypes equal wherever the values happen to convert."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _merge(where: str, group: list) -> torch.Tensor:
    geoms = [e.meta.shard for e, _ in group]
    axes = {g.axis for g in geoms}
    fulls = {tuple(g.full_shape) for g in geoms}
    if len(axes) != 1 or len(fulls) != 1:
        raise ShardMergeError(f"{where}: shards disagree on axis {sorted(axes)} or full shape {sorted(fulls)}")
    axis, full = axes.pop(), fulls.pop()
    _require_one_dtype(where, group)
    offsets = sorted(g.offset for g in geoms)
    if len(set(offsets)) != len(offsets):
        raise ShardMergeError(
            f"{where}: several ranks hold the same slice (offsets {offsets}) — the tensor is replicated "
            f"across ranks (e.g. GQA k/v with fewer heads than ranks); read one rank with shard_rank="
        )
    pieces = sorted(group, key=lambda p: p[0].meta.shard.offset)
    pos = 0
    for e, t in pieces:
        if e.meta.shard.offset != pos or t.dim() != len(full):
            raise ShardMergeError(f"{where}: shards do not tile axis {axis} of {full} (gap or overlap at {pos})")
        other_axes = tuple(t.shape[:axis] + t.shape[axis + 1 :])
        if other_axes != full[:axis] + full[axis + 1 :]:
            raise ShardMergeError(f"{where}: TP rank {e.meta.key.shard_rank}'s shard {tuple(t.shape)} does not "
                                  f"fit the full shape {full} off axis {axis}; read each rank with shard_rank=")
        pos += t.shape[axis]
    merged = torch.cat([t for _, t in pieces], dim=axis)
    if tuple(merged.shape) != full:
        raise ShardMergeError(f"{where}: merged shape {tuple(merged.shape)} is not the recorded full shape {full}")
    return merged


def _require_one_dtype(where: str, group: list) -> None:
    """Shards join only in one dtype: ``torch.cat`` would promote a mixed group to the widest
    without a word, returning values no rank recorded in a dtype none of them stored."""
    dtypes = {str(t.dtype) for _, t in group}
    if len(dtypes) > 1:
        ordered = sorted(group, key=lambda p: p[0].meta.key.shard_rank)
        per_rank = {e.meta.key.shard_rank: str(t.dtype) for e, t in ordered}
        raise ShardMergeError(f"{where}: the TP ranks' shards hold different dtypes {per_rank}; "
                              "read each rank with shard_rank=")


def _concat_tokens(request: str, hook: str, layer: int, ordered: list) -> torch.Tensor:
    where = f"request {request} hook {hook} layer {layer}"
    if len(ordered) == 1:
        return ordered[0][1]
    layouts = {(e.meta.token_axis, e.meta.key_axis) for e, _ in ordered}
    if len(layouts) > 1:
        raise ReaderError(f"{where}: chunks record different token layouts {sorted(layouts, key=str)}")
    axis, key_axis = layouts.pop()
    expected = ordered[0][0].meta.key.start_token
    for e, t in ordered:
        k = e.meta.key
        if k.start_token != expected:
            kind = "missing" if k.start_token > expected else "overlapping"
            raise ReaderError(f"{where}: tokens {min(expected, k.start_token)}..{max(expected, k.start_token)} {kind} between chunks")
        if t.dim() <= axis or t.shape[axis] != k.n_tokens:
            raise ReaderError(
                f"{where}: record at token {k.start_token} has shape {tuple(t.shape)}, tokens not on axis {axis}"
            )
        expected += k.n_tokens
    tensors = [t for _, t in ordered]
    if key_axis is not None:
        tensors = _zero_fill_keys(where, tensors, key_axis)
    tails = {tuple(t.shape[:axis] + t.shape[axis + 1 :]) for t in tensors}
    if len(tails) > 1:
        raise ReaderError(f"{where}: chunks have different trailing shapes {sorted(tails)}; read them one by one")
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) > 1:
        raise ReaderError(f"{where}: chunks hold different dtypes {dtypes}; read them one by one")
    return torch.cat(tensors, dim=axis)


def _zero_fill_keys(where: str, tensors: list[torch.Tensor], key_axis: int) -> list[torch.Tensor]:
    """Chunks widened on ``key_axis`` to the longest, with zeros (see module doc)."""
    if any(t.dim() <= key_axis for t in tensors):
        raise ReaderError(f"{where}: key axis {key_axis} is missing from shapes {[tuple(t.shape) for t in tensors]}")
    keys = max(t.shape[key_axis] for t in tensors)
    widened = []
    for t in tensors:
        missing = keys - t.shape[key_axis]
        if missing:
            fill = torch.zeros((*t.shape[:key_axis], missing, *t.shape[key_axis + 1 :]), dtype=t.dtype)
            t = torch.cat([t, fill], dim=key_axis)
        widened.append(t)
    return widened
