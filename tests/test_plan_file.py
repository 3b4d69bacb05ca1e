"""Capture plans as files: the schema, every rejection path, golden round trips, and one path
from the file to a real capture (``dmi.capture(model, plan=...)`` and ``dmi capture --plan``)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import dmi
from dmi._plan_file import CapturePlan, RingPlan, SchedulePlan, StorePlan, dump_plan, load_plan, parse_plan
from dmi.storage.errors import InvalidArgumentError, PlanError
from tests._models import left_padded_batch, tiny

PLANS = Path(__file__).parent / "data" / "plans"
GOLDEN = sorted(PLANS.glob("*.yaml"))
CANONICAL = ["full.yaml", "layer_list.yaml"]  # written exactly as dump_plan writes them


# ----------------------------------------------------------------------------- golden files


def test_full_golden_loads_every_field():
    plan = load_plan(PLANS / "full.yaml")
    assert plan == CapturePlan(
        version=1, model="tiny-llama", model_id="tiny-llama-plan", run_id="run-0001",
        hooks=("resid_post", "attn", "logits"), layers=range(0, 3),
        schedule=SchedulePlan(phases=("prefill", "decode"), step_stride=2, request_stride=1, warmup=0),
        store=StorePlan(home="/tmp/dmi-plan-home"), codec="zstd",
        ring=RingPlan(slots=4, slot_bytes=1 << 20, timeout=30.0, drop_policy="wait"), decode_chunk_steps=8,
    )


def test_minimal_golden_takes_the_defaults():
    plan = load_plan(PLANS / "minimal.yaml")
    assert plan == CapturePlan(hooks=("resid_post",))
    assert plan.layers is None and plan.schedule.phases == ("prefill", "decode", "forward")
    assert plan.ring == RingPlan(slots=8, slot_bytes=32 << 20, timeout=60.0, drop_policy="wait")


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_golden_round_trip(path):
    plan = load_plan(path)
    assert parse_plan(dump_plan(plan)) == plan


@pytest.mark.parametrize("name", CANONICAL)
def test_dump_writes_the_golden_text(name):
    text = (PLANS / name).read_text()
    assert dump_plan(parse_plan(text)) == text


def test_plans_are_frozen():
    plan = load_plan(PLANS / "full.yaml")
    with pytest.raises(AttributeError):
        plan.hooks = ("embed",)  # type: ignore[misc]


def test_attach_options_are_the_capture_keywords():
    options = load_plan(PLANS / "full.yaml").attach_options()
    assert options == {
        "hooks": ["resid_post", "attn", "logits"], "layers": range(0, 3),
        "schedule": {"phases": ("prefill", "decode"), "step_stride": 2, "request_stride": 1, "warmup": 0},
        "ring_slots": 4, "slot_bytes": 1 << 20, "ring_timeout": 30.0, "drop_policy": "wait",
        "decode_chunk_steps": 8, "model_id": "tiny-llama-plan", "run_id": "run-0001",
        "writer_options": {"codec": "zstd"},
    }
    assert load_plan(PLANS / "layer_list.yaml").attach_options()["layers"] == [0, 2, -1]


@pytest.mark.parametrize(("written", "layers"), [("8:24", range(8, 24)), ("1:4", range(1, 4)), ("'1:4'", range(1, 4)),
                                                 ("12", (12,)), ("[0x1, 0b11, 010]", (1, 3, 10)),
                                                 ("0-3", range(0, 4)), ("'8-23'", range(8, 24)), ("2-2", range(2, 3))])
def test_layer_ranges_are_never_base_60_integers(written, layers):
    """YAML 1.1 reads ``8:24`` as 504; a plan reads it as the range it looks like. ``FIRST-LAST``
    (the span ``dmi show`` prints) includes both ends."""
    assert parse_plan(f"{BASE}layers: {written}\n").layers == layers


@pytest.mark.parametrize(("written", "value"), [("010", 10), ("0_8", 8), ("-010", -10), ("+012", 12), ("0x10", 16),
                                                ("!!int 010", 10)])
def test_zero_padded_integers_are_decimal(written, value):
    """YAML 1.2 reads ``010`` as 10; PyYAML (YAML 1.1) as the octal 8. A plan reads what it shows."""
    assert parse_plan(f"{BASE}layers: [{written}]\n").layers == (value,)
    assert parse_plan(f"{BASE}schedule: {{warmup: {written.lstrip('-')}}}\n").schedule.warmup == abs(value)


def test_merge_keys_merge_and_the_mappings_own_keys_win():
    plan = parse_plan(BASE + "schedule: &base {step_stride: 2}\nring:\n  <<: [{slots: 2, timeout: 5}, {slot_bytes: 64}]\n"
                             "  slots: 3\n")
    assert plan.ring == RingPlan(slots=3, slot_bytes=64, timeout=5.0)
    assert parse_plan(BASE + "ring: &r {slots: 2}\nschedule: {<<: {warmup: 4}}\n").schedule.warmup == 4


def test_hooks_may_be_one_string():
    assert parse_plan("version: 1\nhooks: 'resid_post, logits attn'\n").hooks == ("resid_post", "logits", "attn")


# ----------------------------------------------------------------------------- rejections

BASE = "version: 1\nhooks: [resid_post]\n"

REJECTED = [
    # (document, field path, words the reason must contain)
    ("hooks: [resid_post]\n", "version", "required"),
    ("version: 2\nhooks: [resid_post]\n", "version", "plan version 2"),
    ("version: '1'\n", "version", "integer"),
    ("version: true\n", "version", "integer"),
    (BASE + "layer: 3\n", "layer", "did you mean 'layers'"),
    (BASE + "hook: x\n", "hook", "did you mean 'hooks'"),
    (BASE + "schedule: {stride: 2}\n", "schedule.stride", "did you mean 'step_stride'"),
    (BASE + "ring: {slot: 2}\n", "ring.slot", "did you mean 'slots'"),
    (BASE + "store: {homes: /x}\n", "store.homes", "did you mean 'home'"),
    ("version: 1\nhooks: [resid_post, resid_pots]\n", "hooks[1]", "did you mean 'resid_post'"),
    ("version: 1\nhooks: 'resid_post resid_pots'\n", "hooks", "unknown hook or group 'resid_pots'"),
    ("version: 1\nhooks: []\n", "hooks", "selects no hook"),
    ("version: 1\nhooks: [resid_post, 3]\n", "hooks[1]", "hook name or group token"),
    ("version: 1\nhooks: 3\n", "hooks", "must be a list"),
    (BASE + "layers: '3:1'\n", "layers", "START:STOP"),
    (BASE + "layers: 'a:b'\n", "layers", "START:STOP"),
    (BASE + "layers: '2'\n", "layers", "START:STOP"),
    (BASE + "layers: '3-1'\n", "layers", "FIRST-LAST with FIRST <= LAST"),
    (BASE + "layers: '-1'\n", "layers", "FIRST-LAST"),
    (BASE + "layers: 'a-b'\n", "layers", "FIRST-LAST"),
    (BASE + "layers: []\n", "layers", "selects no layer"),
    (BASE + "layers: [0, x]\n", "layers[1]", "layer number"),
    (BASE + "layers: true\n", "layers", "START:STOP"),
    (BASE + "layers: {start: 0}\n", "layers", "START:STOP"),
    (BASE + "schedule: [prefill]\n", "schedule", "mapping"),
    (BASE + "schedule: {phases: [prefill, decod]}\n", "schedule.phases[1]", "did you mean 'decode'"),
    (BASE + "schedule: {phases: []}\n", "schedule.phases", "must be a list"),
    (BASE + "schedule: {step_stride: 0}\n", "schedule.step_stride", "at least 1"),
    (BASE + "schedule: {request_stride: '2'}\n", "schedule.request_stride", "integer"),
    (BASE + "schedule: {warmup: -1}\n", "schedule.warmup", "at least 0"),
    (BASE + "codec: zstdd\n", "codec", "did you mean 'zstd'"),
    (BASE + "ring: {slots: 0}\n", "ring.slots", "at least 1"),
    (BASE + "ring: {slot_bytes: 8}\n", "ring.slot_bytes", "at least 16"),
    (BASE + "ring: {timeout: 0}\n", "ring.timeout", "positive number"),
    (BASE + "ring: {drop_policy: dorp}\n", "ring.drop_policy", "did you mean 'drop'"),
    (BASE + "store: {home: 5}\n", "store.home", "non-empty string"),
    (BASE + "model: ''\n", "model", "non-empty string"),
    (BASE + "run_id: [a]\n", "run_id", "non-empty string"),
    (BASE + "decode_chunk_steps: 0\n", "decode_chunk_steps", "at least 1"),
    (BASE + "hooks: [embed]\n", "hooks", "appears twice (line 3)"),
    ("version: 1\n? [a, b]\n: 1\n", "(document)", "a key must be a field name; got a sequence (line 2)"),
    (BASE + "schedule:\n  ? {x: 1}\n  : 2\n", "schedule", "a key must be a field name; got a mapping (line 4)"),
    (BASE + "ring:\n  slots: 2\n  slots: 3\n", "ring.slots", "key 'slots' appears twice (line 5)"),
    (BASE + "ring:\n  <<: {slots: 2, slots: 3}\n", "ring.slots", "key 'slots' appears twice (line 4)"),
    ("version: 1\nhooks: [{a: 1, a: 2}]\n", "hooks[0].a", "key 'a' appears twice (line 2)"),
    (BASE + "model: " + "[" * 5000 + "]" * 5000 + "\n", "(document)", "nested too deeply"),
    ("- version: 1\n", "(document)", "mapping"),
    ("version: [1\n", "(document)", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "path", "words"), REJECTED, ids=[r[1] + ":" + r[2] for r in REJECTED])
def test_rejected_at_its_field(text, path, words):
    with pytest.raises(PlanError) as info:
        parse_plan(text, source="plan.yaml")
    err = info.value
    assert (err.source, err.field) == ("plan.yaml", path)
    assert words in err.reason
    assert str(err).startswith(f"plan.yaml: {path}: ")
    assert isinstance(err, InvalidArgumentError)


def test_unreadable_file_is_a_plan_error(tmp_path):
    with pytest.raises(PlanError) as info:
        load_plan(tmp_path / "missing.yaml")
    assert info.value.field == "(file)" and "cannot read" in info.value.reason


@pytest.mark.parametrize(("layers", "n_layers", "expect"), [
    ("all", 3, (0, 1, 2)), ("'0:2'", 3, (0, 1)), ("'1:3'", 3, (1, 2)), ("[2, -1, 0]", 3, (0, 2)), ("-3", 3, (0,)),
])
def test_check_layers_selects(layers, n_layers, expect):
    assert parse_plan(f"{BASE}layers: {layers}\n").check_layers(n_layers) == expect


@pytest.mark.parametrize(("layers", "path", "words"), [
    ("'0:4'", "layers", "0:4 reaches past the model; the model has 3 layers (0..2)"),
    ("[0, 3]", "layers[1]", "layer 3 is out of range"),
    ("[-4]", "layers[0]", "layer -4 is out of range"),
])
def test_check_layers_refuses_layers_the_model_lacks(layers, path, words):
    plan = parse_plan(f"{BASE}layers: {layers}\n")
    with pytest.raises(PlanError) as info:
        plan.check_layers(3, source="p.yaml")
    assert info.value.field == path and words in info.value.reason


# ----------------------------------------------------------------------------- file -> runtime


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("plan-home")


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def test_capture_with_a_plan_file(home, tmp_path):
    plan = _write(tmp_path, "version: 1\nmodel_id: plan-model\nrun_id: plan-run\nhooks: [resid_post, logits]\n"
                            "layers: [0, 2]\ncodec: raw\nschedule: {phases: [forward]}\n")
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store:
        with dmi.capture(model, plan=plan, store=store) as cap:
            assert (cap.model_id, cap.run_id) == ("plan-model", "plan-run")
            with torch.inference_mode():
                cap.forward(ids, mask)
        rows = store.sql("SELECT hook, layer, codec, count() AS n FROM {records} WHERE run_id = 'plan-run' "
                         "GROUP BY hook, layer, codec ORDER BY hook, layer").to_pylist()
    assert rows == [{"hook": "logits", "layer": -1, "codec": "raw", "n": 3},
                    {"hook": "resid_post", "layer": 0, "codec": "raw", "n": 3},
                    {"hook": "resid_post", "layer": 2, "codec": "raw", "n": 3}]


def test_plan_layers_checked_against_the_model_before_attach(home, tmp_path):
    model = tiny("llama")  # 3 layers
    with dmi.open(home=home) as store:
        with pytest.raises(PlanError) as info:
            with dmi.capture(model, plan=parse_plan(BASE + "layers: '1:5'\n"), store=store):
                pass
        assert info.value.field == "layers"
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_plan_and_the_same_argument_are_refused(home):
    plan = parse_plan(BASE)
    with dmi.open(home=home) as store:
        for extra in ({"hooks": "embed"}, {"layers": [0]}, {"ring_slots": 2}):
            with pytest.raises(InvalidArgumentError, match="given both by the plan and as arguments"):
                with dmi.capture(tiny("llama"), plan=plan, store=store, **extra):
                    pass
        with pytest.raises(InvalidArgumentError, match="plan must be a dmi.CapturePlan"):
            with dmi.capture(tiny("llama"), plan={"version": 1}, store=store):
                pass


def _cli(*argv: str) -> tuple[int, str, str]:
    from dmi.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_capture_with_plan_takes_model_and_store_from_the_plan(tmp_path):
    cli_home = tmp_path / "cli-home"
    plan = _write(tmp_path, f"version: 1\nmodel: tiny-llama\nmodel_id: cli-plan\nhooks: [resid_pre]\nlayers: '1:3'\n"
                            f"store: {{home: {json.dumps(str(cli_home))}}}\n")
    rc, out, err = _cli("capture", "--plan", str(plan), "--prompt", "hello", "--max-new-tokens", "0", "--json", "-q")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    # one request x layers 1, 2, plus what the CLI's tokenizer adds: token_ids, token_text, prompt_text
    assert result["model_id"] == "cli-plan" and result["records"] == 2 + 3
    with dmi.open(home=cli_home) as store:
        assert [(h.hook, tuple(h.layers)) for h in store.contents("cli-plan", result["request_ids"][0]).hooks] == [
            ("token_ids", (-1,)), ("resid_pre", (1, 2))]


def test_cli_refuses_flags_the_plan_sets(tmp_path):
    plan = _write(tmp_path, "version: 1\nmodel: tiny-llama\nhooks: [resid_pre]\n")
    rc, out, err = _cli("capture", "--plan", str(plan), "--hooks", "embed", "--layers", "0", "--prompt", "x",
                        "--home", str(tmp_path / "home"))
    assert rc == 2 and out == ""
    assert err == f"dmi: error: --hooks, --layers given with --plan; set them in the plan file {plan}\n"


def test_cli_reports_a_plan_error_in_one_line(tmp_path):
    plan = _write(tmp_path, "version: 1\nmodel: tiny-llama\nlayer: 3\n")
    rc, out, err = _cli("capture", "--plan", str(plan), "--prompt", "x", "--home", str(tmp_path / "home"))
    assert rc == 2
    assert err.startswith(f"dmi: error: {plan}: layer: unknown key 'layer' (did you mean 'layers'?)")


def test_cli_checks_plan_layers_against_the_model(tmp_path):
    plan = _write(tmp_path, "version: 1\nmodel: tiny-llama\nlayers: [0, 4]\n")  # tiny-llama: 4 layers
    rc, out, err = _cli("capture", "--plan", str(plan), "--prompt", "x", "--home", str(tmp_path / "home"))
    assert (rc, out) == (2, "")
    assert err == f"dmi: error: {plan}: layers[1]: layer 4 is out of range; the model has 4 layers (0..3)\n"


def test_cli_capture_needs_a_model(tmp_path):
    rc, _, err = _cli("capture", "--prompt", "x", "--home", str(tmp_path / "home"))
    assert rc == 2 and "no model: give --model" in err
    plan = _write(tmp_path, BASE)
    rc, _, err = _cli("capture", "--plan", str(plan), "--prompt", "x", "--home", str(tmp_path / "home"))
    assert rc == 2 and "the plan" in err and "names none" in err


def test_capture_opens_the_plans_store(tmp_path, monkeypatch):
    """Without ``store=``, the plan's ``store`` section is what ``dmi.open`` gets (not the
    default home, which points elsewhere here)."""
    monkeypatch.setenv("DMI_HOME", str(tmp_path / "default-home"))
    monkeypatch.delenv("DMI_CATALOG", raising=False)
    monkeypatch.delenv("DMI_PACKS", raising=False)
    plan = parse_plan(f"version: 1\nhooks: [embed]\nmodel_id: own-store\nstore: {{home: {json.dumps(str(tmp_path))}}}\n")
    with dmi.capture(tiny("llama"), plan=plan) as cap:
        with torch.inference_mode():
            cap.forward(*left_padded_batch((4, 3)))
    with dmi.open(home=tmp_path) as store:
        assert [(m.model_id, m.requests, m.records) for m in store.models()] == [("own-store", 2, 2)]
