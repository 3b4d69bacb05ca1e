"""``dmi estimate`` against what real captures stored, over the cases ``tests/test_estimate.py``
leaves out: MoE routers on generate, GPT-2 and single-kv-head GQA decode, a prefill alone, and
sliding-window attention, whose cache keeps ``sliding_window - 1`` past keys, so a decode
step's attention pattern stops growing at the window."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi._describe import model_geometry, read_model_config
from dmi._estimate import estimate_plan, sliding_windows
from dmi._plan_file import parse_plan
from dmi.storage.errors import InvalidArgumentError
from tests._models import tiny
from tests.test_estimate import reservations  # noqa: F401 - the fixture, shared

TOKENS, BATCH = 6, 2


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("estimate-capture-home")


def _captured(home, model, text: str, run: str, new_tokens: int) -> dict:
    """Per hook, (raw bytes, records) of one batch captured under the plan, from the catalog."""
    ids = torch.randint(3, 97, (BATCH, TOKENS), generator=torch.Generator().manual_seed(3))
    with dmi.open(home=home) as store:
        with dmi.capture(model, plan=parse_plan(text + f"run_id: {run}\n"), store=store) as cap:
            with torch.inference_mode():
                if new_tokens:
                    cap.generate(ids, torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False)
                else:
                    cap.forward(ids, torch.ones_like(ids))
            cap.flush()
        rows = store.sql(f"SELECT hook, sum(raw_size) AS raw, count() AS n FROM {{records}} WHERE run_id = '{run}' "
                         "GROUP BY hook").to_pylist()
    return {r["hook"]: (int(r["raw"]), int(r["n"])) for r in rows}


def _estimate(model, text: str, new_tokens: int, tmp_path):
    """The estimate as ``dmi estimate`` makes it: from the saved config.json, config included."""
    model.config.save_pretrained(tmp_path)
    where, config = read_model_config(str(tmp_path))
    return estimate_plan(parse_plan(text), model_geometry(config, where=where), model=where, tokens=TOKENS,
                         new_tokens=new_tokens, batch=BATCH, config=config)


def _per_batch(est) -> dict:
    return {h.hook: (h.raw_bytes_per_request * BATCH, h.records_per_request * BATCH) for h in est.hooks}


@pytest.mark.parametrize(("kind", "over", "schedule", "new_tokens", "chunk"), [
    ("qwen2_moe", {}, "{phases: [prefill, decode]}", 4, 2),
    ("olmoe", {}, "{phases: [prefill, decode], step_stride: 2}", 5, 32),
    ("gpt2", {}, "{phases: [prefill, decode]}", 4, 32),
    ("gemma2", {}, "{phases: [prefill, decode]}", 4, 2),  # full and sliding (window 5) layers in turn
    ("gemma3_text", {}, "{phases: [prefill, decode]}", 4, 32),
    ("gpt_neox", {}, "{phases: [prefill, decode]}", 4, 2),  # no resid_mid (a parallel residual)
    ("phi3", {}, "{phases: [prefill, decode]}", 4, 32),
    ("olmo3", {}, "{phases: [prefill, decode]}", 4, 2),  # only post norms; sliding and full layers
    ("gpt_oss", {}, "{phases: [prefill, decode]}", 4, 2),  # router at mlp.router; sinks; sliding and full layers
    ("granite", {}, "{phases: [prefill, decode]}", 4, 32),  # embed, block outputs and logits scaled
    ("llama", {"num_key_value_heads": 1}, "{phases: [prefill]}", 3, 32),
])
def test_every_hook_matches_a_real_capture(kind, over, schedule, new_tokens, chunk, home, tmp_path):
    model = tiny(kind, attn="eager", **over)
    text = f"version: 1\nhooks: [all]\nschedule: {schedule}\ndecode_chunk_steps: {chunk}\n"
    est = _estimate(model, text, new_tokens, tmp_path)
    assert _per_batch(est) == _captured(home, model, text, f"all-{kind}-{new_tokens}", new_tokens)


def test_sliding_window_caps_the_decode_attention_pattern(home, tmp_path):
    """Mistral, window 4, 6-token prompts: the prefill pattern is 6 x 6, each of the 3 decode
    steps attends to 4 keys (the cache's 3 and its own), not 7, 8, 9."""
    model = tiny("mistral", attn="eager", sliding_window=4)
    text = "version: 1\nhooks: [attn_pattern, resid_post]\nschedule: {phases: [prefill, decode]}\n"
    est = _estimate(model, text, 4, tmp_path)
    pattern = {h.hook: h for h in est.hooks}["attn_pattern"]
    heads, layers, f32 = 4, 3, 4
    assert pattern.raw_bytes_per_request == layers * heads * f32 * (TOKENS * TOKENS + 3 * 4) == 2304
    assert pattern.records_per_request == layers * 4
    assert _per_batch(est) == _captured(home, model, text, "sliding-mistral", 4)


def test_a_patterns_largest_tensor_is_one_requests_region(home, tmp_path, reservations):
    """The ring reserves ``attn_pattern`` one request at a time: bf16, 4 heads x 5 x 5 = 200
    bytes, 208 rounded to 16, fits a 256-byte slot, though the batch's two come to 416."""
    model = tiny("llama", attn="eager", dtype=torch.bfloat16)
    text = "version: 1\nhooks: [attn_pattern]\nschedule: {phases: [forward]}\nring: {slot_bytes: 256}\n"
    model.config.save_pretrained(tmp_path)
    where, config = read_model_config(str(tmp_path))
    est = estimate_plan(parse_plan(text), model_geometry(config, where=where, dtype="bfloat16"), model=where,
                        tokens=5, batch=BATCH, config=config)
    ids = torch.randint(3, 97, (BATCH, 5), generator=torch.Generator().manual_seed(3))
    with dmi.open(home=home) as store:
        with dmi.capture(model, plan=parse_plan(text + "run_id: pattern-slot\n"), store=store) as cap:
            with torch.inference_mode():
                cap.forward(ids, torch.ones_like(ids))
            cap.flush()
            reserved = cap.stats["reserved_bytes"]
    assert max(reservations) == 200
    assert (est.largest_tensor_bytes, est.fits_slot) == (208, True)
    assert est.peak_step_bytes == reserved == 3 * BATCH * 208 == 1248  # 3 layers x 2 requests


def test_decode_only_largest_tensor_under_a_sliding_window(home, tmp_path, reservations):
    """The last decode step's pattern holds the window's keys: one request's region, 4 heads x 4
    keys x 4 bytes, the largest the ring reserved."""
    model = tiny("mistral", attn="eager", sliding_window=4)
    text = "version: 1\nhooks: [attn_pattern]\nschedule: {phases: [decode]}\n"
    est = _estimate(model, text, 5, tmp_path)
    assert _per_batch(est) == _captured(home, model, text, "sliding-decode-only", 5)
    assert est.largest_tensor_bytes == max(reservations) == 4 * 4 * 4 == 64


def test_peak_decode_step_with_full_and_sliding_layers(home, tmp_path, reservations):
    """Qwen2 with layer 0 full and layers 1-2 sliding (window 4): the last of 4 decode steps after
    a 6-token prompt attends to 10 keys on layer 0 and 4 on the others, so that step reserves
    2 requests x 4 heads x (10 + 4 + 4) keys x 4 bytes."""
    model = tiny("qwen2", attn="eager", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    text = "version: 1\nhooks: [attn_pattern]\nschedule: {phases: [decode]}\n"
    est = _estimate(model, text, 5, tmp_path)
    assert _per_batch(est) == _captured(home, model, text, "mixed-windows", 5)
    last_step = reservations[-3 * BATCH:]
    assert est.peak_step_bytes == sum(last_step) == BATCH * 4 * (10 + 4 + 4) * 4 == 576
    assert est.largest_tensor_bytes == max(last_step) == 4 * 10 * 4


def test_sliding_windows_per_layer(tmp_path):
    """Qwen2 slides from ``max_window_layers`` on; Mistral's default window is 4096; no config
    (or a model without a window) is full everywhere."""
    qwen2 = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    qwen2.config.save_pretrained(tmp_path)
    assert sliding_windows(read_model_config(str(tmp_path))[1], 3) == (None, 4, 4)
    assert sliding_windows({"model_type": "mistral", "num_hidden_layers": 2}, 2) == (4096, 4096)
    assert sliding_windows({"model_type": "llama"}, 2) == (None, None)
    assert sliding_windows(None, 2) == (None, None)


def test_a_config_transformers_refuses_is_named():
    """Its validation errors are no ``TypeError``/``ValueError``: they once escaped raw."""
    with pytest.raises(InvalidArgumentError, match=r"^transformers cannot build a mistral config from this one "
                                                   r"\(StrictDataclassFieldValidationError: .*sliding_window.*"
                                                   r"fix the config's fields$"):
        sliding_windows({"model_type": "mistral", "sliding_window": "x"}, 2)
