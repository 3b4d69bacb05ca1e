"""One layer-selection rule for capture and read (``dmi.capture.layer_numbers``), and read
arguments checked where they enter.

A real capture of layers 1 and 2 of the built-in four-layer model into a real store: reads
accept every spelling capture accepts (``-1``, ranges, slices, lists), refuse an empty
selection the way capture does, and refuse layers that were not captured with an error
naming the captured ones, instead of clipping the selection.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import dmi
from dmi.capture import MAX_SELECTED_LAYERS, layer_numbers, resolve_layers


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from dmi._models import load_model

    tiny = load_model("tiny-llama")
    enc = tiny.tokenizer(["layers"], return_tensors="pt")
    with dmi.open(home=tmp_path_factory.mktemp("layers-home")) as opened:
        with dmi.capture(tiny.model, hooks="resid_post,token_ids", layers=range(1, 3), store=opened,
                         model_id="m", run_id="r") as cap, torch.inference_mode():
            cap.forward(enc["input_ids"], enc["attention_mask"], request_ids=["a"])
        yield opened


def read(store, layers):
    return store.get_internal("m", "a", "resid_post", layers=layers)


def test_the_rule_is_one_function():
    assert layer_numbers(None, 4, "") is None
    assert layer_numbers(-1, 4, "") == (3,)
    assert layer_numbers(slice(-2, None), 4, "") == (2, 3)
    assert layer_numbers([3, 0, -4], 4, "") == (0, 3)
    assert layer_numbers(range(2, 9), 4, "") == tuple(range(2, 9))  # never clipped: the caller checks
    assert resolve_layers(-1, 4) == (3,)
    with pytest.raises(dmi.HookSelectionError, match="selects no layer"):
        layer_numbers([], 4, "")
    with pytest.raises(dmi.HookSelectionError, match="positive step"):
        layer_numbers(slice(None, None, -1), 4, "")


def test_a_selection_of_more_layers_than_any_model_has_is_refused_before_it_is_listed(store):
    too_many = MAX_SELECTED_LAYERS + 1
    for layers in (range(too_many), slice(0, too_many), (0, too_many), list(range(too_many)),
                   range(0, 10**15), itertools.count()):
        with pytest.raises(dmi.HookSelectionError, match=f"names more than {MAX_SELECTED_LAYERS} layers"):
            layer_numbers(layers, 4, "")
    assert len(layer_numbers(range(MAX_SELECTED_LAYERS), 4, "")) == MAX_SELECTED_LAYERS
    with pytest.raises(dmi.HookSelectionError, match="names more than"):
        read(store, range(0, 10**9))  # a slip for range(0, 9): refused at once, not listed


def test_reads_accept_what_capture_accepts(store):
    full = read(store, None)
    assert full.shape[0] == 2  # layers 1 and 2
    assert torch.equal(read(store, -1), full[1:])  # the last captured layer, as capture's -1 is the last
    assert torch.equal(read(store, -2), full[:1])
    assert torch.equal(read(store, [2, 1]), full)
    assert torch.equal(read(store, range(1, 2)), full[:1])
    assert torch.equal(read(store, slice(2, None)), full[1:])
    assert torch.equal(read(store, (1, 3)), full)
    assert torch.equal(store.lazy("m", "a", "resid_post", layers=-1)[:], full[1:])


def test_layers_not_captured_are_named_not_clipped(store):
    with pytest.raises(dmi.RecordNotFoundError, match=r"has layers \[1, 2\]; layers=range\(1, 9\) asks for "
                                                      r"\[3, 4, 5, 6, 7, 8\], which were not captured"):
        read(store, range(1, 9))
    with pytest.raises(dmi.RecordNotFoundError, match=r"asks for \[0\]"):
        read(store, 0)
    with pytest.raises(dmi.RecordNotFoundError, match=r"asks for \[0\]"):
        store.lazy("m", "a", "resid_post", layers=[0, 1])


def test_empty_and_malformed_selections_fail_as_in_capture(store):
    with pytest.raises(dmi.HookSelectionError, match=r"layer selection \[\] selects no layer.*has layers \[1, 2\]"):
        read(store, [])
    with pytest.raises(dmi.HookSelectionError, match="layers must be"):
        read(store, "1:2")
    with pytest.raises(dmi.HookSelectionError, match="layer 1.5 is not an int"):
        read(store, [1.5])
    with pytest.raises(dmi.HookSelectionError, match="global hook"):
        store.get_internal("m", "a", "token_ids", layers=0)


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ((123, "a", "resid_post"), dmi.InvalidIdentifierError, "model id"),
    (("m", None, "resid_post"), dmi.InvalidIdentifierError, "request id"),
    (("m", "a", 5), dmi.HookSelectionError, "not 5"),
    (("m", "a", ["resid_post"]), dmi.HookSelectionError, r"not \['resid_post'\]"),
])
def test_argument_types_are_checked_where_they_enter(store, arguments, error, message):
    with pytest.raises(error, match=message):
        store.get_internal(*arguments)
    with pytest.raises(error, match=message):
        store.lazy(*arguments)


def test_run_id_and_shard_rank_types(store):
    with pytest.raises(dmi.InvalidIdentifierError, match="run id"):
        store.get_internal("m", "a", "resid_post", run_id=7)
    with pytest.raises(dmi.InvalidArgumentError, match="shard_rank must be an int"):
        store.get_internal("m", "a", "resid_post", shard_rank="0")
