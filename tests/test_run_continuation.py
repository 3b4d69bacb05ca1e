"""A capture given a run id that already holds records continues the run: nothing twice.

A job restarted with a fixed run id, or a user capturing batch after batch under one run id,
attaches again with ``run_id=`` the same. Its default request ids continue after the run's
(``<run>-000003`` after ``<run>-000002``); a request id the run already holds — from the earlier
capture or earlier in the same session — is refused with ``RequestExistsError`` before the
model runs, so no reader ever sees a record twice. Another tensor-parallel rank's requests of
the same run are not this rank's: they do not count.
"""

import dataclasses

import pytest

import dmi
from dmi.capture import attach
from dmi.storage.errors import InvalidArgumentError, RequestExistsError
from tests._models import left_padded_batch, tiny


@pytest.fixture
def store(tmp_path):
    with dmi.open(catalog=f"chdb://{tmp_path / 'catalog'}", packs=str(tmp_path / "packs")) as s:
        yield s


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def _capture(model, store, *, run_id="r", request_ids=None, **over):
    ids, mask = left_padded_batch(seed=1)
    with attach(model, hooks="resid_post", store=store.packs, catalog=store.catalog, model_id="m", run_id=run_id,
                **over) as cap:
        result = cap.generate(ids, attention_mask=mask, request_ids=request_ids, max_new_tokens=2, do_sample=False)
    return list(result.request_ids)


def _keys(store):
    return [dataclasses.astuple(e.meta.key) for e in store.catalog.find_records("m")]


def test_a_second_capture_under_the_run_id_continues_its_request_ids(model, store):
    first = _capture(model, store)
    second = _capture(model, store)
    assert first == ["r-000000", "r-000001", "r-000002"]
    assert second == ["r-000003", "r-000004", "r-000005"]
    keys = _keys(store)
    assert len(keys) == len(set(keys)) == 36  # 6 requests x 3 layers x 2 chunks (prompt, decode)
    assert store.catalog.requests("m", "r") == first + second


def test_request_ids_the_run_already_holds_are_refused_before_the_model_runs(model, store):
    _capture(model, store, request_ids=["a", "b", "c"])
    before = _keys(store)
    with pytest.raises(RequestExistsError, match=r"'b', 'c' already hold records in run 'r' of model 'm'") as info:
        _capture(model, store, request_ids=["z", "b", "c"])
    assert isinstance(info.value, InvalidArgumentError)
    assert _keys(store) == before  # nothing of the refused call was written
    assert _capture(model, store, request_ids=["x", "y", "z"]) == ["x", "y", "z"]  # new ids: fine
    assert sorted(store.catalog.requests("m", "r")) == ["a", "b", "c", "x", "y", "z"]


def test_one_session_refuses_a_request_id_it_already_used(model, store):
    ids, mask = left_padded_batch(seed=1)
    with attach(model, hooks="resid_post", store=store.packs, catalog=store.catalog, model_id="m") as cap:
        cap.generate(ids, attention_mask=mask, request_ids=["a", "b", "c"], max_new_tokens=2, do_sample=False)
        with pytest.raises(RequestExistsError, match="'a' already hold records"):
            cap.generate(ids, attention_mask=mask, request_ids=["a", "d", "e"], max_new_tokens=2, do_sample=False)
        # default ids skip what the session used explicitly
        again = cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert len(set(again.request_ids) | {"a", "b", "c"}) == 6
    keys = _keys(store)
    assert len(keys) == len(set(keys))


def test_default_ids_skip_an_explicit_id_of_the_default_form(model, store):
    _capture(model, store, request_ids=["r-000001", "q", "s"])
    assert _capture(model, store) == ["r-000002", "r-000003", "r-000004"]


def test_another_ranks_requests_are_not_this_ranks(model, store):
    """Rank 1 of a run whose rank 0 published first writes the same request ids: its own keys."""
    ids = _capture(model, store, tp_rank=0, tp_size=2, tp_replicas="all")
    assert _capture(model, store, tp_rank=1, tp_size=2, tp_replicas="all") == ids
    keys = _keys(store)
    assert len(keys) == len(set(keys)) == 36
    assert store.catalog.rank_request_ids("m", "r", shard_rank=1) == set(ids)
    assert store.catalog.rank_request_ids("m", "r", shard_rank=2) == set()


def test_a_fresh_run_id_does_not_ask_the_catalog(model, store, monkeypatch):
    """Only a given run id can hold records already: attaching with a fresh one costs no query."""
    asked = []
    monkeypatch.setattr(store.catalog, "rank_request_ids", lambda *a, **k: asked.append(a) or set())
    _capture(model, store, run_id=None)
    assert asked == []
    _capture(model, store)
    assert asked == [("m", "r")]


@pytest.mark.parametrize("bad", [-1, 1.0, "0", True])
def test_rank_request_ids_refuses_a_rank_that_is_not_a_count(store, bad):
    with pytest.raises(InvalidArgumentError, match="shard_rank must be a non-negative int"):
        store.catalog.rank_request_ids("m", "r", shard_rank=bad)
