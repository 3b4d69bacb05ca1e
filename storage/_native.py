"""Byte loops of the hot path: the C extension built from ``native/`` where it exists, numpy otherwise.

Both give the same bytes (``tests/test_native.py`` holds them to it). The extension is built at
install when a C compiler is present (``setup.py``, ``optional=True``); ``DMI_NATIVE=0`` in the
environment turns it off for a process, which is how ``bench/bench_native.py`` measures one
against the other. What each loop is for and what it saved: ``docs/pack-format.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

try:
    from . import _native_ext
except ImportError:  # built without a compiler: the numpy loops below serve
    _native_ext = None

__all__ = ["ACTIVE", "BUILT", "split_planes", "join_planes", "widen_bf16", "gather_rows"]

BUILT = _native_ext is not None
"""Whether the C extension was built for this install."""
ACTIVE = BUILT and os.environ.get("DMI_NATIVE", "1") != "0"
"""Whether this process uses it (read once, at import)."""

_UINT_BY_WIDTH = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def split_planes(raw: np.ndarray, width: int) -> list[np.ndarray]:
    """Byte planes of the contiguous uint8 array ``raw``: plane ``p`` holds byte ``p`` of each element."""
    if width == 1:
        return [raw]
    if ACTIVE:
        out = np.empty(raw.nbytes, np.uint8)
        _native_ext.split_planes(raw, width, out)
        n = raw.nbytes // width
        return [out[p * n : (p + 1) * n] for p in range(width)]
    words = raw.view(_UINT_BY_WIDTH[width])  # shifts over whole words, not strided byte copies
    return [(words >> np.array(8 * p, words.dtype)).astype(np.uint8) for p in range(width)]


def join_planes(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`, into the writable uint8 array ``out``."""
    if len(planes) == 1:
        if planes[0] is not out:
            out[...] = planes[0]
        return
    if ACTIVE:
        _native_ext.join_planes(planes, out)
        return
    words = out.view(_UINT_BY_WIDTH[len(planes)])  # shifts and ors over whole words, not strided stores
    np.copyto(words, planes[0], casting="safe")
    wide = np.empty_like(words)
    for p, plane in enumerate(planes[1:], start=1):
        np.copyto(wide, plane, casting="safe")
        wide <<= np.array(8 * p, words.dtype)
        words |= wide


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 values (their uint16 bits) as float32, exactly: bf16 is the top half of a float32."""
    bits = np.ascontiguousarray(bits)
    if ACTIVE:
        out = np.empty(bits.size, np.float32)
        _native_ext.widen_bf16(bits, out)
        return out
    halves = np.zeros((bits.size, 2), dtype=np.uint16)
    halves[:, 1] = bits.reshape(-1)
    return halves.view(np.float32).reshape(-1)


def gather_rows(sources: Sequence, picks: np.ndarray, out) -> None:
    """``out[i] = sources[picks[i, 0]][picks[i, 1]]`` for 2-D contiguous torch tensors of one dtype
    and width: the training loader's shuffled window in one copy per row.

    ``out`` may be a view whose rows lie apart (``out.stride(1) == 1``), such as one feature's
    column block of a window that holds several: each feature lands in place, not in a
    temporary that is stacked afterwards. ``picks`` is an int64 array of (source, row) pairs; a
    pair outside its source raises ``IndexError`` naming it (never a row of a neighbouring source).
    """
    import torch

    picks = np.ascontiguousarray(picks, dtype=np.int64).reshape(-1, 2)
    if out.dim() != 2 or out.shape[0] != len(picks):
        raise ValueError(f"out must be [{len(picks)}, width], one row per pick; got {list(out.shape)}")
    if out.shape[0] > 1 and (out.stride(1) != 1 or out.stride(0) < out.shape[1]):
        raise ValueError(f"out's rows must each be contiguous and apart; got strides {list(out.stride())}")
    for i, t in enumerate(sources):
        if t.dim() != 2 or t.shape[1] != out.shape[1] or t.dtype != out.dtype:
            raise ValueError(f"source {i} is {t.dtype} {list(t.shape)}; out's rows are {out.dtype} [*, {out.shape[1]}]")
    if not len(picks):
        return
    if ACTIVE:
        row_bytes = out.shape[1] * out.element_size()
        out_stride = out.stride(0) * out.element_size() if len(picks) > 1 else row_bytes
        _native_ext.gather_rows([_bytes_of(t) for t in sources], picks, row_bytes, _rows_span(out), out_stride)
        return
    rows = np.array([t.shape[0] for t in sources], dtype=np.int64)
    src, row = picks[:, 0], picks[:, 1]
    outside = (src < 0) | (src >= len(sources))
    outside[~outside] = (row[~outside] < 0) | (row[~outside] >= rows[src[~outside]])
    if outside.any():
        bad = int(np.flatnonzero(outside)[0])
        raise IndexError(f"pick {bad} asks for row {row[bad]} of source {src[bad]}, which does not exist")
    starts = np.concatenate(([0], np.cumsum(rows)[:-1])).astype(np.int64)
    flat = torch.cat(list(sources)) if len(sources) != 1 else sources[0]
    index = torch.from_numpy(starts[src] + row)
    if out.is_contiguous():
        torch.index_select(flat, 0, index, out=out)
    else:
        out.copy_(torch.index_select(flat, 0, index))


def _rows_span(out) -> np.ndarray:
    """The bytes from ``out``'s first element to the end of its last row, as a uint8 array
    (shared, not copied): what the C loop writes ``out``'s rows into."""
    import torch

    size = out.element_size()
    span = ((out.shape[0] - 1) * out.stride(0) + out.shape[1]) * size
    whole = torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage())
    start = out.storage_offset() * size
    return whole[start : start + span].numpy()


def _bytes_of(tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a numpy uint8 array (shared, not copied)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("gather_rows needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8).numpy()
