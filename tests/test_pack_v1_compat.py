"""A pack written in format v1 (committed under tests/data/pack_v1) reads bit-exactly today.

The pack was written by tests/data/make_v1_pack.py with the code of commit a36b4a9; its
expected tensors, keys and shard geometry are in expected.pt beside it.
"""

import pathlib

import pytest
import torch

from dmi.reader import FooterCache, assemble, read_records
from dmi.storage import PackStore, RecordKey, read_pack_descriptor, verify_pack

DATA = pathlib.Path(__file__).resolve().parent / "data" / "pack_v1"


@pytest.fixture(scope="module")
def v1():
    store = PackStore.local(DATA)
    (pack_id,) = [p.stem for p in DATA.glob("*.arrow")]
    expected = torch.load(DATA / "expected.pt", weights_only=True)["records"]
    return store, pack_id, expected


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_v1_pack_reads_bit_exactly(v1):
    store, pack_id, expected = v1
    descriptor = read_pack_descriptor(store, pack_id)
    assert descriptor.format_version == 1 and descriptor.writer_id == "w-fixture-v1"
    assert len(descriptor.records) == len(expected)
    got = read_records(store, descriptor.records, cache=FooterCache())
    for entry, tensor, (key_fields, want, shard) in zip(descriptor.records, got, expected):
        assert entry.meta.key == RecordKey(**key_fields)
        assert tensor.dtype == want.dtype and tensor.shape == want.shape
        assert torch.equal(bits(tensor), bits(want)), entry.meta.key
        got_shard = entry.meta.shard
        assert (None if got_shard is None else (got_shard.axis, got_shard.offset, list(got_shard.full_shape))) == shard


def test_v1_pack_gets_the_layout_v1_implied(v1):
    """v1 recorded no token layout; its one hook with tokens off axis 0 was attn_pattern."""
    store, pack_id, _ = v1
    layouts = {(e.meta.key.hook, e.meta.token_axis, e.meta.key_axis) for e in read_pack_descriptor(store, pack_id).records}
    assert layouts == {("token_ids", 0, None), ("resid_post", 0, None), ("attn_q", 0, None),
                       ("attn_pattern", 1, 2), ("router_topk", 0, None), ("mlp_post", 0, None)}


def test_v1_pattern_chunks_assemble_on_the_query_axis(v1):
    store, pack_id, expected = v1
    entries = [e for e in read_pack_descriptor(store, pack_id).records if e.meta.key.hook == "attn_pattern"]
    got = assemble(entries, read_records(store, entries))
    prefill, decode = [want for key, want, _ in expected if key["hook"] == "attn_pattern"]
    assert got.shape == (1, 2, 6, 6)
    assert torch.equal(got[0, :, :5, :5], prefill) and torch.equal(got[0, :, 5:, :], decode)
    assert not got[0, :, :5, 5].any()  # the key the prefill could not see: zero-filled


def test_v1_pack_verifies(v1):
    store, pack_id, _ = v1
    assert verify_pack(store, pack_id) == read_pack_descriptor(store, pack_id)
