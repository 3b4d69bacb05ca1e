"""A drain that fails still publishes the packs it sealed whole before the failure (its lease
is held: readers should see them) and counts the records the failed write discarded as lost;
where that publish fails too, its error counts the packs left unpublished and names
``dmi recover``, which publishes them."""

from __future__ import annotations

import threading

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackStore, verify_pack
from dmi.storage.errors import DrainError, PackSealError
from tests._models import left_padded_batch, tiny

FAIL_AFTER = 25  # records appended before the writer fails: packs of at most 10 sealed by then


def _failing_after(append, n: int, failed: threading.Event):
    """``append`` that raises from its ``n + 1``-th call on (setting ``failed``), as a write that
    failed would (a stand-in for a disk that fails part-way: the real one is
    tests/test_full_disk.py, which needs a mount)."""
    calls = []

    def append_or_fail(key, *args, **kwargs):
        calls.append(None)
        if len(calls) > n:
            failed.set()
            raise PackSealError("pack p: write failed (disk on fire); the pack was discarded with its 1 records",
                                lost_keys=[key])
        return append(key, *args, **kwargs)
    return append_or_fail


def _capture_until_the_writer_fails(store, catalog, *, publish_fails: bool):
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with pytest.raises(DrainError, match="disk on fire") as raised:
        with attach(model, hooks="resid_post mlp_out", store=store, catalog=catalog, model_id="m",
                    writer_options={"max_records": 10}) as cap:
            failed = threading.Event()
            cap.drain.writer.append = _failing_after(cap.drain.writer.append, FAIL_AFTER, failed)
            if publish_fails:  # the catalog goes away as the disk fails: a stand-in for that
                cap.drain._publish = _refusing_once(cap.drain._publish, failed)
            for _ in range(5):
                cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return cap, raised.value


def _refusing_once(publish, failed: threading.Event):
    """``publish`` until ``failed`` is set, then a catalog that is gone."""
    def publish_or_refuse(batch):
        if failed.is_set():
            raise ConnectionError("catalog gone")
        return publish(batch)
    return publish_or_refuse


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
        losses = catalog.losses(model_id="m").to_pylist()
        # the record the failed write discarded; and whatever the failed drain held unwritten after it
        assert sum(r["count"] for r in losses if r["reason"] == "pack not written") == 1
        # and the step the error cut short, where it surfaced in the middle of one
        assert {r["reason"] for r in losses} <= {"pack not written", "drain failed", "step interrupted"}
        assert cap.stats["records_lost"] == sum(r["count"] for r in losses)


def test_packs_a_failed_publish_left_are_counted_and_recovered(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        _, error = _capture_until_the_writer_fails(store, catalog, publish_fails=True)
        sealed, published = set(store.list_packs()), catalog.published_pack_ids()
        assert len(sealed) >= 2 and published < sealed
        assert f"{len(sealed - published)} sealed pack(s) are not published" in str(error)
        assert "`dmi recover` publishes them" in str(error)
        catalog.recover(store)
        assert catalog.published_pack_ids() == sealed


def test_a_failure_a_step_raised_mid_flight_is_raised_again_settled_at_exit(tmp_path):
    """The model's next step raises the drain's failure before the drain has dealt with it;
    leaving the block then raises it again, settled: with the packs it left unpublished counted."""
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError, match="disk on fire") as raised:
            with attach(model, hooks="resid_post mlp_out", store=store, catalog=catalog, model_id="m",
                        writer_options={"max_records": 10}, slot_bytes=16384) as cap:  # slots handed over as they fill
                failed = threading.Event()
                cap.drain.writer.append = _failing_after(cap.drain.writer.append, FAIL_AFTER, failed)
                cap.drain._publish = _refusing_once(cap.drain._publish, failed)
                with pytest.raises(DrainError) as mid_flight:
                    for _ in range(20):  # the step after the failure raises it
                        cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
                        if failed.is_set():
                            _wait_for_the_failure(cap.drain)
                assert "not published" not in str(mid_flight.value)  # raised by a step: not known yet
                raise mid_flight.value
        sealed, published = set(store.list_packs()), catalog.published_pack_ids()
        assert f"{len(sealed - published)} sealed pack(s) are not published" in str(raised.value)
        assert raised.value is not mid_flight.value


def _wait_for_the_failure(drain, bound_seconds: float = 60.0) -> None:
    """Until the drain thread has taken its failure as its error (bounded: never a timing assert)."""
    done = threading.Event()
    for _ in range(int(bound_seconds / 0.05)):
        if drain.error is not None:
            return
        done.wait(0.05)
    raise AssertionError("the drain did not fail")
