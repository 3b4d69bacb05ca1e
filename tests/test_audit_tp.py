"""``store.audit`` on tensor-parallel captures: shards merged as the reader merges them,
compared with an unsharded re-run in this process under the ``tp`` tolerance.

One 2-rank run (spawned, gloo; module fixture) captures a tiny Llama (4 kv heads) four ways
into one embedded store, generating from a left-padded batch (prefill + decode):

* ``honest``: transformers' own TP (``load_tensor_parallel``);
* ``hand``: sharded by hand and described with ``tp_layout=``, every rank writing its copy of
  the replicated hooks (``tp_replicas="all"``);
* ``swapped``: the same hand-made model, but its ``attn_q`` layout gives each rank the *other*
  rank's offset — what a capture bug that concatenates shards in the wrong order records
  (the fault is made on the real path: the records carry the wrong geometry, the data is
  each rank's real block);
* ``overlap``: the hand-made model with both ranks' ``attn_q`` declared at offset 0 (shards
  that overlap and leave a gap: they cannot be merged);
* ``missing``: transformers' TP with ``tp_ranks=(0,)``: rank 1 runs the model but captures
  nothing, so every sharded record lacks rank 1's shard, as after a rank that died unpublished.

The re-run model is the full, unsharded model loaded from the same directory.
"""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi._audit_compare import MARGIN, TP_NOISE
from dmi._models import byte_tokenizer
from dmi.storage.errors import AuditError
from tests._models import left_padded_batch, tiny
from tests._tp_harness import (AUDIT_GEN, AUDIT_HOOKS, AUDIT_SHARDED, RankFailed, hand_layout, run_ranks,
                               shard_llama_by_hand)

WORLD = 2
RUN = "tp2"
GEN, HOOKS, SHARDED = AUDIT_GEN, AUDIT_HOOKS, AUDIT_SHARDED
N_LAYERS = 3
# name: (how the model is sharded, attach options besides the hand layout, the rank whose
# attn_q offset the hand layout declares: None for its own)
CASES = {
    "honest": ("transformers", {}, None),
    "hand": ("hand", {"tp_replicas": "all"}, None),
    "swapped": ("hand", {}, lambda rank: WORLD - 1 - rank),
    "overlap": ("hand", {}, lambda rank: 0),
    "missing": ("transformers", {"tp_ranks": (0,)}, None),
}


def _rank_model(path: str, how: str, rank: int, declared):
    """This rank's model and the attach options describing its cut (``declared``: which
    rank's attn_q offset this rank records, when not its own)."""
    import transformers

    from dmi.capture import TPShard, load_tensor_parallel

    if how == "transformers":
        return load_tensor_parallel(path, WORLD, dtype=torch.float32).eval(), {}
    model = shard_llama_by_hand(transformers.AutoModelForCausalLM.from_pretrained(path), rank, WORLD).eval()
    layout = hand_layout(model.config, rank, WORLD)
    if declared is not None:
        heads = model.config.num_attention_heads
        layout["attn_q"] = TPShard(axis=1, offset=declared(rank) * heads // WORLD, full=heads)
    return model, dict(tp_rank=rank, tp_size=WORLD, tp_layout=layout)


def _capture_cases(rank: int, world: int, home: str, path: str) -> dict:
    """On one rank: every case's capture into the shared store; returns the request ids."""
    ids, mask = left_padded_batch()
    out = {}
    with dmi.open(home=home) as store:
        for name, (how, options, declared) in CASES.items():
            model, cut = _rank_model(path, how, rank, declared)
            with torch.no_grad(), store.capture(model, hooks=HOOKS, model_id=name, run_id=RUN, **cut,
                                                **options) as cap:
                rids, _ = cap.generate(ids, attention_mask=mask, **GEN)
            out[name] = list(rids)
    return out


@pytest.fixture(scope="module")
def tp_store(tmp_path_factory):
    """Run both ranks once; yield the store, the full model, its directory and the request ids."""
    import transformers

    root = tmp_path_factory.mktemp("tp-audit")
    path = str(root / "model")
    tiny("llama", num_key_value_heads=4).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)  # `dmi audit --model DIR` loads a tokenizer with the model
    home = str(root / "home")
    results = run_ranks(_capture_cases, WORLD, root / "ranks", home, path)
    for r in results:
        assert not isinstance(r, (RankFailed, int)), r
    full = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with dmi.open(home=home) as store:
        yield dict(store=store, full=full, path=path, home=home, rids=results[0])


def _audit(tp_store, name: str, **kw):
    return tp_store["store"].audit(name, model=tp_store["full"], request_ids=tp_store["rids"][name], **kw)


@pytest.mark.parametrize("name", ["honest", "hand"])
def test_an_honest_tp_capture_passes_under_the_tp_tolerance(tp_store, name):
    report = _audit(tp_store, name)
    assert report.passed, [c.describe() for c in report.failures]
    assert report.tolerance == "tp" and {c.tolerance for c in report.checks} == {"tp"}
    assert {(c.hook, c.layer) for c in report.checks} >= {(h, l) for h in SHARDED for l in range(N_LAYERS)}
    assert len(report.checks) == 3 * (2 + 8 * N_LAYERS)  # per request: token_ids and logits, 8 hooks per layer
    for c in (c for c in report.checks if c.hook == "attn_q"):  # both ranks' shards were read and merged
        ranks = [e.meta.key.shard_rank for e in tp_store["store"].catalog.find_records(
            name, request_id=c.request_id, hook="attn_q", layers=c.layer, run_id=RUN)]
        assert sorted(set(ranks)) == [0, 1] and c.n_records == len(ranks)
    assert all(c.bound == TP_NOISE[torch.float32] * MARGIN for c in report.checks if c.hook != "token_ids")
    assert any(c.verdict == "noise" for c in report.checks)  # split sums moved some values, within bounds


def test_shards_concatenated_in_the_wrong_order_fail_naming_hook_layer_and_position(tp_store):
    report = _audit(tp_store, "swapped")
    rids = tp_store["rids"]["swapped"]
    assert {(c.request_id, c.hook, c.layer) for c in report.failures} == \
        {(rid, "attn_q", layer) for rid in rids for layer in range(N_LAYERS)}
    assert {c.first_fail for c in report.failures} == {0}
    assert all(c.max_rel > 0.1 and c.tolerance == "tp" for c in report.failures)  # far beyond noise
    assert "attn_q layer 1: fail" in next(c for c in report.failures if c.layer == 1).describe()


def test_a_missing_rank_is_a_failure_naming_request_hook_and_ranks(tp_store):
    report = _audit(tp_store, "missing")
    rids = tp_store["rids"]["missing"]
    assert {(c.request_id, c.hook, c.layer) for c in report.failures} == \
        {(rid, hook, layer) for rid in rids for hook in SHARDED for layer in range(N_LAYERS)}
    failure = next(c for c in report.failures if (c.request_id, c.hook, c.layer) == (rids[1], "attn_k", 2))
    assert failure.first_fail == 0
    assert failure.detail == ("TP rank(s) [1] of 2 missing at position 0 (present: [0]): "
                              "the full tensor cannot be formed")
    assert f"request {rids[1]} attn_k layer 2: fail" in failure.describe()
    replicated = [c for c in report.checks if c.hook not in SHARDED]
    assert replicated and not any(c.failed for c in replicated)  # rank 0 wrote these whole


def test_shards_that_cannot_be_merged_are_a_failure_with_the_readers_reason(tp_store):
    report = _audit(tp_store, "overlap")
    rids = tp_store["rids"]["overlap"]
    assert {(c.request_id, c.hook, c.layer) for c in report.failures} == \
        {(rid, "attn_q", layer) for rid in rids for layer in range(N_LAYERS)}
    failure = report.failures[0]
    assert failure.first_fail == 0
    assert failure.detail.startswith("TP shards at position 0 cannot be merged: ")
    assert "several ranks hold the same slice (offsets [0, 0])" in failure.detail


def test_exact_is_refused_for_a_tp_capture(tp_store):
    with pytest.raises(AuditError, match=r"tensor parallelism \(2 ranks\).*cannot be bit-identical"):
        _audit(tp_store, "honest", exact=True, record=False)


def test_dmi_audit_reports_a_tp_capture(tp_store, capsys):
    from dmi.cli import main

    store = tp_store["store"]
    store.close()  # the CLI opens the embedded store itself
    try:
        rid = tp_store["rids"]["swapped"][0]
        code = main(["audit", "swapped", "--model", tp_store["path"], "--request", rid, "--home", tp_store["home"],
                     "-q"])
        out, err = capsys.readouterr()
    finally:
        tp_store["store"] = dmi.open(home=tp_store["home"])
    assert code == 1, err
    assert f"request {rid} (run {RUN}): 26 hook/layer checks" in out and "within tp noise, 3 failed" in out
    assert f"FAIL request {rid} attn_q layer 0: fail" in out and "first position beyond it: 0" in out
