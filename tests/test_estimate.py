"""``dmi estimate``: the estimate of a plan against what a real capture of the same plan stored
(raw bytes and records per hook, byte for byte; the ring's reservation), the workload rules,
tensor parallelism, the measured ratio and its source, and the command line."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math

import pytest
import torch

import dmi
from dmi._describe import model_geometry, read_model_config
from dmi._estimate import (
    DECODE_CHUNK_BYTES,
    MAX_BATCH,
    MEASURED_RATIOS,
    RATIO_SOURCE,
    estimate_plan,
    estimate_plan_file,
    rank_geometry,
)
from dmi._plan_file import parse_plan
from dmi.capture import ModelGeometry
from dmi.storage.errors import InvalidArgumentError, PlanError
from tests._models import tiny

TOKENS, BATCH = 6, 2


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("estimate-home")


def _batch(vocab=97, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (BATCH, TOKENS), generator=g)
    return ids, torch.ones_like(ids)


def _capture(home, model, plan_text: str, run: str, new_tokens: int) -> tuple[dict, int]:
    """Capture one batch under the plan; per hook (raw bytes, records) as the catalog has them,
    and the bytes the ring reserved."""
    plan = parse_plan(plan_text + f"run_id: {run}\n")
    ids, mask = _batch()
    with dmi.open(home=home) as store:
        with dmi.capture(model, plan=plan, store=store) as cap:
            with torch.inference_mode():
                if new_tokens:
                    cap.generate(ids, mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                else:
                    cap.forward(ids, mask)
            cap.flush()
            reserved = cap.stats["reserved_bytes"]
        rows = store.sql(f"SELECT hook, sum(raw_size) AS raw, count() AS n FROM {{records}} WHERE run_id = '{run}' "
                         "GROUP BY hook").to_pylist()
    return {r["hook"]: (int(r["raw"]), int(r["n"])) for r in rows}, reserved


def _estimate(model, plan_text: str, new_tokens: int, tmp_path):
    model.config.save_pretrained(tmp_path)
    where, config = read_model_config(str(tmp_path))
    return estimate_plan(parse_plan(plan_text), model_geometry(config, where=where), model=where, tokens=TOKENS,
                         new_tokens=new_tokens, batch=BATCH)


def _per_hook(est) -> dict:
    return {h.hook: (h.raw_bytes_per_request * BATCH, h.records_per_request * BATCH) for h in est.hooks}


@pytest.mark.parametrize("kind", ["llama", "mixtral", "gpt2"])
def test_scoring_forward_matches_a_real_capture(kind, home, tmp_path):
    model = tiny(kind, attn="eager")
    text = "version: 1\nhooks: [all]\nschedule: {phases: [forward]}\n"
    est = _estimate(model, text, 0, tmp_path)
    stored, reserved = _capture(home, model, text, f"fwd-{kind}", 0)
    assert _per_hook(est) == stored
    assert est.peak_step_bytes == reserved  # one forward: the ring reserved exactly the peak step
    assert sum(v[0] for v in stored.values()) == est.raw_bytes_per_request * BATCH


@pytest.mark.parametrize(("schedule", "chunk"), [("{phases: [prefill, decode]}", 2),
                                                 ("{phases: [prefill, decode], step_stride: 2}", 32),
                                                 ("{phases: [decode]}", 32)])
def test_generate_matches_a_real_capture(schedule, chunk, home, tmp_path):
    """Prefill logits of the last position only, decode coalesced in chunks (or one record
    per step with a stride, and always for attn_pattern)."""
    model = tiny("llama", attn="eager")
    text = (f"version: 1\nhooks: [token_ids, resid_post, attn_pattern, logits]\nlayers: '1:3'\n"
            f"schedule: {schedule}\ndecode_chunk_steps: {chunk}\n")
    est = _estimate(model, text, 5, tmp_path)
    stored, _ = _capture(home, model, text, f"gen-{abs(hash(schedule)) % 10**6}-{chunk}", 5)
    assert _per_hook(est) == stored


@pytest.fixture
def reservations(monkeypatch) -> list:
    """Every size the ring is asked to reserve, in order."""
    from dmi.capture._ring import Ring

    sizes = []
    reserve = Ring.reserve

    def recording(self, nbytes, **kwargs):
        sizes.append(nbytes)
        return reserve(self, nbytes, **kwargs)

    monkeypatch.setattr(Ring, "reserve", recording)
    return sizes


def test_decode_only_largest_tensor_is_the_largest_a_real_decode_step_reserves(home, tmp_path, reservations):
    """A decode-only plan reserves nothing at the prompt; its largest (hook, layer) tensor is a
    decode step's (the last one's attention pattern), and it does not fit a 64-byte slot."""
    model = tiny("llama", attn="eager")
    text = ("version: 1\nhooks: [resid_post, attn_pattern, logits]\nlayers: '1:3'\nschedule: {phases: [decode]}\n"
            "ring: {slot_bytes: 64}\n")
    est = _estimate(model, text, 5, tmp_path)
    stored, _ = _capture(home, model, text, "decode-only", 5)
    assert _per_hook(est) == stored
    assert est.largest_tensor_bytes == -(-max(reservations) // 16) * 16 > 64  # the ring rounds each up to 16
    assert (est.fits_slot, est.step_fits_ring) == (False, False)
    assert all(h.ring_bytes_per_step == 0 for h in est.hooks)  # nothing reserved at the prompt


def test_batch_is_bounded():
    """A step plan holds one entry per request: an unbounded batch once kept the UI's endpoint
    lock for minutes."""
    plan = parse_plan("version: 1\nhooks: [resid_post]\n")
    assert estimate_plan(plan, LLAMA_8B, model="m", tokens=1, batch=MAX_BATCH).batch == MAX_BATCH == 65_536
    with pytest.raises(InvalidArgumentError, match="batch must be at most 65,536 requests per forward, "
                                                   "got 65,537"):
        estimate_plan(plan, LLAMA_8B, model="m", batch=MAX_BATCH + 1)


def test_decode_chunk_bound_is_the_drains():
    from dmi.capture._drain import Drain  # the private default the estimate mirrors

    assert inspect.signature(Drain).parameters["decode_chunk_bytes"].default == DECODE_CHUNK_BYTES


LLAMA_8B = ModelGeometry("llama", 32, 4096, 32, 8, 128, 14336, 128256, torch.bfloat16)


def test_bytes_per_token_and_per_million():
    plan = parse_plan("version: 1\nhooks: [resid_post, mlp_post]\nlayers: '0:2'\n")
    est = estimate_plan(plan, LLAMA_8B, model="m", tokens=1000, batch=4)
    hooks = {h.hook: h for h in est.hooks}
    assert hooks["resid_post"].bytes_per_token == 4096 * 2 and hooks["mlp_post"].bytes_per_token == 14336 * 2
    assert est.raw_bytes_per_request == 2 * 1000 * (4096 + 14336) * 2
    assert est.raw_bytes_per_million_tokens == est.raw_bytes_per_request * 1000
    assert est.ratio == MEASURED_RATIOS[("split-zstd", "bfloat16")] == 1.468 and est.ratio_source == RATIO_SOURCE
    assert est.stored_bytes_per_million_tokens == math.ceil(est.raw_bytes_per_request / 1.468 * 1000)
    assert est.records_per_million_tokens == 4 * 1000
    assert est.catalog_rows_per_million_tokens == 4000 + est.packs_per_million_tokens
    assert est.packs_per_million_tokens == math.ceil(est.stored_bytes_per_million_tokens / (256 << 20))
    assert est.peak_step_bytes == 4 * est.raw_bytes_per_request  # 281 MiB > the 8 x 32 MiB ring
    assert est.largest_tensor_bytes == 4 * 1000 * 14336 * 2  # one layer of mlp_post: 109 MiB > a 32 MiB slot
    assert (est.fits_slot, est.step_fits_ring) == (False, False)
    small = estimate_plan(plan, LLAMA_8B, model="m", tokens=100)
    assert (small.fits_slot, small.step_fits_ring) == (True, True)


def test_request_stride_divides_the_traffic_captured():
    every = estimate_plan(parse_plan("version: 1\nhooks: [resid_post]\n"), LLAMA_8B, model="m", tokens=100)
    fourth = estimate_plan(parse_plan("version: 1\nhooks: [resid_post]\nschedule: {request_stride: 4}\n"),
                           LLAMA_8B, model="m", tokens=100)
    assert fourth.raw_bytes_per_request == every.raw_bytes_per_request
    assert fourth.raw_bytes_per_million_tokens == every.raw_bytes_per_million_tokens // 4


def test_tensor_parallel_worst_rank():
    g = rank_geometry(LLAMA_8B, 3)
    assert (g.n_heads, g.n_kv_heads, g.intermediate, g.hidden) == (11, 3, 4779, 4096)
    replicated = rank_geometry(ModelGeometry("llama", 2, 64, 8, 2, 8, 100, 10, torch.float32), 4)
    assert (replicated.n_heads, replicated.n_kv_heads, replicated.intermediate) == (2, 2, 25)
    plan = parse_plan("version: 1\nhooks: [attn_q, attn_k, resid_post]\nlayers: [0]\n")
    est = estimate_plan(plan, LLAMA_8B, model="m", tokens=10, tp=4)
    assert {h.hook: h.bytes_per_token for h in est.hooks} == {"attn_q": 8 * 128 * 2, "attn_k": 2 * 128 * 2,
                                                              "resid_post": 4096 * 2}


def test_codecs_without_a_measured_ratio_count_raw():
    raw = estimate_plan(parse_plan("version: 1\nhooks: [resid_post]\ncodec: raw\n"), LLAMA_8B, model="m", tokens=8)
    assert raw.ratio == 1.0 and raw.stored_bytes_per_request == raw.raw_bytes_per_request
    fp16 = estimate_plan(parse_plan("version: 1\nhooks: [resid_post]\n"),
                         ModelGeometry("llama", 2, 64, 8, 8, 8, 100, 10, torch.float16), model="m", tokens=8)
    assert fp16.ratio is None and fp16.stored_bytes_per_request == fp16.raw_bytes_per_request


@pytest.mark.parametrize(("text", "workload", "error", "words"), [
    ("version: 1\nhooks: [router_logits]\n", {}, PlanError,
     "hook 'router_logits' does not exist on model type 'llama'"),
    ("version: 1\nhooks: [resid_post]\nlayers: '0:40'\n", {}, PlanError, "reaches past the model"),
    ("version: 1\nhooks: [resid_post]\nschedule: {phases: [decode]}\n", {}, InvalidArgumentError,
     "captures nothing of this workload"),
    ("version: 1\nhooks: [resid_post]\n", {"tokens": 0}, InvalidArgumentError, "tokens must be an integer >= 1"),
    ("version: 1\nhooks: [resid_post]\n", {"tp": 0}, InvalidArgumentError, "tp must be an integer >= 1"),
])
def test_refusals(text, workload, error, words):
    with pytest.raises(error, match=words):
        estimate_plan(parse_plan(text), LLAMA_8B, model="m", **workload)


def test_an_moe_model_with_dense_layers_among_sparse_ones_has_no_router_to_estimate(tmp_path):
    """Its config's ``mlp_only_layers`` is read as the runtime builds the model: layer 0 dense,
    so neither the router hooks nor ``mlp_post`` is on every layer (what ``attach`` refuses)."""
    tiny("qwen3_moe", mlp_only_layers=[0]).config.save_pretrained(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"version: 1\nmodel: {tmp_path}\nhooks: [router_logits]\n")
    with pytest.raises(PlanError, match=r"hook 'router_logits' does not exist on model type 'qwen3_moe'"):
        estimate_plan_file(str(plan))
    plan.write_text(f"version: 1\nmodel: {tmp_path}\nhooks: [router, mlp, resid_post]\n")
    assert [h.hook for h in estimate_plan_file(str(plan), tokens=8).hooks] == ["mlp_out", "resid_post"]


def test_group_members_missing_on_dense_models_are_skipped():
    est = estimate_plan(parse_plan("version: 1\nhooks: [router, resid_post]\nlayers: [0]\n"), LLAMA_8B, model="m")
    assert [h.hook for h in est.hooks] == ["resid_post"]


def _cli(*argv: str) -> tuple[int, str, str]:
    from dmi.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_json_equals_the_api(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nmodel: tiny-llama\nhooks: [resid, logits]\n")
    rc, out, err = _cli("estimate", "--plan", str(plan), "--tokens", "32", "--new-tokens", "4", "--batch", "2",
                        "--json")
    assert (rc, err) == (0, "")
    api = estimate_plan_file(str(plan), tokens=32, new_tokens=4, batch=2)
    assert json.loads(out) == json.loads(json.dumps(api.as_dict()))
    rc, out, err = _cli("estimate", "--plan", str(plan), "--tokens", "32")
    assert rc == 0 and "per million tokens:" in out and "ratio source: bench/bench_storage.py" in out


def test_cli_needs_a_model(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("version: 1\nhooks: [resid_post]\n")
    rc, out, err = _cli("estimate", "--plan", str(plan))
    assert rc == 2 and err == f"dmi: error: {plan}: model: the plan names no model; add `model:` or give --model " \
                              "DIR|config.json|NAME\n"


@pytest.mark.parametrize("command", ["describe-model", "estimate", "ui"])
def test_new_commands_have_help(command, capsys):
    from dmi.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(f"usage: dmi {command}")
