"""The CLI's building blocks that need no store: argument parsing, human numbers, tables, export, plots."""

from __future__ import annotations

import io
import struct

import pytest
import torch

from dmi import InvalidArgumentError
from dmi._export import export_tensor
from dmi._human import Progress, human_bytes, human_count, human_seconds, render_table
from dmi._plot import token_norms, write_norm_plot
from dmi.capture import MAX_SELECTED_LAYERS
from dmi.cli import _build_parser, main, parse_layers

COMMANDS = ("demo", "capture", "models", "runs", "requests", "show", "get", "sql", "audit", "verify", "recover",
            "delete", "plot", "export")


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk; fails unless the file is a PNG."""
    with open(path, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head[:8]
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dmi {command}")
    assert "--catalog" in out and "--packs" in out and "--home" in out


def test_tabular_commands_offer_json():
    parser = _build_parser()
    for command in COMMANDS:
        args = parser.parse_args([command, *_required(command)])
        assert hasattr(args, "json"), command


def _required(command: str) -> list[str]:
    return {
        "capture": ["--model", "tiny-llama"],
        "requests": ["m"],
        "delete": ["m"],
        "show": ["m", "r"],
        "get": ["m", "r", "h", "-o", "x.pt"],
        "sql": ["SELECT 1"],
        "audit": ["m", "--model", "tiny-llama"],
        "plot": ["m", "r"],
        "export": ["m", "-o", "out"],
    }.get(command, [])


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_parse_layers():
    assert parse_layers(None) is None
    assert parse_layers("all") is None
    assert parse_layers("0:4") == range(0, 4)
    assert parse_layers(":2") == range(0, 2)
    assert parse_layers("2:") == slice(2, None)
    assert parse_layers("3") == [3]
    assert parse_layers("0, 2,5") == [0, 2, 5]
    assert parse_layers("0-3") == [0, 1, 2, 3]  # as `dmi requests` and `dmi show` print a span
    assert parse_layers("4 - 5,7,-1") == [4, 5, 7, -1]
    assert parse_layers("2-2") == [2]
    for text in ("one", "3-1", "1-", "0--1", "1-2-3"):
        with pytest.raises(InvalidArgumentError, match="START:STOP.*FIRST-LAST"):
            parse_layers(text)
    assert parse_layers(f"0-{MAX_SELECTED_LAYERS - 1}") == list(range(MAX_SELECTED_LAYERS))
    for text in (f"0-{MAX_SELECTED_LAYERS}", "0-999999999999", f"0-{MAX_SELECTED_LAYERS - 1},7"):
        with pytest.raises(InvalidArgumentError, match=f"name more than {MAX_SELECTED_LAYERS} layers"):
            parse_layers(text)  # refused before the numbers are listed


def test_human_numbers():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(5 * 1024**3) == "5 GiB"
    assert human_count(999) == "999"
    assert human_count(12_345) == "12.3k"
    assert human_count(2_500_000) == "2.5M"
    assert human_seconds(0.0123) == "12.3 ms"
    assert human_seconds(75) == "1m15s"


def test_table_aligns_numbers_right():
    text = render_table(["name", "n"], [["a", 5], ["bbb", 12345]])
    lines = text.splitlines()
    assert lines[0] == "name  n"
    assert lines[2] == "a         5"
    assert lines[3] == "bbb   12345"


def test_progress_draws_only_when_enabled():
    quiet = io.StringIO()
    with Progress("x", 3, enabled=False, stream=quiet) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with Progress("x", 3, enabled=True, stream=loud) as bar:
        bar.update(3)
    assert "3/3" in loud.getvalue()
    # not a terminal → off by default, so pipes and --json output stay clean
    with Progress("x", 3, stream=io.StringIO()) as bar:
        assert not bar._enabled


@pytest.mark.parametrize("ext", [".safetensors", ".npy", ".pt"])
def test_export_round_trips_exactly(tmp_path, ext):
    tensor = torch.randn(3, 5, 7)[:, ::2]  # non-contiguous on purpose
    path = tmp_path / f"t{ext}"
    assert export_tensor(tensor, path, name="resid_post") == ext
    if ext == ".safetensors":
        from safetensors.torch import load_file

        back = load_file(path)["resid_post"]
    elif ext == ".npy":
        import numpy as np

        back = torch.from_numpy(np.load(path))
    else:
        back = torch.load(path)
    assert torch.equal(back, tensor)


def test_export_refuses_what_it_cannot_store_exactly(tmp_path):
    with pytest.raises(InvalidArgumentError, match="numpy cannot hold torch.bfloat16"):
        export_tensor(torch.zeros(2, dtype=torch.bfloat16), tmp_path / "x.npy", name="h")
    assert not (tmp_path / "x.npy").exists()
    with pytest.raises(InvalidArgumentError, match="use one of"):
        export_tensor(torch.zeros(2), tmp_path / "x.csv", name="h")


def test_plot_is_a_png_of_the_requested_size(tmp_path):
    stacked = torch.zeros(3, 10, 8)
    stacked[1, 4] = 2.0  # one token of layer 1 has norm 2 * sqrt(8)
    norms = token_norms(stacked)
    assert norms.shape == (3, 10) and norms[1, 4].item() == pytest.approx(2 * 8**0.5)
    drawn = write_norm_plot(norms, [4, 5, 6], tmp_path / "p.png", title="t", width=640, height=360)
    assert png_size(tmp_path / "p.png") == (640, 360)
    assert drawn.layers == (4, 5, 6)
    assert drawn.mean_norm_per_layer[1] == pytest.approx(2 * 8**0.5 / 10)
    with pytest.raises(InvalidArgumentError, match="too small"):
        write_norm_plot(norms, [4, 5, 6], tmp_path / "q.png", title="t", width=20, height=20)
    with pytest.raises(InvalidArgumentError, match="do not match"):
        write_norm_plot(norms, [4, 5], tmp_path / "q.png", title="t")
    for name in ("q.svg", "q.jpg", "q"):  # saved as PNG bytes under any of these names before
        with pytest.raises(InvalidArgumentError, match="the plot is a PNG image: name it FILE.png"):
            write_norm_plot(norms, [4, 5, 6], tmp_path / name, title="t")
        assert not (tmp_path / name).exists()
    write_norm_plot(norms, [4, 5, 6], tmp_path / "upper.PNG", title="t")
    assert png_size(tmp_path / "upper.PNG") == (1200, 500)


_PLOT_PAST_THE_FILE_SIZE_LIMIT = """
import os, resource, signal, sys, torch
from dmi._plot import write_norm_plot

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_norm_plot(torch.rand(3, 10) + 1, [0, 1, 2], sys.argv[1], title="t", width=1200, height=500)
except OSError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_plot_that_fails_part_way_leaves_the_old_file_and_no_partial_one(tmp_path):
    """The PNG (tens of KB) is written under a file size limit of 4 KB, in a process of its own:
    a real ``EFBIG`` part-way, as a full disk gives. The error is ``ExportError``; the plot that
    was there is untouched and no temporary file is left (``savefig`` into the path itself left
    4 KB of a PNG under the plot's name)."""
    import subprocess
    import sys

    out = tmp_path / "p.png"
    out.write_bytes(b"the earlier plot")
    run = subprocess.run([sys.executable, "-c", _PLOT_PAST_THE_FILE_SIZE_LIMIT, str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"ExportError could not write {out} (File too large); nothing was written"), run.stdout
    assert out.read_bytes() == b"the earlier plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png"]


def test_an_export_to_a_directory_is_an_argument_error_and_writes_nothing(tmp_path):
    """``write_file`` refuses a directory before it makes its temporary file: the same words for
    ``dmi get -o DIR.npy`` (a directory named like a file) as for the plot."""
    target = tmp_path / "x.npy"
    target.mkdir()
    with pytest.raises(InvalidArgumentError) as info:
        export_tensor(torch.ones(2, 3), target, name="t")
    assert str(info.value) == f"cannot write {target}: Is a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"] and list(target.iterdir()) == []
