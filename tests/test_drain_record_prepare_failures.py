"""A failure while the drain prepares one record — its shard geometry, or the strings of a
``token_ids`` record (``token_text``, ``prompt_text``) — fails the drain like a failed write,
and loses nothing uncounted: that record, its text records, the rest of its entry, of its
slot and of the staged rows are each counted 'drain failed', once, and every token position
the model handed the drain (the strings' positions too) is in a pack in the store or counted
lost. Before, such a failure escaped the drain's cut of the slot: the rest of the entry and
of the slot went uncounted, and a failure among staged decode rows counted the current step
as lost although part of it had been written.

The ledger is tests/test_drain_failure_staged.py's, with the text records added: one
``token_text`` per ``token_ids`` position, one ``prompt_text`` per prefill position.
"""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest

from dmi.capture import TPShard, attach
from dmi.capture._token_text import PROMPT_TEXT, TOKEN_TEXT
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, verify_pack
from dmi.storage.errors import CaptureError, DrainError
from tests._models import left_padded_batch, tiny
from tests.test_drain_failure_staged import _assert_drain_failed, _assert_every_position_accounted, _Ledger
from tests.test_token_text import word_tokenizer

DECODE_STEPS = 8  # max_new_tokens=9: the prefill, then 8 decode steps, staged 4 at a time


def _count_texts(cap, ledger: _Ledger) -> None:
    """Add to ``ledger.produced`` the text records made beside each ``token_ids`` entry."""
    submit = cap.ring._on_submit

    def counting_submit(slot):
        for e in slot.entries:
            if e.hook == "token_ids":
                hooks = (TOKEN_TEXT,) if e.plan.phase == "decode" else (TOKEN_TEXT, PROMPT_TEXT)
                ledger.produced.update((s.request_id, hook, e.layer, p) for s in e.plan.spans for hook in hooks
                                       for p in range(s.start, s.start + s.n))
        submit(slot)
    cap.ring._on_submit = counting_submit


def _capture(store, catalog, *, hooks="resid_post", fail=None, calls=2, **options):
    """Generate ``calls`` times until the drain fails; ``fail(cap)`` breaks something once attached."""
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    with pytest.raises(DrainError) as raised:
        with attach(model, hooks=hooks, store=store, catalog=catalog, model_id="m", decode_chunk_steps=4,
                    writer_options={"max_records": 6, "codec": "raw"}, **options) as cap:
            ledger = _Ledger(cap)
            _count_texts(cap, ledger)
            if fail is not None:
                fail(cap)
            for _ in range(calls):
                cap.generate(ids, attention_mask=mask, max_new_tokens=DECODE_STEPS + 1, do_sample=False)
    return cap, ledger, raised.value


def _assert_counted(store, cap, ledger, error, losses, produced_hooks) -> None:
    """Every position stored or counted lost once, 'drain failed' (or 'step interrupted'), in ``records_lost``, the
    catalog's losses and the error's message; and the ledger saw the hooks it should."""
    assert {hook for _, hook, _, _ in ledger.produced} == produced_hooks
    _assert_every_position_accounted(store, ledger)
    _assert_drain_failed(cap, ledger, losses, error)
    assert str(error).endswith("reason 'drain failed')")


def _run(tmp_path, **options):
    """:func:`_capture` into a fresh store and chDB catalog: the store, capture, ledger, error,
    and the catalog's losses."""
    store = LocalPackStore(tmp_path / "packs")
    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        cap, ledger, error = _capture(store, catalog, **options)
        losses = catalog.losses(model_id="m").to_pylist()
    return store, cap, ledger, error, losses


def _stored_keys(store) -> list:
    return [entry.meta.key for pack_id in store.list_packs() for entry in verify_pack(store, pack_id).records]


# -- the shard geometry ---------------------------------------------------------------------

@pytest.mark.parametrize("encode_threads", [1, 2])
def test_a_record_that_does_not_fit_the_tp_layout_counts_the_rest(tmp_path, encode_threads):
    """A real case: a ``tp_layout`` placing rank 1's ``mlp_post`` at offset 24 of 48 on a model
    that is not sharded (each rank holds the whole ``mlp_post``; attach takes the user's
    layout as given), so the drain's shard geometry for the first record (the prefill's first
    request) raises ``CaptureError``: nothing of ``mlp_post`` is stored, all of it is counted.
    Rank 1 does not write the replicated ``resid_post``."""
    store, cap, ledger, error, losses = _run(tmp_path, hooks="resid_post mlp_post", tp_rank=1, tp_size=2,
                                             tp_layout={"mlp_post": TPShard(axis=1, offset=24, full=48)},
                                             encode_threads=encode_threads)
    assert isinstance(error.__cause__, CaptureError)
    assert "a record of shape (7, 48) does not fit the layout" in str(error.__cause__)
    _assert_counted(store, cap, ledger, error, losses, {"mlp_post"})
    assert _stored_keys(store) == [] and cap.stats["records"] == 0


class _LayoutFailsAt:
    """The session's TP layout, whose shard geometry raises at its ``at``-th call. A stand-in:
    a real layout fails for every record of a hook or for none (the shapes of one hook differ
    only in tokens), so only a fake reaches a failure among the staged decode rows."""

    def __init__(self, layout, at: int):
        self.layout, self.at, self.calls = layout, at, 0

    def shard(self, hook, shape):
        self.calls += 1
        if self.calls == self.at:
            raise CaptureError(f"hook {hook!r}: a record of shape {shape} does not fit the layout")
        return self.layout.shard(hook, shape)


# shard calls: the prefill's 3 requests x 3 layers (calls 1-9), then every 4 decode steps the
# staged rows: one record per request and layer (calls 10-18 for the first 4 steps)
@pytest.mark.parametrize(("name", "at"), [("prefill entry", 2), ("staged decode rows", 14)])
def test_a_shard_geometry_that_fails_counts_the_rest(tmp_path, name, at):
    def fail(cap):
        cap.drain.ctx.layout = _LayoutFailsAt(cap.drain.ctx.layout, at)
    store, cap, ledger, error, losses = _run(tmp_path, fail=fail)
    assert str(error.__cause__) == "hook 'resid_post': a record of shape (4, 32) does not fit the layout"
    _assert_counted(store, cap, ledger, error, losses, {"resid_post"})
    assert len(_stored_keys(store)) == cap.stats["records"] == at - 1  # those before the failing one only


# -- the strings of a token_ids record ------------------------------------------------------

class _DecodeFailsOn:
    """A user's tokenizer whose ``decode`` fails on one id (a custom tokenizer with a hole in
    its vocabulary, as a SentencePiece model raises 'piece id is out of range'): listing its
    vocabulary works, so ``attach`` takes it; the prompt holding ``bad`` fails on the drain."""

    def __init__(self, bad: int):
        self.tokenizer, self.bad = word_tokenizer(), bad

    def __len__(self) -> int:
        return len(self.tokenizer)

    def convert_ids_to_tokens(self, ids):
        return self.tokenizer.convert_ids_to_tokens(ids)

    def decode(self, ids, **options):
        if self.bad in ids:
            raise ValueError(f"piece id {self.bad} is out of range")
        return self.tokenizer.decode(ids, **options)


def _second_prompts_id() -> int:
    """An id in the second request's prompt and in no other prompt."""
    ids, mask = left_padded_batch()
    others = set(ids[0][mask[0] == 1].tolist()) | set(ids[2][mask[2] == 1].tolist())
    return next(i for i in ids[1][mask[1] == 1].tolist() if i not in others)


@pytest.mark.parametrize("encode_threads", [1, 2])
def test_a_tokenizer_whose_decode_fails_counts_the_rest(tmp_path, encode_threads):
    """A real tokenizer failure: the second request's prompt text. Its ``token_ids`` and
    ``token_text`` records are written (and the first request's); its ``prompt_text``, the
    third request's records and everything after are counted."""
    bad = _second_prompts_id()
    store, cap, ledger, error, losses = _run(tmp_path, tokenizer=_DecodeFailsOn(bad), encode_threads=encode_threads)
    assert str(error.__cause__) == f"piece id {bad} is out of range"
    _assert_counted(store, cap, ledger, error, losses, {"resid_post", "token_ids", TOKEN_TEXT, PROMPT_TEXT})
    first_call = sorted({request_id for request_id, _, _, _ in ledger.produced})[:3]  # ids count up
    lost = collections.Counter(key.hook for key, _ in ledger.lost
                               if key.phase == "prefill" and key.request_id in first_call)
    assert lost == {"token_ids": 1, TOKEN_TEXT: 1, PROMPT_TEXT: 2, "resid_post": 3 * 3}


class _TokenRecordFailsAt:
    """The session's token strings, whose ``token_text`` payload raises at its ``at``-th call. A
    stand-in: the payload is a few NumPy gathers over a table built at ``attach`` (an id past
    the tokenizer reads as ``None``), so it fails on no id — only where memory runs out."""

    def __init__(self, texts, at: int):
        self.texts, self.at, self.calls = texts, at, 0

    def token_record(self, ids):
        self.calls += 1
        if self.calls == self.at:
            raise MemoryError("cannot allocate the token text payload")
        return self.texts.token_record(ids)

    def prompt_record(self, ids):
        return self.texts.prompt_record(ids)


# token_record calls: one per token_ids record — the prefill's 3 requests (calls 1-3), then
# every 4 decode steps one per request (calls 4-6 for the first 4 steps)
@pytest.mark.parametrize(("name", "at", "texts_lost"), [("prefill entry", 2, {TOKEN_TEXT, PROMPT_TEXT}),
                                                       ("staged decode rows", 5, {TOKEN_TEXT})])
def test_a_token_text_payload_that_fails_counts_the_rest(tmp_path, name, at, texts_lost):
    def fail(cap):
        cap.drain.texts = _TokenRecordFailsAt(cap.drain.texts, at)
    store, cap, ledger, error, losses = _run(tmp_path, fail=fail, tokenizer=word_tokenizer())
    assert str(error.__cause__) == "cannot allocate the token text payload"
    _assert_counted(store, cap, ledger, error, losses, {"resid_post", "token_ids", TOKEN_TEXT, PROMPT_TEXT})
    stored = _stored_keys(store)
    ids = [key for key in stored if key.hook == "token_ids"]
    assert len(ids) == at  # the failing record's token_ids was written: its strings failed after it
    without_text = [key for key in ids if replace(key, hook=TOKEN_TEXT) not in stored]
    assert len(without_text) == 1
    assert {key.hook for key, _ in ledger.lost if replace(key, hook="token_ids") == without_text[0]} == texts_lost
