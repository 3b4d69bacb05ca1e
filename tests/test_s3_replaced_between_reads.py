"""An S3 pack replaced under its key between the GET that opens it and a later ranged GET
of the same :class:`PackInput`, against a real S3 endpoint (moto's server, ``tests/_s3.py``).

The input's version (size, ETag) comes from the opening GET; every ranged GET it makes later
carries ``If-Match`` with that ETag, so the endpoint refuses (412) to serve the bytes of
another object, and the store says the pack was replaced while it was being read — instead of
returning the new object's bytes behind the old footer (silently, where the layouts match) or
calling the pack corrupt."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from dmi.reader import FooterCache, read_by_key, read_records
from dmi.storage import PackCorruptError, PackReplacedError, PackStore, PackWriter, RecordKey
from dmi.storage._store_s3 import TAIL_BYTES
from tests.pack_store_conformance import body, new_id, seal

pytestmark = pytest.mark.s3

_ROWS, _WIDTH = 128, 256  # 128 KiB of float32 a record: the first records lie before the tail


@pytest.fixture
def s3_store(s3_endpoint):
    return PackStore.from_uri(s3_endpoint.uri(s3_endpoint.new_bucket()))


def replaced_message(store, pack_id: str, etag: str) -> str:
    return (
        f"pack {pack_id} was replaced in {store.uri} while it was being read (it was opened as "
        f"ETag {etag}; the object under its key now has another): read it again, which opens "
        "the pack as it is now"
    )


def get_params(store) -> list[dict]:
    """The parameters of every GetObject the store's real boto3 client makes from now on."""
    calls = []
    store.client.meta.events.register("before-parameter-build.s3.GetObject",
                                      lambda params, **_: calls.append(dict(params)))
    return calls


def put_raw(store, pack_id: str, data: bytes) -> None:
    """Put ``data`` under the pack's key unconditionally, as a restore or a re-seal elsewhere would."""
    store.client.put_object(Bucket=store.s3.bucket, Key=store._key(pack_id), Body=data)


def test_a_ranged_read_after_the_object_was_replaced_is_refused_by_name(s3_store):
    pack_id, first, second = new_id(), body(TAIL_BYTES + 4096, seed=1), body(TAIL_BYTES + 4096, seed=2)
    seal(s3_store, pack_id, first)
    gets = get_params(s3_store)
    with s3_store.open_input(pack_id) as source:
        size, etag = source.version
        assert size == len(first) and etag.startswith('"')
        put_raw(s3_store, pack_id, second)  # same size, other bytes
        out = bytearray(4096)
        with pytest.raises(PackReplacedError) as info:
            source.read_into(0, out)  # before the tail: a ranged GET
        assert type(info.value) is PackReplacedError
        assert str(info.value) == replaced_message(s3_store, pack_id, etag)
        assert info.value.__cause__.response["ResponseMetadata"]["HTTPStatusCode"] == 412
        assert out == bytearray(4096)  # nothing of the new object was written into the buffer
        tail = bytearray(100)
        source.read_into(len(first) - 100, tail)  # served from the tail fetched at open: the old object's
        assert bytes(tail) == first[-100:]
    assert [(g["Range"], g.get("IfMatch")) for g in gets] == [(f"bytes=-{TAIL_BYTES}", None), ("bytes=0-4095", etag)]
    with s3_store.open_input(pack_id) as again:  # read again: the pack as it is now
        out = bytearray(4096)
        again.read_into(0, out)
        assert bytes(out) == second[:4096] and again.version[1] != etag


def test_every_ranged_get_of_an_unchanged_pack_carries_the_etag_seen_at_open(s3_store):
    pack_id, data = new_id(), body(TAIL_BYTES + 3000, seed=3)
    seal(s3_store, pack_id, data)
    gets = get_params(s3_store)
    with s3_store.open_input(pack_id) as source:
        etag = source.version[1]
        parts = [bytearray(1000), bytearray(2000)]
        source.read_into(0, parts[0])
        source.read_into(1000, parts[1])
    assert bytes(parts[0] + parts[1]) == data[:3000]
    assert [(g["Range"], g.get("IfMatch")) for g in gets] == [
        (f"bytes=-{TAIL_BYTES}", None), ("bytes=0-999", etag), ("bytes=1000-2999", etag)]


def write_pack(store, pack_id: str, value: float):
    """One raw-codec pack of 4 records filled with ``value`` under id ``pack_id``; its descriptor."""
    sealed = []
    with mock.patch("dmi.storage._writer.secrets.token_hex", return_value=pack_id):
        with PackWriter(store, codec="raw", on_seal=sealed.append) as writer:
            for layer in range(4):
                key = RecordKey("s3-model", "run", "req0", "resid_post", layer, 0, _ROWS)
                writer.append(key, torch.full((_ROWS, _WIDTH), value))
    (desc,) = sealed
    return desc


def test_a_same_layout_pack_replaced_mid_read_is_named_and_read_again_through_its_own_footer(s3_endpoint):
    """The pack is replaced (a restore, a re-seal) after ``read_records`` opened it and before it
    fetched the payloads: the same ids, keys, shapes and offsets, other values. The read is
    refused as replaced (not as corrupt); read again with the same footer cache, it returns the
    new values through the new object's footer (the old object's entries are refused as stale
    by that footer, as for any replaced pack: a catalog indexes the object it published)."""
    pack_id = new_id()
    live, other = (PackStore.from_uri(s3_endpoint.uri(s3_endpoint.new_bucket())) for _ in range(2))
    desc, again = write_pack(live, pack_id, 1.0), write_pack(other, pack_id, 2.0)
    entries = list(desc.records)
    layout = [(e.meta.key, e.meta.shape, e.payload) for e in entries]
    assert [(e.meta.key, e.meta.shape, e.payload) for e in again.records] == layout
    assert entries[0].payload.end <= desc.size - TAIL_BYTES  # its payload is read by a ranged GET
    replacement = other.client.get_object(Bucket=other.s3.bucket, Key=other._key(pack_id))["Body"].read()
    first_etag = live.client.head_object(Bucket=live.s3.bucket, Key=live._key(pack_id))["ETag"]
    swap = s3_endpoint.client()  # a client of its own: its PUT is not seen by the hook below

    def replace_before_the_payload_get(params, **_):
        if not params["Range"].startswith("bytes=-"):  # the opening GET is a suffix range
            swap.put_object(Bucket=live.s3.bucket, Key=live._key(pack_id), Body=replacement)

    cache = FooterCache()
    live.client.meta.events.register("before-parameter-build.s3.GetObject", replace_before_the_payload_get)
    with pytest.raises(PackReplacedError) as info:
        read_records(live, entries[:1], cache=cache)
    live.client.meta.events.unregister("before-parameter-build.s3.GetObject", replace_before_the_payload_get)
    assert type(info.value) is PackReplacedError
    assert str(info.value) == replaced_message(live, pack_id, first_etag)
    for e in entries:  # read again by key: the new object's own footer replaces the cached one
        assert read_by_key(live, pack_id, e.meta.key, cache=cache).tolist() == [[2.0] * _WIDTH] * _ROWS
    with pytest.raises(PackCorruptError, match="does not match the pack's own index; the catalog row is stale or wrong"):
        read_records(live, entries[:1], cache=cache)
    got = read_records(live, list(again.records), cache=cache)
    assert [t.unique().tolist() for t in got] == [[2.0]] * 4
    assert cache.stats().entries == 1
