"""Lossy codecs at the edges of float32: rows whose values are all far below float32's normal
range (their scale would underflow), and float64 values beyond float32's range (scales and
decoded values are float32). The C quantiser and the torch one give the same bytes there too."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch

from dmi.capture import attach
from dmi.reader import read_records
from dmi.storage import LOSSY_CODECS, PackStore, PackWriter, read_pack_descriptor
from dmi.storage._codecs import encode_lossy
from dmi.storage.errors import LossyCodecError
from dmi.storage.records import RecordKey

from ._models import left_padded_batch, tiny

TINY = 2.0**-126  # float32's smallest normal: the smallest row scale
SUB = 2.0**-149  # float32's smallest subnormal


def key(i: int = 0) -> RecordKey:
    return RecordKey("m", "r", f"q{i}", "resid_post", 0, 0, 8)


def write_and_read(tmp_path, x, codec):
    store = PackStore.local(tmp_path)
    with PackWriter(store, codec=codec) as writer:
        writer.append(key(), x)
        sealed = writer.seal()
    (entry,) = read_pack_descriptor(store, sealed.pack_id).records
    (got,) = read_records(store, [entry])
    return entry, got


@pytest.fixture(params=[True, False], ids=["C", "torch"])
def native(request, monkeypatch):
    from dmi.storage import _native

    monkeypatch.setattr(_native, "ACTIVE", request.param and _native.ACTIVE)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_zeros_of_a_row_of_subnormals_stay_zero(tmp_path, codec):
    """absmax / qmax of this row underflows float32 to 0: without a floor, 0 / 0 made its zeros
    NaN under fp8. With the floor (scale 2^-126) both values are below the smallest code and
    decode to 0: everything was lost (relative error 1), nothing became NaN."""
    x = torch.tensor([[SUB, 0.0, -3 * SUB, 0.0]])
    entry, got = write_and_read(tmp_path, x, codec)
    assert got.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert (entry.meta.codec_max_abs_error, entry.meta.codec_rel_l2_error) == (3 * SUB, 1.0)


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize(("codec", "row"), [("fp8", [1.0, 0.5, 0.0, -0.25]), ("int8", [3.0, -1.0, 0.0, 2.0])])
def test_a_row_below_the_normal_range_is_coded_against_the_floor_scale(tmp_path, codec, row):
    """These values are exact multiples of 2^-126 that fp8 (and int8) codes hold: on the floor
    scale they come back bit for bit. A subnormal scale (absmax / qmax) gave codes of an
    imprecise step instead, and a non-zero error."""
    scale = TINY * (2.0**-4 if codec == "fp8" else 1.0)
    x = torch.tensor([row]) * scale
    payload, error = encode_lossy(codec, x)
    assert payload[18:22] == torch.tensor([TINY], dtype=torch.float32).numpy().tobytes()  # after the 18-byte header
    entry, got = write_and_read(tmp_path, x, codec)
    assert torch.equal(got, x) and torch.equal(error, torch.zeros_like(x))
    assert (entry.meta.codec_max_abs_error, entry.meta.codec_rel_l2_error) == (0.0, 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_c_and_torch_give_the_same_bytes_for_rows_below_the_floor(monkeypatch, codec, dtype):
    """Rows of every magnitude, the smallest ones below the floor, mixed in one record: the C
    loop's results for those rows are replaced by torch's, the others are its own."""
    from dmi.storage import _native

    if not _native.BUILT:
        pytest.skip("the C extension is not built here")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(12, 16, generator=g) * torch.logspace(-44, 4, 12).unsqueeze(1)).to(dtype)
    x[3, :5] = 0.0
    payloads = {}
    for active in (True, False):
        monkeypatch.setattr(_native, "ACTIVE", active)
        payload, error = encode_lossy(codec, x)
        payloads[active] = (payload, error.view(torch.int32).tolist())
    assert payloads[True] == payloads[False]
    assert not torch.tensor(payloads[True][1], dtype=torch.int32).view(torch.float32).isnan().any()


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_float64_beyond_float32_range_is_refused_and_the_writer_goes_on(tmp_path, codec):
    """Such a value would decode to infinity (its whole row to NaN past 448 x float32's largest):
    refused by name, before anything is written; the writer takes the next record."""
    store = PackStore.local(tmp_path)
    with PackWriter(store, codec=codec) as writer:
        with pytest.raises(LossyCodecError, match=r"holds 1e\+39, beyond float32's largest .*lossless codec"):
            writer.append(key(0), torch.tensor([[1e39, 1.0]], dtype=torch.float64))
        writer.append(key(1), torch.tensor([[3.0e38, -1.0, math.inf]], dtype=torch.float64))
        sealed = writer.seal()
    (entry,) = read_pack_descriptor(store, sealed.pack_id).records
    assert entry.meta.key.request_id == "q1"
    (got,) = read_records(store, [entry])
    assert got.dtype == torch.float64 and bool(torch.isfinite(got).all())


@pytest.mark.parametrize(("hooks", "mapping", "named"), [
    ("resid_post token_ids", {"resid_post": "fp8"}, "token_ids hold integers"),
    ("resid_post", {"resid_post": "raw"}, "token_ids, token text (tokenizer=) hold integers"),
], ids=["token_ids", "token-text"])
def test_a_lossy_writer_codec_beside_a_per_hook_mapping_is_refused_before_the_model_runs(tmp_path, hooks, mapping,
                                                                                        named):
    """The hooks a ``{hook: codec}`` mapping leaves out (and token text, and the token_ids a
    tokenizer adds) keep the writer's codec:
    an int8 one would reach integers. It used to be found only by the drain, after the model ran
    its forward (a DrainError wrapping the writer's LossyCodecError)."""
    from .test_token_text import word_tokenizer

    model = tiny("llama")
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    store = PackStore.local(tmp_path)
    extra = {"tokenizer": word_tokenizer()} if "token text" in named else {}
    ids, mask = left_padded_batch(lengths=(3,))
    with pytest.raises(LossyCodecError, match="^" + re.escape(f"codec 'int8' is lossy and stores floating-point values only; {named}:")):
        with attach(model, hooks=hooks, store=store, writer_options={"codec": "int8"}, codec=mapping, **extra) as cap:
            cap.forward(ids, attention_mask=mask)
    assert forwards == [] and store.list_packs() == []


def test_a_lossy_writer_codec_is_taken_where_the_mapping_covers_every_integer_hook(tmp_path):
    """token_ids mapped to a lossless codec: the int8 writer codec reaches float hooks only."""
    model = tiny("llama")
    store = PackStore.local(tmp_path)
    ids, mask = left_padded_batch(lengths=(3,))
    with attach(model, hooks="resid_post token_ids", layers=[0], store=store, model_id="m",
                writer_options={"codec": "int8"}, codec={"token_ids": "raw"}) as cap:
        cap.forward(ids, attention_mask=mask)
    entries = [e for pack in store.list_packs() for e in read_pack_descriptor(store, pack).records]
    assert sorted((e.meta.key.hook, e.meta.codec) for e in entries) == [("resid_post", "int8"), ("token_ids", "raw")]


def test_the_fallback_counts_only_records_whose_codec_it_changed(tmp_path):
    """Behind the model (``adaptive_codec`` at a fill the ring reaches once it holds a step)
    records are stored ``raw``; ``records_fallback_codec`` counts those that would have had
    another codec — the ``token_ids`` records (the writer's ``split-zstd``), not
    ``resid_post``'s, ``raw`` already."""
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(6, 3))
    store = PackStore.local(tmp_path)
    with attach(model, hooks="resid_post token_ids", layers=[1], store=store, model_id="m",
                codec={"resid_post": "raw"}, adaptive_codec=1e-9) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    stored = Counter((e.meta.key.hook, e.meta.codec)
                     for p in store.list_packs() for e in read_pack_descriptor(store, p).records)
    assert {codec for hook, codec in stored if hook == "resid_post"} == {"raw"}
    assert stored["token_ids", "raw"] and stored["resid_post", "raw"]
    assert cap.stats["records_fallback_codec"] == stored["token_ids", "raw"]


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_a_float64_record_too_small_to_square_records_its_loss(codec, tmp_path):
    """float64 values under float32's range decode to zeros: everything was lost, and the record's
    relative error says 1.0 — not 0, which the original's underflowing squares (L2 norm 0)
    would give."""
    original = torch.tensor([[1e-200, 0.0, -2e-200]], dtype=torch.float64)
    with PackWriter(PackStore.local(tmp_path), codec=codec) as writer:
        writer.append(RecordKey("m", "r", "q", "resid_post", 0, 0, 1), original)
        [entry] = writer.seal().records
    [decoded] = read_records(PackStore.local(tmp_path), [entry])
    assert torch.equal(decoded, torch.zeros(1, 3, dtype=torch.float64))
    assert (entry.meta.codec_max_abs_error, entry.meta.codec_rel_l2_error) == (2e-200, 1.0)
