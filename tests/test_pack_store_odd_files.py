"""Odd things where a pack store expects packs: a FIFO or a directory named like a pack, a
``file://`` or ``s3://`` URI carrying parts the store would drop, and zstd frames whose
headers claim more content than their length can hold (docs/pack-format.md)."""

import dataclasses
import os
import struct
import threading

import numpy as np
import pytest
import torch

import dmi
from dmi.reader import read_records
from dmi.storage import (
    CodecError,
    InvalidArgumentError,
    PackCorruptError,
    PackError,
    PackStore,
    PackWriter,
    RecordKey,
    decode,
    read_pack_descriptor,
)

PACK_ID = "0123456789abcdef" * 2
KEY = RecordKey("m", "r", "q", "h", 0, 0, 4)
_BOUNDED_JOIN_S = 60  # a bound on a hang, not a timing: the open returns at once when fixed


def _fifo(directory) -> str:
    path = os.path.join(directory, f"{PACK_ID}.arrow")
    os.mkfifo(path)
    return path


def _outcome_of(call, fifo_path: str):
    """``call()``'s exception, run in a thread so that an open blocked on the FIFO fails the
    test instead of hanging it; a blocked open is released by opening the FIFO's write end."""
    outcome = []

    def run():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test to assert on
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_BOUNDED_JOIN_S)
    if thread.is_alive():
        os.close(os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(_BOUNDED_JOIN_S)
        pytest.fail(f"opening the FIFO {fifo_path} blocked")
    assert len(outcome) == 1, outcome
    return outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_like_a_pack_is_refused_not_waited_on(tmp_path):
    store = PackStore.local(tmp_path)
    path = _fifo(tmp_path)
    assert store.list_packs() == [PACK_ID]  # listed, so verify and recover see it
    for call in (lambda: read_pack_descriptor(store, PACK_ID),
                 lambda: store.open_input(PACK_ID, direct=True)):
        exc = _outcome_of(call, path)
        assert type(exc) is PackError
        assert str(exc) == (f"pack {PACK_ID}: {path} is not a regular file (it is a FIFO); move it out of "
                            "the pack store, or restore the pack file there")


def test_a_directory_named_like_a_pack_is_refused_at_open(tmp_path):
    store = PackStore.local(tmp_path)
    path = os.path.join(tmp_path, f"{PACK_ID}.arrow")
    os.mkdir(path)
    with pytest.raises(PackError) as refused:
        store.open_input(PACK_ID)
    assert type(refused.value) is PackError
    assert str(refused.value) == (f"pack {PACK_ID}: {path} is not a regular file (it is a directory); move it "
                                  "out of the pack store, or restore the pack file there")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_verify_reports_a_fifo_and_recover_names_it(tmp_path):
    """Listing keeps the FIFO: ``verify`` reports it as a pack the catalog does not show,
    and ``recover`` ends with the error that names it rather than hanging on it."""
    with dmi.open(home=tmp_path / "home") as store:
        path = _fifo(store.packs.root)
        report = store.verify()
        assert report.unpublished_packs == (PACK_ID,)
        exc = _outcome_of(store.recover, path)
        assert isinstance(exc, PackError)
        assert f"{path} is not a regular file (it is a FIFO)" in str(exc)


@pytest.mark.parametrize("tail", ["?x=1", "#part", "?x=1#part"])
def test_a_file_uri_with_a_query_or_fragment_is_refused(tmp_path, tail):
    uri = f"file://{tmp_path / 'packs'}{tail}"
    with pytest.raises(InvalidArgumentError) as refused:
        PackStore.from_uri(uri)
    assert str(refused.value) == (
        f"{uri!r}: a local pack store URI takes no query or fragment ('?', '#'); write file:///absolute/path, "
        "or pass the directory as a plain path (where '?' and '#' are part of the name)"
    )
    assert not (tmp_path / "packs").exists()  # refused before creating anything


def test_a_plain_path_keeps_question_marks_and_hashes_in_its_name(tmp_path):
    store = PackStore.from_uri(str(tmp_path / "a?b#c"))
    assert store.root == str(tmp_path / "a?b#c")


@pytest.mark.parametrize(
    "uri, shown",
    [("s3://bucket/p#part", "'s3://bucket/p#...'"),
     ("s3://bucket/p?secret_key=ab#cd", "'s3://bucket/p?secret_key=***#...'")],
)
def test_an_s3_uri_with_a_fragment_is_refused_without_showing_it(uri, shown):
    with pytest.raises(InvalidArgumentError) as refused:
        PackStore.from_uri(uri)
    assert str(refused.value) == (f"{shown}: an S3 pack store URI takes no fragment ('#'); write a '#' inside "
                                  "a parameter value as %23")


def _hostile_frame(content_size: int) -> bytes:
    """A 16-byte zstd frame: magic, a header declaring ``content_size`` (8-byte field, single
    segment) and one empty last raw block."""
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, content_size) + b"\x01\x00\x00"


def _split_payload(frame: bytes) -> bytes:
    """A one-plane (uint8) ``split-zstd`` payload whose plane is ``frame``."""
    return struct.pack("<BB", 1, 1) + struct.pack("<BQ", 1, len(frame)) + frame


def _rle_frame(content_size: int) -> bytes:
    """A valid frame of 128 KiB RLE blocks (4 bytes each) holding ``content_size`` zero bytes:
    the most content a frame of its length can hold."""
    blocks, block = content_size // (128 * 1024), 128 * 1024
    body = b"".join(struct.pack("<I", (i == blocks - 1) | 2 | block << 3)[:3] + b"\0" for i in range(blocks))
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, content_size) + body


class Memory:
    """A ``memory`` / ``out`` that records every size asked of it."""

    def __init__(self, make):
        self.asked, self.make = [], make

    def __call__(self, nbytes):
        self.asked.append(nbytes)
        return self.make(nbytes)


@pytest.mark.parametrize("codec, payload", [("zstd", _hostile_frame(2**36)),
                                            ("split-zstd", _split_payload(_hostile_frame(2**36)))])
def test_a_frame_claiming_more_than_its_length_holds_takes_no_buffer(codec, payload):
    memory = Memory(lambda n: np.empty(n, np.uint8))
    with pytest.raises(CodecError) as refused:
        decode(codec, payload, memory, 1)
    assert str(refused.value) == ("zstd frame of 16 bytes claims 68719476736 bytes of content, more than a valid "
                                  "frame of that length can hold (524288); the payload is damaged")
    assert memory.asked == []


def test_the_densest_valid_frame_still_decodes():
    """The bound is the format's: 64 RLE blocks of 128 KiB in 256 + 13 bytes decode in full."""
    frame = _rle_frame(64 * 128 * 1024)
    out = decode("zstd", frame, lambda n: np.ones(n, np.uint8), 1)
    assert out.nbytes == 64 * 128 * 1024 and not out.any()


@pytest.mark.parametrize("codec, payload", [("zstd", _hostile_frame(2**36)),
                                            ("split-zstd", _split_payload(_hostile_frame(2**36)))])
def test_a_record_whose_frame_and_row_claim_64_gib_is_corrupt_before_its_buffer(tmp_path, codec, payload):
    """The row's raw size agrees with the frame's header, so only the frame's length can tell."""
    store = PackStore.local(tmp_path)
    with PackWriter(store) as writer:
        writer.append(KEY, torch.frombuffer(bytearray(payload), dtype=torch.uint8), codec="raw")
        desc = writer.seal()
    entry = desc.records[0]
    hostile = dataclasses.replace(entry, meta=dataclasses.replace(entry.meta, codec=codec, raw_size=2**36,
                                                                  shape=(2**36,)))
    memory = Memory(lambda n: torch.empty(n, dtype=torch.uint8))
    with pytest.raises(PackCorruptError) as refused:
        read_records(store, [hostile], memory=memory)
    assert str(refused.value) == (
        f"pack {desc.pack_id}: record {KEY.describe()} cannot be decoded: zstd frame of 16 bytes claims 68719476736 "
        "bytes of content, more than a valid frame of that length can hold (524288); the payload is damaged"
    )
    assert memory.asked == [len(payload)]  # the range read alone
