"""A settled ``DrainError`` — one raised by ``flush()`` or by leaving the block — counts every
sealed pack the failure left unpublished: the count is what ``dmi recover`` then publishes.

Before, the flush that reached a failure left the writer's open pack open, and the writer's
close sealed it after that flush's error was built: an error raised by ``flush()`` (settled,
so raised as it is on leaving the block) counted one pack short. A failure raised mid-step
(not settled) was already raised again settled by the close, with the close's pack counted.

The writer failing part-way and the catalog gone with it are stand-ins
(tests/test_drain_failure_publish.py's): a record is appended to the open pack in the step
that fails, so that pack is open when the failure is reached.
"""

from __future__ import annotations

import re
import threading

import pytest

from dmi.capture import attach
from dmi.catalog import open_catalog
from dmi.storage import PackStore
from dmi.storage.errors import DrainError
from tests._models import left_padded_batch, tiny
from tests.test_drain_failure_publish import FAIL_AFTER, _failing_after, _refusing_once


def _counted(error: DrainError) -> int:
    found = re.search(r"; (\d+) sealed pack\(s\) are not published: .*`dmi recover` publishes them", str(error))
    assert found, str(error)
    return int(found.group(1))


def _session(store, catalog):
    return attach(tiny("llama"), hooks="resid_post mlp_out", store=store, catalog=catalog, model_id="m",
                  writer_options={"max_records": 10})


def _failing(cap) -> None:
    """The session's writer fails after ``FAIL_AFTER`` appends, the catalog gone from then on."""
    failed = threading.Event()
    cap.drain.writer.append = _failing_after(cap.drain.writer.append, FAIL_AFTER, failed)
    cap.drain._publish = _refusing_once(cap.drain._publish, failed)


def _generate(cap, *, flush: bool) -> None:
    ids, mask = left_padded_batch()
    for _ in range(5):
        cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        if flush:
            cap.flush()


def _unpublished(store, catalog) -> set[str]:
    return set(store.list_packs()) - catalog.published_pack_ids()


@pytest.mark.parametrize("flush", [True, False], ids=["raised-by-flush", "raised-mid-step"])
def test_the_error_leaving_the_block_counts_every_unpublished_pack(tmp_path, flush):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError, match="disk on fire") as raised:
            with _session(store, catalog) as cap:
                _failing(cap)
                _generate(cap, flush=flush)
        assert raised.value.settled is True
        unpublished = _unpublished(store, catalog)
        assert _counted(raised.value) == len(unpublished) == cap.stats["packs_sealed"] - cap.stats["packs_published"]
        assert set(catalog.recover(store)) == unpublished


def test_a_flush_error_caught_in_the_block_counts_what_the_close_leaves(tmp_path):
    store = PackStore.local(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with pytest.raises(DrainError, match="disk on fire") as closed:
            with _session(store, catalog) as cap:
                _failing(cap)
                with pytest.raises(DrainError, match="disk on fire") as flushed:
                    _generate(cap, flush=True)
        unpublished = _unpublished(store, catalog)
        assert _counted(flushed.value) == _counted(closed.value) == len(unpublished)
        assert set(catalog.recover(store)) == unpublished
