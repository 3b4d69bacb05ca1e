"""Three ``dmi capture`` / ``dmi get`` leftovers: a schedule under which a run stores nothing is
refused before the model loads (exit 2, naming the numbers and what to change); an exported
tensor of lossy-codec values says so (``.safetensors`` metadata, a note for ``.npy``/``.pt``)
and a lossless one carries no mark; the eager-attention refusal names the TransformerLens
alias the user typed."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import dmi
from dmi._export import CodecLoss, export_tensor, loss_note
from dmi.cli import main
from tests._models import left_padded_batch, tiny


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails loudly: a refusal must come before it."""
    import dmi._models

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(dmi._models, "load_model", refuse)


# ------------------------------------------------------------------------ 1: schedule storing nothing
@pytest.mark.parametrize(("flags", "message"), [
    (["--max-new-tokens", "0", "--warmup", "5"],
     "--warmup 5 skips the first 5 model forwards, but this run of 2 prompts makes at most 1 (1 batch of up to 8 "
     "(--batch-size), one forward (a scoring pass) each), so nothing would be stored; give --warmup below 1, or "
     "more prompts"),
    (["--max-new-tokens", "3", "--batch-size", "1", "--warmup", "6"],
     "--warmup 6 skips the first 6 model forwards, but this run of 2 prompts makes at most 6 (2 batches of up to 1 "
     "(--batch-size), 3 forwards (a prefill and 2 decode steps) each), so nothing would be stored; give --warmup "
     "below 6, or more prompts"),
    (["--max-new-tokens", "3", "--batch-size", "1", "--warmup", "3", "--request-stride", "2"],
     "--warmup 3 skips the first 3 model forwards (2 batches of up to 1 (--batch-size), 3 forwards (a prefill and 2 "
     "decode steps) each), and --request-stride 2 keeps none of the requests in the batches left (request 2 of 2), "
     "so nothing would be stored; lower --warmup or --request-stride, or give more prompts"),
    (["--max-new-tokens", "3", "--warmup", "1", "--phases", "prefill"],
     "--warmup 1 skips the first 1 model forward of this run's 3 (1 batch of up to 8 (--batch-size), 3 forwards "
     "(a prefill and 2 decode steps) each), and none left is of a phase --phases keeps (prefill), so nothing would "
     "be stored; lower --warmup or change --phases"),
    (["--max-new-tokens", "3", "--warmup", "2", "--phases", "decode", "--step-stride", "2"],
     "--warmup 2 skips the first 2 model forwards of this run's 3 (1 batch of up to 8 (--batch-size), 3 forwards "
     "(a prefill and 2 decode steps) each), and none left is of a phase --phases keeps (decode; decode steps 1, 3, "
     "... with --step-stride 2), so nothing would be stored; lower --warmup or change --phases"),
    # a misspelt phase is named as one, not taken for a schedule that keeps nothing
    (["--max-new-tokens", "3", "--phases", "prefil"],
     "schedule phases ['prefil'] invalid; choose from ('prefill', 'decode', 'forward')"),
])
def test_a_schedule_storing_nothing_is_refused_before_the_model_loads(tmp_path, no_model_load, flags, message):
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "hi", "--prompt", "yo",
                        "--home", str(tmp_path / "home"), *flags)
    assert (rc, out, err) == (2, "", f"dmi: error: {message}\n")


def test_a_plan_schedule_storing_nothing_names_the_plan_fields(tmp_path, no_model_load):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nmodel: tiny-llama\nschedule:\n  phases: [forward]\n  warmup: 1\n  request_stride: 3\n")
    rc, out, err = _cli("capture", "--plan", str(plan), "--prompt", "a", "--prompt", "b", "--prompt", "c",
                        "--batch-size", "1", "--max-new-tokens", "0", "--home", str(tmp_path / "home"))
    assert (rc, out) == (2, "")
    assert err == (f"dmi: error: the plan {plan}: schedule.warmup 1 skips the first 1 model forward (3 batches of up "
                   "to 1 (--batch-size), one forward (a scoring pass) each), and schedule.request_stride 3 keeps none "
                   "of the requests in the batches left (requests 2-3 of 3), so nothing would be stored; lower "
                   "schedule.warmup or schedule.request_stride, or give more prompts\n")


def test_a_warmup_shorter_than_the_run_still_stores(tmp_path):
    """The check refuses only what stores nothing: one forward past the warmup is kept."""
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "hi", "--prompt", "yo", "--batch-size", "1",
                        "--max-new-tokens", "0", "--warmup", "1", "--home", str(tmp_path / "home"), "--json")
    assert (rc, err) == (0, "")
    assert [r[-6:] for r in json.loads(out)["request_ids"]] == ["000001"]


# ------------------------------------------------------------------------ 2: lossy values exported
@pytest.fixture(scope="module")
def lossy_store(tmp_path_factory):
    """resid_post stored with int8 (lossy), mlp_out with the lossless default; one request each run."""
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(5,))
    with dmi.open(home=tmp_path_factory.mktemp("lossy-get")) as store:
        with store.capture(model, hooks="resid_post mlp_out", layers=[0, 1], model_id="m", run_id="r",
                           codec={"resid_post": "int8"}) as cap:
            with torch.inference_mode():
                result = cap.forward(ids, attention_mask=mask)
        yield store, result.request_ids[0]


def _metas(store, request_id: str, hook: str) -> list:
    return [e.meta for e in store.catalog.find_records("m", request_id=request_id, hook=hook, run_id="r")]


def test_lossy_values_say_so_in_safetensors_metadata(lossy_store, tmp_path):
    from safetensors import safe_open

    store, rid = lossy_store
    metas = _metas(store, rid, "resid_post")
    loss = CodecLoss.of(metas)
    worst_abs, worst_rel = max(m.codec_max_abs_error for m in metas), max(m.codec_rel_l2_error for m in metas)
    assert worst_abs > 0
    assert loss == CodecLoss(("int8",), worst_abs, worst_rel)
    tensor = store.get_internal("m", rid, "resid_post")
    assert export_tensor(tensor, tmp_path / "x.safetensors", name="resid_post", loss=loss) == ".safetensors"
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"dmi_lossy": "true", "dmi_codecs": "int8", "dmi_codec_max_abs_error": repr(worst_abs),
                                "dmi_codec_rel_l2_error": repr(worst_rel)}
        assert torch.equal(f.get_tensor("resid_post"), tensor)
    assert loss_note(tmp_path / "x.safetensors", loss) is None


def test_lossless_values_carry_no_mark(lossy_store, tmp_path):
    from safetensors import safe_open

    store, rid = lossy_store
    loss = CodecLoss.of(_metas(store, rid, "mlp_out"))
    assert loss is None
    export_tensor(store.get_internal("m", rid, "mlp_out"), tmp_path / "y.safetensors", name="mlp_out", loss=loss)
    with safe_open(str(tmp_path / "y.safetensors"), "pt") as f:
        assert f.metadata() is None
    assert loss_note(tmp_path / "y.npy", loss) is None


@pytest.mark.parametrize("ext", [".npy", ".pt"])
def test_formats_without_metadata_get_a_note(ext):
    loss = CodecLoss(("fp8", "zstd"), 0.25, None)
    assert loss_note(f"out/x{ext}", loss) == (
        f"note: out/x{ext} holds lossy values (decoded from records stored with fp8, zstd; worst absolute error "
        f"0.25, relative L2 unknown at capture); {ext} has no metadata to record it, .safetensors does")


# ------------------------------------------------------------------------ 3: the alias the user typed
@pytest.fixture(scope="module")
def sdpa_dir(tmp_path_factory):
    """A model directory that loads with sdpa attention (no attention weights)."""
    from dmi._models import load_model

    loaded = load_model("tiny-llama")
    root = tmp_path_factory.mktemp("sdpa") / "model"
    loaded.model.save_pretrained(root)
    loaded.tokenizer.save_pretrained(root)
    return str(root)


TAIL = "needs eager attention, but the model uses 'sdpa' (which never materialises the attention weights); "


@pytest.mark.parametrize(("hooks", "message"), [
    ("blocks.0.attn.hook_pattern",
     f"blocks.0.attn.hook_pattern (DMI hook 'attn_pattern') {TAIL}pass --attn-implementation eager, or leave "
     "blocks.0.attn.hook_pattern out"),
    ("resid_post,blocks.0.attn.hook_pattern,blocks.1.attn.hook_pattern",
     "blocks.0.attn.hook_pattern, blocks.1.attn.hook_pattern (DMI hook 'attn_pattern') need eager attention, but "
     "the model uses 'sdpa' (which never materialises the attention weights); pass --attn-implementation eager, "
     "or leave blocks.0.attn.hook_pattern, blocks.1.attn.hook_pattern out"),
    ("attn_pattern,blocks.1.attn.hook_pattern",
     f"'attn_pattern' {TAIL}pass --attn-implementation eager, or leave attn_pattern out (--hooks all_but_patterns)"),
])
def test_the_eager_refusal_names_what_the_user_typed(tmp_path, sdpa_dir, hooks, message):
    rc, out, err = _cli("capture", "--model", sdpa_dir, "--prompt", "hi", "--max-new-tokens", "0",
                        "--hooks", hooks, "--home", str(tmp_path / "home"))
    assert (rc, out, err) == (2, "", f"dmi: error: {message}\n")


def test_dmi_get_marks_lossy_values_and_only_those(tmp_path):
    """Through the command: an int8 hook's file says it is lossy (metadata, ``--json``, the
    stderr note for ``.npy``); a lossless hook's file and output carry no mark."""
    from safetensors import safe_open

    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(5,))
    with dmi.open(home=tmp_path / "home") as store:
        with store.capture(model, hooks="resid_post mlp_out", layers=[0, 1], model_id="m", run_id="r",
                           codec={"resid_post": "int8"}) as cap, torch.inference_mode():
            rid = cap.forward(ids, attention_mask=mask).request_ids[0]
        metas = [e.meta for e in store.catalog.find_records("m", request_id=rid, hook="resid_post", run_id="r")]
    worst = repr(max(m.codec_max_abs_error for m in metas))
    home = ("--home", str(tmp_path / "home"))
    rc, out, err = _cli("get", "m", rid, "resid_post", "-o", str(tmp_path / "a.safetensors"), "--json", *home)
    assert (rc, err, json.loads(out)["lossy"]) == (0, "", True)
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert (f.metadata()["dmi_lossy"], f.metadata()["dmi_codecs"], f.metadata()["dmi_codec_max_abs_error"]) == (
            "true", "int8", worst)
    rc, out, err = _cli("get", "m", rid, "resid_post", "-o", str(tmp_path / "a.npy"), *home)
    assert rc == 0 and err.startswith(f"dmi: note: {tmp_path / 'a.npy'} holds lossy values (decoded from records "
                                      f"stored with int8; worst absolute error {worst}, relative L2 ")
    rc, out, err = _cli("get", "m", rid, "mlp_out", "-o", str(tmp_path / "b.safetensors"), "--json", *home)
    assert (rc, err, json.loads(out)["lossy"]) == (0, "", False)
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        assert f.metadata() is None
