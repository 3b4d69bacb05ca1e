"""Publishing at step edges: a reader of a running capture never sees one step published for
some layers and not for others.

The writer seals a pack when it reaches ``max_records``, wherever that falls in a step; the
drain then seals the open pack too once the step's edge is reached, and publishes both. The
ring marks which submitted slots end at a step's edge. Real tiny models, real packs and the
embedded chDB catalog; the check runs after every publish of the session.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import dmi
from dmi.capture._ring import Entry, Ring
from dmi.capture._session import _Publishing

from ._models import left_padded_batch, tiny


def _ends_of_submitted_slots(reservations) -> list[tuple[int, bool]]:
    """Submit what ``reservations`` (a list of steps, each a list of byte sizes) fill into a ring
    of 64-byte slots whose drain never frees one: each submitted slot's index and ``ends_step``."""
    ring = Ring(8, 64, pin=False)
    submitted = []
    ring.connect(lambda slot: submitted.append((slot.index, slot.ends_step)))
    for step in reservations:
        for nbytes in step:
            slot, offset = ring.reserve(nbytes)
            slot.entries.append(Entry("resid_post", 0, offset, nbytes, torch.uint8, nbytes, None))
        ring.end_step()
    ring.submit()
    return submitted


def test_a_slot_a_step_filled_in_its_middle_is_marked_so_and_every_other_ends_a_step():
    # step 1 fills slot 0 and goes on in slot 1 (submitted at its end); step 2 stays in the
    # open slot 2 (the drain holds two slots), which step 3's first region no longer fits
    assert _ends_of_submitted_slots([[48, 48], [16], [60]]) == [(0, False), (1, True), (2, True), (3, True)]


def _published_ends(store, model_id: str, features: list[tuple[str, int]]) -> dict[str, set[int]]:
    """For each published request: the tokens its ``features`` (hook, layer) end at, 0 for one
    with no record published yet."""
    ends: dict[str, dict[tuple[str, int], int]] = defaultdict(dict)
    for entry in store.catalog.find_records(model_id):
        key = entry.meta.key
        feature_ends = ends[key.request_id]
        feature = (key.hook, key.layer)
        feature_ends[feature] = max(feature_ends.get(feature, 0), key.start_token + key.n_tokens)
    return {rid: {by_feature.get(f, 0) for f in features} for rid, by_feature in ends.items()}


@pytest.mark.parametrize(("max_records", "slot_bytes"), [(5, 32 << 20), (7, 32 << 20), (13, 32 << 20), (7, 1024)])
def test_every_publish_holds_each_step_whole_for_every_layer(tmp_path, monkeypatch, max_records, slot_bytes):
    """Packs of a few records seal in the middle of steps (every layer, two hooks, three
    requests a step; with 1 KiB slots, a step also spans several slots); after every publish each published request's layers end at one token, and the
    records read back are the model's own hidden states, bit for bit."""
    model, (ids, mask) = tiny("llama"), left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    store = dmi.open(home=tmp_path)
    uneven = []
    publish = _Publishing.publish

    features = [(hook, layer) for hook in ("resid_post", "mlp_out") for layer in range(model.config.num_hidden_layers)]

    def checked(self, descriptors):
        publish(self, descriptors)
        uneven.extend((k, v) for k, v in _published_ends(store, "m", features).items() if len(v) != 1)

    monkeypatch.setattr(_Publishing, "publish", checked)
    with store:
        with store.capture(model, model_id="m", hooks=["resid_post", "mlp_out"], decode_chunk_steps=1,
                           slot_bytes=slot_bytes, writer_options={"max_records": max_records}) as cap:
            rids, _ = cap.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert cap.stats["packs_published"] >= 4
        assert uneven == []
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              output_hidden_states=True, return_dict_in_generate=True).hidden_states
        inner = range(len(want[0]) - 2)  # the last hidden state is after the final norm: not resid_post
        for i, rid in enumerate(rids):
            got = store.get_internal("m", rid, "resid_post", layers=list(inner))
            prompt = torch.stack([want[0][layer + 1][i, pads[i]:] for layer in inner])
            decode = torch.stack([torch.cat([step[layer + 1][i] for step in want[1:]]) for layer in inner])
            assert torch.equal(got, torch.cat([prompt, decode], dim=1))
