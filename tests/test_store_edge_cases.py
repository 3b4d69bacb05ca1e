"""Leftovers of the hostile-input audit: ``recover`` around entries that are not pack files, lossy
payload headers bounded by the bytes stored, ``dmi.open`` refusing a bad packs URI before it
creates the catalog, and the footer cache seeing a pack file replaced by one of the same size."""

import dataclasses
import os
import struct

import numpy as np
import pytest
import torch

import dmi
from dmi.cli import main
from dmi.reader import FooterCache, load_footer, read_by_key, read_records
from dmi.storage import CodecError, PackError, PackStore, PackWriter, RecordKey, checksum, decode
from dmi.storage.errors import InvalidArgumentError, PackCorruptError, RecoveryIncompleteError
from tests._resealed import write_same_size_packs

FIFO_ID = "0" * 32  # sorts before every written pack: recovery meets it first
DIR_ID = "1" * 32
KEY = RecordKey("m", "run", "q", "resid_post", 0, 0, 3)


# ------------------------------------------------------------------ recover and odd entries


def _write_packs(packs_dir) -> list[str]:
    """Two sealed, unpublished packs of two records each; their ids."""
    sealed = []
    with PackWriter(PackStore.local(packs_dir), max_records=2, on_seal=lambda d: sealed.append(d.pack_id)) as writer:
        for layer in range(4):
            writer.append(RecordKey("m", "run", "q", "resid_post", layer, 0, 3), torch.full((3, 4), float(layer)))
    return sealed


def _odd_entries(packs_dir) -> tuple[str, str]:
    fifo = os.path.join(packs_dir, f"{FIFO_ID}.arrow")
    os.mkfifo(fifo)
    directory = os.path.join(packs_dir, f"{DIR_ID}.arrow")
    os.mkdir(directory)
    return fifo, directory


def _skipped_message(recovered: list[str], fifo: str, directory: str) -> str:
    return (f"recovered {len(recovered)} packs ({', '.join(recovered)}), but skipped 2 entries named like packs: "
            f"{fifo} is not a regular file (it is a FIFO); {directory} is not a regular file (it is a directory); "
            "move them out of the pack store (or restore the pack files there) and run recover again")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_recover_skips_a_fifo_and_a_directory_recovers_every_pack_and_names_them(tmp_path):
    sealed = _write_packs(tmp_path / "packs")
    fifo, directory = _odd_entries(tmp_path / "packs")
    with dmi.open(home=tmp_path) as store:
        with pytest.raises(RecoveryIncompleteError) as refused:
            store.recover()
        assert str(refused.value) == _skipped_message(sorted(sealed), fifo, directory)
        assert refused.value.recovered == tuple(sorted(sealed))
        assert refused.value.skipped == {FIFO_ID: "FIFO", DIR_ID: "directory"}
        assert sorted(e.meta.key.layer for e in store.catalog.find_records("m")) == [0, 1, 2, 3]
        assert store.unindexed_packs() == [FIFO_ID, DIR_ID]  # still there: verify keeps saying so
        with pytest.raises(RecoveryIncompleteError, match=r"^recovered no pack, but skipped 2 entries named like packs: "):
            store.recover()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_cli_recover_publishes_every_pack_and_fails_naming_the_odd_entries(tmp_path, capsys):
    sealed = _write_packs(tmp_path / "packs")
    fifo, directory = _odd_entries(tmp_path / "packs")
    assert main(["recover", "--home", str(tmp_path)]) == 1
    assert _skipped_message(sorted(sealed), fifo, directory) in capsys.readouterr().err
    with dmi.open(home=tmp_path) as store:
        assert len(store.catalog.find_records("m")) == 4


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_local_store_names_the_listed_entries_that_are_not_regular_files(tmp_path):
    sealed = _write_packs(tmp_path)
    _odd_entries(tmp_path)
    os.symlink(tmp_path / "nowhere", tmp_path / f"{'2' * 32}.arrow")  # dangling: left to the read
    store = PackStore.local(tmp_path)
    assert store.not_regular_files(store.list_packs()) == {FIFO_ID: "FIFO", DIR_ID: "directory"}
    assert store.not_regular_files(sealed) == {}
    with pytest.raises(InvalidArgumentError, match="not a pack id"):
        store.not_regular_files(["../x"])


# ------------------------------------------------------------------ lossy payload headers


def _lossy(rows: int, row_len: int, scales: bytes, plane_kind: int, body: bytes) -> bytes:
    """An fp8 payload of bfloat16 values with the given header claims and plane."""
    return struct.pack("<BBQQ", 2, 2, rows, row_len) + scales + struct.pack("<BQ", plane_kind, len(body)) + body


@pytest.mark.parametrize("payload, message", [
    (_lossy(1, 2**40, b"\0\0\x80\x3f", 0, b""),
     "fp8 header claims 1x1099511627776 values but its plane holds 0 codes"),
    (_lossy(2**40, 1, b"\0\0\x80\x3f", 0, b"\x01"), "fp8 payload of 32 bytes is shorter than its 1099511627776 scales"),
    (_lossy(1, 8, b"\0\0\x80\x3f", 0, b"\x01\x02"), "fp8 header claims 1x8 values but its plane holds 2 codes"),
], ids=["row length past the plane", "rows past the scales", "plane shorter than rows x row length"])
def test_a_lossy_header_claiming_more_than_the_payload_holds_never_sizes_a_buffer(payload, message):
    asked = []
    with pytest.raises(CodecError) as refused:
        decode("fp8", payload, lambda n: asked.append(n) or np.empty(n, np.uint8), 2)
    assert str(refused.value) == message
    assert asked == []


def test_a_lossy_zstd_plane_of_another_length_than_its_header_is_refused_before_sizing():
    import zstandard

    frame = zstandard.ZstdCompressor().compress(bytes(64))
    asked = []
    with pytest.raises(CodecError) as refused:
        decode("fp8", _lossy(1, 2**20, b"\0\0\x80\x3f", 1, frame), lambda n: asked.append(n), 2)
    assert str(refused.value) == "fp8 header claims 1x1048576 values but its plane holds 64 codes"
    assert asked == []


def test_a_lossy_payload_whose_header_fits_its_bytes_decodes_through_a_sized_buffer():
    payload = _lossy(2, 2, b"\0\0\x80\x3f" * 2, 0, bytes([0x38, 0x40, 0x38, 0x40]))  # fp8 1.0, 2.0
    asked = []
    out = decode("fp8", payload, lambda n: asked.append(n) or np.empty(n, np.uint8), 2)
    assert asked == [8]
    assert torch.from_numpy(out).view(torch.bfloat16).tolist() == [1.0, 2.0, 1.0, 2.0]


def test_the_reader_turns_a_hostile_lossy_header_into_pack_corrupt(tmp_path):
    """A header rewritten to claim 2**20 times the rows, its record's checksum made to match (as
    a hostile pack would), is refused as corrupt before the reader takes a buffer of that size."""
    store = PackStore.local(tmp_path)
    sealed = []
    with PackWriter(store, codec="fp8", on_seal=sealed.append) as writer:
        writer.append(KEY, torch.ones(3, 8, dtype=torch.bfloat16))
    (entry,) = sealed[0].records
    with open(store.location(entry.pack_id), "r+b") as f:
        f.seek(entry.payload.offset + 2)
        f.write(struct.pack("<Q", 3 << 20))
        f.seek(entry.payload.offset)
        stored = f.read(entry.payload.length)
    forged = dataclasses.replace(entry, meta=dataclasses.replace(
        entry.meta, shape=(3 << 20, 8), raw_size=(3 << 20) * 8 * 2, checksum=checksum(stored)))
    taken = []
    with pytest.raises(PackCorruptError) as refused:
        read_records(store, [forged], memory=lambda n: taken.append(n) or torch.empty(n, dtype=torch.uint8))
    assert str(refused.value) == (f"pack {entry.pack_id}: record {KEY.describe()} cannot be decoded: fp8 payload of "
                                  f"{entry.payload.length} bytes is shorter than its 3145728 scales")
    assert taken == [entry.payload.length]  # the range read only


# ------------------------------------------------------------------ dmi.open and bad packs URIs


@pytest.mark.parametrize("packs", ["file:///x?y=1", "file:///x#frag", "file://host/dir", "file://"])
def test_open_refuses_a_bad_file_uri_before_creating_the_catalog(tmp_path, packs):
    catalog = tmp_path / "catalog"
    with pytest.raises(InvalidArgumentError) as refused:
        dmi.open(catalog=f"chdb://{catalog}", packs=packs)
    assert packs in str(refused.value)
    assert not catalog.exists()
    assert os.listdir(tmp_path) == []


def test_local_directory_names_the_directory_and_creates_nothing(tmp_path):
    assert PackStore.local_directory(f"file://{tmp_path}/packs") == f"{tmp_path}/packs"
    assert PackStore.local_directory(tmp_path / "plain?#") == f"{tmp_path}/plain?#"
    assert PackStore.local_directory("s3://bucket/prefix") is None
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ the footer cache and replaced files


def _same_size_packs(tmp_path, pack_id: str) -> tuple[PackStore, PackStore]:
    """Two packs with one id and one size but other values: a live store and a re-sealed copy."""
    stores = (PackStore.local(tmp_path / "live"), PackStore.local(tmp_path / "resealed"))
    write_same_size_packs(stores, pack_id, KEY)
    assert os.path.getsize(stores[0].location(pack_id)) == os.path.getsize(stores[1].location(pack_id))
    return stores


def test_a_pack_replaced_by_one_of_the_same_size_is_read_through_its_own_footer(tmp_path):
    pack_id = "ab" * 16
    live, resealed = _same_size_packs(tmp_path, pack_id)
    cache = FooterCache()
    assert read_by_key(live, pack_id, KEY, cache=cache).tolist() == [[1.0] * 8] * 3
    os.replace(resealed.location(pack_id), live.location(pack_id))
    assert read_by_key(live, pack_id, KEY, cache=cache).tolist() == [[2.0] * 8] * 3
    assert cache.stats().entries == 1


def test_a_cached_footer_carries_the_version_of_the_file_it_was_read_from(tmp_path):
    pack_id = "cd" * 16
    live, resealed = _same_size_packs(tmp_path, pack_id)
    cache = FooterCache()
    with live.open_input(pack_id) as source:
        st = os.stat(live.location(pack_id))
        assert source.version == (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        assert load_footer(live, pack_id, cache=cache).version == source.version
    os.replace(resealed.location(pack_id), live.location(pack_id))
    with live.open_input(pack_id) as source:
        assert source.version != load_footer(live, pack_id, cache=cache).version  # no source: not checked
        assert load_footer(live, pack_id, cache=cache, source=source).version == source.version


# ------------------------------------------------------------------ a store opened again in another process


def test_another_process_opens_the_store_by_the_uris_it_was_opened_from(tmp_path, clickhouse_uri):
    """vLLM's worker processes open the caller's store again: by the URIs ``dmi.open`` was given,
    the server's user and password included (``catalog_uri`` shows neither)."""
    packs = str(tmp_path / "packs")
    with dmi.open(catalog=clickhouse_uri, packs=packs) as store:
        assert store._locations_for_another_process() == (clickhouse_uri, packs)
        user = clickhouse_uri.split("://", 1)[1].split("@", 1)[0]
        assert user and user not in store.catalog_uri


def test_a_store_made_from_its_parts_is_opened_elsewhere_by_its_locations_unless_its_tables_differ(tmp_path):
    from dmi.catalog import open_catalog

    packs = PackStore.local(tmp_path / "packs")
    plain = dmi.Store(open_catalog(str(tmp_path / "a")), packs)
    prefixed = dmi.Store(open_catalog(str(tmp_path / "b"), table_prefix="other_"), packs)
    try:
        assert plain._locations_for_another_process() == (plain.catalog_uri, packs.uri)
        with pytest.raises(InvalidArgumentError) as refused:
            prefixed._locations_for_another_process()
        assert "table prefix 'other_'" in str(refused.value)
    finally:
        plain.close()
        prefixed.close()
