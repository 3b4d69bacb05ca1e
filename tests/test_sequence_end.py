"""A generated sequence ends with the step that feeds it its end-of-sequence token: transformers
runs the finished row on, fed padding, until every row of the batch is done, and those steps
are no part of the request — they are not recorded. A forward from a filled cache is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from dmi.capture import attach
from dmi.storage.errors import UnsupportedGenerationError

from ._models import MemoryWriter, left_padded_batch, tiny

NEW = 6


def _tokens(writer, rid) -> torch.Tensor:
    parts = sorted((k.start_token, d) for k, d in writer.by("token_ids", rid))
    return torch.cat([d for _, d in parts])


def _resid(writer, rid, layer) -> torch.Tensor:
    parts = sorted((k.start_token, d) for k, d in writer.by("resid_post", rid) if k.layer == layer)
    return torch.cat([d for _, d in parts])


def _eos_of_row_1(model, ids, mask) -> int:
    """A token the model generates for row 1 as its second new token and for no row before:
    made the end-of-sequence token, row 1 ends there and the others run on."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    new = out[:, ids.shape[1]:]
    eos = int(new[1, 1])
    assert eos not in new[:, :1].flatten().tolist() and eos not in new[0].tolist(), "pick another model seed"
    return eos


@pytest.mark.parametrize("direct", [False, True], ids=["session generate", "model.generate inside attach"])
def test_a_row_s_records_end_at_the_step_fed_its_end_token(direct):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    eos = _eos_of_row_1(model, ids, mask)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0,
                  output_hidden_states=True, return_dict_in_generate=True)
    writer = MemoryWriter()
    with attach(model, hooks="resid_post token_ids", writer=writer, decode_chunk_steps=1) as cap:
        if direct:
            out = model.generate(ids, attention_mask=mask, **kwargs)
            rids = sorted({k.request_id for k, _, _ in writer.records})
        else:
            rids, out = cap.generate(ids, attention_mask=mask, **kwargs)
    pads = (mask == 0).sum(1).tolist()
    prompt = ids.shape[1]
    assert out.sequences[1, prompt + 1] == eos and (out.sequences[1, prompt + 2:] == 0).all()  # padding fed on
    assert out.sequences[0, prompt:].ne(eos).all() and len(out.hidden_states) == NEW
    for i, rid in enumerate(rids):
        fed = 2 if i == 1 else NEW - 1  # new tokens fed back; row 1's second is its end token
        assert torch.equal(_tokens(writer, rid).flatten(), out.sequences[i, pads[i]:prompt + fed])
        assert max(k.step for k, _ in writer.by("token_ids", rid)) == fed
        for layer in range(model.config.num_hidden_layers - 1):  # the last hidden state HF returns is normed
            want = torch.cat([out.hidden_states[0][layer + 1][i, pads[i]:]]
                             + [out.hidden_states[s][layer + 1][i, -1:] for s in range(1, fed + 1)])
            assert torch.equal(_resid(writer, rid, layer), want), (rid, layer)


def test_without_an_end_token_every_step_is_recorded():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    model.generation_config.eos_token_id = None
    writer = MemoryWriter()
    with attach(model, hooks="token_ids", writer=writer, decode_chunk_steps=1) as cap:
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    pads = (mask == 0).sum(1).tolist()
    for i, rid in enumerate(rids):
        assert torch.equal(_tokens(writer, rid).flatten(), out[i, pads[i]:ids.shape[1] + NEW - 1])


def test_a_forward_from_a_filled_cache_is_refused_before_the_model_runs():
    model = tiny("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cache = DynamicCache()
    model(ids[:, :4], cache=cache, use_cache=True)
    writer = MemoryWriter()
    with attach(model, hooks="resid_post", writer=writer) as cap:
        with pytest.raises(UnsupportedGenerationError, match="cache that already holds 4 token"):
            cap.forward(ids[:, 4:], cache=cache, use_cache=True)
        assert cap.stats["forwards"] == 0
    assert writer.records == []
