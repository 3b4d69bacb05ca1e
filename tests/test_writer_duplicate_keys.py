"""The pack writer refuses a record key its open pack already holds (``DuplicateRecordError``).

Taken, the second record sealed beside the first: both indexed, ``verify_pack`` content with
both, and every read of that request's hook then refused with ``DuplicateChunkError``, whose
advice (choose a shard rank or a run) cannot help: both records had the same rank and run. The
refusal keeps the first record and the rest of the pack; the writer goes on.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dmi.reader import read_record
from dmi.storage import DuplicateRecordError, InvalidArgumentError, PackStore, PackWriter, RecordKey, verify_pack

BATCH_BYTES = 64  # records of 16 float32 values (64 bytes) are written straight; smaller ones gathered


def key(request="req-1", layer=0, step=0):
    return RecordKey("model", "run", request, "resid_post", layer, 0, 2, step=step)


def values(fill: float, n: int) -> torch.Tensor:
    return torch.full((2, n // 2), fill, dtype=torch.float32)


@pytest.fixture
def store(tmp_path):
    return PackStore.local(tmp_path / "packs")


def _message(k: RecordKey, pack_id: str) -> str:
    return (f"record model/run/req-1/resid_post/layer 0/tokens 0+2/rank 0 (step {k.step}, forward): pack {pack_id} "
            "already holds a record under this key, and readers would find both; this one was not written "
            "(the first stays). Give each record its own key")


@pytest.mark.parametrize("n", [4, 16], ids=["gathered", "written-straight"])
def test_a_key_the_open_pack_holds_is_refused_and_the_first_record_stays(store, n):
    with PackWriter(store, batch_bytes=BATCH_BYTES) as writer:
        writer.append(key(), values(1.0, n))
        writer.append(key(layer=1), values(2.0, n))
        with pytest.raises(DuplicateRecordError) as refused:
            writer.append(key(), values(7.0, n))
        writer.append(key(layer=2), values(3.0, n))  # the writer goes on
        sealed = writer.seal()
    assert isinstance(refused.value, InvalidArgumentError)
    assert str(refused.value) == _message(key(), sealed.pack_id)
    assert [r.meta.key for r in sealed.records] == [key(), key(layer=1), key(layer=2)]
    assert [r.meta.key for r in verify_pack(store, sealed.pack_id).records] == [key(), key(layer=1), key(layer=2)]
    assert torch.equal(read_record(store, sealed.records[0]), values(1.0, n))


def test_keys_differing_in_any_field_are_distinct_records(store):
    """Only the whole key repeated is refused: the same tokens at another step are another record."""
    with PackWriter(store) as writer:
        for k in (key(), key(step=1), key(request="req-2")):
            writer.append(k, values(1.0, 4))
        sealed = writer.seal()
    assert [r.meta.key for r in sealed.records] == [key(), key(step=1), key(request="req-2")]


def test_only_the_open_pack_is_checked(store):
    """A key repeated after its pack sealed is taken into the next pack: the writer keeps no keys
    of sealed packs (a long-lived writer would hold them all); readers refuse the repeat."""
    with PackWriter(store) as writer:
        writer.append(key(), values(1.0, 4))
        first = writer.seal()
        writer.append(key(), values(7.0, 4))
        second = writer.seal()
    assert [r.meta.key for r in first.records] == [r.meta.key for r in second.records] == [key()]


def test_threads_appending_one_key_at_once_store_it_once(store):
    """The check and the add happen under the writer's lock: of eight threads appending the
    same key, one stores it and seven are refused."""
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def append(writer, fill):
        barrier.wait()
        try:
            writer.append(key(), values(fill, 4))
        except DuplicateRecordError:
            outcomes.append("refused")
        else:
            outcomes.append("stored")

    with PackWriter(store) as writer:
        threads = [threading.Thread(target=append, args=(writer, float(i))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sealed = writer.seal()
    assert sorted(outcomes) == ["refused"] * 7 + ["stored"]
    assert [r.meta.key for r in sealed.records] == [key()]
