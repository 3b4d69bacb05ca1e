"""Payload codecs and the record checksum.

Every record's payload is encoded on its own, so one record is one byte range of the
pack file. Three codecs exist (see ``docs/pack-format.md`` for the measurements that
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

All heavy work (numpy shifts, zstd, xxh3) runs in C without the GIL.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import xxhash
import zstandard

__all__ = ["CODECS", "DEFAULT_CODEC", "CodecError", "checksum", "encode", "decode"]

CODECS = ("raw", "zstd", "split-zstd")
DEFAULT_CODEC = "split-zstd"

_PLANE_RAW = 0
_PLANE_ZSTD = 1
_HEADER = struct.Struct("<BB")  # format tag, number of planes
_PLANE_ENTRY = struct.Struct("<BQ")  # plane codec, stored length
_SPLIT_TAG = 1
_SAMPLE = 64 * 1024
_SAMPLE_MIN_GAIN = 0.90  # keep a plane raw unless its sample shrinks below 90 %

_UINT_BY_WIDTH = {2: np.uint16, 4: np.uint32, 8: np.uint64}

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
    """XXH3-64 of the stored bytes, as an unsigned int (≈ 40 GB/s, so reads can afford it)."""
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
    raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")


def decode(codec: str, stored, out: np.ndarray, itemsize: int) -> None:
    """Decode ``stored`` into the writable uint8 array ``out`` (exactly the raw size).

    Raises :class:`CodecError` when the payload cannot produce exactly ``out.nbytes``.
    """
    try:
        if codec == "raw":
            _copy_exact(stored, out)
        elif codec == "zstd":
            _zstd_into(stored, out)
        elif codec == "split-zstd":
            _decode_split(stored, out, itemsize)
        else:
            raise CodecError(f"unknown codec {codec!r}")
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd: {exc}") from exc


def _plane_count(itemsize: int) -> int:
    return min(itemsize, 8)


def _planes(raw: np.ndarray, width: int) -> list[np.ndarray]:
    """Byte planes of ``raw``; vectorised shifts are ~10x faster than strided copies."""
    if width == 1:
        return [raw]
    words = raw.view(_UINT_BY_WIDTH[width])
    return [(words >> np.array(8 * p, words.dtype)).astype(np.uint8) for p in range(width)]


def _encode_split(raw: np.ndarray, itemsize: int) -> bytes:
    width = _plane_count(itemsize)
    compressor = _compressor("plane")
    header = [_HEADER.pack(_SPLIT_TAG, width)]
    bodies = []
    for plane in _planes(raw, width):
        stored, kind = plane, _PLANE_RAW
        if _worth_compressing(compressor, plane):
            packed = compressor.compress(plane)
            if len(packed) < plane.nbytes:
                stored, kind = packed, _PLANE_ZSTD
        header.append(_PLANE_ENTRY.pack(kind, len(stored) if kind else plane.nbytes))
        bodies.append(stored)
    return b"".join([*header, *bodies])


def _worth_compressing(compressor, plane: np.ndarray) -> bool:
    if plane.nbytes <= _SAMPLE:
        return plane.nbytes > 0
    sample = plane[:_SAMPLE]
    return len(compressor.compress(sample)) < _SAMPLE_MIN_GAIN * _SAMPLE


def _decode_split(stored, out: np.ndarray, itemsize: int) -> None:
    view = memoryview(stored).cast("B")
    if len(view) < _HEADER.size:
        raise CodecError("split payload shorter than its header")
    tag, width = _HEADER.unpack_from(view, 0)
    if tag != _SPLIT_TAG or width != _plane_count(itemsize):
        raise CodecError(f"split header tag={tag} planes={width} does not fit itemsize {itemsize}")
    if out.nbytes % width:
        raise CodecError("raw size is not a whole number of elements")
    entries_end = _HEADER.size + width * _PLANE_ENTRY.size
    if len(view) < entries_end:
        raise CodecError("split payload shorter than its plane table")
    pos = entries_end
    plane_len = out.nbytes // width
    planes = []
    for p in range(width):
        kind, length = _PLANE_ENTRY.unpack_from(view, _HEADER.size + p * _PLANE_ENTRY.size)
        chunk = view[pos : pos + length]
        if len(chunk) != length:
            raise CodecError(f"plane {p} runs past the end of the payload")
        pos += length
        if kind == _PLANE_RAW:
            if length != plane_len:
                raise CodecError(f"raw plane {p} holds {length} bytes, expected {plane_len}")
            planes.append(np.frombuffer(chunk, dtype=np.uint8))
        elif kind == _PLANE_ZSTD:
            target = out if width == 1 else np.empty(plane_len, np.uint8)
            _zstd_into(chunk, target)
            planes.append(target)
        else:
            raise CodecError(f"plane {p} has unknown codec {kind}")
    if pos != len(view):
        raise CodecError(f"{len(view) - pos} trailing bytes after the last plane")
    _interleave(planes, out)


def _interleave(planes: list[np.ndarray], out: np.ndarray) -> None:
    """Inverse of :func:`_planes`: shifts and ors on whole words, ~3x faster than strided stores."""
    if len(planes) == 1:
        if planes[0] is not out:
            out[...] = planes[0]
        return
    words = out.view(_UINT_BY_WIDTH[len(planes)])
    np.copyto(words, planes[0], casting="safe")
    wide = np.empty_like(words)
    for p, plane in enumerate(planes[1:], start=1):
        np.copyto(wide, plane, casting="safe")
        wide <<= np.array(8 * p, words.dtype)
        words |= wide


def _copy_exact(stored, out: np.ndarray) -> None:
    src = np.frombuffer(stored, dtype=np.uint8)
    if src.nbytes != out.nbytes:
        raise CodecError(f"stored {src.nbytes} bytes, expected {out.nbytes}")
    out[...] = src


def _zstd_into(stored, out: np.ndarray) -> None:
    """Decompress one zstd frame straight into ``out``; refuse a size mismatch."""
    params = zstandard.get_frame_parameters(stored)
    if params.content_size != out.nbytes:
        raise CodecError(f"zstd frame holds {params.content_size} bytes, expected {out.nbytes}")
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
