"""Capture on CUDA: side-stream copies into pinned slots, bit-exact against the uncaptured run."""

from __future__ import annotations

import pytest
import torch

from dmi.capture import attach

from ._models import MemoryWriter, left_padded_batch, tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def test_cuda_capture_is_bit_exact_and_uses_pinned_slots():
    model = tiny("llama").cuda()
    ids, mask = left_padded_batch()
    ids, mask = ids.cuda(), mask.cuda()
    pads = (mask == 0).sum(1).tolist()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    w = MemoryWriter()
    with attach(model, hooks="resid_pre attn_q", writer=w) as cap:
        assert cap.ring.pin
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 return_dict_in_generate=True)
    assert cap._cuda_side_stream is not None
    assert torch.equal(out.sequences, ref.sequences)
    for i, rid in enumerate(rids):
        recs = sorted((k.start_token, d) for k, d, _ in w.records
                      if k.request_id == rid and k.hook == "resid_pre" and k.layer == 1)
        got = torch.cat([d for _, d in recs])
        want = torch.cat([ref.hidden_states[0][1][i, pads[i]:]] +
                         [ref.hidden_states[s][1][i] for s in range(1, 4)]).cpu()
        assert torch.equal(got, want)
