"""What a new user reads: shell-quoted suggestions, plurals, help that matches the docs and
the defaults, an indexable capture result, one model id per model directory, a public
``dmi.load_model``, and a status line on a terminal while a model loads.

Real parts throughout: the built-in model, a real store, a model directory written with
``save_pretrained``, and a real pseudo-terminal for the status line.
"""

from __future__ import annotations

import os
import pty
import selectors
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dmi
from dmi._human import plural
from dmi.capture import derive_model_id
from dmi.cli import SCORING_HELP, main

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny():
    return dmi.load_model("tiny-llama")


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny):
    """One request of model ``it's`` (an id that needs quoting in a shell)."""
    path = tmp_path_factory.mktemp("wording-home")
    enc = tiny.tokenizer(["quote me"], return_tensors="pt")
    with dmi.open(home=path) as store, dmi.capture(tiny.model, store=store, model_id="it's") as cap:
        with torch.inference_mode():
            result = cap.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=2, do_sample=False)
        # the result is the pair (request_ids, output): unpacked and indexed alike
        request_ids, output = result
        assert (result[0], result[1], result[-1], len(result)) == (request_ids, output, output, 2)
        assert result[:] == (request_ids, output) and tuple(result) == result[:]
        assert torch.equal(result[1], result.sequences)
    return path


def test_suggested_commands_are_shell_quoted(home, capsys):
    assert main(["show", "it's", "no-such-request", "--home", str(home)]) == 1
    err = capsys.readouterr().err
    assert "list them with `dmi requests 'it'\"'\"'s'`" in err, err
    assert "(1 request;" in err


def test_an_unknown_run_points_at_the_command_that_lists_runs(home, capsys):
    assert main(["requests", "it's", "--run", "no-such-run", "--home", str(home)]) == 1
    err = capsys.readouterr().err
    assert "has no run 'no-such-run' (list runs with `dmi runs 'it'\"'\"'s'`)" in err, err


def test_counts_agree_with_their_nouns(home, capsys):
    assert (plural(1, "pack"), plural(0, "pack"), plural(2, "layer")) == ("1 pack", "0 packs", "2 layers")
    assert plural(1500, "record", lambda n: f"{n / 1000:.1f}k") == "1.5k records"
    assert main(["verify", "--home", str(home)]) == 0
    assert " in 1 pack (" in capsys.readouterr().out


def test_capture_says_one_request(tmp_path, capsys):
    argv = ["capture", "--model", "tiny-llama", "--prompt", "one", "--max-new-tokens", "0", "--home", str(tmp_path)]
    assert main(argv) == 0
    assert "captured 1 request, " in capsys.readouterr().out


def test_help_matches_the_defaults_and_the_docs(capsys):
    from dmi._home import DEFAULT_HOME

    with pytest.raises(SystemExit):
        main(["capture", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"else {DEFAULT_HOME})" in text  # --home names the real default
    assert SCORING_HELP in text
    assert SCORING_HELP in " ".join((REPO / "docs" / "cli.md").read_text().split())


def test_a_model_directory_has_one_id_however_it_is_spelled(tmp_path, tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    real = tmp_path / "models" / "m"
    tiny.model.save_pretrained(real)
    (tmp_path / "link").symlink_to(tmp_path / "models")
    monkeypatch.chdir(tmp_path / "models")
    spellings = ["./m", "m/", str(real), str(tmp_path / "link" / "m")]
    ids = {derive_model_id(AutoModelForCausalLM.from_pretrained(s)) for s in spellings}
    assert ids == {os.path.realpath(real)}


def test_load_model_is_public():
    assert "load_model" in dmi.__all__ and dmi.load_model is dmi._models.load_model
    for needle in ("dmi._models", "dmi.load_model"):
        assert (needle in (REPO / "docs" / "quickstart.md").read_text()) == (needle == "dmi.load_model")


def _stderr_on_a_terminal(argv: list[str], home: Path) -> str:
    """Run ``dmi ARGV`` with stderr on a pseudo-terminal (stdout a pipe); what the terminal got.

    The terminal is watched with a selector, not ``select.select``: the suite's process may hold
    descriptors numbered past select's 1024 by the time this runs."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMI_")}
    proc = subprocess.Popen([sys.executable, "-m", "dmi.cli", *argv, "--home", str(home)], stdout=subprocess.PIPE,
                            stderr=follower, env=env)
    os.close(follower)
    seen = b""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(leader, selectors.EVENT_READ)
            while selector.select(timeout=240):
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the terminal closed: every writer has exited
                    break
                if not chunk:
                    break
                seen += chunk
            else:  # silent for 240 s
                proc.kill()
    except BaseException:
        proc.kill()
        raise
    finally:
        proc.communicate(timeout=240)
        os.close(leader)
    assert proc.returncode == 0, seen
    return seen.decode(errors="replace")


@pytest.mark.parametrize("command", [["capture", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "1"],
                                     ["demo"]])
def test_a_status_line_shows_while_the_model_loads(tmp_path, command):
    shown = _stderr_on_a_terminal(command, tmp_path / "on-a-tty")
    assert "\rloading model tiny-llama ...\r\x1b[K" in shown, shown
    assert "loading model" not in _stderr_on_a_terminal([*command, "-q"], tmp_path / "quiet")
