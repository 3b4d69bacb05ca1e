"""Token selection in the schedule: ``last_tokens=N`` keeps exactly the last N real prompt
tokens of each request (plus decode tokens as the schedule says), records say which positions
they hold, and the kept values are bit-exact against ``output_hidden_states``."""

from __future__ import annotations

import pytest
import torch

from dmi.capture import Schedule, attach
from dmi.reader import assemble, read_records
from dmi.storage.errors import InvalidArgumentError, ReaderError

from ._models import left_padded_batch, tiny

N_NEW = 4
LAST = 3


def read_back(store, catalog, request_id, hook="resid_post", layers=None):
    entries = catalog.find_records("windows", request_id=request_id, hook=hook, layers=layers)
    return entries, assemble(entries, read_records(store, entries))


def test_last_tokens_keeps_the_prompt_suffix_and_every_decode_token(store_and_catalog):
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(7, 2, 6))  # the 2-token prompt is shorter than LAST
    real = mask.sum(1).tolist()
    pads = (mask == 0).sum(1).tolist()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    with attach(model, hooks="resid_post token_ids", layers=[1], store=store, catalog=catalog, model_id="windows",
                schedule=Schedule(last_tokens=LAST)) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    for i, rid in enumerate(rids):
        first = max(0, real[i] - LAST)
        entries, got = read_back(store, catalog, rid)
        prefill = [e.meta.key for e in entries if e.meta.key.phase == "prefill"]
        assert [(k.start_token, k.n_tokens) for k in prefill] == [(first, real[i] - first)]
        hidden = ref.hidden_states
        want = torch.cat([hidden[0][2][i, pads[i] + first:]] + [hidden[s][2][i] for s in range(1, N_NEW)])
        assert got.shape == (1, real[i] - first + N_NEW - 1, model.config.hidden_size)
        assert torch.equal(got[0], want)
        _, toks = read_back(store, catalog, rid, hook="token_ids")
        assert torch.equal(toks, ref.sequences[i, pads[i] + first:-1])


def test_last_tokens_on_a_scoring_forward_with_prompt_phases_only(store_and_catalog):
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    real = mask.sum(1).tolist()
    ref = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    with attach(model, hooks="resid_post", store=store, catalog=catalog, model_id="windows",
                schedule=Schedule(phases=("prefill", "forward"), last_tokens=1)) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    for i, rid in enumerate(rids):
        entries, got = read_back(store, catalog, rid)
        assert {(e.meta.key.start_token, e.meta.key.n_tokens) for e in entries} == {(real[i] - 1, 1)}
        for layer in range(model.config.num_hidden_layers - 1):
            assert torch.equal(got[layer], ref[layer + 1][i, -1:])


def test_a_request_with_skipped_decode_steps_reads_as_a_gap(store_and_catalog):
    """last_tokens with a step stride leaves holes; the reader names them (as for any gap)."""
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch()
    with attach(model, hooks="resid_post", layers=[0], store=store, catalog=catalog, model_id="windows",
                schedule=Schedule(last_tokens=2, step_stride=2), decode_chunk_steps=1) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    with pytest.raises(ReaderError, match="missing between chunks"):
        read_back(store, catalog, rids[0])


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3"])
def test_last_tokens_must_be_a_positive_int(bad):
    with pytest.raises(InvalidArgumentError, match="last_tokens"):
        Schedule(last_tokens=bad)


WINDOW = (2, 6)


def test_a_position_window_keeps_exactly_those_positions_of_prompt_and_decode(store_and_catalog):
    """positions=(2, 6) on a left-padded batch generating 4 tokens: each request keeps real
    positions 2..5 — from its prompt, its decode steps or both, wherever they fall — bit-exact
    against output_hidden_states; logits only where the model materialised them inside the
    window; a request whose prompt alone covers the window records no decode step."""
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(7, 2, 4))
    real = mask.sum(1).tolist()
    pads = (mask == 0).sum(1).tolist()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                         output_hidden_states=True, output_logits=True, return_dict_in_generate=True)
    with attach(model, hooks="resid_post token_ids logits", layers=[1], store=store, catalog=catalog,
                model_id="windows", schedule=Schedule(positions=WINDOW)) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    lo, hi = WINDOW
    for i, rid in enumerate(rids):
        # every position the model ran for request i, in order: its prompt, then one per decode step
        hidden = torch.cat([ref.hidden_states[0][2][i, pads[i]:]] + [ref.hidden_states[s][2][i] for s in range(1, N_NEW)])
        entries, got = read_back(store, catalog, rid)
        assert {e.meta.key.start_token for e in entries} <= set(range(lo, hi))
        assert torch.equal(got[0], hidden[lo:hi])
        _, toks = read_back(store, catalog, rid, hook="token_ids")
        ran = real[i] + N_NEW - 1  # positions the model ran: the last generated token is never fed
        assert torch.equal(toks, ref.sequences[i, pads[i] + lo : pads[i] + min(hi, ran)])
        phases = {e.meta.key.phase for e in entries}
        assert phases == ({"prefill"} if real[i] >= hi else {"decode"} if real[i] <= lo else {"prefill", "decode"})
        # logits exist at the last prompt position and at each decode position: those inside the window
        logit_positions = [p for p in range(real[i] - 1, real[i] - 1 + N_NEW) if lo <= p < hi]
        if not logit_positions:  # the 7-token prompt: its first logits (position 6) are past the window
            assert catalog.find_records("windows", request_id=rid, hook="logits") == []
            continue
        logit_entries, logits = read_back(store, catalog, rid, hook="logits")
        assert [e.meta.key.start_token for e in logit_entries][:1] == logit_positions[:1]
        want = torch.stack([ref.logits[p - (real[i] - 1)][i] for p in logit_positions])
        assert torch.equal(logits.reshape(len(logit_positions), -1), want)


def test_a_position_window_cuts_attention_patterns_on_the_query_axis(store_and_catalog):
    store, catalog = store_and_catalog
    model = tiny("llama", attn="eager")
    ids, mask = left_padded_batch(lengths=(7, 5))
    pads = (mask == 0).sum(1).tolist()
    ref = model(ids, attention_mask=mask, output_attentions=True).attentions
    with attach(model, hooks="attn_pattern", layers=[0], store=store, catalog=catalog, model_id="windows",
                schedule=Schedule(positions=(1, 3))) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    for i, rid in enumerate(rids):
        _, got = read_back(store, catalog, rid, hook="attn_pattern")
        want = ref[0][i, :, pads[i] + 1 : pads[i] + 3, pads[i]:]
        assert torch.equal(got[0], want)


@pytest.mark.parametrize("bad", [(3, 3), (4, 2), (-1, 5), (1.0, 4), (True, 4), 5, (1, 2, 3), ("a", None)])
def test_positions_must_be_a_start_and_a_larger_stop(bad):
    with pytest.raises(InvalidArgumentError, match="positions"):
        Schedule(positions=bad)


def test_positions_without_an_end_keep_everything_from_start(store_and_catalog):
    store, catalog = store_and_catalog
    model = tiny("llama")
    ids, mask = left_padded_batch(lengths=(5,))
    ref = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    with attach(model, hooks="resid_post", layers=[0], store=store, catalog=catalog, model_id="windows",
                schedule={"positions": (3, None)}) as cap:
        rids, _ = cap.forward(ids, attention_mask=mask)
    _, got = read_back(store, catalog, rids[0])
    assert torch.equal(got[0], ref[1][0, 3:])
