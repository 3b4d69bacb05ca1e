"""Payload codecs and the record checksum.

Every record's payload is encoded on its own, so one record is one byte range of the
pack file. Three lossless codecs exist (see ``docs/pack-format.md`` for the measurements that
chose the default):

``raw``
    The tensor's bytes, little-endian, C order.
``zstd``
    zstd level 1 over the raw bytes.
``split-zstd`` (the default)
    The raw bytes split into byte planes (plane ``p`` holds byte ``p`` of every
    element, ``min(itemsize, 8)`` planes); each plane is zstd-compressed with parameters
    tuned for entropy coding (short hash table, long minimum match) when a sample of it
    compresses, and kept raw otherwise. On bf16 activations the high byte (sign and
    exponent) compresses ~2.7x and the low byte (mantissa) is close to random, so this
    spends zstd's time only where it pays.

Two lossy codecs are opt-in, for floating-point records only (integer values are refused
with :class:`~dmi.storage.errors.LossyCodecError`). A *row* is the record's last axis (for a
``[tokens, hidden]`` record: one token's features); each row gets its own float32 scale:

``fp8``
    ``float8_e4m3fn`` of ``x / scale`` with ``scale = row absmax / 448``: each element within
    ``2^-4`` of its row's absmax (3 mantissa bits), half the bytes of bf16.
``int8``
    ``round(x / scale)`` with ``scale = row absmax / 127`` (symmetric): each element within
    ``scale / 2``.

A scale below float32's smallest normal (``2^-126``: a row whose values are all under about
``5e-36``, ``1.5e-36`` for int8) is raised to it — a subnormal scale holds few bits, and one that underflowed to 0
made the row's zeros NaN — so such a row's elements are within ``2^-136`` (fp8's smallest step
on that scale, or ``2^-4`` of the row's absmax where larger) or ``2^-127`` (int8). Scales and
decoded values are float32: a float64 record holding a finite value beyond float32's largest
is refused (:class:`~dmi.storage.errors.LossyCodecError`).

A lossy payload is self-describing (original dtype, rows, row length, scales, then the
quantised bytes, zstd-compressed where a sample shows it pays), so decoding returns the
original dtype. :func:`encode_lossy` also returns ``decoded - original`` per value, from which
the writer measures what was lost (``codec_max_abs_error``, ``codec_rel_l2_error`` in every
record). The quantiser is one C pass a row (:func:`~dmi.storage._native.quantise`).

All heavy work (the byte-plane loops of ``native/`` or numpy's, zstd, xxh3) runs in C without the GIL.
"""

from __future__ import annotations

import functools
import math
import struct
import threading

import numpy as np
import xxhash
import zstandard

from dmi.storage._native import join_planes, quantise, split_planes
from dmi.storage.errors import LossyCodecError

__all__ = ["CODECS", "LOSSY_CODECS", "DEFAULT_CODEC", "CodecError", "checksum", "encode", "encode_lossy", "decode"]

CODECS = ("raw", "zstd", "split-zstd")
"""The lossless codecs: decoding gives back the exact bytes."""
LOSSY_CODECS = ("fp8", "int8")
"""The opt-in lossy codecs: decoding gives back the dtype and shape, within each codec's bound."""
DEFAULT_CODEC = "split-zstd"

_PLANE_RAW = 0
_PLANE_ZSTD = 1
_HEADER = struct.Struct("<BB")  # format tag, number of planes
_PLANE_ENTRY = struct.Struct("<BQ")  # plane codec, stored length
_SPLIT_TAG = 1
_SAMPLE_ABOVE = 64 * 1024  # planes up to this size are compressed whole, without a sample
_SAMPLE = 8 * 1024  # the prefix of a larger plane that decides whether zstd runs on it
_SAMPLE_MIN_GAIN = 0.90  # keep a plane raw unless its sample shrinks below 90 %
_ZSTD_BLOCK_MAX = 128 * 1024  # zstd's Block_Maximum_Size: no block decodes to more
_ZSTD_MIN_BLOCK = 4  # stored bytes of the cheapest block that decodes to anything (RLE)


# Entropy-coding oriented parameters: activations have almost no long repeats, so a
# tiny hash table and min_match=7 skip most of the match search that makes level 1 slow
# on byte planes, while the literals still get Huffman-coded (negative levels do not).
# Chosen by a sweep on bf16 activation high bytes (docs/pack-format.md).
_PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)


_local = threading.local()


def _compressor(kind: str) -> zstandard.ZstdCompressor:
    """One compressor per thread and kind: contexts are reused, never shared across threads."""
    cached = getattr(_local, kind, None)
    if cached is None:
        if kind == "plane":
            cached = zstandard.ZstdCompressor(compression_params=_PLANE_PARAMS)
        else:
            cached = zstandard.ZstdCompressor(level=1)
        setattr(_local, kind, cached)
    return cached


class CodecError(ValueError):
    """A stored payload cannot be decoded; the reader turns it into PackCorruptError."""


def checksum(data) -> int:
    """XXH3-64 of the stored bytes, as an unsigned int: fast enough that every read verifies it
    (its measured rate: docs/pack-format.md, "Checksum")."""
    return xxhash.xxh3_64_intdigest(data)


def encode(codec: str, raw: np.ndarray, itemsize: int):
    """Encode the contiguous uint8 array ``raw`` (elements of ``itemsize`` bytes).

    Returns a buffer-like object (bytes or a numpy array) holding the stored payload.
    """
    if codec == "raw":
        return raw
    if codec == "zstd":
        return _compressor("plain").compress(raw)
    if codec == "split-zstd":
        return _encode_split(raw, itemsize)
    if codec in LOSSY_CODECS:
        raise ValueError(f"{codec} is lossy and needs the tensor: use encode_lossy")
    raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")


def decode(codec: str, stored, out, itemsize: int) -> np.ndarray:
    """Decode ``stored`` into ``out`` and return it: the writable uint8 array of exactly the raw
    size, or a function ``out(nbytes)`` giving one, called once the payload's headers have said
    how many bytes it decodes to — so that a reader checks that size against the record's
    before taking a buffer of it (a damaged size could ask for gigabytes).

    Raises :class:`CodecError` when the payload cannot produce exactly ``out.nbytes``.
    """
    try:
        if callable(out):
            out = out(_decoded_size(codec, memoryview(stored).cast("B"), itemsize))
        if codec == "raw":
            _copy_exact(stored, out)
        elif codec == "zstd":
            _zstd_into(stored, out)
        elif codec == "split-zstd":
            _decode_split(stored, out, itemsize)
        elif codec in LOSSY_CODECS:
            _decode_lossy(codec, stored, out, itemsize)
        else:
            raise CodecError(f"unknown codec {codec!r}")
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from exc
    return out


def _decoded_size(codec: str, view: memoryview, itemsize: int) -> int:
    """The raw bytes the payload ``view`` decodes to, from its headers alone."""
    if codec == "raw":
        return len(view)
    if codec == "zstd":
        return _frame_size(view)
    if codec == "split-zstd":
        return sum(len(chunk) if kind == _PLANE_RAW else _frame_size(chunk) for kind, chunk in _split_table(view, itemsize))
    if codec in LOSSY_CODECS:
        dtype, rows, row_len, *_ = _lossy_layout(codec, view, itemsize)
        return rows * row_len * dtype.itemsize
    raise CodecError(f"unknown codec {codec!r}")


def _frame_size(frame) -> int:
    """The content size a zstd frame's header declares, refused above what a frame of its
    length can decode to: a damaged or hostile header must not size a buffer."""
    content_size = zstandard.get_frame_parameters(frame).content_size
    stored_len = memoryview(frame).nbytes
    if content_size > _frame_limit(stored_len):
        raise CodecError(
            f"zstd frame of {stored_len} bytes claims {content_size} bytes of content, more than a "
            f"valid frame of that length can hold ({_frame_limit(stored_len)}); the payload is damaged"
        )
    return content_size


def _frame_limit(stored_len: int) -> int:
    """The most bytes a zstd frame of ``stored_len`` bytes can decode to. A block decodes to
    at most 128 KiB (the format's Block_Maximum_Size) and costs at least 4 stored bytes (a
    3-byte block header and the one byte an RLE block repeats), so no frame expands more than
    32768-fold; libzstd's best, on zeros, is about 32,500."""
    return stored_len // _ZSTD_MIN_BLOCK * _ZSTD_BLOCK_MAX


def _plane_count(itemsize: int) -> int:
    return min(itemsize, 8)


def _encode_split(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """The split payload, built in one buffer: the planes are split to their places after the
    header, and each stored plane moves down over what was read already (a compressed plane
    is shorter than the plane it replaces), so no second copy of the whole payload is made."""
    width = _plane_count(itemsize)
    start = _HEADER.size + width * _PLANE_ENTRY.size
    out = np.empty(start + raw.nbytes, np.uint8)
    _HEADER.pack_into(out, 0, _SPLIT_TAG, width)
    compressor = _compressor("plane")
    end = start
    for p, plane in enumerate(split_planes(raw, width, out[start:])):
        kind, stored = _PLANE_RAW, plane
        if _worth_compressing(compressor, plane):
            packed = compressor.compress(plane)
            if len(packed) < plane.nbytes:
                kind, stored = _PLANE_ZSTD, np.frombuffer(packed, np.uint8)
        if stored is not plane or end != start + p * plane.nbytes:
            out[end : end + stored.nbytes] = stored  # overlapping only a plane already read
        _PLANE_ENTRY.pack_into(out, _HEADER.size + p * _PLANE_ENTRY.size, kind, stored.nbytes)
        end += stored.nbytes
    return out[:end]


def _worth_compressing(compressor, plane: np.ndarray) -> bool:
    """Whether zstd may pay on ``plane``, judged from its first bytes.

    The sample's compression is work thrown away when the plane compresses, so it is kept
    small: on activations a plane is either close to random or compresses throughout, and
    8 KiB tells the two apart (docs/pack-format.md)."""
    if plane.nbytes <= _SAMPLE_ABOVE:
        return plane.nbytes > 0
    sample = plane[:_SAMPLE]
    return len(compressor.compress(sample)) < _SAMPLE_MIN_GAIN * _SAMPLE


def _split_table(view: memoryview, itemsize: int) -> list[tuple[int, memoryview]]:
    """A split payload's planes as ``(kind, stored bytes)``, its header and plane table checked."""
    if len(view) < _HEADER.size:
        raise CodecError("split payload shorter than its header")
    tag, width = _HEADER.unpack_from(view, 0)
    if tag != _SPLIT_TAG or width != _plane_count(itemsize):
        raise CodecError(f"split header tag={tag} planes={width} does not fit itemsize {itemsize}")
    entries_end = _HEADER.size + width * _PLANE_ENTRY.size
    if len(view) < entries_end:
        raise CodecError("split payload shorter than its plane table")
    pos = entries_end
    planes = []
    for p in range(width):
        kind, length = _PLANE_ENTRY.unpack_from(view, _HEADER.size + p * _PLANE_ENTRY.size)
        chunk = view[pos : pos + length]
        if len(chunk) != length:
            raise CodecError(f"plane {p} runs past the end of the payload")
        if kind not in (_PLANE_RAW, _PLANE_ZSTD):
            raise CodecError(f"plane {p} has unknown codec {kind}")
        pos += length
        planes.append((kind, chunk))
    if pos != len(view):
        raise CodecError(f"{len(view) - pos} trailing bytes after the last plane")
    return planes


def _decode_split(stored, out: np.ndarray, itemsize: int) -> None:
    table = _split_table(memoryview(stored).cast("B"), itemsize)
    width = len(table)
    if out.nbytes % width:
        raise CodecError("raw size is not a whole number of elements")
    plane_len = out.nbytes // width
    planes = []
    for p, (kind, chunk) in enumerate(table):
        if kind == _PLANE_RAW:
            if len(chunk) != plane_len:
                raise CodecError(f"raw plane {p} holds {len(chunk)} bytes, expected {plane_len}")
            planes.append(np.frombuffer(chunk, dtype=np.uint8))
        else:
            target = out if width == 1 else np.empty(plane_len, np.uint8)
            _zstd_into(chunk, target)
            planes.append(target)
    join_planes(planes, out)


def _copy_exact(stored, out: np.ndarray) -> None:
    src = np.frombuffer(stored, dtype=np.uint8)
    if src.nbytes != out.nbytes:
        raise CodecError(f"stored {src.nbytes} bytes, expected {out.nbytes}")
    out[...] = src


def _zstd_into(stored, out: np.ndarray) -> None:
    """Decompress one zstd frame straight into ``out``; refuse a size mismatch."""
    content_size = _frame_size(stored)
    if content_size != out.nbytes:
        raise CodecError(f"zstd frame holds {content_size} bytes, expected {out.nbytes}")
    reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False)
    view = memoryview(out).cast("B") if out.nbytes else memoryview(bytearray(0))
    filled = 0
    while filled < out.nbytes:
        n = reader.readinto(view[filled:])
        if n == 0:
            raise CodecError(f"zstd frame ended after {filled} of {out.nbytes} bytes")
        filled += n
    if reader.read(1):
        raise CodecError("zstd frame longer than expected")


# --- lossy codecs -------------------------------------------------------------------------

_LOSSY_TAGS = {"fp8": 2, "int8": 3}
_LOSSY_HEADER = struct.Struct("<BBQQ")  # codec tag, original dtype code, rows, row length
_LOSSY_DTYPES = ("float16", "bfloat16", "float32", "float64")  # code = index + 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def encode_lossy(codec: str, tensor):
    """Quantise the floating tensor ``tensor`` with ``codec`` (``fp8`` or ``int8``).

    Returns ``(stored bytes, error)``: the payload, and what :func:`decode` will give back minus
    ``tensor``, per value (float32; float64 for float64 values; ``tensor``'s shape), for
    measuring the loss. Raises ``ValueError`` for a dtype the codec cannot hold (the writer
    refuses those first), :class:`LossyCodecError` for float64 values beyond float32's range.
    """
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _LOSSY_DTYPES:
        raise ValueError(f"{codec} stores {', '.join(_LOSSY_DTYPES)} only, not {name}")
    _check_float32_range(codec, tensor)
    rows2d = tensor.reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)
    quantised = quantise(rows2d, fp8=codec == "fp8")
    header = _LOSSY_HEADER.pack(_LOSSY_TAGS[codec], _LOSSY_DTYPES.index(name) + 1, *rows2d.shape)
    payload = header + quantised.scales.tobytes() + _plane_bytes(quantised.codes)
    return payload, quantised.error.reshape(tensor.shape)


def _check_float32_range(codec: str, tensor) -> None:
    """Refuse a float64 tensor holding a finite value beyond float32's largest: scales and
    decoded values are float32, so such a value would decode to infinity (or its whole row to
    NaN, its scale being infinite)."""
    import torch

    if tensor.dtype != torch.float64 or not tensor.numel():
        return
    finite = tensor.abs().nan_to_num(nan=0.0, posinf=0.0)
    largest = float(finite.max())
    if largest > _FLOAT32_MAX:
        raise LossyCodecError(
            f"{codec} scales and decodes in float32, and this float64 record holds {largest:.6g}, beyond "
            f"float32's largest ({_FLOAT32_MAX:.6g}); store it with a lossless codec (raw, zstd, split-zstd)"
        )


def _dequantise(quantised, scale, dtype):
    return (_widen(quantised) * scale).to(dtype)


def _widen(quantised):
    """float32 values of int8 or float8_e4m3fn codes. fp8 goes through a table of its 256 codes
    built by torch's own conversion (the same values, NaN included) instead of that conversion,
    which goes an element at a time."""
    import torch

    if quantised.dtype != torch.float8_e4m3fn:
        return quantised.to(torch.float32)
    codes = quantised.contiguous().view(torch.uint8).numpy()
    return torch.from_numpy(np.take(_fp8_values(), codes))


@functools.cache
def _fp8_values() -> np.ndarray:
    """float32 value of each float8_e4m3fn code (the code is the index)."""
    import torch

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    values.setflags(write=False)  # shared by every decode
    return values


def _plane_bytes(plane: np.ndarray) -> bytes:
    """One byte plane, zstd-compressed when that pays (plane entry + body)."""
    compressor = _compressor("plane")
    if _worth_compressing(compressor, plane):
        packed = compressor.compress(plane)
        if len(packed) < plane.nbytes:
            return _PLANE_ENTRY.pack(_PLANE_ZSTD, len(packed)) + packed
    return _PLANE_ENTRY.pack(_PLANE_RAW, plane.nbytes) + plane.tobytes()


def _lossy_layout(codec: str, view: memoryview, itemsize: int):
    """``(dtype, rows, row length, scales, plane codec, plane body)`` of a lossy payload, every
    size its header claims checked against the bytes stored: ``rows`` scales must fit, the plane
    must hold exactly ``rows * row length`` codes (a zstd plane by its frame header, itself
    bounded by its stored length), so that a damaged or hostile header cannot size a buffer
    beyond what the payload can decode to."""
    import torch

    if len(view) < _LOSSY_HEADER.size + _PLANE_ENTRY.size:
        raise CodecError(f"{codec} payload shorter than its header")
    tag, dtype_code, rows, row_len = _LOSSY_HEADER.unpack_from(view, 0)
    if tag != _LOSSY_TAGS[codec] or not 1 <= dtype_code <= len(_LOSSY_DTYPES):
        raise CodecError(f"{codec} header tag={tag} dtype code={dtype_code} is not a {codec} payload")
    dtype = getattr(torch, _LOSSY_DTYPES[dtype_code - 1])
    if dtype.itemsize != itemsize:
        raise CodecError(f"{codec} payload holds {dtype}, not elements of {itemsize} bytes")
    pos = _LOSSY_HEADER.size
    if len(view) < pos + 4 * rows + _PLANE_ENTRY.size:
        raise CodecError(f"{codec} payload of {len(view)} bytes is shorter than its {rows} scales")
    scales = view[pos : pos + 4 * rows]
    pos += 4 * rows
    kind, length = _PLANE_ENTRY.unpack_from(view, pos)
    body = view[pos + _PLANE_ENTRY.size :]
    if len(body) != length:
        raise CodecError(f"{codec} plane holds {len(body)} bytes, its entry says {length}")
    if kind not in (_PLANE_RAW, _PLANE_ZSTD):
        raise CodecError(f"{codec} plane has unknown codec {kind}")
    codes = len(body) if kind == _PLANE_RAW else _frame_size(body)
    if codes != rows * row_len:
        raise CodecError(f"{codec} header claims {rows}x{row_len} values but its plane holds {codes} codes")
    return dtype, rows, row_len, scales, kind, body


def _decode_lossy(codec: str, stored, out: np.ndarray, itemsize: int) -> None:
    import torch

    dtype, rows, row_len, scales, kind, body = _lossy_layout(codec, memoryview(stored).cast("B"), itemsize)
    if rows * row_len * dtype.itemsize != out.nbytes:
        raise CodecError(f"{codec} payload holds {rows}x{row_len} {dtype}, not {out.nbytes} raw bytes")
    plane = np.empty(rows * row_len, np.uint8)
    if kind == _PLANE_ZSTD:
        _zstd_into(body, plane)
    else:
        _copy_exact(body, plane)
    qtype = torch.float8_e4m3fn if codec == "fp8" else torch.int8
    quantised = torch.from_numpy(plane).view(qtype).reshape(rows, row_len)
    row_scales = torch.from_numpy(np.frombuffer(scales, dtype=np.float32).copy()).reshape(rows, 1)
    decoded = _dequantise(quantised, row_scales, dtype)
    out[...] = decoded.reshape(-1).view(torch.uint8).numpy()
