"""Generation capture against plain ``generate``: a left-padded batch whose rows end at different
steps (one row fed its end token early), greedy and seeded sampling, read back through
``Store.tokens`` and ``get_internal`` and compared bit-exactly with ``output_hidden_states``;
and token ids capture refuses before the model runs (a negative id, one past the model's
vocabulary, a bool in a list)."""

from __future__ import annotations

import pytest
import torch

import dmi
from dmi.capture import attach
from dmi.storage.errors import InvalidArgumentError

from ._models import MemoryWriter, left_padded_batch, tiny
from .test_token_text import word_tokenizer

NEW = 5
SEED = 123


def _plain(model, ids, mask, **kwargs):
    """``generate`` without capture, with every step's hidden states."""
    torch.manual_seed(SEED)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                          output_hidden_states=True, **kwargs)


def _expected(out, ids, mask, row: int, eos: int):
    """``(token ids, phases, layer-0 residuals)`` row ``row``'s request should hold: its real prompt
    tokens, then each generated token fed back up to and including the one fed its end token."""
    t = ids.shape[1]
    pad = int((mask[row] == 0).sum())
    new = out.sequences[row, t:].tolist()
    token_ids = out.sequences[row, pad:t].tolist()
    rows = [out.hidden_states[0][1][row, c] for c in range(pad, t)]
    for step in range(1, len(out.hidden_states)):
        if eos in new[:step - 1]:
            break
        token_ids.append(new[step - 1])
        rows.append(out.hidden_states[step][1][row, 0])
    phases = ("prefill",) * (t - pad) + ("decode",) * (len(token_ids) - (t - pad))
    return tuple(token_ids), phases, torch.stack(rows)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "seeded sampling"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_rows_of_a_padded_batch_that_end_early_match_plain_generate(tmp_path, kind, sample):
    model = tiny(kind)
    tok = word_tokenizer()
    ids, mask = left_padded_batch(lengths=(7, 3, 5))
    greedy = _plain(model, ids, mask, do_sample=False).sequences[:, ids.shape[1]:]
    eos = int(greedy[1, 1])  # row 1's second new token (greedy): it ends there, the others run on
    kwargs = dict(do_sample=sample, eos_token_id=eos, **({"top_k": 0} if sample else {}))
    plain = _plain(model, ids, mask, **kwargs)
    with dmi.open(home=tmp_path) as store:
        with store.capture(model, hooks="resid_post", layers=0, model_id="m", tokenizer=tok) as cap:
            torch.manual_seed(SEED)
            result = cap.generate(ids, mask, max_new_tokens=NEW, **kwargs)
        assert torch.equal(result.sequences, plain.sequences)  # capture draws nothing from the RNG
        for row, rid in enumerate(result.request_ids):
            token_ids, phases, resid = _expected(plain, ids, mask, row, eos)
            got = store.tokens("m", rid)
            assert got.token_ids == token_ids and got.phases == phases
            assert got.positions == tuple(range(len(token_ids)))
            assert got.tokens == tuple(tok.convert_ids_to_tokens(list(token_ids)))
            assert got.prompt_text == tok.decode(token_ids[:phases.count("prefill")], skip_special_tokens=True)
            assert torch.equal(store.get_internal("m", rid, "resid_post", layers=0)[0], resid)
        if not sample:  # row 1: its 3 prompt tokens, then its new tokens up to its end token, fed back
            fed = greedy[1].tolist().index(eos) + 1
            assert fed < NEW - 1  # it ended before the call's last step
            assert store.tokens("m", result.request_ids[1]).phases == ("prefill",) * 3 + ("decode",) * fed


NEGATIVE = r"negative token id \(-[13]\)"
PAST_VOCABULARY = r"token id (300|97), past the model's vocabulary of 97 \(ids 0-96\)"


@pytest.mark.parametrize(("prompts", "message"), [
    ([[1, -3, 4]], NEGATIVE),
    ([[5, 6], [-1]], NEGATIVE),
    (torch.tensor([[-1, 5, 6]]), NEGATIVE),
    ([[1, 300, 4]], PAST_VOCABULARY),
    (torch.tensor([[1, 97, 4]]), PAST_VOCABULARY),
], ids=["negative in a list", "negative second prompt", "tensor padded with -1",
        "past the vocabulary in a list", "past the vocabulary in a tensor"])
def test_a_token_id_the_embedding_cannot_hold_is_refused_before_the_model_runs(prompts, message):
    """Refused before any hook runs: the request's ``token_ids`` record is never stored, and the
    capture goes on with the next request as if the refused one had not been asked for."""
    model = tiny("llama")
    assert model.config.vocab_size == 97
    writer = MemoryWriter()
    with attach(model, hooks="token_ids resid_post", layers=0, writer=writer) as cap:
        with pytest.raises(InvalidArgumentError, match=message):
            cap.generate(prompts, max_new_tokens=2, do_sample=False)
        assert cap.stats["forwards"] == 0
        rids, _ = cap.generate([[1, 96, 4]], max_new_tokens=2, do_sample=False)
    assert sorted((k.request_id, k.hook, k.start_token, k.n_tokens) for k, _, _ in writer.records) == [
        (rids[0], "resid_post", 0, 3), (rids[0], "resid_post", 3, 1),
        (rids[0], "token_ids", 0, 3), (rids[0], "token_ids", 3, 1)]


@pytest.mark.parametrize("prompts", [[[True, False]], [[5, torch.tensor(True)]]], ids=["bool", "bool tensor"])
def test_a_bool_in_a_list_prompt_is_not_a_token_id(prompts):
    model = tiny("llama")
    with attach(model, hooks="resid_post", layers=0, writer=MemoryWriter()) as cap:
        with pytest.raises(InvalidArgumentError, match="list of token ids"):
            cap.forward(prompts)
        assert cap.stats["forwards"] == 0


def _gapped_tokenizer():
    """A fast tokenizer whose ids skip 4..9 (``c`` is 10, ``d`` 11; its added ``</s>`` takes the
    first free id, 6): it holds 7 tokens, so ``len`` is 7, yet ids 10 and 11 are its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<s>": 1, "a": 2, "b": 3, "c": 10, "d": 11},
                                     unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", padding_side="left")
    fast.add_special_tokens({"eos_token": "</s>"})
    return fast


def test_ids_past_the_length_of_a_tokenizer_with_gaps_keep_their_strings(tmp_path):
    tok = _gapped_tokenizer()
    assert len(tok) == 7 and tok.convert_tokens_to_ids("</s>") == 6
    with dmi.open(home=tmp_path) as store:
        with store.capture(tiny("llama"), hooks="resid_post", layers=0, model_id="m", tokenizer=tok) as cap:
            rid = cap.forward([[1, 2, 10, 11, 6, 5, 3]]).request_ids[0]
        got = store.tokens("m", rid)
    assert got.token_ids == (1, 2, 10, 11, 6, 5, 3)
    assert got.tokens == ("<s>", "a", "c", "d", "</s>", None, "b")  # 5 lies in the gap: no string
    assert got.prompt_text == "a c d b"
