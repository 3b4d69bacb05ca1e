"""``dmi`` as a newcomer meets it: argument errors that point at the right ``--help``, output
paths that cannot be written, sizes and ports out of range, and ``verify``'s count of bad
records when a whole pack is lost.

Parsing errors run in-process (``dmi.cli.main`` exits before any store opens); what needs
a store runs in a subprocess through ``tests.test_cli.batch``, against a store written
directly with ``PackWriter`` and published by ``dmi recover`` (no model, no torch forward).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dmi.cli import main
from dmi.storage.errors import InvalidArgumentError
from tests.test_cli import assert_one_line_error, batch, parsed

LAYERS = (0, 1, 2)


def _usage_error(capsys, argv: list[str]) -> str:
    """The one stderr line of a command argparse refuses (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmi: error: "), lines
    return lines[0]


def test_an_unknown_option_points_at_its_subcommands_help(capsys):
    line = _usage_error(capsys, ["models", "--bogus"])
    assert line == "dmi: error: unrecognized arguments: --bogus (see: dmi models --help)"
    line = _usage_error(capsys, ["requests", "m", "extra"])
    assert line == "dmi: error: unrecognized arguments: extra (see: dmi requests --help)"


def test_a_plot_size_too_large_to_draw_is_refused(capsys):
    line = _usage_error(capsys, ["plot", "m", "r", "--size", "100000x500"])
    assert line == ("dmi: error: argument --size: size 100000x500 is too large (at most 10000x10000 pixels) "
                    "(see: dmi plot --help)")


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_ui_port_out_of_range_is_refused(capsys, port):
    line = _usage_error(capsys, ["ui", "--no-browser", "--port", port])
    assert line.startswith("dmi: error: argument --port: ") and "from 0 to 65535 (see: dmi ui --help)" in line


def _write_store(home: Path) -> str:
    """A published pack of model ``m``: request ``r``, ``resid_post`` at layers 0-2, 3 tokens;
    returns the pack id."""
    from dmi.storage import PackStore, PackWriter, RecordKey

    with PackWriter(PackStore.local(home / "packs")) as writer:
        for layer in LAYERS:
            writer.append(RecordKey("m", "run-1", "r", "resid_post", layer, 0, 3), torch.ones(3, 8) * (layer + 1))
    [recovered] = batch(home, ["recover", "--json"])
    [pack] = parsed(recovered)["recovered"]
    assert pack["records"] == len(LAYERS)
    return pack["pack_id"]


@pytest.fixture(scope="module")
def store_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("newcomer") / "home"
    _write_store(home)
    return home


def test_a_plot_that_cannot_be_written_is_an_argument_error(store_home, tmp_path):
    missing_dir, a_directory, fine = batch(
        store_home,
        ["plot", "m", "r", "-o", str(tmp_path / "no-such-dir" / "p.png")],
        ["plot", "m", "r", "-o", str(tmp_path)],
        ["plot", "m", "r", "-o", str(tmp_path / "p.png"), "--json"],
    )
    assert_one_line_error(missing_dir, 2, f"cannot write {tmp_path / 'no-such-dir' / 'p.png'}: No such file")
    assert_one_line_error(a_directory, 2, f"cannot write {tmp_path}: Is a directory")
    assert parsed(fine)["layers"] == list(LAYERS) and (tmp_path / "p.png").stat().st_size > 0


def test_verify_counts_every_record_of_a_lost_pack(tmp_path):
    """A missing pack is one problem line, but all of its records are bad."""
    home = tmp_path / "home"
    pack_id = _write_store(home)
    (home / "packs" / f"{pack_id}.arrow").unlink()
    [missing] = batch(home, ["verify"])
    assert_one_line_error(missing, 1, f"{len(LAYERS)} bad records in 1 pack")
    assert missing.stdout.splitlines()[1].startswith(f"missing: pack {pack_id}: {len(LAYERS)} records lost")


def test_the_demo_refuses_a_plot_path_before_capturing(tmp_path):
    """The plot path is checked first: a run is not captured and stored only for its plot to fail."""
    from dmi._demo import run_demo

    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("x")
    said: list[str] = []
    store = SimpleNamespace(home=str(tmp_path))  # the check needs no more of the store
    with pytest.raises(InvalidArgumentError) as refused:
        run_demo(store, plot_path=str(in_the_way / "demo.png"), say=said.append)
    assert str(refused.value) == (f"cannot write the plot {in_the_way / 'demo.png'}: cannot make the directory "
                                  f"{in_the_way}: File exists")
    with pytest.raises(InvalidArgumentError) as refused:
        run_demo(store, plot_path=str(tmp_path), say=said.append)
    assert str(refused.value) == f"cannot write the plot {tmp_path}: Is a directory"
    with pytest.raises(InvalidArgumentError) as refused:
        run_demo(store, plot_path=str(tmp_path / "demo.svg"), say=said.append)
    assert str(refused.value) == f"the plot is a PNG image: name it FILE.png, not {str(tmp_path / 'demo.svg')!r}"
    assert said == []  # refused before step 1


def test_audit_names_an_unknown_model_or_run_before_missing_token_ids(store_home):
    """A typo in the model id or ``--run`` says so, like every other command; a known model
    captured without ``token_ids`` still gets the token_ids refusal."""
    unknown_model, unknown_run, no_tokens = batch(
        store_home,
        ["audit", "gpt3", "--model", "tiny-llama"],
        ["audit", "m", "--model", "tiny-llama", "--run", "nope"],
        ["audit", "m", "--model", "tiny-llama"],
    )
    assert_one_line_error(unknown_model, 1, "no model 'gpt3' in the catalog (models: m)")
    assert_one_line_error(unknown_run, 1, "model 'm' has no run 'nope' (list runs with `dmi runs m`)")
    assert_one_line_error(no_tokens, 1, "model 'm' has no requests with token_ids records to audit")


@pytest.mark.parametrize("value", [" ", "\t", "a\nb"])
def test_a_dmi_home_that_names_no_directory_is_refused(monkeypatch, tmp_path, value):
    """A blank ``$DMI_HOME`` used to become a directory named ``' '`` in the working directory."""
    from dmi._home import default_home

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DMI_HOME", value)
    with pytest.raises(InvalidArgumentError) as refused:
        default_home()
    assert str(refused.value) == (f"$DMI_HOME is {value!r}: name a directory, or unset it for the default "
                                  "~/.local/share/dmi")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_dmi_home_is_unset(monkeypatch, tmp_path):
    from dmi._home import default_home

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DMI_HOME", "")
    assert default_home() == str((tmp_path / ".local/share/dmi").resolve())
