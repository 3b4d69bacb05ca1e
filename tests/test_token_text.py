"""Token strings and the prompt text are kept with a request when capture knows the tokenizer:
read back by ``Store.tokens`` (with each position's phase), shown by ``dmi show``, on
``dmi plot``'s token axis; they survive a catalog rebuild from the packs and go with
``dmi delete``. Without a tokenizer there are none, and the commands say so.

The tokenizer is built here, in-process, with the ``tokenizers`` library (no download): a
word-level vocabulary with non-ASCII words, a ``$`` (matplotlib's math marker), a tab and a
newline, covering the tiny model's 97 ids so every generated id has a string.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

import dmi
from dmi._plot import axis_token_labels, norm_figure, write_norm_plot
from dmi._tokens import RequestTokens, read_tokens, token_lines
from dmi._values import PhaseSpan
from dmi.capture import PROMPT_TEXT, TOKEN_TEXT, attach, decode_strings
from dmi.capture._token_text import encode_strings
from dmi.cli import NO_TOKENIZER, main
from dmi.storage import PackStore
from dmi.storage.errors import (
    HookSelectionError,
    InvalidArgumentError,
    PackCorruptError,
    RecordNotFoundError,
)

from ._models import GatedWriter, tiny

VOCAB = 97  # tests/_models.SMALL
WORDS = ["<pad>", "<s>", "</s>", "héllo", "wörld", "日本", "a$b$c", "tab\there", "new\nline", "ŉ", "x" * 30]
WORDS += [f"w{i}" for i in range(len(WORDS), VOCAB)]
PROMPTS = [[1, 3, 4, 5, 6], [1, 7, 8], [1, 9, 10, 3, 4, 11]]
N_NEW = 4


def word_tokenizer(size: int = VOCAB):
    """A fast HF tokenizer over the first ``size`` of ``WORDS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS[:size])}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left")


def capture(home, *, tokenizer, model_id="m", hooks="resid_post", prompts=PROMPTS, decode_chunk_steps=32):
    """Generate ``prompts`` (greedy, ``N_NEW`` tokens) and score the first one, captured into ``home``."""
    model = tiny("llama")
    with dmi.open(home=home) as store:
        with store.capture(model, hooks=hooks, model_id=model_id, tokenizer=tokenizer,
                           decode_chunk_steps=decode_chunk_steps) as cap:
            generated = cap.generate(prompts, max_new_tokens=N_NEW, do_sample=False)
            scored = cap.forward(prompts[:1])
            run_id = cap.run_id
    return run_id, generated.request_ids, scored.request_ids[0]


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def home(tmp_path_factory, tok):
    home = tmp_path_factory.mktemp("tokens")
    run_id, generated, scored = capture(home, tokenizer=tok, hooks="resid_post logits")
    capture(home, tokenizer=None, model_id="plain")
    return home, run_id, generated, scored


# ------------------------------------------------------------------------------- capture and read


@pytest.mark.parametrize("chunk", [1, 32])
def test_strings_are_the_tokenizers_strings_of_the_captured_ids(tmp_path, tok, chunk):
    # hooks="resid_post" only: a tokenizer brings token_ids (the strings are cut from its records)
    run_id, generated, scored = capture(tmp_path, tokenizer=tok, decode_chunk_steps=chunk)
    with dmi.open(home=tmp_path) as store:
        for rid, prompt in zip(generated, PROMPTS):
            ids = store.get_internal("m", rid, "token_ids")
            got = store.tokens("m", rid)
            assert isinstance(got, RequestTokens) and (got.model_id, got.run_id, got.request_id) == ("m", run_id, rid)
            assert got.token_ids == tuple(ids.tolist()) and ids[: len(prompt)].tolist() == prompt
            assert got.tokens == tuple(tok.convert_ids_to_tokens(ids.tolist()))
            assert got.tokens[: len(prompt)] == tuple(WORDS[i] for i in prompt)
            assert got.positions == tuple(range(len(prompt) + N_NEW - 1))
            assert got.phases == ("prefill",) * len(prompt) + ("decode",) * (N_NEW - 1)
            assert got.spans == (PhaseSpan("prefill", 0, len(prompt)),
                                 PhaseSpan("decode", len(prompt), len(prompt) + N_NEW - 1))
            assert got.decode_start == len(prompt)
            assert got.prompt_text == tok.decode(prompt, skip_special_tokens=True)
            assert got.at(1) == WORDS[prompt[1]]
        scoring = store.tokens("m", scored)
        assert scoring.phases == ("forward",) * len(PROMPTS[0]) and scoring.decode_start is None
        assert scoring.prompt_text == "héllo wörld 日本 a$b$c"
        # one text record per token_ids record (same key but the hook), one prompt per request
        rows = store.sql("SELECT hook, start_token, n_tokens, step, phase FROM {records} "
                         f"WHERE request_id = '{generated[0]}' AND hook IN ('token_ids', '{TOKEN_TEXT}') "
                         "ORDER BY start_token, hook").to_pylist()
        keys = {h: [(r["start_token"], r["n_tokens"], r["step"], r["phase"]) for r in rows if r["hook"] == h]
                for h in ("token_ids", TOKEN_TEXT)}
        assert keys[TOKEN_TEXT] == keys["token_ids"] and len(keys["token_ids"]) == (1 + (N_NEW - 1 if chunk == 1 else 1))
        prompts = store.sql(f"SELECT request_id, n_tokens, phase FROM {{records}} WHERE hook = '{PROMPT_TEXT}' "
                            "ORDER BY request_id").to_pylist()
        assert [(r["n_tokens"], r["phase"]) for r in prompts] == [
            *((len(p), "prefill") for p in PROMPTS), (len(PROMPTS[0]), "forward")]


def test_ids_past_the_tokenizers_vocabulary_have_no_string(tmp_path):
    small = word_tokenizer(90)  # the model's ids 90..96 have no string in this tokenizer
    capture(tmp_path, tokenizer=small, prompts=[[1, 3, 95, 4]])
    with dmi.open(home=tmp_path) as store:
        rid = store.requests("m")[0].request_id
        got = store.tokens("m", rid)
        assert got.tokens[:4] == ("<s>", "héllo", None, "wörld")
        assert got.tokens == tuple(small.convert_ids_to_tokens(list(got.token_ids)))


def test_strings_are_cut_on_the_drain_thread_with_one_vocabulary_lookup_at_attach(tmp_path, tok):
    calls: list[tuple[str, str]] = []

    class Counting(type(tok)):  # the real tokenizer, its calls noted with the thread making them
        def convert_ids_to_tokens(self, ids, *args, **kwargs):
            calls.append(("convert_ids_to_tokens", threading.current_thread().name))
            return super().convert_ids_to_tokens(ids, *args, **kwargs)

        def decode(self, ids, *args, **kwargs):
            calls.append(("decode", threading.current_thread().name))
            return super().decode(ids, *args, **kwargs)

    counting = Counting(tokenizer_object=tok.backend_tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    capture(tmp_path, tokenizer=counting)
    model_thread = threading.current_thread().name
    assert calls[0] == ("convert_ids_to_tokens", model_thread)  # the whole vocabulary, once, at attach
    assert calls[1:] == [("decode", "dmi-drain")] * (len(PROMPTS) + 1)  # one prompt text per request


def test_a_tokenizer_that_is_not_one_is_refused_before_the_model_is_touched(tmp_path):
    model = tiny("llama")
    store = PackStore.from_uri(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="needs a Hugging Face tokenizer"):
        with attach(model, store=store, tokenizer=object()):
            pass
    with attach(model, store=store) as cap:  # nothing was left attached
        cap.forward([[1, 2, 3]])


class _Listing:
    """Stands in for a tokenizer whose vocabulary listing misbehaves (no real one does)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return 3

    def convert_ids_to_tokens(self, ids):
        if isinstance(self.tokens, Exception):
            raise self.tokens
        return self.tokens

    def decode(self, ids, skip_special_tokens=False):
        return ""


@pytest.mark.parametrize("tokenizer, problem", [
    (_Listing(RuntimeError("vocab file gone")), "cannot list its vocabulary: RuntimeError"),
    (_Listing(["a", 7, "c"]), "gave a token that is not a string: 7"),
])
def test_a_tokenizer_that_cannot_list_its_strings_is_refused_at_attach(tmp_path, tokenizer, problem):
    with pytest.raises(InvalidArgumentError, match=problem):
        with attach(tiny("llama"), store=PackStore.from_uri(str(tmp_path)), tokenizer=tokenizer):
            pass


def test_text_records_are_not_hooks_of_the_model(home):
    home, run_id, generated, _ = home
    with dmi.open(home=home) as store:
        contents = store.contents("m", generated[0])
        assert [h.hook for h in contents.hooks] == ["token_ids", "resid_post", "logits"]
        assert store.requests("m")[0].hooks == ("token_ids", "resid_post", "logits")
        with pytest.raises(HookSelectionError, match="records hold text: read them with Store.tokens"):
            store.get_internal("m", generated[0], TOKEN_TEXT)
        with pytest.raises(RecordNotFoundError, match="it holds: token_ids, resid_post, logits$"):
            store.get_internal("m", generated[0], "attn_out")


def test_an_audit_leaves_the_strings_out(home):
    home, run_id, generated, _ = home
    model = tiny("llama")
    with dmi.open(home=home) as store:
        report = store.audit("m", model=model, request_ids=[generated[1]], record=False)
    assert report.passed
    assert {c.hook for c in report.checks} == {"token_ids", "resid_post", "logits"}


def test_no_tokenizer_no_strings(home, tmp_path, capsys):
    home, *_ = home
    with dmi.open(home=home) as store:
        rid = store.requests("plain")[0].request_id
        assert store.tokens("plain", rid) is None
        assert store.sql(f"SELECT count() AS n FROM {{records}} WHERE model_id = 'plain' "
                         f"AND hook IN ('{TOKEN_TEXT}', '{PROMPT_TEXT}')").to_pylist() == [{"n": 0}]
    assert main(["show", "plain", rid, "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert NO_TOKENIZER in out and "prompt text" not in out
    assert main(["show", "plain", rid, "--json", "--home", str(home)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] is None
    assert main(["plot", "plain", rid, "-o", str(tmp_path / "p.png"), "--home", str(home)]) == 0
    assert NO_TOKENIZER + "; the token axis shows positions" in capsys.readouterr().out
    assert main(["plot", "plain", rid, "-o", str(tmp_path / "p.png"), "--json", "--home", str(home)]) == 0
    assert json.loads(capsys.readouterr().out)["token_labels"] == []


# ------------------------------------------------------------------------------- durability


def test_strings_survive_a_catalog_rebuilt_from_the_packs(tmp_path, tok):
    run_id, generated, scored = capture(tmp_path, tokenizer=tok)
    with dmi.open(home=tmp_path) as store:
        before = [store.tokens("m", rid) for rid in (*generated, scored)]
    shutil.rmtree(tmp_path / "catalog")
    with dmi.open(home=tmp_path) as store:
        assert store.recover()
        after = [store.tokens("m", rid) for rid in (*generated, scored)]
    assert after == before and after[0].prompt_text == "héllo wörld 日本 a$b$c"


def test_strings_go_with_their_run_and_only_theirs(tmp_path, tok):
    kept_run, kept, _ = capture(tmp_path, tokenizer=tok, model_id="keep")
    gone_run, gone, _ = capture(tmp_path, tokenizer=tok, model_id="gone")
    with dmi.open(home=tmp_path) as store:
        kept_tokens = store.tokens("keep", kept[0])
        assert store.tokens("gone", gone[0]).tokens
        gone_packs = {e.pack_id for e in store.catalog.find_records("gone", hook=[TOKEN_TEXT, PROMPT_TEXT])}
    assert main(["delete", "gone", "--yes", "-q", "--home", str(tmp_path)]) == 0
    with dmi.open(home=tmp_path) as store:
        with pytest.raises(RecordNotFoundError):
            store.tokens("gone", gone[0])
        text_rows = store.sql(f"SELECT model_id, count() AS n FROM {{records}} WHERE hook IN "
                              f"('{TOKEN_TEXT}', '{PROMPT_TEXT}') GROUP BY model_id").to_pylist()
        assert store.tokens("keep", kept[0]) == kept_tokens
        assert gone_packs and not gone_packs & set(store.packs.list_packs())  # the files went too
    assert [r["model_id"] for r in text_rows] == ["keep"]


def test_strings_that_do_not_line_up_with_the_ids_are_refused(home):
    # a capture never writes this: the entries are the real ones with one token_text record left out
    home, run_id, generated, _ = home
    with dmi.open(home=home) as store:
        entries = store.catalog.find_records("m", request_id=generated[0], run_id=run_id)
        first_text = next(e for e in entries if e.meta.key.hook == TOKEN_TEXT)
        with pytest.raises(PackCorruptError, match="token strings cover tokens"):
            read_tokens([e for e in entries if e is not first_text], store._read, model_id="m", run_id=run_id,
                        request_id=generated[0])


@pytest.mark.parametrize("payload, problem", [
    (encode_strings(["ab", "c"])[:-1], "a string of 1 bytes"),
    (torch.cat([encode_strings(["ab"]), torch.tensor([0], dtype=torch.uint8)]), "1 bytes after the last string"),
    (torch.cat([encode_strings(["ab"])[:-2], torch.tensor([0xC3, 0x28], dtype=torch.uint8)]), "can't decode"),
    (torch.tensor([1, 0], dtype=torch.uint8), "unpack_from requires"),
    (encode_strings([None])[:4].clone().fill_(255), "a negative string count"),
])
def test_a_payload_that_does_not_parse_is_a_corrupt_pack(payload, problem):
    with pytest.raises(PackCorruptError, match=problem):
        decode_strings(payload, "rec")
    assert decode_strings(encode_strings(["", None, "日本"]), "rec") == ("", None, "日本")


# ------------------------------------------------------------------------------- show and plot


def test_show_prints_the_prompt_text_and_the_token_strings(home, capsys):
    home, run_id, generated, scored = home
    rid = generated[0]
    assert main(["show", "m", rid, "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "prompt text: 'héllo wörld 日本 a$b$c'" in out
    assert "prefill tokens 0-4: '<s>' 'héllo' 'wörld' '日本' 'a$b$c'" in out
    with dmi.open(home=home) as store:
        decoded = store.tokens("m", rid).tokens[5:]
    assert "decode tokens 5-7: " + " ".join(map(repr, decoded)) in out
    assert main(["show", "m", generated[1], "--home", str(home)]) == 0
    assert r"prefill tokens 0-2: '<s>' 'tab\there' 'new\nline'" in capsys.readouterr().out  # one line each
    assert main(["show", "m", rid, "--json", "--home", str(home)]) == 0
    shown = json.loads(capsys.readouterr().out)["tokens"]
    assert shown["prompt_text"] == "héllo wörld 日本 a$b$c" and shown["tokens"][:2] == ["<s>", "héllo"]
    assert shown["phases"] == ["prefill"] * 5 + ["decode"] * (N_NEW - 1)


def test_show_cuts_long_token_lists_and_wraps_them():
    many = RequestTokens("m", "r", "q", "p" * 500, tuple(range(200)), tuple(range(200)),
                         tuple(f"t{i}" for i in range(200)), ("prefill",) * 200)
    lines = token_lines(many)
    assert lines[0].startswith("prompt text: 'ppp") and "(200 more characters)" in "".join(lines)
    text = " ".join(lines)
    assert "'t39' ... (152 more) ... 't192'" in text and "'t40'" not in text and "'t199'" in text
    assert max(map(len, lines)) <= 100


def test_plot_labels_its_token_axis_with_the_strings(home, tmp_path, capsys):
    home, run_id, generated, scored = home
    rid = generated[0]
    assert main(["plot", "m", rid, "-o", str(tmp_path / "p.png"), "--json", "--home", str(home)]) == 0
    drawn = json.loads(capsys.readouterr().out)
    with dmi.open(home=home) as store:
        strings = store.tokens("m", rid).tokens
    assert drawn["token_labels"] == [f"{i}:{t}" for i, t in enumerate(strings)]
    assert drawn["decode_start"] == len(PROMPTS[0])
    # logits: the last prompt position, then one per step, labelled by the tokens at those positions
    assert main(["plot", "m", rid, "--hook", "logits", "-o", str(tmp_path / "l.png"), "--json",
                 "--home", str(home)]) == 0
    assert json.loads(capsys.readouterr().out)["token_labels"] == [
        f"{i}:{t}" for i, t in enumerate(strings[len(PROMPTS[0]) - 1:])]


def test_the_figures_token_axis_holds_the_labels_as_plain_text():
    labels = ["<s>", "a$b$c", "x" * 30, "日本", "e"]
    fig = norm_figure(torch.ones(2, 5), [0, 1], title="t", decode_start=3, token_labels=labels)
    heat = fig.axes[0]
    assert [t.get_text() for t in heat.get_xticklabels()] == ["<s>", "a$b$c", "x" * 11 + "…", "日本", "e"]
    assert list(heat.get_xticks()) == [0, 1, 2, 3, 4]
    assert not any(t.get_parse_math() for t in heat.get_xticklabels())  # '$' is not math
    assert heat.get_xlabel() == "token (dashed: decode starts)"
    assert axis_token_labels(heat)[1] == "1:a$b$c"


def test_a_long_token_axis_labels_every_kth_token_and_the_first_decode_token(tmp_path):
    n, boundary = 400, 301
    labels = [f"t{i}" for i in range(n)]
    fig = norm_figure(torch.ones(2, n), [0, 1], title="t", width=1200, decode_start=boundary, token_labels=labels)
    heat = fig.axes[0]
    ticks = [int(x) for x in heat.get_xticks()]
    step = ticks[1] - ticks[0]
    # 1200 px x 0.4 of it for the heatmap / 12 px per label = 40 labels fit: every 10th token,
    # without 300 and 310 (closer than a step to the first decode token 301), plus 301 itself
    assert step == 10 and ticks == sorted(set(range(0, n, 10)) - {300, 310} | {boundary})
    assert boundary in ticks and [t.get_text() for t in heat.get_xticklabels()][ticks.index(boundary)] == "t301"
    assert all(abs(t - boundary) >= step for t in ticks if t != boundary)
    assert heat.get_xlabel() == f"token (one label every {step}) (dashed: decode starts)"
    with pytest.raises(InvalidArgumentError, match="3 token labels for 400 plotted tokens"):
        write_norm_plot(torch.ones(2, n), [0, 1], tmp_path / "p.png", title="t", token_labels=labels[:3])


def test_dmi_capture_keeps_the_prompt_text(tmp_path, capsys):
    assert main(["capture", "--model", "tiny-llama", "--prompt", "héllo wörld", "--max-new-tokens", "2",
                 "--home", str(tmp_path), "-q"]) == 0
    rid = capsys.readouterr().out.split()[-1]
    with dmi.open(home=tmp_path) as store:
        got = store.tokens("tiny-llama", rid)
    assert got.prompt_text == "héllo wörld"
    assert got.tokens[:3] == ("<s>", "h", "Ã") and got.phases.count("decode") == 1


def test_strings_whose_count_is_not_the_records_token_count_are_refused(home):
    # a capture never writes this: the real records, read back with one text payload short a string
    home, run_id, generated, _ = home
    with dmi.open(home=home) as store:
        entries = store.catalog.find_records("m", request_id=generated[0], run_id=run_id)

        def short_read(selected):
            payloads = store._read(selected)
            first_text = next(i for i, e in enumerate(selected) if e.meta.key.hook == TOKEN_TEXT)
            payloads[first_text] = encode_strings(decode_strings(payloads[first_text], "rec")[:-1])
            return payloads

        with pytest.raises(PackCorruptError, match=r"4 token strings for 5 tokens"):
            read_tokens(entries, short_read, model_id="m", run_id=run_id, request_id=generated[0])


def test_tensor_parallel_ranks_copies_of_the_strings_are_read_once(tmp_path, tok):
    model = tiny("llama")
    with dmi.open(home=tmp_path) as store:
        for rank in (0, 1):  # two ranks of one run, as two TP processes asked for every copy write them
            with store.capture(model, run_id="r", model_id="m", tokenizer=tok, tp_rank=rank, tp_size=2,
                               tp_replicas="all") as cap:
                cap.generate(PROMPTS[:1], max_new_tokens=N_NEW, do_sample=False, request_ids=["q"])
        got = store.tokens("m", "q")
        ranks = {e.meta.key.shard_rank for e in store.catalog.find_records("m", request_id="q", hook=TOKEN_TEXT)}
    assert ranks == {0, 1}
    assert got.positions == tuple(range(len(PROMPTS[0]) + N_NEW - 1))
    assert got.tokens == tuple(tok.convert_ids_to_tokens(list(got.token_ids)))


def _capture_twice(tokenizer, writer, **options) -> dict:
    """Two greedy generates of ``PROMPTS`` (hooks resid_post at layer 0); returns the stats."""
    model = tiny("llama")
    with attach(model, hooks="resid_post", layers=0, writer=writer, tokenizer=tokenizer,
                decode_chunk_steps=1, **options) as cap:
        for _ in range(2):
            cap.generate(PROMPTS, max_new_tokens=N_NEW, do_sample=False)
        writer.gate.set()
    return cap.stats


def test_a_dropped_token_ids_record_counts_its_text_records_as_lost_too(store_and_catalog, tok):
    _, catalog = store_and_catalog
    lossless = GatedWriter()
    lossless.gate.set()
    _capture_twice(tok, lossless)
    dropping = GatedWriter()
    stats = _capture_twice(tok, dropping, ring_slots=1, slot_bytes=1024, drop_policy="drop",
                           catalog=catalog, model_id="m-drop-text")
    # calls x requests x (a prefill's 4 records: resid_post, token_ids, its text, the prompt's text;
    # each decode step's 3: resid_post, token_ids, its text)
    assert len(lossless.records) == 2 * len(PROMPTS) * (4 + (N_NEW - 1) * 3)
    assert stats["records_lost"] > 0
    assert len(dropping.records) + stats["records_lost"] == len(lossless.records)
    losses = catalog.losses(model_id="m-drop-text").to_pylist()
    by_hook = {}
    for row in losses:
        by_hook[row["hook"]] = by_hook.get(row["hook"], 0) + row["count"]
    assert sum(by_hook.values()) == stats["records_lost"]
    assert by_hook[TOKEN_TEXT] == by_hook["token_ids"] and by_hook[PROMPT_TEXT] > 0
    written = [k.hook for k, _, _ in dropping.records]
    for hook in ("token_ids", TOKEN_TEXT, PROMPT_TEXT, "resid_post"):  # each hook: written + lost = lossless
        assert written.count(hook) + by_hook.get(hook, 0) == [k.hook for k, _, _ in lossless.records].count(hook)
