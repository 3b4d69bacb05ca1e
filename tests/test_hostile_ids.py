"""Malformed and hostile ids, hooks and layers through ``dmi.open(...)``'s read methods, on
the default chDB catalog: an id that is not one is an ``InvalidIdentifierError`` (a
``ValueError``) on every method — ``contents(run_id=...)`` and ``verify(model_id=...)``
used to answer ``RecordNotFoundError`` ("no run True", "no model ''"), a ``LookupError`` —;
an id that is one but names nothing is a ``RecordNotFoundError`` quoting it verbatim; and
nothing in the store changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dmi
from dmi.storage import PackWriter
from dmi.storage.errors import HookSelectionError, InvalidArgumentError, InvalidIdentifierError, RecordNotFoundError
from dmi.storage.records import RecordKey


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with dmi.open(home=tmp_path_factory.mktemp("hostile-ids")) as opened:
        descriptors = []
        with PackWriter(opened.packs, on_seal=descriptors.append) as writer:
            for request in ("a", "b"):
                for layer in (0, 1):
                    writer.append(RecordKey("m", "r", request, "resid_post", layer, 0, 4, phase="forward"),
                                  torch.full((4, 8), float(layer)))
        with opened.catalog.publisher("hostile-ids") as publisher:
            publisher.publish(descriptors)
        yield opened


def _unchanged(store) -> None:
    assert [(r.request_id, r.records) for r in store.requests("m")] == [("a", 2), ("b", 2)]
    assert store.get_internal("m", "a", "resid_post").tolist() == [[[0.0] * 8] * 4, [[1.0] * 8] * 4]


# (value, the message InvalidIdentifierError gives for an id named WHAT)
NOT_IDS = [
    ("", "{what} must not be empty"),
    ("a\x00b", "{what} 'a\\x00b' contains the control character U+0000"),
    ("a\nb", "{what} 'a\\nb' contains the control character U+000A"),
    ("\ud800", "{what} '\\ud800' is not valid Unicode (lone surrogate)"),
    ("é" * 513, "is 513 characters long; the limit is 512"),
    (True, "{what} must be a str, not bool"),
    (1.5, "{what} must be a str, not float"),
    (np.int64(1), "{what} must be a str, not int64"),
    (b"r", "{what} must be a str, not bytes"),
]
NOT_ID_IDS = ["empty", "nul", "newline", "surrogate", "too-long", "bool", "float", "numpy-int", "bytes"]

CALLS = {
    "contents-run": (lambda s, v: s.contents("m", "a", run_id=v), "run id"),
    "verify-model": (lambda s, v: s.verify(model_id=v), "model id"),
    "contents-model": (lambda s, v: s.contents(v, "a"), "model id"),
    "contents-request": (lambda s, v: s.contents("m", v), "request id"),
    "get_internal-run": (lambda s, v: s.get_internal("m", "a", "resid_post", run_id=v), "run id"),
    "tokens-run": (lambda s, v: s.tokens("m", "a", run_id=v), "run id"),
    "requests-run": (lambda s, v: s.requests("m", run_id=v), "run id"),
    "delete-run": (lambda s, v: s.delete("m", v), "run id"),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("value, message", NOT_IDS, ids=NOT_ID_IDS)
def test_an_id_that_is_not_one_is_an_identifier_error_everywhere(store, call, value, message):
    method, what = CALLS[call]
    with pytest.raises(InvalidIdentifierError) as info:
        method(store, value)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, LookupError)
    assert message.format(what=what) in str(info.value)
    _unchanged(store)


HOSTILE = ["x' OR 1=1 --", "x'); DROP TABLE dmi_records; --", "a\\", "a\\'", '"', "`", "%(x)s", "é", "a" * 512]


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[:20])
def test_hostile_ids_name_nothing_and_change_nothing(store, value):
    with pytest.raises(RecordNotFoundError) as info:
        store.contents("m", "a", run_id=value)
    assert str(info.value) == f"model 'm' has no run {value!r} (list runs with `dmi runs m`)"
    with pytest.raises(RecordNotFoundError, match="no model"):
        store.verify(model_id=value)
    with pytest.raises(RecordNotFoundError) as info:
        store.get_internal("m", value, "resid_post")
    assert str(info.value).startswith(f"model 'm' has no request {value!r} (2 requests")
    assert store.catalog.losses(model_id=value).num_rows == 0
    with pytest.raises(HookSelectionError, match="unknown hook"):
        store.get_internal("m", "a", value)
    _unchanged(store)


@pytest.mark.parametrize("layers, error, message", [
    (1.5, HookSelectionError, "layers must be an int, range, slice or list of ints, got 1.5"),
    (True, HookSelectionError, "got True"),
    (np.int64(1), HookSelectionError, "got np.int64(1)"),
    ([], HookSelectionError, "selects no layer"),
    (2 ** 64, RecordNotFoundError, f"asks for [{2 ** 64}], which were not captured"),
    ([2 ** 63], RecordNotFoundError, f"asks for [{2 ** 63}], which were not captured"),
], ids=["float", "bool", "numpy-int", "empty", "huge", "past-int64"])
def test_malformed_layers_are_named_errors(store, layers, error, message):
    with pytest.raises(error) as info:
        store.get_internal("m", "a", "resid_post", layers=layers)
    assert message in str(info.value)
    _unchanged(store)


def test_verify_and_contents_still_answer_for_real_ids(store):
    assert store.verify(model_id="m").records_checked == 4
    assert store.contents("m", "a", run_id="r").hooks[0].layers == (0, 1)


@pytest.mark.parametrize("argument, value, message", [
    ("catalog", "", "catalog is '': name a directory or URI, or leave catalog out for the default"),
    ("packs", "  ", "packs is '  ': name a directory or URI, or leave packs out for the default"),
    ("home", "", "home is '': name a directory or URI, or leave home out for the default"),
    ("catalog", "chdb://{tmp}/cat\nalog", "contains the character U+000A"),
    ("catalog", "chdb://{tmp}/cat\talog", "contains the character U+0009"),
    ("catalog", "{tmp}/cat\x00alog", "contains the character U+0000"),
    ("packs", "{tmp}/pa\x00cks", "contains the character U+0000"),
    ("home", "{tmp}/ho\rme", "contains the character U+000D"),
    ("home", "{tmp}/\ud800", "contains the character U+D800"),
    ("catalog", 5, "catalog must be a str or a path, not int"),
    ("packs", True, "packs must be a str or a path, not bool"),
    ("home", b"/tmp/x", "home must be a str or a path, not bytes"),
], ids=["empty-catalog", "blank-packs", "empty-home", "newline", "tab", "nul-catalog", "nul-packs", "cr-home",
        "surrogate", "int", "bool", "bytes"])
def test_open_refuses_a_location_that_names_no_place_and_creates_nothing(tmp_path, monkeypatch, argument, value,
                                                                         message):
    """``home=""`` opened the working directory, ``catalog=""`` the default home, and a newline
    or tab in a ``chdb://`` URI was dropped by the URI parser: another directory was opened."""
    work, default = tmp_path / "work", tmp_path / "default-home"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("DMI_HOME", str(default))
    for name in ("DMI_CATALOG", "DMI_PACKS"):
        monkeypatch.delenv(name, raising=False)
    value = value.format(tmp=tmp_path) if isinstance(value, str) else value
    others = {"catalog": f"chdb://{tmp_path}/c", "packs": str(tmp_path / "p")} if argument != "home" else {}
    others.pop(argument, None)
    with pytest.raises(InvalidArgumentError) as info:
        dmi.open(**others, **{argument: value}).close()
    assert message in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert list(work.iterdir()) == []


def test_open_still_takes_paths_and_unusual_names(tmp_path):
    with dmi.open(catalog=tmp_path / "c", packs=tmp_path / "x' OR 1=1 --") as opened:
        assert opened.packs_uri.endswith("x' OR 1=1 --") and opened.models() == []
