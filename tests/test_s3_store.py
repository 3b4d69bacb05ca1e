"""S3PackStore against a real S3 endpoint (moto's server, ``tests/_s3.py``): the conformance
class, create-if-absent sealing, ranged and coalesced reads through the footer cache, capture
into S3 packs with a chDB catalog read back bit-exact, and recovery by listing."""

from __future__ import annotations

import sys

import pytest
import torch

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.reader import FooterCache, assemble, load_footer, read_by_key, read_records
from dmi.storage import (
    InvalidArgumentError,
    PackSealError,
    PackStore,
    PackStoreNotInstalledError,
    PackWriter,
    RecordKey,
    S3PackStore,
    verify_pack,
)
from tests._models import left_padded_batch, tiny
from tests._resealed import write_same_size_packs
from tests.pack_store_conformance import PackStoreConformance, body, new_id, read, seal

pytestmark = pytest.mark.s3


@pytest.fixture
def s3_store(s3_endpoint):
    return PackStore.from_uri(s3_endpoint.uri(s3_endpoint.new_bucket()))


class TestS3PackStore(PackStoreConformance):
    @pytest.fixture
    def store(self, s3_store):
        return s3_store

    def put_foreign_file(self, store, name, data):
        store.client.put_object(Bucket=store.s3.bucket, Key=store.s3.key(name), Body=data)


def count_requests(store, operation: str) -> list:
    """Every ``operation`` call the store's real boto3 client makes from now on."""
    calls = []
    store.client.meta.events.register(f"before-parameter-build.s3.{operation}", lambda params, **_: calls.append(dict(params)))
    return calls


def write_records(store, n: int, size: int = 256, *, max_records: int = 1000):
    """``n`` records of ``size`` float32 values (distinct contents) in sealed packs; returns (descriptors, tensors by key)."""
    sealed, tensors = [], {}
    with PackWriter(store, max_records=max_records, on_seal=sealed.append) as writer:
        for i in range(n):
            key = RecordKey("s3-model", "run", f"req{i // 4}", "resid_post", i % 4, 0, size // 4)
            tensors[key] = torch.randn(size // 4, 4, generator=torch.Generator().manual_seed(i))  # incompressible
            writer.append(key, tensors[key])
    return sealed, tensors


def test_a_second_conditional_write_is_refused_with_412_and_the_first_body_kept(s3_store):
    pack_id, first = new_id(), body(seed=1)
    seal(s3_store, pack_id, first)
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as raw:  # the endpoint itself enforces If-None-Match: *
        s3_store.client.put_object(Bucket=s3_store.s3.bucket, Key=s3_store.s3.key(f"{pack_id}.arrow"),
                                   Body=b"second", IfNoneMatch="*")
    assert raw.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(PackSealError, match=f"pack {pack_id} already exists") as info:
        seal(s3_store, pack_id, body(20_000, seed=2))
    assert info.value.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert read(s3_store, pack_id, 0, len(first)) == first
    assert s3_store.open_input(pack_id).size == len(first)


def test_sealing_is_one_put_and_nothing_reaches_the_bucket_before_it(s3_store):
    puts = count_requests(s3_store, "PutObject")
    pack_id = new_id()
    sink = s3_store.create(pack_id)
    sink.stream.write(body())
    assert puts == [] and s3_store.list_packs() == []
    assert sink.seal() == 10_000
    assert len(puts) == 1 and puts[0]["IfNoneMatch"] == "*"
    assert puts[0]["Key"] == f"packs/{pack_id}.arrow"
    assert s3_store.list_packs() == [pack_id]


def test_a_pack_bigger_than_one_put_is_refused_before_uploading(s3_store, monkeypatch):
    monkeypatch.setattr("dmi.storage._store_s3.MAX_PUT_BYTES", 1000)
    puts = count_requests(s3_store, "PutObject")
    with pytest.raises(PackSealError, match="more than one S3 PUT takes"):
        seal(s3_store, new_id(), body(1001))
    assert puts == [] and s3_store.list_packs() == []


def test_footer_is_one_get_and_cached_records_are_coalesced_ranged_gets(s3_store):
    (desc,), tensors = write_records(s3_store, 40)
    gets = count_requests(s3_store, "GetObject")
    cache = FooterCache()
    footer = load_footer(s3_store, desc.pack_id, cache=cache)
    assert footer.descriptor == desc
    assert [g["Range"] for g in gets] == ["bytes=-262144"]  # the tail: size, footer and index at once
    gets.clear()
    entries = list(desc.records)
    got = read_records(s3_store, entries, cache=cache)
    assert all(torch.equal(t, tensors[e.meta.key]) for t, e in zip(got, entries))
    # open (the tail) + nothing for the cached footer; the 40 adjacent payloads lie inside the
    # tail here, so no further GET: every byte came from that one suffix-range read
    assert len(gets) == 1 and len(cache) == 1


def test_a_pack_put_again_with_the_same_size_is_read_through_its_own_footer(s3_endpoint):
    """An object put again under a pack's key (a restored backup, a re-sealed pack) with the
    same size but other values: its ETag differs, so it is read through its own footer, not
    the one cached for the old object (whose checksums would refuse every record)."""
    pack_id, key = "ab" * 16, RecordKey("s3-model", "run", "req0", "resid_post", 0, 0, 3)
    live, resealed = (PackStore.from_uri(s3_endpoint.uri(s3_endpoint.new_bucket())) for _ in range(2))
    write_same_size_packs((live, resealed), pack_id, key)
    cache = FooterCache()
    assert read_by_key(live, pack_id, key, cache=cache).tolist() == [[1.0] * 8] * 3
    again = resealed.client.get_object(Bucket=resealed.s3.bucket, Key=resealed._key(pack_id))["Body"].read()
    with live.open_input(pack_id) as source:
        assert len(again) == source.size
    live.client.put_object(Bucket=live.s3.bucket, Key=live._key(pack_id), Body=again)
    assert read_by_key(live, pack_id, key, cache=cache).tolist() == [[2.0] * 8] * 3
    assert cache.stats().entries == 1


def test_a_whole_read_is_one_big_ranged_get(s3_store):
    (desc,), _ = write_records(s3_store, 12, size=32 * 1024)  # 128 KiB records: past the tail
    assert desc.size > 262144
    gets = count_requests(s3_store, "GetObject")
    assert verify_pack(s3_store, desc.pack_id) == desc
    assert [g["Range"] for g in gets] == ["bytes=-262144", f"bytes=0-{desc.size - 1}"]


def test_records_outside_the_tail_are_read_by_coalesced_ranges(s3_store):
    (desc,), tensors = write_records(s3_store, 12, size=32 * 1024)
    entries = [e for e in desc.records if e.payload.end <= desc.size - 262144]
    assert len(entries) >= 4
    gets = count_requests(s3_store, "GetObject")
    got = read_records(s3_store, entries)
    assert all(torch.equal(t, tensors[e.meta.key]) for t, e in zip(got, entries))
    first, last = entries[0].payload.offset, entries[-1].payload.end - 1
    assert [g["Range"] for g in gets] == ["bytes=-262144", f"bytes={first}-{last}"]


def test_uri_parameters_and_no_secret_in_the_uri(s3_endpoint, monkeypatch):
    bucket = s3_endpoint.new_bucket()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    store = PackStore.from_uri(f"{s3_endpoint.uri(bucket, 'a/b')}&access_key=k1&secret_key=s3cr3t")
    assert isinstance(store, S3PackStore)
    assert store.uri == f"s3://{bucket}/a/b?endpoint_override={s3_endpoint.url}&region=us-east-1"
    assert "s3cr3t" not in repr(store)
    pack_id = new_id()
    seal(store, pack_id, body(100))  # the URI's credentials were used: the environment has none
    assert store.location(pack_id) == f"s3://{bucket}/a/b/{pack_id}.arrow"
    assert store.list_packs() == [pack_id]


@pytest.mark.parametrize("uri, message", [
    ("s3://bucket/p?endpoint=x", "unknown S3 URI parameter"),
    ("s3://bucket/p?scheme=ftp", "must be http or https"),
    ("s3:///p", "not an S3 URI"),
])
def test_malformed_s3_uris_are_refused(uri, message):
    with pytest.raises(InvalidArgumentError, match=message):
        PackStore.from_uri(uri)


def test_secret_in_a_refused_uri_is_not_echoed():
    with pytest.raises(InvalidArgumentError) as info:
        PackStore.from_uri("s3://bucket/p?secret_key=s3cr3t&bogus=1")
    assert "s3cr3t" not in str(info.value) and "secret_key=***" in str(info.value)


def test_missing_boto3_is_a_named_error_with_the_install_hint(monkeypatch):
    """A fake: boto3 is installed here, so an import that fails stands in for its absence."""
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(PackStoreNotInstalledError, match=r"pip install 'dmi-capture\[s3\]'") as info:
        PackStore.from_uri("s3://bucket/prefix")
    assert isinstance(info.value, ImportError)


def test_capture_into_s3_packs_with_a_chdb_catalog_reads_back_bit_exact(s3_store, tmp_path):
    catalog = open_catalog(f"chdb://{tmp_path / 'catalog'}")
    model = tiny("llama")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    try:
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, output_hidden_states=True)
        with attach(model, hooks="resid_post", store=s3_store, catalog=catalog, model_id="tiny-s3",
                    writer_options={"max_records": 4}) as cap:
            rids, _ = cap.forward(ids, attention_mask=mask)
        assert len(cap.published) >= 2 and sorted(s3_store.list_packs()) == sorted(d.pack_id for d in cap.published)
        for i, rid in enumerate(rids):
            entries = catalog.find_records("tiny-s3", request_id=rid, hook="resid_post")
            got = assemble(entries, read_records(s3_store, entries, cache=FooterCache()))
            for layer in range(model.config.num_hidden_layers - 1):  # HF's last hidden state is normed
                assert torch.equal(got[layer], ref.hidden_states[layer + 1][i, pads[i]:]), (rid, layer)
    finally:
        catalog.close()


def test_recovery_publishes_sealed_but_unpublished_packs_found_by_listing(s3_store, tmp_path):
    sealed, tensors = write_records(s3_store, 30, max_records=8)  # 4 packs, never published
    s3_store.client.put_object(Bucket=s3_store.s3.bucket, Key=s3_store.s3.key(f"{new_id()}.arrow.part"), Body=b"x")
    catalog = open_catalog(f"chdb://{tmp_path / 'catalog'}")
    try:
        assert catalog.find_records("s3-model") == []
        recovered = catalog.recover(s3_store)
        assert sorted(recovered) == sorted(d.pack_id for d in sealed) and len(recovered) == 4
        entries = catalog.find_records("s3-model")
        keys = [e.meta.key for e in entries]
        assert len(keys) == len(set(keys)) == 30 and set(keys) == set(tensors)  # each record exactly once
        got = read_records(s3_store, entries)
        assert all(torch.equal(t, tensors[e.meta.key]) for t, e in zip(got, entries))
        assert catalog.recover(s3_store) == []
    finally:
        catalog.close()


def test_a_pickled_store_reads_the_same_packs_with_its_own_client(s3_store):
    """Loader workers get the store pickled: the settings travel, the boto3 client does not."""
    import pickle

    (desc,), tensors = write_records(s3_store, 4)
    copy = pickle.loads(pickle.dumps(s3_store))
    assert copy.uri == s3_store.uri and copy.client is not s3_store.client
    got = read_records(copy, list(desc.records))
    assert all(torch.equal(t, tensors[e.meta.key]) for t, e in zip(got, desc.records))
