"""Arguments of the wrong type refused where they enter, with a named error, never a raw
``TypeError`` or a misleading verdict.

A 0-d tensor or array as ``layers`` (one value that claims to be iterable) is refused like
any other non-int layer selection; a hook given as ``bytes`` (or a list holding a non-str)
is refused by the loader instead of being iterated byte by byte; and a model of another size
than the captured one is refused by the audit before anything is re-run, naming the stored
shapes and the model's, instead of failing every check on shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dmi
from dmi.capture import layer_numbers
from dmi.storage.errors import AuditError, HookSelectionError, InvalidArgumentError

from ._models import tiny


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real capture of the tiny float32 llama (3 layers, hidden 32): ``resid_post`` of every layer and
    the token ids of one request ``a``."""
    ids = torch.tensor([[5, 9, 2, 7]])
    with dmi.open(home=tmp_path_factory.mktemp("argument-types")) as opened:
        with dmi.capture(tiny("llama"), hooks="resid_post token_ids", store=opened, model_id="m",
                         run_id="r") as cap, torch.inference_mode():
            cap.forward(ids, torch.ones_like(ids), request_ids=["a"])
        yield opened


@pytest.mark.parametrize("layers", [torch.tensor(1), np.array(1)], ids=["tensor", "ndarray"])
def test_a_0d_tensor_or_array_is_refused_as_a_layer_selection(store, layers):
    with pytest.raises(HookSelectionError, match=r"layers must be an int, range, slice or list of ints, got") as err:
        store.get_internal("m", "a", "resid_post", layers=layers)
    assert "has layers [0, 1, 2]" in str(err.value)  # names the layers the request holds
    with pytest.raises(HookSelectionError, match=r"got (tensor|array)\(1\); 4 layers"):
        layer_numbers(layers, 4, "4 layers")


@pytest.mark.parametrize("layers", [torch.tensor(1), np.array(1)], ids=["tensor", "ndarray"])
def test_the_loader_refuses_a_0d_tensor_or_array_as_layers(store, layers):
    with pytest.raises(InvalidArgumentError, match=r"layers must be a int or an iterable of them, not"):
        store.loader("m", layers=layers)


def test_a_list_of_ints_still_reads_what_an_int_reads(store):
    one = store.get_internal("m", "a", "resid_post", layers=1)
    assert one.shape == (1, 4, 32)
    assert torch.equal(store.get_internal("m", "a", "resid_post", layers=[1]), one)


@pytest.mark.parametrize("hooks", [b"resid_post", ["resid_post", b"token_ids"], ("resid_post", 3)])
def test_the_loader_refuses_a_hook_that_is_not_a_str(store, hooks):
    with pytest.raises(InvalidArgumentError, match=r"a hook is a str \(a hook name\), not") as err:
        store.loader("m", hooks=hooks)
    assert not isinstance(err.value, HookSelectionError)  # a type error, not an "unknown hook"
    assert "unknown hook" not in str(err.value) and repr(hooks) in str(err.value)


def test_the_loader_still_takes_a_str_or_a_list_of_them(store):
    assert list(store.loader("m", hooks="resid_post").features) == ["resid_post.0", "resid_post.1", "resid_post.2"]
    assert list(store.loader("m", hooks=["resid_post"], layers=[1]).features) == ["resid_post.1"]


def test_an_audit_against_a_model_of_another_size_is_refused_before_any_re_run(store, monkeypatch):
    import dmi._audit as audit

    def never(*args, **kwargs):
        raise AssertionError("a model of another size was re-run")

    monkeypatch.setattr(audit, "audit_request", never)
    wider = tiny("llama", hidden_size=64)
    with pytest.raises(AuditError) as err:
        store.audit("m", model=wider, request_ids=["a"])
    assert str(err.value).startswith("the capture's resid_post records are (32,) per token but the model given "
                                     "for the re-run (llama, hidden 64) gives (64,)")
    assert store.catalog.audits(model_id="m").num_rows == 0  # nothing judged, nothing recorded


def test_an_audit_against_the_captured_model_still_passes(store):
    report = store.audit("m", model=tiny("llama"), request_ids=["a"], record=False)
    assert report.passed and [c.hook for c in report.checks] == ["token_ids", "resid_post", "resid_post", "resid_post"]


def test_cli_audit_of_a_tiny_llama_capture_against_small_llama_is_refused(tmp_path, capsys):
    from dmi.cli import main

    home = ["--home", str(tmp_path)]
    assert main(["capture", *home, "--model", "tiny-llama", "--prompt", "hi", "--hooks", "resid_post token_ids",
                 "-q"]) == 0
    capsys.readouterr()
    assert main(["audit", "tiny-llama", *home, "--model", "small-llama", "-q"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" not in captured.out
    assert ("dmi: error: the capture's resid_post records are (64,) per token but the model given for the re-run "
            "(llama, hidden 256) gives (256,)") in captured.err
