"""``session.published`` holds every pack the session published, also where leaving its block
raises: the drain failed after publishing some, the writer failed to close after the last
flush, or the catalog failed to release the lease."""

from __future__ import annotations

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackStore
from dmi.storage.errors import DrainError

from ._models import left_padded_batch, tiny
from .test_drain_failure_publish import _capture_until_the_writer_fails


def _ids(descriptors) -> list[str]:
    return sorted(d.pack_id for d in descriptors)


def test_packs_published_before_the_drain_failed_are_in_published(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, _ = _capture_until_the_writer_fails(store, catalog, publish_fails=False)
        published = catalog.published_pack_ids()
    assert len(published) >= 2
    assert _ids(cap.published) == sorted(published)
    assert cap.stats["packs_published"] == len(cap.published)


def test_packs_flushed_before_the_writer_failed_to_close_are_in_published(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with pytest.raises(DrainError, match="writer would not close"):
        with attach(model, hooks="resid_post", store=store, writer_options={"max_records": 4}) as cap:
            cap.drain.writer.close = _closing_then_failing(cap.drain.writer.close)
            cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    sealed = sorted(store.list_packs())
    assert len(sealed) >= 2
    assert _ids(cap.published) == sealed


def test_packs_published_before_the_lease_failed_to_release_are_in_published(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(ConnectionError, match="catalog gone"):
            with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m") as cap:
                cap._publisher.publisher.release = _catalog_gone
                cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        published = catalog.published_pack_ids()
    assert len(published) == 1
    assert _ids(cap.published) == sorted(published)


def _closing_then_failing(close):
    """``close`` (nothing is left open after the last flush), then a failure to close."""
    def close_then_fail():
        close()
        raise OSError("writer would not close")
    return close_then_fail


def _catalog_gone():
    raise ConnectionError("catalog gone")
