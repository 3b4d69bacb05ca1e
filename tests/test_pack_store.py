"""PackStore: the conformance suite for every store, and the local store's sealing crashes."""

import dataclasses
import errno
import os
import secrets

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from dmi.storage import (
    FileSystemPackStore,
    InvalidArgumentError,
    LocalPackStore,
    PackNotFoundError,
    PackSealError,
    PackStore,
    PackWriter,
    RecordKey,
    read_pack_descriptor,
    verify_pack,
)
from dmi.storage._store import _LocalPackSink
from dmi.reader import read_record, read_records
from tests.pack_store_conformance import PackStoreConformance

KEY = RecordKey("model", "run", "req", "resid_post", 0, 0, 4)


def write_one(store, tensor=None, **kw):
    with PackWriter(store, **kw) as w:
        w.append(KEY, torch.arange(64, dtype=torch.float32) if tensor is None else tensor)
        return w.seal()


class TestLocalPackStore(PackStoreConformance):
    def make_store(self, tmp_path):
        return PackStore.local(tmp_path / "packs")

    def put_foreign_file(self, store, name, data):
        with open(os.path.join(store.root, name), "wb") as f:
            f.write(data)

    def test_a_name_with_a_newline_after_the_id_is_not_listed(self, store):
        """A file named ``<id>\\n.arrow`` (a local file system allows it) is a foreign file."""
        pack_id = secrets.token_hex(16)
        self.put_foreign_file(store, f"{pack_id}\n.arrow", b"not a pack")
        assert store.list_packs() == []


class TestFileSystemPackStore(PackStoreConformance):
    """The object-storage code path on pyarrow's local filesystem."""

    UNSEALED_PACKS_HIDDEN = False  # LocalFileSystem shows a file as soon as it is opened for writing

    def make_store(self, tmp_path):
        return FileSystemPackStore(pafs.LocalFileSystem(), str(tmp_path / "not-yet-created"))

    def put_foreign_file(self, store, name, data):
        store.filesystem.create_dir(store.root, recursive=True)
        with store.filesystem.open_output_stream(f"{store.root}/{name}") as f:
            f.write(data)


class TestSubTreeFileSystemPackStore(TestFileSystemPackStore):
    """The same, with the store's root relative to a ``SubTreeFileSystem`` (as a bucket prefix is)."""

    def make_store(self, tmp_path):
        return FileSystemPackStore(pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()), "packs")


def test_missing_pack_is_file_not_found(tmp_path):
    store = PackStore.local(tmp_path)
    desc = write_one(store)
    os.unlink(desc.location)
    with pytest.raises(PackNotFoundError, match=desc.pack_id) as info:
        read_record(store, desc.records[0])
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(PackNotFoundError):
        read_pack_descriptor(store, desc.pack_id)


def test_from_uri(tmp_path):
    assert isinstance(PackStore.from_uri(str(tmp_path)), LocalPackStore)
    store = PackStore.from_uri(f"file://{tmp_path}/sub")
    assert isinstance(store, LocalPackStore) and store.root == f"{tmp_path}/sub"
    generic = PackStore.from_uri("mock://bucket/prefix")
    assert isinstance(generic, FileSystemPackStore) and generic.uri == "mock://bucket/prefix"
    with pytest.raises(InvalidArgumentError):
        PackStore.from_uri("nosuchscheme://bucket/x")


def test_generic_filesystem_path(tmp_path):
    """The object-storage code path (direct write, pyarrow range reads) on a local filesystem."""
    store = FileSystemPackStore(pafs.LocalFileSystem(), str(tmp_path / "obj"))
    t = torch.randn(300, 7).to(torch.bfloat16)
    desc = write_one(store, t)
    assert store.list_packs() == [desc.pack_id]
    assert desc.location.endswith(f"/{desc.pack_id}.arrow")
    assert verify_pack(store, desc.pack_id) == desc
    assert torch.equal(read_record(store, desc.records[0]).view(torch.int16), t.view(torch.int16))
    assert torch.equal(read_records(store, desc.records)[0].view(torch.int16), t.view(torch.int16))


class Crash(BaseException):
    """A process death: no cleanup handler (they catch OSError/Exception) runs."""


SEAL_STEPS = ["_close_stream", "_fsync_file", "_rename", "_fsync_dir"]


@pytest.mark.parametrize("step", SEAL_STEPS)
def test_crash_at_each_sealing_step_leaves_no_half_pack(tmp_path, monkeypatch, step):
    store = PackStore.local(tmp_path)
    t = torch.arange(100_000, dtype=torch.float32)
    done = []

    def crash(self):
        raise Crash(step)

    monkeypatch.setattr(_LocalPackSink, step, crash)
    w = PackWriter(store, max_records=2, on_seal=done.append)
    w.append(KEY, t)
    with pytest.raises(Crash):
        w.append(RecordKey("model", "run", "req", "resid_post", 1, 0, 4), t)
    monkeypatch.undo()
    listed = store.list_packs()
    assert done == []
    if SEAL_STEPS.index(step) <= SEAL_STEPS.index("_rename"):
        assert listed == []  # only a temporary file is there
        assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    else:
        # renamed but the directory fsync "crashed": the pack is whole and readable
        (pack_id,) = listed
        desc = verify_pack(store, pack_id)
        assert all(torch.equal(read_record(store, e), t) for e in desc.records)
    # a fresh writer and store work as usual next to the leftovers
    again = write_one(PackStore.local(tmp_path))
    assert again.pack_id in store.list_packs()


def test_full_disk_on_fsync(tmp_path, monkeypatch):
    store = PackStore.local(tmp_path)

    def enospc(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(PackSealError, match="No space") as info:
        write_one(store)
    assert isinstance(info.value, OSError)
    monkeypatch.undo()
    assert store.list_packs() == [] and os.listdir(tmp_path) == []


class DevFullStore(LocalPackStore):
    """Every pack body goes to /dev/full: a real ENOSPC from write(2)."""

    def create(self, pack_id):
        sink = super().create(pack_id)
        sink.stream.close()
        sink.stream = pa.OSFile("/dev/full", "wb")
        return sink


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_on_write(tmp_path):
    store = DevFullStore(tmp_path)
    w = PackWriter(store, codec="raw", batch_bytes=1024)
    with pytest.raises(PackSealError, match="discarded") as info:
        w.append(KEY, torch.zeros(10_000))
    assert isinstance(info.value.__cause__, OSError)
    assert store.list_packs() == [] and os.listdir(tmp_path) == []
    w.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_counts_the_gathered_records_lost(tmp_path):
    """A gathered batch that cannot be written loses its records and the one being added:
    the error counts all of them."""
    store = DevFullStore(tmp_path)
    w = PackWriter(store, codec="raw", batch_bytes=1 << 20)
    w.append(KEY, torch.zeros(400_000, dtype=torch.uint8))
    w.append(dataclasses.replace(KEY, layer=1), torch.zeros(400_000, dtype=torch.uint8))
    with pytest.raises(PackSealError, match="discarded with its 3 records"):
        w.append(dataclasses.replace(KEY, layer=2), torch.zeros(400_000, dtype=torch.uint8))
    assert store.list_packs() == [] and os.listdir(tmp_path) == []
    w.close()


@pytest.mark.parametrize("kind", ["local", "generic"])
def test_existing_pack_never_overwritten(tmp_path, monkeypatch, kind):
    store = PackStore.local(tmp_path) if kind == "local" else FileSystemPackStore(pafs.LocalFileSystem(), str(tmp_path))
    first = write_one(store)
    monkeypatch.setattr("secrets.token_hex", lambda n=16: first.pack_id[: 2 * n])
    with pytest.raises(PackSealError, match="already exists"):
        write_one(store)
    monkeypatch.undo()
    assert verify_pack(store, first.pack_id) == first


class _UploadFailingAtClose:
    """An output file whose upload completes at close, and fails there half-way (EIO): what an
    object-store or network filesystem client can do. A fake, because no real filesystem here
    fails at a chosen close."""

    def __init__(self, path):
        self.file, self.pending, self.closed = open(path, "wb"), b"", False

    def writable(self):
        return True

    def write(self, data):
        self.pending += bytes(data)
        return len(data)

    def tell(self):
        return len(self.pending)

    def flush(self):
        pass

    def close(self):
        if not self.closed:
            self.closed = True
            self.file.write(self.pending[: len(self.pending) // 2])
            self.file.close()
            raise OSError(errno.EIO, "Input/output error")


class _FailingUploads(pafs.FileSystemHandler):
    """The local filesystem, but every output stream is an :class:`_UploadFailingAtClose`."""

    def __init__(self):
        self.local = pafs.LocalFileSystem()

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def get_type_name(self):
        return "failing-uploads"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_file(self, path):
        self.local.delete_file(path)

    def open_input_file(self, path):
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_UploadFailingAtClose(path), mode="w")

    # not used by a pack store
    delete_dir = delete_dir_contents = delete_root_dir_contents = move = copy_file = None
    open_input_stream = open_append_stream = None


def test_an_upload_failing_at_close_leaves_no_pack_behind(tmp_path):
    """The sink writes the final key directly: when the upload fails at its close, the part
    written must be deleted, or a truncated file would be listed (and recovered) as a pack."""
    store = FileSystemPackStore(pafs.PyFileSystem(_FailingUploads()), str(tmp_path))
    with pytest.raises(PackSealError, match="could not complete the upload"):
        with PackWriter(store, codec="raw") as writer:
            writer.append(RecordKey("m", "r", "q", "h", 0, 0, 1), torch.ones(1000))
    assert store.list_packs() == [] and os.listdir(tmp_path) == []
