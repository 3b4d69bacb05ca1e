"""A pack store on a full disk: the ``PackSealError`` (an ``OSError``) says the disk holding
the store is full and what to do, and nothing is left under a pack's name.

Most tests fake the full disk at the system-call boundary (``os.fsync``) or use
``/dev/full`` (a real ``ENOSPC`` from ``write(2)``). The capture test mounts a real, small
tmpfs for its packs where this process may (root, ``CAP_SYS_ADMIN``) and skips elsewhere.
"""

from __future__ import annotations

import errno
import os
import re

import shutil
import subprocess

import pyarrow as pa
import pytest
import torch

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, PackStore, PackWriter, verify_pack
from dmi.storage.errors import DrainError, PackSealError
from dmi.storage.records import RecordKey
from tests._models import left_padded_batch, tiny

KEY = RecordKey("m", "r", "q", "resid_post", 0, 0, 4, phase="prefill")
ADVICE = re.escape("is full: free space there (or give the store a larger disk) and run again")


def _failing_fsync(code: int):
    """``os.fsync`` failing with ``code`` (a fake at the system-call boundary)."""
    def fsync(fd):
        raise OSError(code, os.strerror(code))
    return fsync


def test_a_full_disk_at_the_seal_names_the_store_and_what_to_do(tmp_path, monkeypatch):
    store = PackStore.local(tmp_path)
    writer = PackWriter(store)
    writer.append(KEY, torch.zeros(4, 8))

    monkeypatch.setattr(os, "fsync", _failing_fsync(errno.ENOSPC))
    with pytest.raises(PackSealError, match=rf"nothing published: .*No space left on device; the disk holding "
                                            rf"{tmp_path} {ADVICE}; .*`dmi recover`") as raised:
        writer.seal()
    assert isinstance(raised.value, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert raised.value.lost_keys == (KEY,)  # what a caller counts as lost
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # the temporary file is removed


def test_a_record_whose_append_seals_a_pack_that_fails_is_lost_with_it(tmp_path, monkeypatch):
    """The second record does not fit the open pack: sealing it fails, and the record, which
    never joined a pack, is lost with the pack's."""
    writer = PackWriter(PackStore.local(tmp_path), codec="raw", max_bytes=200)  # one record of 128 bytes fits
    writer.append(KEY, torch.zeros(4, 8))
    second = RecordKey("m", "r", "q", "resid_post", 1, 0, 4, phase="prefill")

    monkeypatch.setattr(os, "fsync", _failing_fsync(errno.ENOSPC))
    with pytest.raises(PackSealError) as raised:
        writer.append(second, torch.zeros(4, 8))
    assert raised.value.lost_keys == (KEY, second)


def test_another_seal_failure_gives_no_full_disk_advice(tmp_path, monkeypatch):
    store = PackStore.local(tmp_path)
    writer = PackWriter(store)
    writer.append(KEY, torch.zeros(4, 8))

    monkeypatch.setattr(os, "fsync", _failing_fsync(errno.EIO))
    with pytest.raises(PackSealError, match="Input/output error") as raised:
        writer.seal()
    assert "is full" not in str(raised.value)


class _DevFullStore(LocalPackStore):
    """Every pack body goes to /dev/full: a real ENOSPC from write(2)."""

    def create(self, pack_id):
        sink = super().create(pack_id)
        sink.stream.close()
        os.unlink(sink.temp_path)
        sink.stream = pa.OSFile("/dev/full", "wb")
        return sink


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_while_a_pack_is_written_names_the_store_and_what_to_do(tmp_path):
    store = _DevFullStore(tmp_path)
    writer = PackWriter(store, codec="raw", batch_bytes=1024)
    with pytest.raises(PackSealError, match=rf"discarded with its 1 records; the disk holding {store.uri} "
                                            rf"{ADVICE}") as raised:
        writer.append(KEY, torch.zeros(10_000))
    assert raised.value.__cause__.errno == errno.ENOSPC and raised.value.lost_keys == (KEY,)
    assert store.list_packs() == [] and os.listdir(tmp_path) == []
    writer.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted at ``tmp_path / "disk"``, unmounted afterwards; skips where
    mounting is not permitted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(disk, leave: int):
    """A file taking all but ``leave`` bytes of ``disk``'s free space."""
    filler = disk / "filler"
    stat = os.statvfs(disk)
    filler.write_bytes(bytes(stat.f_bavail * stat.f_frsize - leave))
    return filler


def test_a_capture_onto_a_full_disk_fails_named_and_loses_no_sealed_pack(small_disk, tmp_path):
    store = PackStore.local(small_disk / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    filler = _fill(small_disk, 128 * 1024)
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError) as raised:
            with attach(model, hooks="resid_post mlp_out", store=store, catalog=catalog, model_id="m",
                        writer_options={"max_records": 10}) as cap:
                for _ in range(40):
                    cap.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        cause = raised.value.__cause__
        assert isinstance(cause, PackSealError) and isinstance(cause, OSError)
        assert cause.__cause__.errno == errno.ENOSPC
        assert f"the disk holding {store.root} is full: free space there" in str(raised.value)
        lost = cap.stats["records_lost"]
        losses = catalog.losses(model_id="m").to_pylist()
        assert sum(r["count"] for r in losses) == lost
        # the discarded pack's records; and what the failed drain held unwritten after it
        assert sum(r["count"] for r in losses if r["reason"] == "pack not written") == len(cause.lost_keys) > 0
        # and the step the error cut short, where it surfaced in the middle of one
        assert {r["reason"] for r in losses} <= {"pack not written", "drain failed", "step interrupted"}
        names = os.listdir(store.root)
        assert [n for n in names if not n.endswith(".arrow")] == []  # no partial file left
        sealed = store.list_packs()
        assert len(sealed) == len(names) > 0
        for pack_id in sealed:  # every pack there is whole
            assert verify_pack(store, pack_id).pack_id == pack_id
        filler.unlink()
        catalog.recover(store)  # what the drain sealed but did not publish
        assert catalog.published_pack_ids() == set(sealed)
        with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m") as cap:
            again, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        assert set(again) <= set(catalog.requests("m"))
