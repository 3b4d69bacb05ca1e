"""A byte flipped at the start of a pack (the Arrow magic and the schema message before the
first batch) is found by ``verify_pack``: the file reader never reads those bytes, a stream
reader reads nothing else (docs/pack-format.md, "What verify checks")."""

import struct

import pyarrow as pa
import pytest
import torch

from dmi.storage import PackCorruptError, PackStore, PackWriter, RecordKey, verify_pack


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """One small pack of two records; returns (store, descriptor, the file's bytes)."""
    store = PackStore.local(tmp_path_factory.mktemp("head"))
    with PackWriter(store, codec="raw") as writer:
        writer.append(RecordKey("m", "r", "q", "h", 0, 0, 4), torch.arange(16, dtype=torch.float32).reshape(4, 4))
        writer.append(RecordKey("m", "r", "q", "h", 1, 0, 4), torch.ones(4, 2, dtype=torch.bfloat16))
        desc = writer.seal()
    with open(store.location(desc.pack_id), "rb") as f:
        return store, desc, f.read()


def _leading_region(data: bytes) -> range:
    """The magic (8 bytes) and the schema message: continuation marker, metadata length, metadata."""
    assert data[8:12] == b"\xff\xff\xff\xff"
    return range(16 + struct.unpack("<i", data[12:16])[0])


def _what_readers_get(data: bytes) -> tuple:
    """Everything the file reader (footer) and a stream reader (from the leading schema message)
    give: schemas with metadata, and every batch with its custom metadata."""
    buffer = pa.py_buffer(data)
    by_footer = pa.ipc.open_file(pa.BufferReader(buffer))
    as_stream = pa.ipc.open_stream(pa.BufferReader(buffer.slice(8)))
    stream_batches = []
    while True:
        try:
            stream_batches.append(as_stream.read_next_batch_with_custom_metadata())
        except StopIteration:
            break
    footer_batches = [by_footer.get_batch_with_custom_metadata(i) for i in range(by_footer.num_record_batches)]
    return data[:6], by_footer.schema, as_stream.schema, footer_batches, stream_batches


def _same(a: tuple, b: tuple) -> bool:
    magic_a, footer_a, stream_a, fb_a, sb_a = a
    magic_b, footer_b, stream_b, fb_b, sb_b = b
    batches_equal = all(
        len(x) == len(y) and all(p.equals(q) and dict(m or {}) == dict(n or {}) for (p, m), (q, n) in zip(x, y))
        for x, y in ((fb_a, fb_b), (sb_a, sb_b))
    )
    return (magic_a == magic_b and footer_a.equals(footer_b, check_metadata=True)
            and stream_a.equals(stream_b, check_metadata=True) and batches_equal)


def test_every_byte_of_the_leading_region(sealed, tmp_path):
    """Each byte flipped in turn: verify refuses it with PackCorruptError, or the flip changed
    nothing any reader gets (padding, a flatbuffer's unused bytes) and verify returns the pack's
    descriptor unchanged. The magic, the message framing and the metadata values are refused."""
    _, desc, clean = sealed
    store = PackStore.local(tmp_path)
    path = store.location(desc.pack_id)
    expected = _what_readers_get(clean)
    refused = set()
    for pos in _leading_region(clean):
        damaged = bytearray(clean)
        damaged[pos] ^= 0xFF
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            got = verify_pack(store, desc.pack_id)
        except PackCorruptError as exc:
            assert type(exc) is PackCorruptError and str(exc).startswith(f"pack {desc.pack_id}: "), pos
            refused.add(pos)
            continue
        assert got.records == desc.records, pos
        assert _same(_what_readers_get(bytes(damaged)), expected), pos
    region = _leading_region(clean)
    named = {*range(0, 6), *range(8, 16)}  # magic; continuation marker and metadata length
    for value in (desc.pack_id.encode(), desc.writer_id.encode(), b"dmi-pack", b"payload"):
        at = clean.index(value)
        assert at + len(value) <= region.stop
        named |= set(range(at, at + len(value)))
    assert named <= refused
    assert {6, 7}.isdisjoint(refused)  # the magic's padding: no reader reads it


def test_a_damaged_leading_magic_is_named(sealed, tmp_path):
    _, desc, clean = sealed
    store = PackStore.local(tmp_path)
    with open(store.location(desc.pack_id), "wb") as f:
        f.write(b"ARROW2" + clean[6:])
    with pytest.raises(PackCorruptError) as refused:
        verify_pack(store, desc.pack_id)
    assert str(refused.value) == (
        f"pack {desc.pack_id}: the leading Arrow magic is damaged: the file is damaged where a stream reader "
        "(or any tool that reads it from its start) would read it; restore the pack from a copy or recapture it"
    )


def test_a_schema_message_that_differs_from_the_footer_is_named(sealed, tmp_path):
    """The pack id inside the leading schema message changed (one hex digit): the footer's copy,
    which every DMI read uses, still names the pack."""
    _, desc, clean = sealed
    store = PackStore.local(tmp_path)
    at = clean.index(desc.pack_id.encode())
    damaged = bytearray(clean)
    damaged[at] = ord("f") if damaged[at] != ord("f") else ord("e")
    with open(store.location(desc.pack_id), "wb") as f:
        f.write(damaged)
    with pytest.raises(PackCorruptError) as refused:
        verify_pack(store, desc.pack_id)
    assert str(refused.value) == (
        f"pack {desc.pack_id}: the leading schema message differs from the footer's schema: the file is damaged "
        "where a stream reader (or any tool that reads it from its start) would read it; restore the pack "
        "from a copy or recapture it"
    )


def test_dmi_verify_reports_a_pack_damaged_beside_records_that_read_back_whole(tmp_path):
    """``Store.verify`` and ``dmi verify`` read a pack whose records all read back whole again as a
    whole file: a flipped byte in its leading magic is a ``"damaged"`` problem (no bad record
    counted: every record still reads), exit 1."""
    import json

    import dmi
    from tests.test_cli import batch

    home = tmp_path / "home"
    with PackWriter(PackStore.local(home / "packs"), codec="raw") as writer:
        writer.append(RecordKey("m", "r", "q", "resid_post", 0, 0, 4), torch.ones(4, 4))
        writer.append(RecordKey("m", "r", "q", "resid_post", 1, 0, 4), torch.zeros(4, 4))
        desc = writer.seal()
    with dmi.open(home=home) as store:
        store.recover()  # published as a capture would
        path = store.packs.location(desc.pack_id)
    with open(path, "r+b") as f:
        f.write(b"B")  # "ARROW1" -> "BRROW1": no DMI read touches it
    with dmi.open(home=home) as store:
        report = store.verify()
    assert report.records_checked == 2 and not report.ok
    [problem] = report.problems
    assert (problem.kind, problem.pack_id, problem.key) == ("damaged", desc.pack_id, None)
    assert problem.reason.startswith(
        f"the file is damaged beside its 2 records, which read back whole: pack {desc.pack_id}: "
        "the leading Arrow magic is damaged")
    [verified] = batch(home, ["verify", "--json"])
    assert verified.returncode == 1
    assert json.loads(verified.stdout)["problems"] == [problem.as_dict()]
    assert verified.stderr.strip().splitlines()[-1] == (
        "dmi: error: 0 bad records in 1 pack (1 pack damaged beside records that read back whole)")
