"""A plan and an argument it also sets are refused even when the argument equals its default
(``hooks="resid_post"``, ``--hooks resid_post``); without a plan the defaults are unchanged."""

from __future__ import annotations

import contextlib
import inspect
import io
import json

import pytest
import torch

import dmi
import dmi._store as store_module
from dmi._capture_cli import apply_plan
from dmi.cli import _build_parser, main
from dmi.storage.errors import InvalidArgumentError
from tests._models import left_padded_batch, tiny

LOGITS_PLAN = "version: 1\nmodel: tiny-llama\nhooks: [logits]\n"


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "pl.yaml"
    path.write_text(LOGITS_PLAN)
    return path


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("given", "named"), [
    ({"hooks": "resid_post"}, "hooks"),
    ({"layers": None}, "layers"),
    ({"hooks": "resid_post", "layers": None}, "hooks, layers"),
])
def test_default_valued_argument_beside_a_plan_is_refused(tmp_path, plan, given, named):
    model = tiny("llama")
    with dmi.open(home=tmp_path / "home") as store:
        with pytest.raises(InvalidArgumentError) as info:
            with dmi.capture(model, plan=plan, store=store, **given):
                pass
        assert str(info.value) == f"{named} given both by the plan and as arguments; set them in one place"
        assert store.models() == []
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_plan_alone_still_captures_its_hooks(tmp_path, plan):
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path / "home") as store:
        with dmi.capture(tiny("llama"), plan=plan, store=store, model_id="m") as cap, torch.inference_mode():
            request_ids, _ = cap.forward(ids, mask)
        assert [h.hook for h in store.contents("m", request_ids[0]).hooks] == ["logits"]


def test_without_a_plan_the_defaults_are_unchanged(tmp_path):
    signature = inspect.signature(store_module.capture)
    assert (repr(signature.parameters["hooks"].default), repr(signature.parameters["layers"].default)) == (
        "'resid_post'", "None")
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path / "home") as store:
        with dmi.capture(tiny("llama"), store=store, model_id="m") as cap, torch.inference_mode():
            request_ids, _ = cap.forward(ids, mask)
        assert [(h.hook, tuple(h.layers)) for h in store.contents("m", request_ids[0]).hooks] == [
            ("resid_post", (0, 1, 2))]


@pytest.mark.parametrize(("flags", "named"), [
    (["--hooks", "resid_post"], "--hooks"),
    (["--phases", "prefill,decode", "--step-stride", "1", "--request-stride", "1", "--warmup", "0"],
     "--phases, --step-stride, --request-stride, --warmup"),
])
def test_cli_default_valued_flag_beside_a_plan_is_refused(tmp_path, plan, flags, named):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--plan", str(plan), *flags, "--prompt", "x", "--home", str(home))
    assert (rc, out) == (2, "")
    assert err == f"dmi: error: {named} given with --plan; set them in the plan file {plan}\n"
    assert not home.exists()


def test_cli_flags_left_out_take_their_defaults(plan):
    parser = _build_parser()
    defaults = {"hooks": "resid_post", "layers": None, "phases": "prefill,decode", "step_stride": 1,
                "request_stride": 1, "warmup": 0, "model_id": None}
    for argv, returned_plan in ((["capture", "--model", "tiny-llama"], False),
                                (["capture", "--plan", str(plan)], True)):
        args = parser.parse_args(argv)
        assert (apply_plan(args) is not None) == returned_plan
        assert {name: getattr(args, name) for name in defaults} == defaults


def test_cli_without_a_plan_captures_the_default_hooks(tmp_path):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "hello", "--max-new-tokens", "0",
                        "--home", str(home), "--json", "-q")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    with dmi.open(home=home) as store:
        assert [(h.hook, tuple(h.layers)) for h in store.contents(result["model_id"], result["request_ids"][0]).hooks] == [
            ("token_ids", (-1,)), ("resid_post", (0, 1, 2, 3))]
