"""The footer cache over generic ``pyarrow.fs`` filesystems (neither local nor S3): a pack
replaced under its name by one of the same size is read through its own index, not the one
cached for the file it replaced.

Real filesystems, no stand-ins: ``SubTreeFileSystem`` over the local disk and
``PyFileSystem(FSSpecHandler(...))`` over fsspec's local and memory filesystems. The first two
give a modification time (the pack's version is its size and that time); fsspec's memory
filesystem gives none (the version is ``None``, and the index is read again on every open).
"""

from __future__ import annotations

import os
import uuid
from unittest import mock

import fsspec
import pyarrow.fs as pafs
import pytest
import torch
from pyarrow.fs import FSSpecHandler, PyFileSystem

from dmi.reader import FooterCache, load_footer, read_by_key, read_records
from dmi.storage import FileSystemPackStore, PackWriter, RecordKey, read_pack_descriptor

PACK = "ab" * 16
KEY = RecordKey("m", "run", "q", "resid_post", 0, 0, 3)
OTHER = RecordKey("m", "run", "q", "resid_post", 1, 0, 3)
SEALED_AT = 1_700_000_000.25
"""One seal time for every pack written here: the index holds it as text, and two packs of the
same records must be of the same size."""
KEPT_MTIME_NS = 1_600_000_000_000_000_000
REPLACED_MTIME_NS = KEPT_MTIME_NS + 1_000_000_000


class _Disk:
    """A filesystem over a local directory, and where one of its paths lies on the disk (to set
    its modification time: two writes within one tick of the kernel's clock may share one)."""

    def __init__(self, kind: str, tmp_path):
        self.local = str(tmp_path / "fs")
        os.makedirs(self.local)
        if kind == "subtree":
            self.fs, self.root = pafs.SubTreeFileSystem(self.local, pafs.LocalFileSystem()), "packs"
        elif kind == "fsspec-local":
            self.fs, self.root = PyFileSystem(FSSpecHandler(fsspec.filesystem("file"))), f"{self.local}/packs"
        else:
            self.fs, self.root = PyFileSystem(FSSpecHandler(fsspec.filesystem("memory"))), f"/{uuid.uuid4().hex}"
        self.kind = kind

    def set_mtime(self, path: str, mtime_ns: int) -> None:
        if self.kind == "memory":
            return  # fsspec's memory filesystem keeps no modification time
        on_disk = path if self.kind == "fsspec-local" else os.path.join(self.local, path)
        os.utime(on_disk, ns=(mtime_ns, mtime_ns))


@pytest.fixture(params=["subtree", "fsspec-local", "memory"])
def disk(request, tmp_path):
    return _Disk(request.param, tmp_path)


def _write(store: FileSystemPackStore, records) -> None:
    with mock.patch("dmi.storage._writer.secrets.token_hex", return_value=PACK), \
            mock.patch("dmi.storage._writer.time.time", return_value=SEALED_AT):
        with PackWriter(store, codec="raw") as writer:
            for key, value in records:
                writer.append(key, torch.full((3, 8), value))


def _live_and_replacement(disk: _Disk, live_records, replacement_records) -> tuple[FileSystemPackStore, str, float]:
    """The live store holding pack ``PACK``, the path of a pack of the same id and size written
    beside it, and the value ``replacement_records(value)`` was given for it: the first of
    ``_CANDIDATES`` whose pack is as large as the live one (the index is compressed, so its size
    depends on the values)."""
    live = FileSystemPackStore(disk.fs, f"{disk.root}/live")
    _write(live, live_records)
    disk.set_mtime(live._path(PACK), KEPT_MTIME_NS)
    size = read_pack_descriptor(live, PACK).size
    for i, value in enumerate(_CANDIDATES):
        spare = FileSystemPackStore(disk.fs, f"{disk.root}/spare{i}")
        _write(spare, replacement_records(value))
        if read_pack_descriptor(spare, PACK).size == size:
            return live, spare._path(PACK), value
    raise AssertionError(f"no replacement of {size} bytes among {_CANDIDATES}")


_CANDIDATES = tuple(float(v) for v in range(2, 40))


def _replace(disk: _Disk, live: FileSystemPackStore, replacement: str) -> None:
    """Rewrite the live pack in place with the replacement's bytes."""
    with disk.fs.open_input_file(replacement) as source:
        data = source.read()
    with disk.fs.open_output_stream(live._path(PACK)) as out:
        out.write(data)
    disk.set_mtime(live._path(PACK), REPLACED_MTIME_NS)


def test_a_pack_replaced_by_one_of_the_same_size_is_read_through_its_own_index(disk):
    live, replacement, value = _live_and_replacement(disk, [(KEY, 1.0)], lambda v: [(KEY, v)])
    cache = FooterCache()
    assert read_by_key(live, PACK, KEY, cache=cache).tolist() == [[1.0] * 8] * 3
    _replace(disk, live, replacement)
    assert read_by_key(live, PACK, KEY, cache=cache).tolist() == [[value] * 8] * 3
    assert cache.stats().entries == 1


def test_a_stale_index_never_reads_a_key_at_its_old_place(disk):
    """The replacement holds ``OTHER`` where the old pack held ``KEY``, with ``KEY``'s old values:
    the old index would find ``KEY`` there and its checksum would pass, giving the old values."""
    live, replacement, value = _live_and_replacement(disk, [(KEY, 1.0), (OTHER, 2.0)], lambda v: [(OTHER, 1.0), (KEY, v)])
    old, new = read_pack_descriptor(live, PACK), read_pack_descriptor(FileSystemPackStore(disk.fs, os.path.dirname(replacement)), PACK)
    assert old.records[0].payload == new.records[0].payload and old.records[0].meta.key == KEY
    assert old.records[0].meta.checksum == new.records[0].meta.checksum  # the trap is armed
    cache = FooterCache()
    assert read_by_key(live, PACK, KEY, cache=cache).tolist() == [[1.0] * 8] * 3
    _replace(disk, live, replacement)
    assert read_by_key(live, PACK, KEY, cache=cache).tolist() == [[value] * 8] * 3
    assert read_by_key(live, PACK, OTHER, cache=cache).tolist() == [[1.0] * 8] * 3
    assert [t.tolist() for t in read_records(live, list(new.records), cache=cache)] == [[[1.0] * 8] * 3, [[value] * 8] * 3]


def test_the_version_is_the_size_and_modification_time_or_none_without_a_time(disk):
    live, _, _ = _live_and_replacement(disk, [(KEY, 1.0)], lambda v: [(KEY, v)])
    size = read_pack_descriptor(live, PACK).size
    with live.open_input(PACK) as source:
        expected = None if disk.kind == "memory" else (size, KEPT_MTIME_NS)
        if disk.kind == "fsspec-local":  # fsspec gives the time as float seconds
            expected = (size, disk.fs.get_file_info(live._path(PACK)).mtime_ns)
            assert abs(expected[1] - KEPT_MTIME_NS) < 1000
        assert source.version == expected
        assert load_footer(live, PACK, cache=FooterCache(), source=source).version == expected


def test_a_file_changed_around_its_open_has_no_version_and_its_index_is_read_from_the_bytes_opened(tmp_path):
    """The time taken before the open differs from the time when the version is first asked:
    which file was opened is unknown, so the version is ``None`` and the index is the one of the
    bytes opened (a local file opened keeps its bytes when another is renamed over it)."""
    disk = _Disk("subtree", tmp_path)
    live, replacement, value = _live_and_replacement(disk, [(KEY, 1.0)], lambda v: [(KEY, v)])
    disk.set_mtime(replacement, REPLACED_MTIME_NS)
    opened = read_pack_descriptor(live, PACK).records
    cache = FooterCache()
    with live.open_input(PACK) as source:
        disk.fs.move(replacement, live._path(PACK))
        assert source.version is None
        assert load_footer(live, PACK, cache=cache, source=source).descriptor.records == opened
    assert read_by_key(live, PACK, KEY, cache=cache).tolist() == [[value] * 8] * 3
