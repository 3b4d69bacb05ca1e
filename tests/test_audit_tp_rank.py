"""``store.audit(..., per_rank=...)``: a tensor-parallel capture audited on every rank, each
rank re-running the requests through its own shard and checking the records it wrote.

One 2-rank run (spawned, gloo; module fixture) captures a tiny Llama (4 kv heads) into one
embedded store, generating from a left-padded batch, then audits per rank on both ranks:

* ``honest``: transformers' own TP (``load_tensor_parallel``), audited with ``per_rank=True``
  (the TP group from the model's device mesh);
* ``fault``: sharded by hand (``per_rank=`` the world group), every rank writing its copy of
  the replicated hooks (``tp_replicas="all"``), and on rank 1 one value of
  layer 1's ``attn_q`` (channel 0 of the last prompt position) is changed in the record
  only: a hook before DMI's adds 1 to it and a hook after DMI's copy puts the original back,
  so the model computes on unchanged — a corrupted shard record on the real capture path;
* ``swapped``: the hand-made layout giving each rank the other's ``attn_q`` offset — a wrong
  shard order, which each rank alone cannot see (its data and re-run are its own block);
* ``alone``: one request captured alone on the same ranks, audited with ``exact=True``;
* ``missing``: transformers' TP with ``tp_ranks=(0,)``: rank 1 wrote nothing;
* ``single``: an unsharded capture (made in this process before the ranks start), audited
  per rank with the 2-way model;
* ``solo``: a process group of rank 0 alone; ``differ``: each rank names another request.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

import dmi
from dmi._audit_compare import BATCHED_NOISE, MARGIN
from dmi.storage.errors import AuditError, InvalidArgumentError
from tests._models import left_padded_batch, tiny
from tests._tp_harness import (AUDIT_GEN, AUDIT_HOOKS, AUDIT_SHARDED, RankFailed, hand_layout, run_ranks,
                               shard_llama_by_hand)

WORLD = 2
RUN = "tp2"
GEN, HOOKS, SHARDED = AUDIT_GEN, AUDIT_HOOKS, AUDIT_SHARDED
REPLICATED = {"resid_pre", "attn_out", "resid_post"}
N_LAYERS = 3
FAULT_LAYER = 1


@contextlib.contextmanager
def _record_changed_on(model, on: bool):
    """While open (inside the capture, so that the second hook runs after DMI's copy): the
    first forward's ``attn_q`` at ``FAULT_LAYER``, channel 0 of the last position, is 1
    larger when DMI copies it and restored right after, bit for bit."""
    if not on:
        yield
        return
    proj = model.model.layers[FAULT_LAYER].self_attn.q_proj
    saved: dict[str, torch.Tensor] = {}
    calls = []

    def change(module, args, out):
        calls.append(1)
        if len(calls) == 1:
            saved["value"] = out[:, -1, 0].clone()
            out[:, -1, 0] += 1.0

    def restore(module, args, out):
        if "value" in saved:
            out[:, -1, 0] = saved.pop("value")

    handles = [proj.register_forward_hook(change, prepend=True), proj.register_forward_hook(restore)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _capture(store, model, name: str, cut: dict, ids, mask=None, fault: bool = False) -> list[str]:
    with torch.no_grad(), store.capture(model, hooks=HOOKS, model_id=name, run_id=RUN, **cut) as cap, \
            _record_changed_on(model, fault):
        rids, _ = cap.generate(ids, attention_mask=mask, **GEN)
    return list(rids)


def _outcome(call):
    """A report (as a dict) or the error a rank raised (its class name and message)."""
    try:
        return ("report", call().as_dict())
    except dmi.DMIError as exc:
        return ("error", type(exc).__name__, str(exc))


def _read_times(module) -> dict[str, float]:
    """When each model id's first per-rank audit began to read the catalog (``choose_requests``
    wrapped in ``module``, the per-rank audit's)."""
    read_at: dict[str, float] = {}
    choose = module.choose_requests

    def timed(catalog, model_id, *args, **kwargs):
        read_at.setdefault(model_id, time.time())
        return choose(catalog, model_id, *args, **kwargs)

    module.choose_requests = timed
    return read_at


def _rank_audits(rank: int, world: int, home: str, path: str) -> dict:
    """On one rank: every case's capture, then every case's per-rank audit."""
    import torch.distributed as dist
    import transformers

    from dmi import _audit_rank
    from dmi.capture import TPShard, load_tensor_parallel

    ids, mask = left_padded_batch()
    rids: dict[str, list[str]] = {}
    with dmi.open(home=home) as store:
        hf_tp = load_tensor_parallel(path, WORLD, dtype=torch.float32).eval()
        rids["honest"] = _capture(store, hf_tp, "honest", {}, ids, mask)
        rids["missing"] = _capture(store, hf_tp, "missing", {"tp_ranks": (0,)}, ids, mask)
        hand = shard_llama_by_hand(transformers.AutoModelForCausalLM.from_pretrained(path), rank, WORLD).eval()
        layout = hand_layout(hand.config, rank, WORLD)
        cut = dict(tp_rank=rank, tp_size=WORLD, tp_layout=layout)
        rids["fault"] = _capture(store, hand, "fault", {**cut, "tp_replicas": "all"}, ids, mask, fault=rank == 1)
        heads = hand.config.num_attention_heads
        swapped = {**layout, "attn_q": TPShard(axis=1, offset=(WORLD - 1 - rank) * heads // WORLD, full=heads)}
        rids["swapped"] = _capture(store, hand, "swapped", {**cut, "tp_layout": swapped}, ids, mask)
        rids["alone"] = _capture(store, hand, "alone", cut, ids[:1])  # the unpadded 7-token prompt, alone
        group = dist.group.WORLD
        solo = dist.new_group([0])  # a group of one rank, which rank 1 is not in
        read_at = _read_times(_audit_rank)
        audits = {
            "honest": _outcome(lambda: store.audit("honest", model=hf_tp, per_rank=True)),
            "fault": _outcome(lambda: store.audit("fault", model=hand, per_rank=group, request_ids=rids["fault"])),
            "swapped": _outcome(lambda: store.audit("swapped", model=hand, per_rank=group, record=False)),
            "alone": _outcome(lambda: store.audit("alone", model=hand, per_rank=group, exact=True, record=False)),
            "missing": _outcome(lambda: store.audit("missing", model=hf_tp, per_rank=True, record=False)),
            "single": _outcome(lambda: store.audit("single", model=hf_tp, per_rank=True, record=False)),
            "solo": _outcome(lambda: store.audit("fault", model=hand, per_rank=solo, record=False)),
            "differ": _outcome(lambda: store.audit("honest", model=hf_tp, per_rank=True, record=False,
                                                   request_ids=[rids["honest"][rank]])),
        }
    return {"rids": rids, "audits": audits, "read_at": read_at}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The unsharded capture here, then both ranks once; yields the store, its home, the
    ranks' results and the full model."""
    import transformers

    root = tmp_path_factory.mktemp("tp-rank-audit")
    path = str(root / "model")
    tiny("llama", num_key_value_heads=4).save_pretrained(path)
    home = str(root / "home")
    full = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask = left_padded_batch()
    with dmi.open(home=home) as store:
        _capture(store, full, "single", {}, ids, mask)
    results = run_ranks(_rank_audits, WORLD, root / "ranks", home, path)
    for r in results:
        assert not isinstance(r, (RankFailed, int)), r
    with dmi.open(home=home) as store:
        yield dict(store=store, home=home, results=results, full=full)


def _reports(ranks, name: str) -> list[dict]:
    outcomes = [r["audits"][name] for r in ranks["results"]]
    assert all(o[0] == "report" for o in outcomes), outcomes
    return [o[1] for o in outcomes]


def _errors(ranks, name: str) -> list[tuple[str, str]]:
    outcomes = [r["audits"][name] for r in ranks["results"]]
    assert all(o[0] == "error" for o in outcomes), outcomes
    return [o[1:] for o in outcomes]


def test_an_honest_tp_capture_passes_per_rank_on_both_ranks(ranks):
    reports = _reports(ranks, "honest")
    assert reports[0] == reports[1]  # every rank returns every rank's checks, under rank 0's audit id
    report = reports[0]
    assert report["passed"], [c for c in report["checks"] if c["verdict"] == "fail"]
    assert report["tolerance"] == "batched"
    assert sorted(rid for _, rid in report["requests"]) == sorted(ranks["results"][0]["rids"]["honest"])
    checked = {(c["request_id"], c["hook"], c["layer"], c["shard_rank"]) for c in report["checks"]}
    for _, rid in report["requests"]:
        for layer in range(N_LAYERS):
            assert {(rid, h, layer, r) for h in SHARDED for r in (0, 1)} <= checked  # each rank its own shard
            assert {(rid, h, layer, 0) for h in REPLICATED} <= checked  # rank 0 the replicated hooks
            assert not {(rid, h, layer, 1) for h in REPLICATED} & checked  # which rank 1 did not write
        assert {(rid, "token_ids", -1, 0), (rid, "logits", -1, 0)} <= checked
    assert len(report["checks"]) == 3 * (2 + N_LAYERS * (len(REPLICATED) + 2 * len(SHARDED)))
    bound = BATCHED_NOISE[torch.float32] * MARGIN
    assert all(c["bound"] == bound for c in report["checks"] if c["hook"] != "token_ids")
    q = [c for c in report["checks"] if c["hook"] == "attn_q"]
    assert all(c["n_records"] >= 1 for c in q)  # one rank's records: a prefill and a decode record per token
    assert any(c["verdict"] == "noise" for c in report["checks"])  # batch vs alone moved some values


def test_a_changed_shard_record_fails_on_rank_1_exactly_that_hook(ranks):
    reports = _reports(ranks, "fault")
    assert reports[0] == reports[1]
    failures = [c for c in reports[0]["checks"] if c["verdict"] == "fail"]
    rids = ranks["results"][0]["rids"]["fault"]
    assert sorted((c["request_id"], c["hook"], c["layer"], c["shard_rank"]) for c in failures) == \
        sorted((rid, "attn_q", FAULT_LAYER, 1) for rid in rids)
    prompt_lengths = left_padded_batch()[1].sum(dim=1).tolist()
    assert {c["request_id"]: c["first_fail"] for c in failures} == \
        {rid: n - 1 for rid, n in zip(rids, prompt_lengths)}  # the last prompt position, as changed
    assert all(c["max_abs"] == pytest.approx(1.0, abs=1e-5) for c in failures)
    checks = reports[0]["checks"]
    rank0_q = [c for c in checks if (c["hook"], c["layer"], c["shard_rank"]) == ("attn_q", FAULT_LAYER, 0)]
    assert len(rank0_q) == 3 and not any(c["verdict"] == "fail" for c in rank0_q)
    checked = {(c["hook"], c["layer"], c["shard_rank"]) for c in checks}
    assert {(h, 2, r) for h in REPLICATED for r in (0, 1)} <= checked  # each rank its own replicated copies
    assert {c["shard_rank"] for c in checks if c["hook"] == "token_ids"} == {0}  # the copy every rank re-ran
    report = dmi.AuditReport(**{**{k: reports[0][k] for k in ("audit_id", "model_id", "model", "seed", "tolerance",
                                                             "audited_at")},
                                "requests": tuple(map(tuple, reports[0]["requests"])),
                                "checks": tuple(dmi.AuditCheck(**c) for c in reports[0]["checks"])})
    line = next(c for c in report.failures if c.request_id == rids[1]).describe()
    assert line.startswith(f"request {rids[1]} attn_q layer {FAULT_LAYER} on TP rank 1: fail")
    assert line.endswith("first position beyond it: 3: values differ beyond the batched tolerance from position 3")


def test_rank_0_records_the_per_rank_audit_once_with_every_ranks_checks(ranks, capsys):
    from dmi.cli import main

    store = ranks["store"]
    report = _reports(ranks, "fault")[0]
    rows = store.catalog.audits("fault").to_pylist()
    assert {r["audit_id"] for r in rows} == {report["audit_id"]}  # one audit, written once (by rank 0)
    assert sum(r["checks"] for r in rows) == len(report["checks"])
    assert sorted((r["failed"], r["first_failure"]) for r in rows) == [(1, f"attn_q@{FAULT_LAYER}")] * 3
    table = store.catalog.tables["audits"]
    details = store.catalog.sql(f"SELECT detail FROM {table} WHERE model_id = 'fault' AND verdict = 'fail'")
    assert {d.split(":")[0] for d in details.column("detail").to_pylist()} == {"TP rank 1"}
    store.close()  # the CLI opens the embedded store itself
    try:
        assert main(["runs", "fault", "--home", ranks["home"], "--json", "-q"]) == 0
        fault_runs = json.loads(capsys.readouterr().out)
        assert main(["runs", "honest", "--home", ranks["home"], "--json", "-q"]) == 0
        honest_runs = json.loads(capsys.readouterr().out)
    finally:
        ranks["store"] = dmi.open(home=ranks["home"])
    assert [r["last_audit"] for r in fault_runs] == ["FAILED 3 checks (batched)"]
    assert [r["last_audit"] for r in honest_runs] == ["passed (batched)"]


def test_a_per_rank_audit_is_stamped_with_rank_0s_start_before_any_rank_read_the_catalog(ranks):
    """Its rows then carry a time no deletion decided while it ran can precede, so the
    tombstone hides them (the single-process audit's race is tested in ``test_audit.py``)."""
    reports = _reports(ranks, "fault")
    assert reports[0]["audited_at"] == reports[1]["audited_at"]
    assert reports[0]["audited_at"] <= ranks["results"][0]["read_at"]["fault"]


def test_a_wrong_shard_order_passes_per_rank_and_is_left_to_the_merged_audit(ranks):
    report = _reports(ranks, "swapped")[0]
    assert report["passed"]  # each rank's block is its own re-run's block: only a merge sees the order
    merged = ranks["store"].audit("swapped", model=ranks["full"], record=False)
    assert {c.hook for c in merged.failures} == {"attn_q"}


def test_a_request_captured_alone_on_the_same_ranks_is_bit_exact_per_rank(ranks):
    report = _reports(ranks, "alone")[0]
    assert report["passed"] and report["tolerance"] == "exact"
    assert {c["verdict"] for c in report["checks"]} == {"exact"}
    assert {c["shard_rank"] for c in report["checks"]} == {0, 1}


def test_a_request_without_records_of_this_rank_is_refused_on_every_rank(ranks):
    (kind0, message0), (kind1, message1) = _errors(ranks, "missing")
    assert kind0 == kind1 == "AuditError"
    assert "has no records of TP rank 1 of 2 for attn_k@0, attn_k@1" in message1
    assert message0.startswith("the per-rank audit was refused on another rank; TP rank 1: request ")
    assert message1 in message0


def test_a_capture_of_another_tp_size_is_refused(ranks):
    errors = _errors(ranks, "single")
    assert [kind for kind, _ in errors] == ["AuditError", "AuditError"]
    assert all("was captured with TP size 1 but the model of this per-rank audit is sharded 2 ways: audit it "
               "without per_rank" in message for _, message in errors)


def test_ranks_that_chose_different_requests_refuse_before_re_running(ranks):
    (kind0, message0), (kind1, message1) = _errors(ranks, "differ")
    assert kind0 == kind1 == "AuditError"
    assert message0.startswith("TP rank(s) [1] chose other requests than TP rank 0: every rank must call")
    assert message1.startswith("TP rank(s) [0] chose other requests than TP rank 1")


def test_per_rank_over_a_group_without_this_rank_is_refused(ranks):
    (kind0, message0), (kind1, message1) = _errors(ranks, "solo")
    assert kind0 == kind1 == "AuditError"
    assert message0.startswith("the TP group of this per-rank audit has one rank")
    assert message1 == "this process is not a member of the process group given as per_rank"


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (the refusals below come before any
    collective and before the catalog is read)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-init'}", rank=0, world_size=1)
    try:
        with dmi.open(home=str(tmp_path / "home")) as store:
            yield store, dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_per_rank_true_needs_the_models_tp_mesh(one_process_group):
    store, _ = one_process_group
    with pytest.raises(AuditError, match="for a model sharded by hand pass its TP process group"):
        store.audit("anything", model=tiny("llama"), per_rank=True, record=False)


def test_per_rank_over_a_group_of_one_rank_is_refused(one_process_group):
    store, world = one_process_group
    with pytest.raises(AuditError, match="the TP group of this per-rank audit has one rank"):
        store.audit("anything", model=tiny("llama"), per_rank=world, record=False)


def test_per_rank_must_be_true_or_a_process_group(one_process_group):
    store, _ = one_process_group
    with pytest.raises(InvalidArgumentError, match="per_rank must be True .* not 'yes'"):
        store.audit("anything", model=tiny("llama"), per_rank="yes", record=False)


def test_per_rank_outside_a_process_group_is_refused(tmp_path):
    # refused before the catalog is read: an empty store and any model will do
    with dmi.open(home=str(tmp_path)) as store, \
            pytest.raises(AuditError, match="torch.distributed is not initialized in this process"):
        store.audit("anything", model=tiny("llama"), per_rank=True, record=False)


def test_a_position_this_rank_did_not_record_fails_naming_it(ranks):
    # A rank that published its prefill records but not a later one cannot be captured on
    # purpose: the real records of the hand-made capture are read from the catalog and rank
    # 1's prefill attn_q record of layer 0 is left out of the list, as if it were lost. The
    # re-run is the full model's (this process has no rank 1), so only the missing position
    # is asserted: it is the first problem.
    from dmi._audit import check_request, plan_request
    from dmi.reader import read_records

    store = ranks["store"]
    rid = ranks["results"][0]["rids"]["fault"][0]
    entries = store.catalog.find_records("fault", request_id=rid, run_id=RUN)
    lost = [e for e in entries if (e.meta.key.hook, e.meta.key.layer, e.meta.key.shard_rank,
                                   e.meta.key.phase) == ("attn_q", 0, 1, "prefill")]
    assert len(lost) == 1
    kept = [e for e in entries if e not in lost]

    def read(es):
        return read_records(store.packs, es)

    plan = plan_request(ranks["full"], RUN, rid, kept, read, "batched")
    group = {("attn_q", 0): plan.groups[("attn_q", 0)]}
    (check,) = check_request(plan, plan.rerun(ranks["full"], group), read, group, shard_rank=1)
    assert (check.verdict, check.first_fail, check.shard_rank) == ("fail", 0, 1)
    assert check.detail == "TP rank 1 has no record at position 0 (another rank has)"
