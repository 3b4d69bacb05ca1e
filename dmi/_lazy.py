"""``LazyInternal``: one hook of one request as a tensor-like view that reads on demand.

Making the view costs one catalog query and no payload read; ``shape``, ``dtype``,
``layers`` and ``len()`` come from the index rows. Indexing reads only the records the
index touches: ``view[2]`` reads layer 2 of a per-layer hook, ``view[:, 10:20]`` reads
only the records that overlap tokens 10..19 of every layer. Every read verifies its
checksum, exactly like ``Store.get_internal``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dmi._values import PhaseSpan, decode_start, phase_spans
from dmi.storage import torch_dtype
from dmi.storage.records import GLOBAL_LAYER, RecordEntry, RecordMeta

__all__ = ["LazyInternal"]

class LazyInternal:
    """A lazily read ``[layers, tokens, ...]`` (per-layer hook) or ``[tokens, ...]`` (global hook).

    Made by ``Store.lazy``. Positions on the first axis of a per-layer view are positions
    in ``layers`` (``view[0]`` is the first stored layer, like ``get_internal(...)[0]``);
    ``view.layer(n)`` reads layer number ``n``. ``token_axis`` is the axis of ``shape`` that
    runs over tokens, from the layout recorded with the records (``attn_pattern``: its
    query axis, after the heads).
    """

    __slots__ = ("model_id", "request_id", "hook", "_entries", "_read", "layers", "per_layer", "dtype", "shape",
                 "token_axis", "_merged")

    def __init__(
        self,
        model_id: str,
        request_id: str,
        hook: str,
        entries: Sequence[RecordEntry],
        read: Callable[[list[RecordEntry]], torch.Tensor],
        *,
        merged: bool = True,
    ):
        self.model_id = model_id
        self.request_id = request_id
        self.hook = hook
        self._entries = tuple(entries)
        self._read = read
        self._merged = merged  # TP shards are read merged (full shapes), else one rank's as stored
        layers = sorted({e.meta.key.layer for e in self._entries})
        self.per_layer = layers != [GLOBAL_LAYER]
        self.layers: tuple[int, ...] = tuple(layers) if self.per_layer else ()
        self.dtype: torch.dtype = torch_dtype(self._entries[0].meta.dtype)
        self.shape: torch.Size = self._infer_shape()
        self.token_axis: int = self._entries[0].meta.token_axis + (1 if self.per_layer else 0)

    def _infer_shape(self) -> torch.Size:
        """The assembled shape from the index rows of the first layer: the tokens of every
        chunk on the token axis, the longest key axis (zero-filled on read), full TP shapes."""
        first_layer = self.layers[0] if self.per_layer else GLOBAL_LAYER
        chunks: dict[int, RecordEntry] = {}
        for e in self._entries:
            if e.meta.key.layer == first_layer:
                chunks.setdefault(e.meta.key.start_token, e)
        ordered = [chunks[s].meta for s in sorted(chunks)]
        shape_of = _full_shape if self._merged else (lambda meta: meta.shape)
        inner = list(shape_of(ordered[0]))
        if inner:
            inner[ordered[0].token_axis] = sum(m.key.n_tokens for m in ordered)
            key_axis = ordered[0].key_axis
            if key_axis is not None:
                inner[key_axis] = max(shape_of(m)[key_axis] for m in ordered)
        return torch.Size((len(self.layers), *inner) if self.per_layer else inner)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (
            f"LazyInternal(model_id={self.model_id!r}, request_id={self.request_id!r}, hook={self.hook!r}, "
            f"shape={tuple(self.shape)}, dtype={self.dtype}, records={len(self._entries)})"
        )

    @property
    def phases(self) -> tuple[PhaseSpan, ...]:
        """Which positions of the token axis are prefill and which decode (from the index rows;
        nothing is read): e.g. ``(PhaseSpan("prefill", 0, 7), PhaseSpan("decode", 7, 10))``."""
        return phase_spans(e.meta.key for e in self._entries)

    @property
    def positions(self) -> tuple[int, ...]:
        """The request position of each index on the token axis (from the index rows; nothing
        is read): ``(0, 1, ..., 9)`` for a prompt of 7 and 3 decode steps, ``(6, 7, 8, 9)``
        for its ``logits`` (the last prompt position, then one per step)."""
        first = min((e.meta.key.layer, e.meta.key.shard_rank) for e in self._entries)
        chunks = {e.meta.key.start_token: e.meta.key.n_tokens for e in self._entries
                  if (e.meta.key.layer, e.meta.key.shard_rank) == first}
        return tuple(p for start in sorted(chunks) for p in range(start, start + chunks[start]))

    @property
    def decode_start(self) -> int | None:
        """The first decode position on the token axis (the prefill/decode boundary);
        ``None`` when the view holds no decode step."""
        return decode_start(self.phases)

    @property
    def records(self) -> int:
        """How many records back this view (what reading all of it would fetch)."""
        return len(self._entries)

    @property
    def metas(self) -> tuple[RecordMeta, ...]:
        """The index rows of the records behind this view (nothing is read): each record's
        key, codec and the codec's measured error among them."""
        return tuple(e.meta for e in self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor once decoded."""
        return math.prod(self.shape) * self.dtype.itemsize

    def layer(self, number: int) -> torch.Tensor:
        """The tensor of layer number ``number``; ``KeyError`` if the view does not hold it."""
        if number not in self.layers:
            raise KeyError(f"layer {number} is not in this view (layers {list(self.layers)})")
        return self[self.layers.index(number)]

    def read(self) -> torch.Tensor:
        """The whole tensor (same as ``view[...]``)."""
        return self._read(list(self._entries))

    def __getitem__(self, index: Any) -> torch.Tensor:
        parts = index if isinstance(index, tuple) else (index,)
        if not parts or not all(isinstance(p, (int, slice)) and not isinstance(p, bool) for p in parts):
            return self.read()[index]  # Ellipsis, None, masks, tensors: read all, let torch index
        entries = list(self._entries)
        final: list[Any] = []
        if self.per_layer:
            selected = _positions(parts[0], len(self.layers))
            if not selected:
                return torch.empty((0, *self.shape[1:]), dtype=self.dtype)[(slice(None), *parts[1:])]
            ascending = sorted(set(selected))
            keep = {self.layers[i] for i in ascending}
            entries = [e for e in entries if e.meta.key.layer in keep]
            final.append(0 if isinstance(parts[0], int) else [ascending.index(i) for i in selected])
            parts = parts[1:]
        if parts and self.token_axis == (1 if self.per_layer else 0):  # tokens lead: read only the records hit
            entries, token_index = _select_tokens(entries, parts[0], self.shape[1 if self.per_layer else 0])
            parts = (token_index, *parts[1:])
        return self._read(entries)[(*final, *parts)]


def _full_shape(meta) -> tuple[int, ...]:
    return meta.shard.full_shape if meta.shard is not None and meta.key.tp_size > 1 else meta.shape


def _positions(part: int | slice, length: int) -> list[int]:
    """Positions ``part`` selects among ``length`` layers (an int out of range is an ``IndexError``)."""
    if isinstance(part, int):
        if not -length <= part < length:
            raise IndexError(f"layer position {part} is out of range for {length} layers")
        return [part % length]
    _check_step(part)
    return list(range(length))[part]


def _check_step(part: slice) -> None:
    if part.step is not None and part.step <= 0:
        raise ValueError("step must be greater than zero")  # what torch says for the same index


def _select_tokens(entries: list[RecordEntry], part: int | slice, n_tokens: int) -> tuple[list[RecordEntry], Any]:
    """Keep only the records overlapping the token positions ``part`` selects; re-base ``part``
    onto the first kept record. An empty slice keeps every record."""
    if isinstance(part, int):
        if not -n_tokens <= part < n_tokens:
            raise IndexError(f"token position {part} is out of range for {n_tokens} tokens")
        lo = hi = part % n_tokens
    else:
        _check_step(part)
        start, stop, step = part.indices(n_tokens)
        positions = range(start, stop, step)
        if not positions:
            return entries, part
        lo, hi = positions[0], positions[-1]
    base = min(e.meta.key.start_token for e in entries)
    chosen = [
        e for e in entries
        if e.meta.key.start_token <= base + hi and e.meta.key.start_token + e.meta.key.n_tokens > base + lo
    ]
    shift = min(e.meta.key.start_token for e in chosen) - base
    if isinstance(part, int):
        return chosen, lo - shift
    return chosen, slice(start - shift, stop - shift, step)
