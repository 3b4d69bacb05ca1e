"""Opt-in lossy codecs (fp8, int8): error within each codec's bound, the measured error in the
pack footer and the catalog row equal to an independent recomputation, lossless unchanged,
integer values refused."""

from __future__ import annotations

import math

import pytest
import torch

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.reader import read_records
from dmi.storage import LOSSY_CODECS, PackStore, PackWriter, read_pack_descriptor
from dmi.storage.errors import LossyCodecError
from dmi.storage.records import RecordKey

from ._models import left_padded_batch, tiny

BOUNDS = {
    "fp8": lambda rowmax: rowmax * 2.0**-4,  # 3 mantissa bits: half a step of 2^-3, relative to the row max
    "int8": lambda rowmax: rowmax / 127 / 2,  # half the scale
}


def key(i: int = 0, hook: str = "resid_post") -> RecordKey:
    return RecordKey("m", "r", f"q{i}", hook, 0, 0, 8)


def activations(dtype) -> torch.Tensor:
    """Rows of very different magnitudes (outlier features, a zero row): per-row scales matter."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 96, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)
    x[2] = 0
    x[5, 7] = 1e4
    return x.to(dtype)


def write_and_read(tmp_path, tensors, codec):
    """Entries as the sealed pack's own footer describes them (not the writer's memory), and
    the tensors read back from the file."""
    store = PackStore.local(tmp_path)
    writer = PackWriter(store, codec=codec)
    for i, t in enumerate(tensors):
        writer.append(key(i), t)
    sealed = writer.close()
    entries = list(read_pack_descriptor(store, sealed.pack_id).records)
    assert list(map(repr, entries)) == list(map(repr, sealed.records))  # repr: NaN fields compare equal
    return entries, read_records(store, entries)


def recomputed(original: torch.Tensor, decoded: torch.Tensor) -> tuple[float, float]:
    """The error fields, recomputed element by element in float64 (independently of the writer)."""
    o = original.double().reshape(-1).tolist()
    d = decoded.double().reshape(-1).tolist()
    diffs = [b - a for a, b in zip(o, d)]
    norm = math.sqrt(sum(a * a for a in o))
    return max(abs(e) for e in diffs), math.sqrt(sum(e * e for e in diffs)) / norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_round_trip_within_bound_and_error_fields_match_recomputation(tmp_path, codec, dtype):
    x = activations(dtype)
    (entry,), (got,) = write_and_read(tmp_path, [x], codec)
    assert got.dtype == dtype and got.shape == x.shape and entry.meta.codec == codec
    err = (got.double() - x.double()).abs()
    rowmax = x.double().abs().amax(dim=1, keepdim=True)
    # the decoded value is rounded once more to the original dtype: allow that dtype's half-ulp
    slack = x.double().abs() * torch.finfo(dtype).eps
    assert bool((err <= BOUNDS[codec](rowmax) + slack).all())
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # a zero row stays zero
    max_abs, rel = recomputed(x, got)
    assert entry.meta.codec_max_abs_error == max_abs  # exact: the writer's difference loses nothing
    assert entry.meta.codec_rel_l2_error == pytest.approx(rel, rel=1e-9)
    assert 0 < entry.meta.codec_rel_l2_error < 0.05


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_a_nan_in_the_record_makes_both_error_fields_nan(tmp_path, codec):
    x = activations(torch.float32)
    x[4, 10] = math.nan
    store = PackStore.local(tmp_path)
    with PackWriter(store, codec=codec) as writer:
        writer.append(key(), x)
        sealed = writer.seal()
    (entry,) = read_pack_descriptor(store, sealed.pack_id).records  # as the footer holds it
    assert math.isnan(entry.meta.codec_max_abs_error) and math.isnan(entry.meta.codec_rel_l2_error)


def test_fp8_codes_widen_to_the_values_torch_gives_them():
    """fp8 records are decoded through a table of the 256 codes: each entry, NaN included, is
    the float32 torch's own conversion gives (bit for bit)."""
    from dmi.storage._codecs import _widen

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    assert torch.equal(_widen(codes).view(torch.int32), codes.to(torch.float32).view(torch.int32))
    assert torch.equal(_widen(codes[:, ::3]).view(torch.int32), codes[:, ::3].to(torch.float32).view(torch.int32))


def test_lossy_payload_is_smaller_than_the_raw_record(tmp_path):
    x = activations(torch.bfloat16)
    (entry,), _ = write_and_read(tmp_path, [x], "fp8")
    assert entry.payload.length < 0.7 * entry.meta.raw_size


@pytest.mark.parametrize("codec", ["raw", "split-zstd"])
def test_lossless_records_carry_zero_error(tmp_path, codec):
    x = activations(torch.bfloat16)
    (entry,), (got,) = write_and_read(tmp_path, [x], codec)
    assert torch.equal(got, x)
    assert (entry.meta.codec_max_abs_error, entry.meta.codec_rel_l2_error) == (0.0, 0.0)


@pytest.mark.parametrize("data", [torch.arange(8), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.uint8)])
def test_writer_refuses_lossy_codec_for_integer_values(tmp_path, data):
    with PackWriter(PackStore.local(tmp_path), codec="int8") as writer:
        with pytest.raises(LossyCodecError, match="floating-point values only"):
            writer.append(key(hook="token_ids"), data)
        writer.append(key(hook="token_ids"), data, codec="raw")  # a lossless codec still takes it


def test_attach_refuses_lossy_codec_for_integer_hooks_before_the_model_runs(tmp_path):
    model = tiny("llama")
    store = PackStore.local(tmp_path)
    with pytest.raises(LossyCodecError, match="token_ids"):
        with attach(model, hooks="resid_post token_ids", store=store, codec="fp8"):
            pass
    with pytest.raises(LossyCodecError, match="token_ids"):
        with attach(model, hooks="resid_post token_ids", store=store, codec={"token_ids": "int8"}):
            pass
    assert store.list_packs() == []


@pytest.mark.parametrize("how", ["writer_options", "tokenizer"])
def test_attach_refuses_a_capture_wide_lossy_codec_that_would_reach_integers(tmp_path, how):
    from .test_token_text import word_tokenizer

    model = tiny("llama")
    store = PackStore.local(tmp_path)
    hooks, extra = ("resid_post token_ids", {}) if how == "writer_options" else ("resid_post", {"tokenizer": word_tokenizer()})
    codec = {"writer_options": {"codec": "int8"}} if how == "writer_options" else {"codec": "fp8"}
    with pytest.raises(LossyCodecError, match="token_ids" if how == "writer_options" else "token text"):
        with attach(model, hooks=hooks, store=store, **codec, **extra):
            pass
    assert store.list_packs() == []


def test_capture_per_hook_lossy_codec_is_in_the_catalog_row(tmp_path):
    model = tiny("llama", dtype=torch.bfloat16)
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    store = PackStore.local(tmp_path / "packs")
    catalog = open_catalog(f"chdb://{tmp_path / 'catalog'}")
    try:
        with torch.inference_mode():
            ref = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
            with attach(model, hooks="resid_post token_ids", layers=[0], store=store, catalog=catalog,
                        model_id="lossy", codec={"resid_post": "fp8"}) as cap:
                rids, _ = cap.forward(ids, attention_mask=mask)
        rows = catalog.sql(
            f"SELECT request_id, hook, codec, codec_max_abs_error, codec_rel_l2_error "
            f"FROM {catalog.tables['records_published']} WHERE model_id = 'lossy' ORDER BY request_id, hook"
        ).to_pylist()
        assert [(r["hook"], r["codec"]) for r in rows] == [("resid_post", "fp8"), ("token_ids", "split-zstd")] * 3
        for i, rid in enumerate(rids):
            (entry,) = catalog.find_records("lossy", request_id=rid, hook="resid_post")
            (got,) = read_records(store, [entry])
            max_abs, rel = recomputed(ref[1][i, pads[i]:], got)
            row = next(r for r in rows if r["request_id"] == rid and r["hook"] == "resid_post")
            assert row["codec_max_abs_error"] == pytest.approx(max_abs, rel=1e-12) and max_abs > 0
            assert row["codec_rel_l2_error"] == pytest.approx(rel, rel=1e-9)
            ids_row = next(r for r in rows if r["request_id"] == rid and r["hook"] == "token_ids")
            assert (ids_row["codec_max_abs_error"], ids_row["codec_rel_l2_error"]) == (0.0, 0.0)
    finally:
        catalog.close()


@pytest.mark.parametrize("codec, extra, match", [
    ({"attn_q": "fp8"}, {}, "does not write"),
    ({"resid_post": "bogus"}, {}, "unknown codec 'bogus'"),
    ("bogus", {}, "unknown codec 'bogus'"),
    (8, {}, "codec must be a codec name"),
    ("fp8", {"writer_options": {"codec": "raw"}}, "disagree"),
])
def test_attach_refuses_a_codec_it_cannot_apply(tmp_path, codec, extra, match):
    from dmi.storage.errors import InvalidArgumentError

    store = PackStore.local(tmp_path)
    with pytest.raises(InvalidArgumentError, match=match):
        with attach(tiny("llama"), hooks="resid_post", store=store, codec=codec, **extra):
            pass
    assert store.list_packs() == []


def test_decode_refuses_a_lossy_payload_of_another_element_size():
    """A payload whose own dtype disagrees with the record's (same byte count) is refused,
    not reinterpreted. Built directly: the checksum stops a damaged pack before this."""
    import numpy as np

    from dmi.storage import CodecError, decode
    from dmi.storage._codecs import encode_lossy

    stored, error = encode_lossy("fp8", torch.ones(2, 4, dtype=torch.bfloat16))
    out = np.empty(16, np.uint8)
    decode("fp8", stored, out, 2)
    assert torch.equal(error, torch.zeros(2, 4))  # 1 = 448 * (1 / 448) exactly
    assert torch.equal(torch.from_numpy(out).view(torch.bfloat16).reshape(2, 4), torch.ones(2, 4, dtype=torch.bfloat16))
    with pytest.raises(CodecError, match="not elements of 4 bytes"):
        decode("fp8", stored, np.empty(16, np.uint8), 4)


def _damaged(kind: str) -> tuple[str, bytes, int]:
    """(codec to decode with, payload, raw bytes asked for) for one kind of damaged payload."""
    from dmi.storage._codecs import _LOSSY_HEADER, encode_lossy

    stored, _ = encode_lossy("int8", activations(torch.bfloat16))
    plane_kind_at = _LOSSY_HEADER.size + 4 * 8
    return {
        "short header": ("int8", stored[:5], 8 * 96 * 2),
        "cut in the scales": ("int8", stored[: _LOSSY_HEADER.size + 13], 8 * 96 * 2),
        "other codec's tag": ("fp8", stored, 8 * 96 * 2),
        "other raw size": ("int8", stored, 8 * 96 * 2 - 2),
        "truncated plane": ("int8", stored[:-1], 8 * 96 * 2),
        "unknown plane kind": ("int8", stored[:plane_kind_at] + b"\x07" + stored[plane_kind_at + 1 :], 8 * 96 * 2),
    }[kind]


@pytest.mark.parametrize("kind, match", [
    ("short header", "shorter than its header"),
    ("cut in the scales", "shorter than its 8 scales"),
    ("other codec's tag", "is not a fp8 payload"),
    ("other raw size", "not 1534 raw bytes"),
    ("truncated plane", "its entry says"),
    ("unknown plane kind", "unknown codec 7"),
])
def test_decode_refuses_a_damaged_lossy_payload(kind, match):
    """Built directly: in a pack the checksum refuses damaged bytes before decoding."""
    import numpy as np

    from dmi.storage import CodecError, decode

    codec, stored, raw = _damaged(kind)
    with pytest.raises(CodecError, match=match):
        decode(codec, stored, np.empty(raw, np.uint8), 2)


@pytest.mark.parametrize("shape", [(4, 0), (0, 4), (2, 0, 3), ()])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_empty_and_scalar_records_round_trip(tmp_path, codec, shape):
    """Rows of no values (and a record of no rows, or one value) are stored as such."""
    x = torch.full(shape, 3.0)
    (entry,), (got,) = write_and_read(tmp_path, [x], codec)
    assert got.shape == x.shape and torch.equal(got, x)
    assert entry.meta.codec_max_abs_error == 0.0


@pytest.mark.parametrize("native", [True, False], ids=["C", "torch"])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_an_infinity_saturates_and_leaves_its_row_finite(tmp_path, monkeypatch, codec, native):
    """A row's scale comes from its finite values: an infinity (a bf16 overflow) decodes to the
    row's largest finite magnitude with its sign, and the row's other values keep the codec's
    bound; the error fields say a value was lost without bound."""
    from dmi.storage import _native

    monkeypatch.setattr(_native, "ACTIVE", native and _native.ACTIVE)
    x = torch.tensor([[float("inf"), 1.0, 2.0, -3.0], [1.0, 2.0, 3.0, float("-inf")]])
    (entry,), (got,) = write_and_read(tmp_path, [x], codec)
    assert (got[0, 0].item(), got[1, 3].item()) == (3.0, -3.0)
    finite = torch.isfinite(x)
    rowmax = torch.tensor([[3.0], [3.0]])
    assert bool(((got - x).abs()[finite] <= BOUNDS[codec](rowmax.expand_as(x))[finite]).all())
    assert entry.meta.codec_max_abs_error == math.inf and math.isnan(entry.meta.codec_rel_l2_error)
