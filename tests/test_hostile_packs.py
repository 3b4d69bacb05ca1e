"""Corrupt, truncated and hostile packs: every read gives the exact tensor or a named pack error.

Random damage is caught by the checksums (each payload's XXH3, the index's zstd checksum); these
tests add what a checksum cannot catch: an index or catalog row whose values are well formed
but impossible (crafted, or written by another tool), sizes that would make a reader allocate
gigabytes before failing, and a pack file replaced under a footer cache.
"""

import base64
import dataclasses
import json
import os

import pyarrow as pa
import pytest
import torch
import zstandard

from dmi.reader import FooterCache, read_by_key, read_record, read_records
from dmi.storage import (
    DMIError,
    PackCorruptError,
    PackStore,
    PackTruncatedError,
    PackWriter,
    RecordKey,
    read_pack_descriptor,
    verify_pack,
)

_INDEX = b"dmi.index"


def same_bits(a, b):
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


def key(layer, hook="h"):
    return RecordKey("m", "r", "q", hook, layer, 0, 4)


def write_pack(root, records, **writer):
    """Seal ``records`` (``(key, tensor, codec)``) into one pack; return its descriptor."""
    store = PackStore.local(root)
    with PackWriter(store, **writer) as w:
        for k, t, codec in records:
            w.append(k, t, codec=codec)
        return w.seal()


def rewrite_index(path, mutate):
    """Rewrite the pack at ``path`` with its index document changed by ``mutate`` — a valid
    Arrow file and a valid zstd checksum, as a tool other than DMI's writer could make."""
    reader = pa.ipc.open_file(pa.py_buffer(path.read_bytes()))
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches - 1)]
    _, meta = reader.get_batch_with_custom_metadata(reader.num_record_batches - 1)
    doc = json.loads(zstandard.ZstdDecompressor().decompress(base64.b64decode(meta[_INDEX])))
    mutate(doc)
    blob = base64.b64encode(zstandard.ZstdCompressor(write_checksum=True).compress(json.dumps(doc).encode()))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, reader.schema) as w:
        for b in batches:
            w.write_batch(b)
        w.write_batch(pa.RecordBatch.from_pylist([], schema=reader.schema), custom_metadata={_INDEX: blob})


def set_value(column, value):
    def mutate(doc):
        doc["columns"][column][0] = value
    return mutate


@pytest.mark.parametrize(
    "column,value",
    [
        ("hook", ["h"]),  # unhashable: a TypeError once the footer is keyed
        ("shape", [4.0, 8.0]),  # a float shape: torch refuses it with a TypeError
        ("shape", [-4, -8]),  # negative sizes whose product still matches raw_size
        ("payload_offset", 2**64),  # an OverflowError at the read
        ("raw_size", 128.0),
        ("layer", 2**31),
        ("model_id", None),
    ],
    ids=["hook-list", "shape-float", "shape-negative", "offset-2**64", "raw-size-float", "layer-int32", "model-none"],
)
def test_index_values_outside_their_column_types_are_refused(tmp_path, column, value):
    desc = write_pack(tmp_path, [(key(0), torch.randn(4, 8), "zstd")])
    rewrite_index(tmp_path / f"{desc.pack_id}.arrow", set_value(column, value))
    store = PackStore.local(tmp_path)
    for read in (lambda: read_pack_descriptor(store, desc.pack_id), lambda: verify_pack(store, desc.pack_id),
                 lambda: read_by_key(store, desc.pack_id, key(0), cache=FooterCache())):
        with pytest.raises(PackCorruptError, match=rf"unreadable record index \(index column {column} holds .*restore the pack"):
            read()


def test_a_writer_id_that_is_not_a_string_is_refused(tmp_path):
    desc = write_pack(tmp_path, [(key(0), torch.randn(4, 8), "zstd")])
    rewrite_index(tmp_path / f"{desc.pack_id}.arrow", lambda doc: doc.__setitem__("writer_id", 5))
    with pytest.raises(PackCorruptError, match="writer id 5 is not a string"):
        read_pack_descriptor(PackStore.local(tmp_path), desc.pack_id)


@pytest.mark.parametrize("column,value", [("payload_length", 2**62), ("payload_offset", 2**63)])
def test_an_index_range_past_the_file_is_refused(tmp_path, column, value):
    """The index said where a payload is; a range past the file's end would have a reader size
    its buffer from it (4 EiB here) before it found the file too short."""
    desc = write_pack(tmp_path, [(key(0), torch.randn(4, 8), "zstd")])
    rewrite_index(tmp_path / f"{desc.pack_id}.arrow", set_value(column, value))
    store = PackStore.local(tmp_path)
    for read in (lambda: read_pack_descriptor(store, desc.pack_id),
                 lambda: read_by_key(store, desc.pack_id, key(0), cache=FooterCache())):
        with pytest.raises(PackCorruptError, match=r"index puts record m/r/q/h/layer 0.* past the file's \d+ bytes"):
            read()


class Memory:
    """A ``memory`` for ``read_records`` that records every size asked of it."""

    def __init__(self):
        self.asked = []

    def __call__(self, nbytes):
        self.asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def test_a_catalog_range_past_the_file_is_refused_before_any_buffer(tmp_path):
    desc = write_pack(tmp_path, [(key(0), torch.randn(4, 8), "zstd")])
    entry = desc.records[0]
    huge = dataclasses.replace(entry, payload=dataclasses.replace(entry.payload, length=2**40))
    memory = Memory()
    with pytest.raises(PackTruncatedError, match=r"file ends at byte \d+, before byte .*records affected: m/r/q/h/layer 0"):
        read_records(PackStore.local(tmp_path), [huge], memory=memory)
    assert memory.asked == []
    with pytest.raises(PackTruncatedError, match="run `dmi verify`"):
        read_record(PackStore.local(tmp_path), huge)


@pytest.mark.parametrize("codec", ["raw", "zstd", "split-zstd", "fp8", "int8"])
def test_a_raw_size_the_payload_does_not_hold_is_refused_before_its_buffer(tmp_path, codec):
    """A row whose raw size (and shape) claim 64 GiB for a payload that holds 128 bytes: the
    payload's own headers are read first, and no 64 GiB buffer is asked for."""
    desc = write_pack(tmp_path, [(key(0), torch.randn(4, 8), codec)])
    entry = desc.records[0]
    meta = dataclasses.replace(entry.meta, raw_size=2**36, shape=(2**34, 1))
    memory = Memory()
    with pytest.raises(PackCorruptError, match="cannot be decoded: its payload decodes to 128 bytes, its row says 68719476736"):
        read_records(PackStore.local(tmp_path), [dataclasses.replace(entry, meta=meta)], memory=memory)
    assert memory.asked == [entry.payload.length]  # the range read alone


def test_negative_dimensions_are_refused(tmp_path):
    """(-4) x (-8) float32 is 128 bytes too: the size check alone would let torch raise."""
    desc = write_pack(tmp_path, [(key(0), torch.randn(4, 8), "raw")])
    entry = desc.records[0]
    bad = dataclasses.replace(entry, meta=dataclasses.replace(entry.meta, shape=(-4, -8)))
    with pytest.raises(PackCorruptError, match=r"claims shape \(-4, -8\) float32 but 128 raw bytes"):
        read_record(PackStore.local(tmp_path), bad)


def test_a_pack_replaced_after_its_footer_was_cached_is_read_as_it_is_now(tmp_path):
    """Same name, new content (a pack restored or rewritten in place): the cache sees the file's
    size change and reads its index again, instead of refusing every record of the new file as
    corrupt or stale."""
    old = write_pack(tmp_path / "a", [(key(0), torch.ones(4, 8), "raw")])
    new = write_pack(tmp_path / "b", [(key(0), torch.full((4, 16), 2.0), "raw")])
    store = PackStore.local(tmp_path / "a")
    cache = FooterCache()
    assert same_bits(read_by_key(store, old.pack_id, key(0), cache=cache), torch.ones(4, 8))
    data = (tmp_path / "b" / f"{new.pack_id}.arrow").read_bytes().replace(new.pack_id.encode(), old.pack_id.encode())
    (tmp_path / "a" / f"{old.pack_id}.arrow").write_bytes(data)
    assert same_bits(read_by_key(store, old.pack_id, key(0), cache=cache), torch.full((4, 16), 2.0))
    replaced = dataclasses.replace(new.records[0], pack_id=old.pack_id)
    assert same_bits(read_record(store, replaced, cache=cache), torch.full((4, 16), 2.0))
    with pytest.raises(PackCorruptError, match="stale or wrong"):
        read_record(store, old.records[0], cache=cache)
    assert cache.get((store.uri, old.pack_id)).descriptor.size == len(data)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One pack of several small batches: every codec, bf16, fp32, int64 token ids, an empty
    record; returns (root, descriptor, expected tensor by key)."""
    root = tmp_path_factory.mktemp("mixed")
    g = torch.Generator().manual_seed(5)
    tensors = {
        "bf16": (torch.randn(6, 24, generator=g) * 3).to(torch.bfloat16),
        "f32": torch.randn(5, 12, generator=g),
        "ids": torch.randint(0, 50_000, (7,), generator=g),
        "empty": torch.empty(0, 8, dtype=torch.bfloat16),
    }
    records = []
    for codec in ("raw", "zstd", "split-zstd", "fp8", "int8"):
        for name, t in tensors.items():
            if codec not in ("fp8", "int8") or name != "ids":
                records.append((key(len(records), f"{codec}-{name}"), t, codec))
    desc = write_pack(root, records, batch_bytes=1024)
    store = PackStore.local(root)
    return root, desc, {e.meta.key: read_record(store, e) for e in desc.records}


def _reads(store, desc):
    """Every read path over the whole pack: (name, records read or None, thunk)."""
    entries = list(desc.records)
    return [
        ("descriptor", None, lambda: read_pack_descriptor(store, desc.pack_id)),
        ("verify", None, lambda: verify_pack(store, desc.pack_id)),
        ("cached", entries, lambda: read_records(store, entries, cache=FooterCache())),
        ("by key", entries[::4], lambda: [read_by_key(store, desc.pack_id, e.meta.key, cache=FooterCache()) for e in entries[::4]]),
    ]


def _check_all(store, desc, expected, where):
    """Each read path gives the exact tensors and descriptor, or a DMI error (any other
    exception fails the test as it is)."""
    refused = 0
    here = dataclasses.replace(desc, location=store.location(desc.pack_id))
    for name, entries, read in _reads(store, desc):
        try:
            got = read()
        except DMIError:
            refused += 1
            continue
        if entries is None:
            assert got == here, (where, name)
        else:
            assert all(same_bits(t, expected[e.meta.key]) for e, t in zip(entries, got)), (where, name)
    return refused


def test_flips_in_the_footer_and_batch_headers_of_every_codec(mixed, tmp_path):
    """Byte flips outside the payloads (schema, batch headers and row columns, index batch,
    Arrow footer and trailer), sampled every few bytes, on a pack of every codec and dtype."""
    root, desc, expected = mixed
    clean = (root / f"{desc.pack_id}.arrow").read_bytes()
    path = tmp_path / f"{desc.pack_id}.arrow"
    store = PackStore.local(tmp_path)
    payload = {p for e in desc.records for p in range(e.payload.offset, e.payload.end)}
    positions = [p for p in range(0, len(clean), 19) if p not in payload]
    refused = 0
    for pos in positions:
        damaged = bytearray(clean)
        damaged[pos] ^= 0xFF
        path.write_bytes(damaged)
        refused += _check_all(store, desc, expected, pos)
    assert len(positions) > 300 and refused > len(positions)


def test_truncations_of_every_codec(mixed, tmp_path):
    root, desc, expected = mixed
    clean = (root / f"{desc.pack_id}.arrow").read_bytes()
    path = tmp_path / f"{desc.pack_id}.arrow"
    store = PackStore.local(tmp_path)
    cuts = [*range(0, len(clean), 211), *range(len(clean) - 64, len(clean))]
    for cut in cuts:
        path.write_bytes(clean[:cut])
        assert _check_all(store, desc, expected, cut) == 4, cut
    for e in desc.records:
        if e.payload.length:
            path.write_bytes(clean[: e.payload.end - 1])
            with pytest.raises(PackTruncatedError, match=rf"{desc.pack_id}: file ends at byte {e.payload.end - 1}"):
                read_record(store, e)


def test_a_pack_that_is_a_directory_or_a_symlink_loop(mixed, tmp_path):
    root, desc, _ = mixed
    path = tmp_path / f"{desc.pack_id}.arrow"
    store = PackStore.local(tmp_path)
    os.mkdir(path)
    for name, _, read in _reads(store, desc):
        with pytest.raises(DMIError, match=desc.pack_id):
            read()
    os.rmdir(path)
    os.symlink(path, path)
    for name, _, read in _reads(store, desc):
        with pytest.raises(DMIError, match="Too many levels of symbolic links"):
            read()


def test_an_empty_pack_file(mixed, tmp_path):
    root, desc, _ = mixed
    (tmp_path / f"{desc.pack_id}.arrow").write_bytes(b"")
    store = PackStore.local(tmp_path)
    for name, _, read in _reads(store, desc):
        with pytest.raises(PackCorruptError, match="truncated"):
            read()
    with pytest.raises(PackTruncatedError, match="file ends at byte 0"):
        read_records(store, list(desc.records))


def test_zero_length_payloads_need_no_bytes(tmp_path):
    """An empty raw record stores no bytes: it reads back from any pack, even a damaged one."""
    desc = write_pack(tmp_path, [(key(0), torch.empty(0, 8), "raw")])
    (entry,) = desc.records
    assert entry.payload.length == 0
    (tmp_path / f"{desc.pack_id}.arrow").write_bytes(b"")
    (got,) = read_records(PackStore.local(tmp_path), [entry])
    assert same_bits(got, torch.empty(0, 8))


def test_copy_keeps_mixed_fixture_intact(mixed):
    """The fuzz tests damage copies only."""
    root, desc, expected = mixed
    store = PackStore.local(root)
    assert verify_pack(store, desc.pack_id) == desc
    for e, t in zip(desc.records, read_records(store, list(desc.records))):
        assert same_bits(t, expected[e.meta.key])
