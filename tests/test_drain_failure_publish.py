"""A drain that fails still publishes the packs it sealed whole before the failure (its lease
is held: readers should see them), and where that publish fails too, its error counts the
packs left unpublished and names ``dmi recover``, which publishes them."""

from __future__ import annotations

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackStore, verify_pack
from dmi.storage.errors import DrainError, PackSealError
from tests._models import left_padded_batch, tiny

FAIL_AFTER = 25  # records appended before the writer fails: packs of at most 10 sealed by then


def _failing_after(append, n: int):
    """``append`` that raises from its ``n + 1``-th call on, as a write that failed would (a stand-in
    for a disk that fails part-way: the real one is tests/test_full_disk.py, which needs a mount)."""
    calls = []

    def append_or_fail(*args, **kwargs):
        calls.append(None)
        if len(calls) > n:
            raise PackSealError("pack p: write failed (disk on fire); the pack was discarded with its 5 records")
        return append(*args, **kwargs)
    return append_or_fail


def _capture_until_the_writer_fails(store, catalog, *, publish_fails: bool):
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with pytest.raises(DrainError, match="disk on fire") as raised:
        with attach(model, hooks="resid_post mlp_out", store=store, catalog=catalog, model_id="m",
                    writer_options={"max_records": 10}) as cap:
            cap.drain.writer.append = _failing_after(cap.drain.writer.append, FAIL_AFTER)
            if publish_fails:  # the catalog fails as well: a stand-in for one that went away
                cap.drain._publish = _refuse
            for _ in range(5):
                cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return cap, raised.value


def _refuse(batch):
    raise ConnectionError("catalog gone")


def test_packs_sealed_before_the_failure_are_published(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, error = _capture_until_the_writer_fails(store, catalog, publish_fails=False)
        sealed = set(store.list_packs())
        assert len(sealed) >= 2
        assert catalog.published_pack_ids() == sealed
        assert cap.stats["packs_published"] == len(sealed)
        assert "not published" not in str(error)
        records = sum(len(verify_pack(store, pack_id).records) for pack_id in sealed)
        assert len(catalog.select_records("m")) == records <= FAIL_AFTER


def test_packs_a_failed_publish_left_are_counted_and_recovered(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        _, error = _capture_until_the_writer_fails(store, catalog, publish_fails=True)
        sealed = set(store.list_packs())
        assert len(sealed) >= 2 and catalog.published_pack_ids() == set()
        assert f"{len(sealed)} sealed pack(s) are not published" in str(error)
        assert "`dmi recover` publishes them" in str(error)
        catalog.recover(store)
        assert catalog.published_pack_ids() == sealed
