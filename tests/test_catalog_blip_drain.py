"""A drain whose publish fails keeps the batch in ``ctx.sealed`` until a publish of it succeeds:
the packs are published when the drain tries again after the failure, and where that fails
too the error counts every one of them (before, the failed batch left ``ctx.sealed`` first,
so it was neither published, nor retried, nor counted).

The catalog failing is a stand-in: the drain's ``publish`` raises ``CatalogUnavailableError``
(a real outage under a real server is tests/test_catalog_blip_server.py)."""

from __future__ import annotations

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackStore
from dmi.storage.errors import CatalogUnavailableError, DrainError
from tests._models import left_padded_batch, tiny


def _failing(publish, *, fail_calls: set[int]):
    """``publish`` that raises ``CatalogUnavailableError`` on the listed calls (counted from 1),
    and records the size of each batch it was handed."""
    batches: list[int] = []

    def publish_or_fail(batch):
        batches.append(len(batch))
        if len(batches) in fail_calls:
            raise CatalogUnavailableError("catalog gone for a moment")
        return publish(batch)

    publish_or_fail.batches = batches
    return publish_or_fail


def _capture(store, catalog, fail_calls):
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with pytest.raises(DrainError, match="catalog gone for a moment") as raised:
        with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="m",
                    writer_options={"max_records": 10}) as cap:
            publish = cap.drain._publish = _failing(cap.drain._publish, fail_calls=fail_calls)
            for _ in range(3):
                cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
                cap.flush()
    return cap, publish, raised.value


def test_a_batch_whose_publish_failed_is_published_when_the_drain_tries_again(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, publish, error = _capture(store, catalog, fail_calls={1})
        sealed = set(store.list_packs())
        assert publish.batches[0] >= 1 and publish.batches[1] == publish.batches[0]  # the same batch again
        assert catalog.published_pack_ids() == sealed
        assert cap.stats["packs_sealed"] == cap.stats["packs_published"] == len(sealed)
        assert "not published" not in str(error)


def test_a_batch_whose_publish_failed_is_counted_in_the_error(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, publish, error = _capture(store, catalog, fail_calls=set(range(1, 100)))
        sealed = set(store.list_packs())
        assert catalog.published_pack_ids() == set()
        assert f"{len(sealed)} sealed pack(s) are not published" in str(error)
        assert (cap.stats["packs_sealed"], cap.stats["packs_published"]) == (len(sealed), 0)
        assert set(catalog.recover(store)) == sealed
