"""Token windows and last-N selection at their edges, with decode coalescing and a lossy codec:
every selected position is stored exactly once, at the position its record says, and each
record's error fields are what its stored values lost against ``output_hidden_states``."""

from __future__ import annotations

import pytest
import torch

from dmi.capture import Schedule, attach
from dmi.reader import read_records
from dmi.storage import PackStore, read_pack_descriptor

from ._models import left_padded_batch, tiny

N_NEW = 5
LENGTHS = (7, 2, 4)


def selected(schedule: Schedule, real: int, ran: int) -> list[int]:
    """The positions ``schedule`` keeps of a request with ``real`` prompt tokens that ran ``ran``."""
    keep = set(range(ran))
    if schedule.last_tokens is not None:
        keep -= set(range(max(0, real - schedule.last_tokens)))
    if schedule.positions is not None:
        lo, hi = schedule.positions
        keep &= set(range(lo, ran if hi is None else hi))
    return sorted(keep)


@pytest.mark.parametrize("schedule", [
    Schedule(last_tokens=2, positions=(3, 8)),  # both: the prompt's last 2 and a window into decode
    Schedule(last_tokens=50),  # more than any prompt holds: every token
    Schedule(positions=(9, 12)),  # past every prompt: decode tokens only, some requests none
    Schedule(last_tokens=4, positions=(0, 5)),
], ids=["last2-window3to8", "last50", "window9to12", "last4-window0to5"])
@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_each_selected_position_is_stored_once_with_its_exact_loss(tmp_path, schedule, codec):
    model = tiny("llama", dtype=torch.bfloat16)
    ids, mask = left_padded_batch(lengths=LENGTHS)
    pads = (mask == 0).sum(1).tolist()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    assert ref.sequences.shape[1] == ids.shape[1] + N_NEW  # no request stopped early
    store = PackStore.local(tmp_path)
    with attach(model, hooks="resid_post", layers=[1], store=store, model_id="edges", schedule=schedule,
                codec=codec, decode_chunk_steps=3, slot_bytes=1 << 20, ring_slots=4) as cap:
        rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    entries = [e for pack in store.list_packs() for e in read_pack_descriptor(store, pack).records]
    stored = read_records(store, entries)
    for i, rid in enumerate(rids):
        ran = torch.cat([ref.hidden_states[0][2][i, pads[i]:]] + [ref.hidden_states[s][2][i] for s in range(1, N_NEW)])
        positions = []
        for entry, got in zip(entries, stored):
            k = entry.meta.key
            if k.request_id != rid:
                continue
            span = list(range(k.start_token, k.start_token + k.n_tokens))
            positions += span
            diff = got.double() - ran[span].double()
            assert got.dtype == torch.bfloat16 and entry.meta.codec == codec
            assert entry.meta.codec_max_abs_error == diff.abs().max().item()
            assert entry.meta.codec_rel_l2_error == pytest.approx(diff.norm().item() / ran[span].double().norm().item(),
                                                                  rel=1e-12)
        assert sorted(positions) == selected(schedule, LENGTHS[i], LENGTHS[i] + N_NEW - 1)
        assert len(positions) == len(set(positions))
