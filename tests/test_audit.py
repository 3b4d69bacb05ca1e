"""``store.audit``: honest captures pass, deliberately broken ones are caught and named.

Every test captures a real tiny HF model (built from a config) into a real store (chDB
catalog, pack files). Faults are injected into that real capture in one of two ways, said
in each test: by patching the captured tensor on its way to the pack writer (a wrapper
around the real ``PackWriter`` that changes the key or the data of chosen records before
they are written), so the fault is in the packs and index rows exactly as a capture bug
would put it there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dmi
from dmi._audit_compare import BATCHED_NOISE, MARGIN
from dmi.storage import PackWriter
from dmi.storage.errors import AuditError

from ._models import left_padded_batch, tiny

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "gpt2"]
HOOKS = "all_but_patterns token_ids"
N_NEW = 4


@pytest.fixture
def store(tmp_path):
    with dmi.open(home=tmp_path) as s:
        yield s


def _capture(store, model, ids, mask, *, generate=True, writer=None, hooks=HOOKS, **kw):
    opts = {} if writer is None else {"writer": writer(store)}
    with dmi.capture(model, hooks=hooks, store=store, decode_chunk_steps=2, **opts, **kw) as cap:
        if generate:
            rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
        else:
            pos = (mask.cumsum(-1) - 1).clamp_min(0)  # absolute positions (GPT-2) must skip the padding
            rids, _ = cap.forward(ids, attention_mask=mask, position_ids=pos)
        return cap.model_id, rids


class Tamper:
    """A real ``PackWriter`` whose ``append`` first lets ``change(key, data)`` rewrite a record
    (return the new ``(key, data)``): the fault lands in the packs and the catalog."""

    def __init__(self, change):
        self.change = change

    def __call__(self, store):
        writer = PackWriter(store.packs, writer_id="tamper")
        change = self.change
        real_append = writer.append

        def append(key, data, *, shard=None):
            key, data = change(key, data)
            return real_append(key, data, shard=shard)

        writer.append = append
        return writer


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("generate", [True, False], ids=["generate", "forward"])
def test_an_honest_batched_left_padded_capture_passes_on_every_architecture(store, kind, generate):
    model = tiny(kind)
    ids, mask = left_padded_batch()
    model_id, rids = _capture(store, model, ids, mask, generate=generate)
    report = store.audit(model_id, model=model, requests=3)
    assert report.passed, [c.describe() for c in report.failures]
    assert sorted(r for _, r in report.requests) == sorted(rids)
    hooks = {c.hook for c in report.checks}
    assert {"token_ids", "resid_pre", "attn_q", "mlp_out", "resid_post", "logits"} <= hooks
    assert all(c.verdict in ("exact", "noise") for c in report.checks)
    assert any(c.verdict == "noise" for c in report.checks)  # batching moved some values, within bounds


def test_a_capture_alone_is_bit_exact(store):
    model = tiny("llama", attn="eager")
    ids, mask = left_padded_batch(lengths=(6,))
    model_id, rids = _capture(store, model, ids, mask, hooks="all token_ids")
    report = store.audit(model_id, model=model, request_ids=rids, exact=True)
    assert report.passed and report.tolerance == "exact"
    assert all(c.verdict == "exact" for c in report.checks)
    assert len({(c.hook, c.layer) for c in report.checks}) == len(report.checks) == 1 + 3 + 3 * 11
