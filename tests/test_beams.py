"""Several sequences per prompt: sampled sequences are captured one request each, bit-exact;
beam search is refused before the model runs and stores nothing."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.capture import attach
from dmi.storage.errors import CaptureError, InvalidArgumentError, UnsupportedGenerationError

from ._models import MemoryWriter, left_padded_batch, tiny

N_NEW = 4
PER_PROMPT = 2


def collect(writer, rid, hook, layer):
    recs = sorted((k.start_token, d) for k, d, _ in writer.records
                  if k.request_id == rid and k.hook == hook and k.layer == layer)
    return torch.cat([d for _, d in recs])


def _sample(model, ids, mask, seed, **extra):
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=True,
                          num_return_sequences=PER_PROMPT, return_dict_in_generate=True, **extra)


def _count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_sampled_sequences_are_one_request_each_bit_exact():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    pads = (mask == 0).sum(1).tolist()
    ref = _sample(model, ids, mask, seed=7, output_hidden_states=True)
    w = MemoryWriter()
    with attach(model, hooks="resid_pre resid_post token_ids", writer=w) as cap:
        torch.manual_seed(7)
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=True,
                                 num_return_sequences=PER_PROMPT, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)  # generation unchanged by capture
    assert len(rids) == ids.shape[0] * PER_PROMPT == len(set(rids))
    # the two samples of some prompt differ, so a mix-up of rows would show
    assert any(not torch.equal(out.sequences[2 * i], out.sequences[2 * i + 1]) for i in range(ids.shape[0]))
    embed = model.get_input_embeddings()
    steps = ref.hidden_states
    for row, rid in enumerate(rids):
        pad = pads[row // PER_PROMPT]
        fed = out.sequences[row, pad:-1]  # the prompt, then every generated token but the last
        assert torch.equal(collect(w, rid, "token_ids", -1), fed)
        # independent of generate: the returned sequence's own embeddings
        assert torch.equal(collect(w, rid, "resid_pre", 0), embed(fed).detach())
        for layer in range(model.config.num_hidden_layers - 1):
            want = torch.cat([steps[0][layer + 1][row, pad:]] + [steps[s][layer + 1][row] for s in range(1, N_NEW)])
            assert torch.equal(collect(w, rid, "resid_post", layer), want), (row, layer)


def test_sampled_sequences_take_one_request_id_per_returned_sequence():
    model = tiny("gpt2")
    ids, mask = left_padded_batch(lengths=(5, 3))
    names = ["a0", "a1", "b0", "b1"]
    w = MemoryWriter()
    with attach(model, hooks="token_ids", writer=w) as cap:
        torch.manual_seed(3)
        rids, out = cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True,
                                 num_return_sequences=PER_PROMPT, request_ids=names)
        assert rids == tuple(names)
        cap.flush()
        assert sorted({k.request_id for k, _, _ in w.records}) == names
        with pytest.raises(InvalidArgumentError, match="need 4 distinct request ids"):
            cap.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True,
                         num_return_sequences=PER_PROMPT, request_ids=["a", "b"])


@pytest.mark.parametrize("how", ["keyword", "generation_config"])
def test_beam_search_refused_before_the_model_runs_and_nothing_stored(tmp_path, how):
    model = tiny("llama")
    ids, mask = left_padded_batch()
    forwards = _count_forwards(model)
    kwargs = {"num_beams": 2}
    if how == "generation_config":
        config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
        config.num_beams = 2
        kwargs = {"generation_config": config}
    with dmi.open(home=tmp_path) as store:
        with store.capture(model, hooks="resid_post token_ids", model_id="beams") as cap:
            with pytest.raises(UnsupportedGenerationError, match=r"beam search \(num_beams=2\)"):
                cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, **kwargs)
        assert forwards[0] == 0
        assert cap.stats["records"] == 0 and cap.stats["copies"] == 0
        assert store.models() == []


def test_a_batch_the_call_did_not_announce_is_a_named_error_not_an_index_error(monkeypatch):
    """The last line of defence for a generation mode that changes the batch unannounced. No
    real ``generate`` mode reaches it once beam search is refused, so the test hides the
    sampled sequences from the session (a fake: the only way to produce the case)."""
    import dmi.capture._session as session_module

    monkeypatch.setattr(session_module, "sequences_per_prompt", lambda config, kwargs: 1)
    model = tiny("llama")
    ids, mask = left_padded_batch()
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w) as cap:
        with pytest.raises(CaptureError, match="ran 6 rows for a call of 3 requests"):
            cap.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=True,
                         num_return_sequences=PER_PROMPT)
    assert w.records == []


def test_beam_search_called_on_the_model_directly_inside_the_block_is_refused_too():
    model = tiny("llama")
    ids, mask = left_padded_batch()
    forwards = _count_forwards(model)
    w = MemoryWriter()
    with attach(model, hooks="resid_post", writer=w):
        with pytest.raises(UnsupportedGenerationError, match=r"num_beams=2"):
            model.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, num_beams=2)
        assert forwards[0] == 0
        # sampled sequences through model.generate: each row its own request, as always
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, num_return_sequences=PER_PROMPT)
    assert len({k.request_id for k, _, _ in w.records}) == ids.shape[0] * PER_PROMPT
    assert "generate" not in vars(model)  # detached: the class's own generate again
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2)
    assert out.shape == (ids.shape[0], ids.shape[1] + 2)
