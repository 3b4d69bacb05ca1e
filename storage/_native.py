"""Byte loops of the hot path: the C extension built from ``native/`` where it exists, numpy otherwise.

Both give the same bytes (``tests/test_native.py`` holds them to it). The extension is built at
install when a C compiler is present (``setup.py``, ``optional=True``); ``DMI_NATIVE=0`` in the
environment turns it off for a process, which is how ``bench/bench_native.py`` measures one
against the other. What each loop is for and what it saved: ``docs/pack-format.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:
    from . import _native_ext
except ImportError:  # built without a compiler: the numpy loops below serve
    _native_ext = None

__all__ = [
    "ACTIVE",
    "BUILT",
    "MOMENT_LANES",
    "Moments",
    "Quantised",
    "SCALE_FLOOR",
    "split_planes",
    "join_planes",
    "moments",
    "gather_rows",
    "quantise",
]

BUILT = _native_ext is not None
"""Whether the C extension was built for this install."""
ACTIVE = BUILT and os.environ.get("DMI_NATIVE", "1") != "0"
"""Whether this process uses it (read once, at import)."""

_UINT_BY_WIDTH = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def split_planes(raw: np.ndarray, width: int, out: np.ndarray | None = None) -> list[np.ndarray]:
    """Byte planes of the contiguous uint8 array ``raw``: plane ``p`` holds byte ``p`` of each element.

    With ``out`` (a writable uint8 array of ``raw.nbytes``) the planes are written there back to
    back and returned as views of it; without, ``width == 1`` returns ``raw`` itself."""
    if out is None:
        if width == 1:
            return [raw]
        out = np.empty(raw.nbytes, np.uint8)
    n = raw.nbytes // width
    planes = [out[p * n : (p + 1) * n] for p in range(width)]
    if ACTIVE:
        _native_ext.split_planes(raw, width, out)
        return planes
    if width == 1:
        out[...] = raw
        return planes
    words = raw.view(_UINT_BY_WIDTH[width])  # shifts over whole words, not strided byte copies
    for p, plane in enumerate(planes):
        np.copyto(plane, words >> np.array(8 * p, words.dtype), casting="unsafe")
    return planes


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


MOMENT_LANES = 64
"""Lanes of :func:`moments` (the C loop's ``LANES``; ``tests/test_native.py`` holds them equal)."""

_MOMENT_KINDS = {np.dtype(np.float32): "f", np.dtype(np.float64): "d"}


@dataclass(frozen=True, slots=True)
class Moments:
    """What a record's statistics are made from: per-lane sums and sums of squares (float64;
    lane ``j`` adds elements ``j``, ``j + MOMENT_LANES``, ... in that order), and the smallest and
    largest value (NaN skipped: it shows as a NaN sum of squares)."""

    sums: np.ndarray
    squares: np.ndarray
    low: float
    high: float


def moments(values: np.ndarray, *, bf16: bool = False) -> Moments:
    """:class:`Moments` of the non-empty numeric array ``values`` (bf16 as its uint16 bits, with
    ``bf16=True``): one pass in C for bf16, float32 and float64, numpy column sums otherwise."""
    values = np.ascontiguousarray(values).reshape(-1)
    kind = "b" if bf16 else _MOMENT_KINDS.get(values.dtype)
    if ACTIVE and kind is not None:
        out = np.empty(2 * MOMENT_LANES + 2, np.float64)
        _native_ext.moments(values, kind, out)
        return Moments(out[:MOMENT_LANES], out[MOMENT_LANES : 2 * MOMENT_LANES], float(out[-2]), float(out[-1]))
    with np.errstate(all="ignore"):  # inf and NaN inputs give inf and NaN sums, by design
        narrow = _widen_bf16(values) if bf16 else values
        low, high = float(np.fmin.reduce(narrow)), float(np.fmax.reduce(narrow))  # NaN skipped
        low, high = (np.inf, -np.inf) if np.isnan(low) else (low, high)  # nothing but NaN
        wide = narrow.astype(np.float64)  # a copy of our own: squared in place below
        rows = wide.size // MOMENT_LANES
        body, tail = wide[: rows * MOMENT_LANES].reshape(rows, MOMENT_LANES), wide[rows * MOMENT_LANES :]
        sums = body.sum(axis=0)  # along the slow axis: each lane in order, as the C loop adds it
        sums[: tail.size] += tail
        np.multiply(wide, wide, out=wide)
        squares = body.sum(axis=0)
        squares[: tail.size] += tail
    return Moments(sums, squares, low, high)


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 values (their uint16 bits) as float32, exactly: bf16 is the top half of a float32."""
    words = bits.astype(np.uint32)
    words <<= 16
    return words.view(np.float32)


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


_QUANTISE_KINDS = {"float16": "h", "bfloat16": "b", "float32": "f"}
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_INT8_MAX = 127.0  # symmetric int8
SCALE_FLOOR = float(np.finfo(np.float32).tiny)
"""The smallest row scale, float32's smallest normal (2^-126): ``absmax / qmax`` below it (a
row whose values are all under about 5e-36 for fp8, 1.5e-36 for int8) would be a subnormal of
a few bits, or 0, which turns the row's zeros into NaN (``0 / 0``) and its other values into 0."""


@dataclass(frozen=True, slots=True)
class Quantised:
    """A lossy codec's work on rows of values: each row's float32 scale, each value's code byte
    (row after row), and ``decoded - original`` per value, float32 (float64 for float64 values),
    which is exact (``storage/_writer.py``'s ``lossy_errors`` says why)."""

    scales: np.ndarray
    codes: np.ndarray
    error: object  # a torch tensor shaped like the rows


def quantise(rows, *, fp8: bool) -> Quantised:
    """Quantise the 2-D floating tensor ``rows`` a row at a time: ``scale = absmax / 448`` and
    float8_e4m3fn codes of ``x / scale`` (``fp8=True``), or ``scale = absmax / 127`` and int8 codes
    of ``round(x / scale)``. ``absmax`` is the row's largest finite magnitude, so an infinity
    saturates to the largest code instead of making every value of its row NaN; a row with no
    finite non-zero value gets scale 1; a scale below :data:`SCALE_FLOOR` is raised to it; a NaN
    int8 code is 0.

    One pass a row in C for float16, bfloat16 and float32 (scale, codes and the error while the
    row sits in cache); torch's operations otherwise, rounding the same way at every step. The C
    loop knows no floor: the rare rows it gives a smaller scale are done again the torch way."""
    import torch

    kind = _QUANTISE_KINDS.get(str(rows.dtype).removeprefix("torch."))
    if not (ACTIVE and kind is not None and rows.numel()):
        return _quantise_torch(rows, fp8)
    rows = rows.contiguous()
    scales = np.empty(rows.shape[0], np.float32)
    codes = np.empty(rows.numel(), np.uint8)
    error = np.empty(rows.numel(), np.float32)  # numpy asks for huge pages: far fewer faults than torch.empty
    _native_ext.quantise(_bytes_of(rows), kind, rows.shape[1], "e" if fp8 else "i", scales, codes, error)
    _redo_below_floor(rows, fp8, scales, codes.reshape(rows.shape), error.reshape(rows.shape))
    return Quantised(scales, codes, torch.from_numpy(error).reshape(rows.shape))


def _redo_below_floor(rows, fp8: bool, scales: np.ndarray, codes: np.ndarray, error: np.ndarray) -> None:
    """Quantise again, in place and the torch way, the rows the C loop gave a scale below
    :data:`SCALE_FLOOR`, so that both ways give the same bytes."""
    import torch

    small = np.flatnonzero(scales < SCALE_FLOOR)
    if not small.size:
        return
    redone = _quantise_torch(rows[torch.from_numpy(small)], fp8)
    scales[small] = redone.scales
    codes[small] = redone.codes.reshape(len(small), -1)
    error[small] = redone.error.numpy()


def _quantise_torch(rows, fp8: bool) -> Quantised:
    import torch

    work_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    work = rows.to(work_dtype)
    qmax = _FP8_MAX if fp8 else _INT8_MAX
    finite = torch.where(work.isfinite(), work.abs(), 0.0)  # inf and NaN do not set the scale
    absmax = finite.amax(dim=1, keepdim=True) if work.numel() else work.new_zeros((work.shape[0], 1))
    scale = torch.where(absmax > 0, (absmax / qmax).to(torch.float32).clamp_min(SCALE_FLOOR), 1.0)
    scaled = work / scale.to(work_dtype)
    if fp8:
        quantised = scaled.to(torch.float8_e4m3fn)  # saturating: 448 for anything larger, inf too
    else:  # a NaN's int8 code is 0 by choice here, not by the platform's float-to-int conversion
        quantised = scaled.nan_to_num_(nan=0.0).round_().clamp_(-qmax, qmax).to(torch.int8)
    decoded = (quantised.to(torch.float32) * scale).to(rows.dtype)
    codes = quantised.view(torch.uint8).reshape(-1).numpy()
    return Quantised(scale.reshape(-1).numpy(), codes, decoded.to(work_dtype) - work)


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
