"""The C loops of ``native/`` give exactly the bytes of the numpy code they replace.

Where the extension was not built (no compiler at install) these tests skip, except when
``DMI_REQUIRE_NATIVE=1`` (``.ci/run`` sets it): there a missing extension fails.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dmi.storage import _codecs, _native, _writer

REQUIRED = os.environ.get("DMI_REQUIRE_NATIVE") == "1"

pytestmark = pytest.mark.skipif(not _native.BUILT and not REQUIRED, reason="native extension not built (no C compiler at install)")


def test_the_extension_is_built_and_used():
    assert _native.BUILT, "dmi.storage._native_ext missing: reinstall with a C compiler (pip install -e .)"
    assert _native.ACTIVE or os.environ.get("DMI_NATIVE") == "0"


@pytest.fixture
def numpy_loops(monkeypatch):
    """Run the numpy loops in this process, as DMI_NATIVE=0 would."""
    monkeypatch.setattr(_native, "ACTIVE", False)


def _both(monkeypatch, fn):
    """``fn()`` with the C loops, then with numpy's."""
    monkeypatch.setattr(_native, "ACTIVE", True)
    native = fn()
    monkeypatch.setattr(_native, "ACTIVE", False)
    return native, fn()


def _random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("elements", [0, 1, 7, 4099, 250_000])
def test_split_and_join_are_byte_identical_to_numpy(monkeypatch, width, elements):
    raw = _random_bytes(width * elements, seed=elements + width)
    native, reference = _both(monkeypatch, lambda: [p.copy() for p in _native.split_planes(raw, width)])
    assert len(native) == len(reference) == width
    for p, (a, b) in enumerate(zip(native, reference)):
        assert np.array_equal(a, b), f"plane {p}"
        assert np.array_equal(a, raw[p::width]), f"plane {p} is not byte {p} of each element"

    def split_into_out():
        out = np.full(raw.nbytes, 0xA5, np.uint8)
        planes = _native.split_planes(raw, width, out)
        assert all(np.shares_memory(plane, out) for plane in planes if plane.nbytes)
        return out

    into_native, into_numpy = _both(monkeypatch, split_into_out)
    assert np.array_equal(into_native, into_numpy)
    assert np.array_equal(into_native, np.concatenate(native) if width > 1 else raw)


    def join():
        out = np.empty_like(raw)
        _native.join_planes(reference, out)
        return out

    joined_native, joined_numpy = _both(monkeypatch, join)
    assert np.array_equal(joined_native, raw)
    assert np.array_equal(joined_numpy, raw)


def test_moment_lanes_are_the_c_loops():
    assert _native._native_ext.MOMENT_LANES == _native.MOMENT_LANES


def _same_floats(a, b) -> bool:
    """Bit for bit (the sign of zero included), a NaN matching any NaN: which NaN an addition
    gives depends on operand order in the hardware, and no statistic tells NaNs apart."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint64), b[~nan].view(np.uint64))


def _same_moments(a: _native.Moments, b: _native.Moments) -> bool:
    return _same_floats(a.sums, b.sums) and _same_floats(a.squares, b.squares) and _same_floats([a.low, a.high], [b.low, b.high])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("elements", [1, 7, 63, 64, 65, 4099, 250_001])
def test_moments_are_bit_identical_to_numpy(monkeypatch, dtype, elements):
    rng = np.random.default_rng(elements)
    values = (rng.standard_normal(elements) * np.exp(rng.standard_normal(elements) * 8)).astype(dtype)
    native, reference = _both(monkeypatch, lambda: _native.moments(values))
    assert _same_moments(native, reference)
    assert (native.low, native.high) == (values.min(), values.max())


def test_moments_of_every_bf16_value_are_bit_identical_to_numpy(monkeypatch):
    bits = np.arange(1 << 16, dtype=np.uint16)  # all of them: NaNs, infinities, subnormals, -0
    finite = bits[np.isfinite(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy())]
    for values in (bits, finite, finite[::-1].copy()):
        native, reference = _both(monkeypatch, lambda: _native.moments(values, bf16=True))
        assert _same_moments(native, reference)
    as_float = torch.from_numpy(finite.view(np.int16)).view(torch.bfloat16).double()
    assert (native.low, native.high) == (as_float.min().item(), as_float.max().item())


def test_numpy_lanes_add_each_lane_in_order(numpy_loops):
    """The C loop's order, written out: lane j is ((0 + x[j]) + x[j + L]) + ... — not pairwise."""
    lanes = _native.MOMENT_LANES
    values = np.random.default_rng(1).standard_normal(lanes * 300 + 5) * 1e6
    values[::7] *= 1e12  # large and small mixed: any other order rounds differently
    expected_sums, expected_squares = [0.0] * lanes, [0.0] * lanes
    for i, v in enumerate(values.tolist()):
        expected_sums[i % lanes] += v
        expected_squares[i % lanes] += v * v
    got = _native.moments(values)
    assert got.sums.tolist() == expected_sums
    assert got.squares.tolist() == expected_squares


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "values",
    [
        [1.5, float("nan"), -3.0],
        [float("inf"), float("-inf"), 2.0],
        [-0.0] * 200,
        [3e38, 3e38, -1.0],
    ],
    ids=["nan", "inf-minus-inf", "negative-zeros", "near-max"],
)
def test_record_statistics_of_special_values_are_identical(monkeypatch, dtype, values):
    tensor = torch.tensor(values * 3, dtype=torch.float32).to(dtype)
    native, reference = _both(monkeypatch, lambda: _writer._stats(tensor))
    assert _same_floats([native.l2_norm, native.mean, native.absmax], [reference.l2_norm, reference.mean, reference.absmax])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_split_zstd_payloads_and_decodes_are_identical(monkeypatch, dtype):
    values = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    raw = values.contiguous().view(torch.uint8).numpy().reshape(-1)
    itemsize = values.element_size()
    native, reference = _both(monkeypatch, lambda: bytes(_codecs.encode("split-zstd", raw, itemsize)))
    assert native == reference

    def decode():
        out = np.empty_like(raw)
        _codecs.decode("split-zstd", reference, out, itemsize)
        return out

    decoded_native, decoded_numpy = _both(monkeypatch, decode)
    assert np.array_equal(decoded_native, raw)
    assert np.array_equal(decoded_numpy, raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_record_statistics_are_identical(monkeypatch, dtype):
    tensor = (torch.randn(32, 577, generator=torch.Generator().manual_seed(5)) * 7).to(dtype)
    native, reference = _both(monkeypatch, lambda: _writer._stats(tensor))
    assert native == reference
    exact = tensor.to(torch.float64)
    assert native.absmax == exact.abs().max().item()
    assert native.l2_norm == pytest.approx(exact.norm().item(), rel=1e-12)
    assert native.mean == pytest.approx(exact.mean().item(), rel=1e-9)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda ext: ext.split_planes(np.zeros(6, np.uint8), 4, np.zeros(6, np.uint8)), "multiples of 4"),
        (lambda ext: ext.split_planes(np.zeros(8, np.uint8), 2, np.zeros(6, np.uint8)), "multiples of 2"),
        (lambda ext: ext.split_planes(np.zeros(9, np.uint8), 3, np.zeros(9, np.uint8)), "width must be 1, 2, 4 or 8"),
        (lambda ext: ext.join_planes([np.zeros(3, np.uint8)] * 3, np.zeros(9, np.uint8)), "1, 2, 4 or 8 planes"),
        (lambda ext: ext.join_planes([np.zeros(4, np.uint8), np.zeros(3, np.uint8)], np.zeros(8, np.uint8)), "plane 1 holds 3 bytes"),
        (lambda ext: ext.join_planes([np.zeros(4, np.uint8)] * 2, np.zeros(7, np.uint8)), "not a multiple of 2 planes"),
        (lambda ext: ext.moments(np.zeros(3, np.uint8), "b", np.zeros(130)), "whole 2-byte values"),
        (lambda ext: ext.moments(np.zeros(4, np.float32), "f", np.zeros(129)), "130 float64"),
        (lambda ext: ext.moments(np.zeros(4, np.float32), "h", np.zeros(130)), "kind must be"),
        (lambda ext: ext.quantise(np.zeros(8, np.uint8), "d", 2, "e", *_quantise_out(2, 2)), "kind must be"),
        (lambda ext: ext.quantise(np.zeros(8, np.uint8), "b", 2, "x", *_quantise_out(2, 2)), "codec must be"),
        (lambda ext: ext.quantise(np.zeros(8, np.uint8), "b", 0, "e", *_quantise_out(2, 2)), "row_len must be"),
        (lambda ext: ext.quantise(np.zeros(8, np.uint8), "b", 3, "e", *_quantise_out(1, 3)), "rows of 3"),
        (lambda ext: ext.quantise(np.zeros(8, np.uint8), "b", 2, "e", *_quantise_out(1, 4)), "rows of 2"),
        (lambda ext: ext.quantise(np.zeros(8, np.uint8), "f", 2, "i", *_quantise_out(2, 2)), "rows of 2"),
    ],
)
def test_sizes_that_do_not_fit_are_refused_not_overrun(call, message):
    with pytest.raises(ValueError, match=message):
        call(_native._native_ext)


def test_read_only_output_is_refused():
    out = np.zeros(8, np.uint8)
    out.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        _native._native_ext.split_planes(np.zeros(8, np.uint8), 2, out)


@pytest.mark.parametrize("setting, active", [("0", False), ("1", True)])
def test_dmi_native_0_turns_it_off_for_a_process(setting, active):
    code = "from dmi.storage import _native; print(_native.ACTIVE)"
    env = {**os.environ, "DMI_NATIVE": setting}
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert shown.strip() == str(active)


def _sources(dtype=torch.bfloat16, width=48):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(n, width, generator=g).to(dtype) for n in (5, 1, 17, 9)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_gather_rows_is_identical_to_indexing_and_to_numpy(monkeypatch, dtype):
    sources = _sources(dtype)
    rng = np.random.default_rng(2)
    src = rng.integers(0, len(sources), 300)
    picks = np.stack([src, [rng.integers(0, sources[s].shape[0]) for s in src]], axis=1)

    def gather():
        out = torch.empty(len(picks), 48, dtype=dtype)
        _native.gather_rows(sources, picks, out)
        return out

    native, reference = _both(monkeypatch, gather)
    expected = torch.stack([sources[s][r] for s, r in picks])
    assert torch.equal(native.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(reference.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("layout", ["stack", "concat"])
def test_gather_rows_writes_one_block_of_a_wider_window_in_place(monkeypatch, layout):
    """A feature's rows land in their slot of a window holding three features, on both paths;
    the other features' bytes are left as they were."""
    sources = _sources()
    picks = np.array([(2, 16), (0, 4), (3, 0), (2, 3), (1, 0)])

    def gather():
        window = torch.full((5, 3 * 48), -7.0, dtype=torch.bfloat16)
        place = window.view(5, 3, 48)[:, 1] if layout == "stack" else window[:, 48:96]
        _native.gather_rows(sources, picks, place)
        return window

    native, reference = _both(monkeypatch, gather)
    expected = torch.full((5, 3 * 48), -7.0, dtype=torch.bfloat16)
    expected[:, 48:96] = torch.stack([sources[s][r] for s, r in picks])
    assert torch.equal(native.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(reference.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("active", [True, False])
def test_gather_rows_refuses_rows_that_overlap_or_are_not_contiguous(monkeypatch, active):
    monkeypatch.setattr(_native, "ACTIVE", active)
    base = torch.zeros(4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"contiguous and apart; got strides \[96, 2\]"):
        _native.gather_rows(_sources(), np.array([(0, 0)] * 4), base[:, ::2])
    overlapping = base.view(-1).as_strided((4, 48), (24, 1))
    with pytest.raises(ValueError, match=r"contiguous and apart; got strides \[24, 1\]"):
        _native.gather_rows(_sources(), np.array([(0, 0)] * 4), overlapping)
    assert not base.any()


def test_the_c_loop_refuses_a_stride_shorter_than_a_row():
    out = np.zeros(96, np.uint8)
    with pytest.raises(ValueError, match="out_stride at least row_bytes"):
        _native._native_ext.gather_rows([np.zeros(96, np.uint8)], np.zeros((1, 2), np.int64), 96, out, 48)


@pytest.mark.parametrize("active", [True, False])
@pytest.mark.parametrize("pick", [(0, 5), (1, 1), (4, 0), (-1, 0), (2, -1)])
def test_gather_rows_refuses_a_row_its_source_does_not_have(monkeypatch, active, pick):
    """Row 5 of a 5-row source is not row 0 of the next one: refused on both paths."""
    monkeypatch.setattr(_native, "ACTIVE", active)
    out = torch.empty(2, 48, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match=f"pick 1 asks for row {pick[1]} of source {pick[0]}"):
        _native.gather_rows(_sources(), np.array([(0, 0), pick]), out)


@pytest.mark.parametrize("active", [True, False])
def test_gather_rows_refuses_sources_of_another_width_or_dtype(monkeypatch, active):
    monkeypatch.setattr(_native, "ACTIVE", active)
    out = torch.empty(1, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"source 0 is torch.bfloat16 \[5, 48\]"):
        _native.gather_rows(_sources(), np.array([(0, 0)]), out)
    with pytest.raises(ValueError, match="source 0 is torch.float32"):
        _native.gather_rows(_sources(torch.float32), np.array([(0, 0)]), torch.empty(1, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one row per pick"):
        _native.gather_rows(_sources(), np.array([(0, 0), (0, 1)]), torch.empty(1, 48, dtype=torch.bfloat16))


def _quantise_out(rows: int, row_len: int):
    """The quantiser's outputs for ``rows`` rows of ``row_len`` values: scales, codes, error."""
    return np.empty(rows, np.float32), np.empty(rows * row_len, np.uint8), np.empty(rows * row_len, np.float32)


def _every_value(dtype) -> torch.Tensor:
    """All 65536 values of a 16-bit float dtype, NaNs and infinities included."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


def _quantise_cases():
    g = torch.Generator().manual_seed(13)
    for dtype in (torch.bfloat16, torch.float16):
        every = _every_value(dtype)
        finite = every[torch.isfinite(every.float())]
        yield f"every {dtype} value, rows of 256", every.reshape(-1, 256)
        yield f"every {dtype} value shuffled, rows of 64", every[torch.randperm(65536, generator=g)].reshape(-1, 64)
        yield f"every finite {dtype} value shuffled", finite[torch.randperm(finite.numel(), generator=g)][:61440].reshape(-1, 128)
        scales = torch.logspace(-8, 4, 512).reshape(-1, 1)
        yield f"{dtype} activations of many scales", (torch.randn(512, 1024, generator=g) * scales).to(dtype)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    yield "random float32 bit patterns", bits.view(torch.float32).reshape(-1, 256)
    yield "random float32 bit patterns, rows of 4", bits.view(torch.float32).reshape(-1, 4)
    yield "float32 of many scales", torch.randn(1024, 512, generator=g) * torch.logspace(-30, 30, 1024).reshape(-1, 1)
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45, 3.4e38, 1.0, 448.0, 449.0, 464.0, 480.0]
    yield "pairs of special float32 values", torch.tensor([[a, b] for a in special for b in special])
    yield "all-zero rows", torch.zeros(3, 8)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "int8"])
def test_the_quantiser_is_identical_to_torch(monkeypatch, fp8):
    """Scales and codes byte for byte, errors value for value (NaN where torch has NaN: its
    payload bits are the platform's), for every 16-bit float, float32 bit patterns and the
    special values, against the torch operations it replaces."""
    for label, rows in _quantise_cases():
        native, reference = _both(monkeypatch, lambda: _native.quantise(rows, fp8=fp8))
        assert native.scales.tobytes() == reference.scales.tobytes(), label
        assert native.codes.tobytes() == reference.codes.tobytes(), label
        assert native.error.dtype == reference.error.dtype == torch.float32, label
        assert torch.equal(native.error.isnan(), reference.error.isnan()), label
        assert torch.equal(native.error.nan_to_num(), reference.error.nan_to_num()), label


def test_the_quantiser_saturates_fp8_and_stores_int8_nan_as_zero(monkeypatch):
    """What torch 2.13 does, pinned: fp8 gives 448 (code 0x7E) for anything larger, infinity
    included, and keeps NaN (0x7F); int8 has no NaN, so a NaN stores code 0. Both loops choose
    that 0 explicitly (a float-to-int conversion of NaN is undefined in C and C++); on x86-64
    the unguarded conversions happen to give 0 as well, so this pins the result, not the guard."""
    rows = torch.tensor([[1.0, 2.0, float("inf"), float("nan"), -448.0]])  # finite absmax 448: fp8 scale 1
    for active in (True, False):
        monkeypatch.setattr(_native, "ACTIVE", active)
        fp8 = _native.quantise(rows, fp8=True)
        assert fp8.scales.tolist() == [1.0], active
        assert fp8.codes.tolist() == [0x38, 0x40, 0x7E, 0x7F, 0xFE], active
        int8 = _native.quantise(rows, fp8=False)
        assert int8.scales.tolist() == [np.float32(448.0) / np.float32(127.0)], active
        assert int8.codes.view(np.int8).tolist() == [0, 1, 127, 0, -127], active
