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
