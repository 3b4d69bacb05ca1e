"""``dmi capture`` driven the way a newcomer or an adversary would: phases that capture nothing
of the run, a blank model id, prompts that are not UTF-8, empty or longer than the model's
position table, a schedule that skips requests. Each refusal is one ``dmi: error:`` line with
exit 2, made before the first forward, so no earlier batch is left stored; the request ids
printed are those with records."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import dmi
from dmi.cli import main

NEXT = "(0: a scoring pass, 1: a prefill, N: a prefill and N - 1 decode steps)"


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _models(home) -> list[str]:
    with dmi.open(home=home) as store:
        return [m.model_id for m in store.models()]


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory):
    """Two tiny GPT-2 directories (a learned table of 64 positions): one whose byte tokenizer
    prepends ``<s>``, one whose tokenizer gives the empty prompt no token at all."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dmi._models import byte_tokenizer

    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=259,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0))
    dirs = {}
    for name, bos in (("bos", True), ("nobos", False)):
        model.save_pretrained(root / name)
        tokenizer = byte_tokenizer()
        if not bos:
            tokenizer._tokenizer.post_processor = None
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-new-tokens", "2", "--phases", "forward"],
     "--phases forward, none of which this run produces: --max-new-tokens 2 runs a prefill and decode steps "
     "(phases prefill, decode); change --phases or --max-new-tokens " + NEXT),
    (["--max-new-tokens", "0", "--phases", "prefill,decode"],
     "--phases prefill,decode, none of which this run produces: --max-new-tokens 0 runs one scoring pass "
     "(phase forward); change --phases or --max-new-tokens " + NEXT),
    (["--max-new-tokens", "1", "--phases", "decode"],
     "--phases decode, none of which this run produces: --max-new-tokens 1 runs a prefill alone "
     "(phases prefill); change --phases or --max-new-tokens " + NEXT),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be at least 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--model-id", "   "], "--model-id is blank (only whitespace); give a model id with a visible character, "
                            "or leave --model-id out"),
])
def test_contradicting_flags_are_refused_before_the_store_opens(tmp_path, flags, message):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "hi", "--home", str(home), *flags)
    assert (rc, out, err) == (2, "", f"dmi: error: {message}\n")
    assert not home.exists()


def test_a_plan_whose_phases_the_run_never_produces_is_refused(tmp_path):
    plan = tmp_path / "gen.yaml"
    plan.write_text("version: 1\nmodel: tiny-llama\nschedule: {phases: [prefill, decode]}\n")
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--plan", str(plan), "--prompt", "hi", "--max-new-tokens", "0", "--home", str(home))
    assert (rc, out, err) == (2, "", f"dmi: error: the plan {plan} captures phases prefill, decode, none of which "
                                     "this run produces: --max-new-tokens 0 runs one scoring pass (phase forward); "
                                     "change schedule.phases or --max-new-tokens " + NEXT + "\n")
    assert not home.exists()


def test_a_forward_among_generation_phases_still_captures(tmp_path):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "2",
                        "--phases", "prefill,forward", "--home", str(home), "--json", "-q")
    assert (rc, err) == (0, "")
    assert len(json.loads(out)["request_ids"]) == 1


def test_stdin_bytes_that_are_not_utf8_are_refused_by_prompt(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\udcff\udcfe bad\n"))
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompts-file", "-", "--batch-size", "1",
                        "--home", str(home), "-q")
    assert (rc, out, err) == (2, "", "dmi: error: prompt 2 is not UTF-8 text (byte 0xff cannot be read); "
                                     "give prompts as UTF-8\n")
    assert _models(home) == []


def test_a_prompts_file_that_is_not_utf8_is_refused_by_line_before_the_store_opens(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"hello\nw\xe9rld\n")
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompts-file", str(prompts), "--home", str(home))
    assert (rc, out, err) == (2, "", f"dmi: error: {prompts}: not UTF-8 text: byte 0xe9 on line 2 cannot be "
                                     "read; save the prompts as UTF-8\n")
    assert not home.exists()


def test_an_empty_prompt_is_refused_before_the_batches_ahead_of_it_are_stored(tmp_path, gpt2_dirs):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", gpt2_dirs["nobos"], "--prompt", "ab", "--prompt", "",
                        "--batch-size", "1", "--max-new-tokens", "2", "--home", str(home), "-q")
    assert (rc, out, err) == (2, "", "dmi: error: prompt 2 is empty: the tokenizer gives it no token; "
                                     "remove it or give it some text\n")
    assert _models(home) == []


@pytest.mark.parametrize(("prompt_chars", "new", "message"), [
    (60, "16", "prompt 1 is 61 tokens and --max-new-tokens 16 feeds 15 more: 76 positions, past the model's 64 "
               "(n_positions in its config); shorten the prompt or lower --max-new-tokens"),
    (64, "0", "prompt 1 is 65 tokens: 65 positions, past the model's 64 (n_positions in its config); "
              "shorten the prompt"),
])
def test_a_prompt_past_the_learned_positions_is_refused(tmp_path, gpt2_dirs, prompt_chars, new, message):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", gpt2_dirs["bos"], "--prompt", "a", "--prompt", "a" * prompt_chars,
                        "--batch-size", "1", "--max-new-tokens", new, "--home", str(home), "-q")
    assert (rc, out, err) == (2, "", f"dmi: error: {message.replace('prompt 1', 'prompt 2')}\n")
    assert _models(home) == []


def test_a_prompt_that_just_fits_the_learned_positions_is_captured(tmp_path, gpt2_dirs):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", gpt2_dirs["bos"], "--prompt", "a" * 48, "--max-new-tokens", "16",
                        "--home", str(home), "--json", "-q")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    with dmi.open(home=home) as store:
        tokens = store.tokens(result["model_id"], result["request_ids"][0])
    assert tokens.positions == tuple(range(64))


def test_the_request_ids_printed_are_those_stored(tmp_path):
    home = tmp_path / "home"
    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "a", "--prompt", "b", "--prompt", "c",
                        "--request-stride", "2", "--max-new-tokens", "0", "--home", str(home), "--json", "-q")
    assert (rc, err) == (0, "")
    result = json.loads(out)
    run = result["run_id"]
    assert result["request_ids"] == [f"{run}-000000", f"{run}-000002"]
    with dmi.open(home=home) as store:
        assert [r.request_id for r in store.requests("tiny-llama")] == result["request_ids"]


def test_a_misspelled_hook_is_refused_with_the_nearest_name(tmp_path):
    from dmi.capture import GROUPS, HOOKS

    rc, out, err = _cli("capture", "--model", "tiny-llama", "--prompt", "hi", "--hooks", "resid_pots",
                        "--home", str(tmp_path / "home"))
    assert (rc, out) == (2, "")
    assert err == (f"dmi: error: unknown hook or group 'resid_pots' (did you mean 'resid_post'?); valid hooks: "
                   f"{', '.join(HOOKS)}; groups: {', '.join(GROUPS)}\n")


def test_attn_pattern_without_eager_attention_names_the_flag(tmp_path, gpt2_dirs):
    rc, out, err = _cli("capture", "--model", gpt2_dirs["bos"], "--prompt", "hi", "--hooks", "attn_pattern",
                        "--home", str(tmp_path / "home"), "-q")
    assert (rc, out) == (2, "")
    assert err == ("dmi: error: 'attn_pattern' needs eager attention, but the model uses 'sdpa' (which never "
                   "materialises the attention weights); pass --attn-implementation eager, or leave attn_pattern "
                   "out (--hooks all_but_patterns)\n")
    rc, out, err = _cli("capture", "--model", gpt2_dirs["bos"], "--prompt", "hi", "--hooks", "attn_pattern",
                        "--attn-implementation", "eager", "--home", str(tmp_path / "home"), "-q")
    assert (rc, err) == (0, "") and len(out.split()) == 1
