"""Damaged packs: every damaged record raises, no read ever returns a wrong tensor."""

import dataclasses
import os
import shutil

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from dmi.storage import (
    FileSystemPackStore,
    PackCorruptError,
    PackError,
    PackFormatError,
    PackStore,
    PackTruncatedError,
    PackWriter,
    RecordKey,
    read_pack_descriptor,
    read_pack_index,
    verify_pack,
)
from dmi.storage._pack_format import FORMAT_VERSION, PACK_ROW_SCHEMA, schema_with_metadata
from dmi.reader import FooterCache, read_record, read_records


def same_bits(a, b):
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


def key(layer, hook="resid_post"):
    return RecordKey("model", "run", "req", hook, layer, 0, 8)


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """A small pack mixing codecs and dtypes; returns (store dir, descriptor, tensors)."""
    root = tmp_path_factory.mktemp("sealed")
    store = PackStore.local(root)
    g = torch.Generator().manual_seed(1)
    tensors = [
        (torch.randn(8, 32, generator=g) * 3).to(torch.bfloat16),
        torch.randn(8, 16, generator=g),
        torch.arange(8, dtype=torch.int64),
        torch.empty(0, 4, dtype=torch.float16),
        torch.randn(8, 3, generator=g, dtype=torch.complex64),
    ]
    entries = []
    for codec in ("raw", "split-zstd", "zstd"):
        with PackWriter(store, codec=codec) as w:
            for i, t in enumerate(tensors):
                w.append(key(i, hook=codec), t)
            desc = w.seal()
        entries.extend(desc.records)
    return root, entries, tensors * 3


def damaged_copy(root, tmp_path, pack_id, mutate, kind="local"):
    shutil.copytree(root, tmp_path / "copy")
    path = tmp_path / "copy" / f"{pack_id}.arrow"
    data = bytearray(path.read_bytes())
    path.write_bytes(mutate(data))
    if kind == "generic":  # the object-storage code path: pyarrow range reads
        return FileSystemPackStore(pafs.LocalFileSystem(), str(tmp_path / "copy"))
    return PackStore.local(tmp_path / "copy")


def test_byte_flips_everywhere(sealed, tmp_path):
    """Every byte of the footer (the schema before the first payload, the index batch and the
    Arrow footer after the last) and a sample of row-column and payload bytes: each flip gives a named pack error or unchanged tensors, on
    every read path that touches the footer (descriptor, footer-checked reads, verify)."""
    root, entries, tensors = sealed
    store = PackStore.local(root)
    packs = sorted({e.pack_id for e in entries})
    originals = {p: read_pack_descriptor(store, p) for p in packs}
    checked = affected_seen = footer_refused = 0
    for pack_id in packs:
        path = root / f"{pack_id}.arrow"
        clean = path.read_bytes()
        mine = [(e, t) for e, t in zip(entries, tensors) if e.pack_id == pack_id]
        in_payload = {pos for e, _ in mine for pos in range(e.payload.offset, e.payload.end)}
        first = min(e.payload.offset for e, _ in mine if e.payload.length)
        last = max(e.payload.end for e, _ in mine)
        footer = set(range(first)) | set(range(last, len(clean)))  # schema, index batch, Arrow footer
        between = set(range(first, last, 11)) - in_payload  # row columns and batch headers, sampled
        positions = sorted(footer | between | set(sorted(in_payload)[::13]))
        try:
            for pos in positions:
                flipped = bytearray(clean)
                flipped[pos] ^= 1 << (pos % 8)
                path.write_bytes(flipped)
                hit_payload = pos in in_payload
                for e, t in mine:
                    if e.payload.offset <= pos < e.payload.end:
                        affected_seen += 1
                        with pytest.raises(PackCorruptError, match=pack_id):
                            read_record(store, e)
                    elif hit_payload:
                        assert same_bits(read_record(store, e), t), (pos, e.meta.key)
                if not hit_payload:
                    try:
                        for got, (e, t) in zip(read_records(store, [e for e, _ in mine], cache=FooterCache()), mine):
                            assert same_bits(got, t), (pos, e.meta.key)
                    except PackError:
                        footer_refused += 1
                try:
                    assert read_pack_descriptor(store, pack_id) == originals[pack_id], pos
                except PackError:
                    pass
                try:
                    assert verify_pack(store, pack_id) == originals[pack_id], pos
                    assert not hit_payload, pos
                except PackError:
                    pass
                checked += 1
        finally:
            path.write_bytes(clean)
    assert checked > 2000 and affected_seen > 50 and footer_refused > 1000


def test_damaged_writer_id_is_a_pack_error(sealed, tmp_path):
    """The writer id sits in unchecksummed schema metadata: a byte that makes it invalid
    UTF-8 is a PackFormatError, not a UnicodeDecodeError (the footer's copy is the one
    Arrow reads; the stream header keeps its own)."""
    root, entries, tensors = sealed
    pack_id = entries[0].pack_id
    writer_id = read_pack_descriptor(PackStore.local(root), pack_id).writer_id.encode()

    def damage(data):
        at = data.rindex(writer_id)
        data[at] = 0xFF
        return data

    store = damaged_copy(root, tmp_path, pack_id, damage)
    for read in (lambda: read_pack_descriptor(store, pack_id), lambda: verify_pack(store, pack_id),
                 lambda: read_records(store, [entries[0]], cache=FooterCache())):
        with pytest.raises(PackFormatError, match="writer id"):
            read()


def test_coalesced_read_refuses_only_the_damaged_record(sealed, tmp_path):
    root, entries, tensors = sealed
    victim = entries[1]
    store = damaged_copy(root, tmp_path, victim.pack_id, lambda d: (d.__setitem__(victim.payload.offset + 3, d[victim.payload.offset + 3] ^ 0x80), d)[1])
    with pytest.raises(PackCorruptError, match="resid_post|raw") as info:
        read_records(store, entries)
    assert victim.pack_id in str(info.value) and "layer 1" in str(info.value)
    others = [i for i, e in enumerate(entries) if e is not victim]
    for i, got in zip(others, read_records(store, [entries[i] for i in others])):
        assert same_bits(got, tensors[i])


@pytest.mark.parametrize("kind", ["local", "generic"])
@pytest.mark.parametrize("keep", [0, 1, 7, 100, 0.25, 0.5, 0.75, -9, -1])
def test_truncated_pack(sealed, tmp_path, keep, kind):
    root, entries, tensors = sealed
    pack_id = entries[0].pack_id
    size = os.path.getsize(root / f"{pack_id}.arrow")
    cut = int(size * keep) if isinstance(keep, float) else (keep if keep >= 0 else size + keep)
    store = damaged_copy(root, tmp_path, pack_id, lambda d: d[:cut], kind)
    with pytest.raises(PackCorruptError):
        read_pack_descriptor(store, pack_id)
    for e, t in zip(entries, tensors):
        if e.pack_id != pack_id or e.payload.length == 0:
            continue
        if e.payload.end <= cut:
            assert same_bits(read_record(store, e), t)
        else:
            with pytest.raises(PackTruncatedError, match="truncated"):
                read_record(store, e)
            with pytest.raises(PackTruncatedError, match="layer"):
                read_records(store, [e])


def test_stale_catalog_row_caught_by_footer_check(sealed):
    """A row whose key says one record but whose range/checksum are another's."""
    root, entries, tensors = sealed
    store = PackStore.local(root)
    wrong = dataclasses.replace(entries[1], meta=dataclasses.replace(entries[1].meta, key=entries[0].meta.key))
    assert same_bits(read_record(store, wrong), tensors[1])  # without the footer: undetectable
    with pytest.raises(PackCorruptError, match="stale"):
        read_record(store, wrong, cache=FooterCache())
    with pytest.raises(PackCorruptError, match="stale"):
        read_records(store, [entries[0], wrong], cache=FooterCache())


def test_wrong_checksum_in_entry(sealed):
    root, entries, _ = sealed
    bad = dataclasses.replace(entries[0], meta=dataclasses.replace(entries[0].meta, checksum=entries[0].meta.checksum ^ 1))
    with pytest.raises(PackCorruptError, match="checksum"):
        read_record(PackStore.local(root), bad)


def test_shape_disagreeing_with_size_refused(sealed):
    root, entries, _ = sealed
    bad = dataclasses.replace(entries[0], meta=dataclasses.replace(entries[0].meta, shape=(8, 33)))
    with pytest.raises(PackCorruptError, match="claims shape"):
        read_record(PackStore.local(root), bad)


def write_arrow(path, schema, batches, metadata_last=None):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for b in batches:
            w.write_batch(b)
        if metadata_last is not None:
            w.write_batch(pa.RecordBatch.from_pylist([], schema=schema), custom_metadata=metadata_last)


def test_not_a_dmi_pack(tmp_path):
    pack_id = "ab" * 16
    write_arrow(tmp_path / f"{pack_id}.arrow", pa.schema([("x", pa.int32())]), [])
    with pytest.raises(PackFormatError, match="not a DMI pack"):
        read_pack_descriptor(PackStore.local(tmp_path), pack_id)


def test_future_version_refused(tmp_path):
    pack_id = "cd" * 16
    schema = schema_with_metadata(pack_id, "w")
    meta = dict(schema.metadata)
    future = FORMAT_VERSION + 1
    meta[b"dmi.format_version"] = str(future).encode()
    write_arrow(tmp_path / f"{pack_id}.arrow", schema.with_metadata(meta), [])
    with pytest.raises(PackFormatError, match=f"version {future}"):
        read_pack_descriptor(PackStore.local(tmp_path), pack_id)


def test_missing_index_batch(tmp_path):
    pack_id = "ef" * 16
    write_arrow(tmp_path / f"{pack_id}.arrow", schema_with_metadata(pack_id, "w"), [])
    with pytest.raises(PackFormatError, match="index"):
        read_pack_descriptor(PackStore.local(tmp_path), pack_id)


def test_pack_renamed_to_another_id(sealed, tmp_path):
    root, entries, _ = sealed
    other = "0" * 32
    shutil.copy(root / f"{entries[0].pack_id}.arrow", tmp_path / f"{other}.arrow")
    with pytest.raises(PackFormatError, match="says it is pack"):
        read_pack_descriptor(PackStore.local(tmp_path), other)


def test_garbage_file(tmp_path):
    pack_id = "12" * 16
    (tmp_path / f"{pack_id}.arrow").write_bytes(os.urandom(5000))
    with pytest.raises(PackCorruptError, match="not a readable Arrow"):
        read_pack_descriptor(PackStore.local(tmp_path), pack_id)


def test_schema_columns_checked(tmp_path):
    pack_id = "34" * 16
    schema = pa.schema([f for f in PACK_ROW_SCHEMA if f.name != "mean"]).with_metadata(schema_with_metadata(pack_id, "w").metadata)
    write_arrow(tmp_path / f"{pack_id}.arrow", schema, [])
    with pytest.raises(PackFormatError, match="columns"):
        read_pack_descriptor(PackStore.local(tmp_path), pack_id)


def test_verify_pack_detects_row_and_payload_damage(sealed, tmp_path):
    root, entries, _ = sealed
    e = entries[5]  # split-zstd pack, first record
    store = damaged_copy(root, tmp_path, e.pack_id, lambda d: (d.__setitem__(e.payload.offset, d[e.payload.offset] ^ 4), d)[1])
    read_pack_descriptor(store, e.pack_id)  # the index itself is intact
    with pytest.raises(PackCorruptError, match="checksum"):
        verify_pack(store, e.pack_id)


@pytest.mark.parametrize("field,value", [("length", -4), ("offset", -8)])
def test_a_negative_byte_range_is_refused(sealed, field, value):
    """The index holds unsigned offsets and lengths: a negative one (a damaged or hand-built
    entry) must not read nothing or other bytes."""
    root, entries, _ = sealed
    store = PackStore.local(root)
    bad = dataclasses.replace(entries[0], payload=dataclasses.replace(entries[0].payload, **{field: value}))
    with pytest.raises(PackCorruptError, match="impossible byte range"):
        read_records(store, [bad])
    with pytest.raises(PackCorruptError, match="impossible byte range"):
        read_record(store, bad)


def test_a_pack_deleted_after_it_was_opened_still_reads(sealed, tmp_path):
    """The index comes from the file that was opened, not from its path again: a concurrent
    delete is not reported as corruption, and the index and payloads are the same file's."""
    shutil.copytree(sealed[0], tmp_path / "copy")
    store = PackStore.local(tmp_path / "copy")
    entry = sealed[1][0]
    with store.open_input(entry.pack_id) as source:
        os.unlink(store.location(entry.pack_id))
        descriptor = read_pack_index(source, store.location(entry.pack_id))
    assert [e.meta.key for e in descriptor.records] == [e.meta.key for e in sealed[1] if e.pack_id == entry.pack_id]
