"""Codecs: bit-exact round trips, the ratio that chose the default, refusal of bad payloads."""

import numpy as np
import pytest
import torch

from dmi.storage import _codecs
from dmi.storage._codecs import CODECS, DEFAULT_CODEC, CodecError, checksum, decode, encode


def activation_like(tokens=512, hidden=2048, seed=0) -> torch.Tensor:
    """Heavy-tailed values with a few outlier channels, like a residual stream, in bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) / torch.rand(tokens, hidden, generator=g).clamp_min(0.05).sqrt()
    x[:, torch.randperm(hidden, generator=g)[:8]] *= 40
    return (x * 0.5).to(torch.bfloat16)


def raw_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def round_trip(codec, raw, itemsize):
    stored = encode(codec, raw, itemsize)
    out = np.empty_like(raw)
    decode(codec, np.frombuffer(stored, np.uint8) if not isinstance(stored, np.ndarray) else stored, out, itemsize)
    return out


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n_items", [0, 1, 3, 1000, 70_000])
def test_round_trip_bit_exact(codec, itemsize, n_items):
    rng = np.random.default_rng(n_items + itemsize)
    raw = rng.integers(0, 256, n_items * itemsize, dtype=np.uint8)
    raw[: raw.size // 2] = 7  # a compressible half, so zstd planes are exercised too
    assert np.array_equal(round_trip(codec, raw, itemsize), raw)


def test_default_codec_ratio_on_bf16_activations():
    raw = raw_of(activation_like())
    ratio = raw.nbytes / len(encode(DEFAULT_CODEC, raw, 2))
    plain = raw.nbytes / len(encode("zstd", raw, 2))
    assert ratio >= 1.40, ratio
    assert ratio > plain + 0.1, (ratio, plain)


def test_split_keeps_random_planes_raw():
    """The bf16 low byte (mantissa) is near random: stored raw, not zstd-framed."""
    raw = raw_of(activation_like(tokens=64))
    stored = memoryview(encode("split-zstd", raw, 2))
    kinds = [stored[_codecs._HEADER.size + p * _codecs._PLANE_ENTRY.size] for p in range(2)]
    assert kinds == [_codecs._PLANE_RAW, _codecs._PLANE_ZSTD]


def _split_payload_by_the_format(raw: np.ndarray, itemsize: int, kinds: list[int]) -> bytes:
    """docs/pack-format.md's split payload, assembled piece by piece: the header, one table entry
    per plane, then each plane's body (raw, or one zstd frame of the plane parameters)."""
    import struct

    import zstandard

    planes = [raw.reshape(-1, itemsize)[:, p].copy() for p in range(itemsize)]
    compressor = zstandard.ZstdCompressor(compression_params=_codecs._PLANE_PARAMS)
    bodies = [compressor.compress(plane) if kind else plane.tobytes() for plane, kind in zip(planes, kinds)]
    table = [struct.pack("<BQ", kind, len(body)) for kind, body in zip(kinds, bodies)]
    return b"".join([struct.pack("<BB", 1, itemsize), *table, *bodies])


@pytest.mark.parametrize("itemsize, compressible", [
    (2, [False, True]), (2, [True, False]), (4, [True, False, True, False]), (4, [False, True, False, True]),
    (8, [True, True, False, True, False, False, True, False]), (1, [True]), (1, [False]),
])
def test_split_payload_is_the_documented_layout_whatever_planes_compress(itemsize, compressible):
    """The encoder builds the payload in one buffer, moving each stored plane down over planes
    already read: a raw plane after a compressed one is moved, and must arrive intact."""
    n = 3 * _codecs._SAMPLE_ABOVE
    rng = np.random.default_rng(itemsize)
    elements = rng.integers(0, 256, (n, itemsize), dtype=np.uint8)
    for p, flat in enumerate(compressible):
        if flat:
            elements[:, p] = rng.integers(0, 2, n, dtype=np.uint8)  # one bit of entropy: zstd takes it
    raw = elements.reshape(-1)
    kinds = [_codecs._PLANE_ZSTD if flat else _codecs._PLANE_RAW for flat in compressible]
    assert _plane_kinds(raw, itemsize) == kinds
    assert bytes(encode("split-zstd", raw, itemsize)) == _split_payload_by_the_format(raw, itemsize, kinds)
    assert np.array_equal(round_trip("split-zstd", raw, itemsize), raw)


def _plane_kinds(raw: np.ndarray, itemsize: int) -> list[int]:
    stored = memoryview(encode("split-zstd", raw, itemsize))
    return [stored[_codecs._HEADER.size + p * _codecs._PLANE_ENTRY.size] for p in range(itemsize)]


def test_large_plane_is_judged_by_its_sample():
    """Above _SAMPLE_ABOVE bytes a plane is compressed only if its first _SAMPLE bytes compress:
    random first bytes keep a plane raw even though the rest would compress."""
    n = 2 * _codecs._SAMPLE_ABOVE
    plane = np.zeros(n, np.uint8)
    plane[: _codecs._SAMPLE] = np.random.default_rng(0).integers(0, 256, _codecs._SAMPLE, dtype=np.uint8)
    assert _plane_kinds(plane, 1) == [_codecs._PLANE_RAW]
    assert _plane_kinds(plane[::-1].copy(), 1) == [_codecs._PLANE_ZSTD]


def test_small_plane_is_compressed_whole():
    """Up to _SAMPLE_ABOVE bytes there is no sample: the whole plane is tried."""
    plane = np.zeros(_codecs._SAMPLE_ABOVE, np.uint8)
    plane[: _codecs._SAMPLE] = np.random.default_rng(0).integers(0, 256, _codecs._SAMPLE, dtype=np.uint8)
    assert _plane_kinds(plane, 1) == [_codecs._PLANE_ZSTD]


@pytest.mark.parametrize("codec", ["zstd", "split-zstd", "raw"])
def test_wrong_size_refused(codec):
    raw = raw_of(activation_like(tokens=8))
    stored = np.frombuffer(encode(codec, raw, 2), np.uint8) if codec != "raw" else raw
    with pytest.raises(CodecError):
        decode(codec, stored, np.empty(raw.nbytes + 2, np.uint8), 2)


@pytest.mark.parametrize("cut", [1, 5, 100])
def test_truncated_split_payload_refused(cut):
    raw = raw_of(activation_like(tokens=8))
    stored = bytes(encode("split-zstd", raw, 2))
    with pytest.raises(CodecError):
        decode("split-zstd", stored[:-cut], np.empty_like(raw), 2)


def test_trailing_bytes_refused():
    raw = raw_of(activation_like(tokens=8))
    stored = bytes(encode("split-zstd", raw, 2)) + b"\0"
    with pytest.raises(CodecError, match="trailing"):
        decode("split-zstd", stored, np.empty_like(raw), 2)


def test_plane_count_must_fit_dtype():
    raw = raw_of(activation_like(tokens=8))
    stored = bytes(encode("split-zstd", raw, 2))
    with pytest.raises(CodecError, match="planes"):
        decode("split-zstd", stored, np.empty_like(raw), 4)


def test_zstd_frame_with_wrong_content_size_refused():
    a = np.zeros(1000, np.uint8)
    stored = encode("zstd", a, 1)
    with pytest.raises(CodecError, match="holds 1000"):
        decode("zstd", stored, np.empty(999, np.uint8), 1)


def test_unknown_codec():
    with pytest.raises(ValueError):
        encode("lz5", np.zeros(4, np.uint8), 1)
    with pytest.raises(CodecError):
        decode("lz5", b"", np.zeros(0, np.uint8), 1)


def test_checksum_is_xxh3_64():
    assert checksum(b"") == 0x2D06800538D394C2
    assert checksum(b"a") != checksum(b"b")
    assert 0 <= checksum(np.arange(100, dtype=np.uint8)) < 2**64


def test_raw_plane_sizes_must_match():
    """Plane lengths that sum right but split wrong are refused, not broadcast."""
    n = 100
    header = _codecs._HEADER.pack(_codecs._SPLIT_TAG, 2)
    table = _codecs._PLANE_ENTRY.pack(_codecs._PLANE_RAW, n - 1) + _codecs._PLANE_ENTRY.pack(_codecs._PLANE_RAW, n + 1)
    with pytest.raises(CodecError, match="raw plane 0"):
        decode("split-zstd", header + table + bytes(2 * n), np.empty(2 * n, np.uint8), 2)
