"""A generated row's records end where ``generate``'s own stopping criteria end the row — its
end-of-sequence token, a stop string, a criterion of the caller's — with the step that feeds
it the token after which they marked it done; transformers runs it on (fed padding where an
end token is set) until the batch ends, and those steps are not recorded. Where this
transformers has no ``_get_stopping_criteria`` to watch, the end-token rule holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import StoppingCriteria, StoppingCriteriaList

from dmi._models import byte_tokenizer
from dmi.capture import attach
from dmi.capture._generate import SequenceEnds

from ._models import MemoryWriter, left_padded_batch, tiny

NEW = 6
STOP_AFTER = 2  # row 1 ends with its second new token, the others run on
TOKENIZER = byte_tokenizer()


class _StopRowOne(StoppingCriteria):
    """A criterion of the caller's: row 1 is done once the sequences are ``length`` long."""

    def __init__(self, length: int):
        self.length = length
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[1] = input_ids.shape[1] >= self.length
        return done


def _model_and_end_token():
    """The model, its batch, and a token it generates for row 1 as its second new token and
    for no row before (nor for rows 0 and 2 at all): a one-letter stop string or an end token."""
    model = tiny("llama", vocab_size=len(TOKENIZER))
    ids, mask = left_padded_batch()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    new = out[:, ids.shape[1]:]
    end = int(new[1, STOP_AFTER - 1])
    before = new[1, :STOP_AFTER - 1].tolist() + new[0].tolist() + new[2].tolist()
    assert end not in before and TOKENIZER.decode([end]).isalpha(), "pick another model seed"
    return model, ids, mask, end


def _ending(how: str, end: int, prompt: int) -> tuple[dict, _StopRowOne | None]:
    """``generate``'s keywords that end row 1 after its ``STOP_AFTER``-th new token, ``how``."""
    if how == "end token":
        return dict(eos_token_id=end), None
    if how == "stop string":
        return dict(eos_token_id=TOKENIZER.eos_token_id, stop_strings=[TOKENIZER.decode([end])],
                    tokenizer=TOKENIZER), None
    criterion = _StopRowOne(prompt + STOP_AFTER)
    eos = TOKENIZER.eos_token_id if how == "own criterion" else None  # None: the row is fed no padding
    return dict(eos_token_id=eos, stopping_criteria=StoppingCriteriaList([criterion])), criterion


def _records(writer, hook, rid, layer=None) -> torch.Tensor:
    parts = sorted((k.start_token, d) for k, d in writer.by(hook, rid) if layer is None or k.layer == layer)
    return torch.cat([d for _, d in parts])


@pytest.mark.parametrize("direct", [False, True], ids=["session generate", "model.generate"])
@pytest.mark.parametrize("how", ["end token", "stop string", "own criterion", "own criterion, no end token"])
def test_a_row_s_records_end_with_the_step_fed_the_token_its_criteria_stopped_at(how, direct):
    model, ids, mask, end = _model_and_end_token()
    prompt = ids.shape[1]
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    stop, _ = _ending(how, end, prompt)
    plain = model.generate(ids, attention_mask=mask, **kwargs, **stop)
    stop, criterion = _ending(how, end, prompt)
    writer = MemoryWriter()
    with attach(model, hooks="resid_post token_ids", writer=writer, decode_chunk_steps=1) as cap:
        if direct:
            out = model.generate(ids, attention_mask=mask, **kwargs, **stop)
            rids = sorted({k.request_id for k, _, _ in writer.records})
        else:
            rids, out = cap.generate(ids, attention_mask=mask, **kwargs, **stop)
    assert torch.equal(out.sequences, plain.sequences) and len(out.hidden_states) == NEW  # generate ran as without DMI
    if stop["eos_token_id"] is not None:  # row 1 was stopped: fed padding since
        assert (out.sequences[1, prompt + STOP_AFTER:] == 0).all()
    if criterion is not None:
        assert criterion.calls == NEW  # the caller's criterion, asked once per new token
    pads = (mask == 0).sum(1).tolist()
    for i, rid in enumerate(rids):
        fed = STOP_AFTER if i == 1 else NEW - 1  # new tokens fed back; row 1's last is the one it stopped at
        assert torch.equal(_records(writer, "token_ids", rid).flatten(), out.sequences[i, pads[i]:prompt + fed])
        assert max(k.step for k, _ in writer.by("token_ids", rid)) == fed
        for layer in range(model.config.num_hidden_layers - 1):  # the last hidden state HF returns is normed
            want = torch.cat([out.hidden_states[0][layer + 1][i, pads[i]:]]
                             + [out.hidden_states[s][layer + 1][i, -1:] for s in range(1, fed + 1)])
            assert torch.equal(_records(writer, "resid_post", rid, layer), want), (rid, layer)


def test_the_model_s_stopping_criteria_are_its_own_again_after_the_call():
    model, ids, mask, end = _model_and_end_token()
    with attach(model, hooks="token_ids", writer=MemoryWriter()) as cap:
        cap.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=end)
        assert "_get_stopping_criteria" not in vars(model)
    assert "_get_stopping_criteria" not in vars(model)


def test_without_criteria_to_watch_a_row_ends_where_it_is_fed_an_end_token():
    """A transformers without ``_get_stopping_criteria`` (or a call that never asks for
    criteria): the rows whose fed token is an end token have ended, the others run on."""
    ends = SequenceEnds(frozenset({7, 9}))
    with ends.watching(nn.Linear(1, 1)):
        fed = torch.tensor([[5, 7], [5, 8], [5, 9]])
        assert ends.ended_rows(fed) == [0, 2]
        assert ends.ended_rows(None) == []
    assert SequenceEnds(frozenset()).ended_rows(fed) == []


class _Generating(nn.Module):
    """Stands in for a model whose ``generate`` asks ``_get_stopping_criteria`` for its criteria."""

    def _get_stopping_criteria(self, *args, **kwargs):
        return StoppingCriteriaList([_StopRowOne(3)])


def test_criteria_seen_decide_over_the_end_token_rule():
    """Once generate's criteria have given a verdict, it alone ends rows (an end token among
    them), accumulated step by step: a row once done stays ended."""
    ends, model = SequenceEnds(frozenset({7})), _Generating()
    fed = torch.tensor([[5, 7], [5, 8], [5, 9]])
    with ends.watching(model):
        criteria = model._get_stopping_criteria()
        assert criteria(fed, None).tolist() == [False, False, False]
        assert ends.ended_rows(fed) == []
        assert criteria(torch.cat([fed, fed[:, -1:]], 1), None).tolist() == [False, True, False]
        assert ends.ended_rows(fed) == [1]
        criteria(fed, None)
        assert ends.ended_rows(fed) == [1]
    assert "_get_stopping_criteria" not in vars(model)
