"""A loader export into a full disk: every file it writes (shards, ``tokens.parquet``,
``manifest.json``) fails as the named ``ExportError``, leaves no partial file and never an
empty manifest, and leaves the loader where it stood.

The full disk is a fake at the file boundary: the temporary file's handle raises ``ENOSPC``
on its first write (as ``write(2)`` does on a full tmpfs, where this was reproduced; mounting
one needs root). A file that cannot even be created for lack of space is faked at ``os.open``.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

import dmi
import dmi._export as export
from dmi.storage import PackWriter
from dmi.storage.errors import ExportError
from tests.test_loader import ALL, _write


class _FullDiskHandle:
    """A fake: the temporary file's handle, whose every write fails as on a full disk."""

    def __init__(self, handle):
        self.handle = handle

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The loader tests' records, published in a store of this module's own."""
    home = tmp_path_factory.mktemp("faults-export-home")
    with dmi.open(home=home) as opened:
        descriptors = []
        with PackWriter(opened.packs, max_records=10, on_seal=descriptors.append) as writer:
            _write(writer)
        with opened.catalog.publisher("faults-export") as publisher:
            publisher.publish(descriptors)
        yield opened


def _disk_full_for(monkeypatch, name: str) -> None:
    """Writes of the file called ``name`` fail with ENOSPC; every other file is written."""
    real = export._open_temp

    def open_temp(out):
        handle, temp = real(out)
        return (_FullDiskHandle(handle) if os.path.basename(out) == name else handle), temp

    monkeypatch.setattr(export, "_open_temp", open_temp)


@pytest.mark.parametrize("name", ["manifest.json", "tokens.parquet"])
def test_a_full_disk_at_the_index_or_manifest_is_an_export_error_and_leaves_no_file(store, tmp_path, monkeypatch,
                                                                                     name):
    loader = store.loader("m", layers=[0], batch_size=10, with_tokens=True, seed=1)
    _disk_full_for(monkeypatch, name)
    out = tmp_path / "full"
    with pytest.raises(ExportError, match=rf"could not write .*{name} \(No space left on device\); nothing was "
                                          "written: make room there") as raised:
        loader.export(out)
    assert isinstance(raised.value, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    left = sorted(p.name for p in out.iterdir())
    assert name not in left and "manifest.json" not in left
    assert [p for p in left if p.endswith(".part")] == []
    assert loader.state_dict()["cursors"] == [[0, 0]] and loader.epoch == 0
    monkeypatch.undo()
    manifest = json.loads(loader.export(tmp_path / "again").read_text())
    assert (manifest["epoch"], manifest["rows"]) == (0, len(ALL))


def test_a_file_that_cannot_be_created_for_lack_of_space_is_an_export_error(tmp_path, monkeypatch):
    """No room even for the file's inode (a full disk, or a quota): the same ``ExportError``
    as a write that fails part-way, not a bad path."""
    import torch

    real_open = os.open

    def no_space(path, flags, *args):
        if str(path).endswith(".part"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_space)
    target = tmp_path / "x.safetensors"
    with pytest.raises(ExportError, match=r"could not write .*x\.safetensors \(No space left on device\); nothing "
                                          "was written") as raised:
        export.export_tensor(torch.zeros(4), target, name="x")
    assert isinstance(raised.value, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
