"""``dmi export``: the loader's selection written as shard files from the command line.

The store is the loader tests' (``tests/test_loader.py``: real packs from a PackWriter,
published into a real chDB catalog), written once per module. The commands run in one
subprocess through ``dmi.cli.main`` (``tests/test_cli.py``'s batch: a process per command
would cost seconds each, and chDB serves one directory per process); the files they write
are read back here and compared, bit for bit, with the batches ``store.loader`` yields for
the same options. Bad arguments must each end in one ``dmi: error:`` line, no traceback.
"""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import dmi
from dmi.storage import PackStore, PackWriter
from dmi.storage.records import GLOBAL_LAYER, RecordKey
from tests.test_cli import _BATCH, _env
from tests.test_loader import ALL, ALL_R1, R1, _write

pytestmark = pytest.mark.slow

GOOD = {
    "shuffled": ["--hooks", "resid_post,mlp_out", "--layers", "1", "--runs", "r1", "--batch-size", "7",
                 "--shuffle-buffer", "16", "--seed", "3", "--with-tokens"],
    "filtered": ["--layers=-2:", "--format", "npy", "--dtype", "float64", "--no-shuffle", "--layout", "concat",
                 "--where", "phase = %(p)s AND request_id IN %(ids)s", "--param", "p=prefill",
                 "--param", 'ids=["q01", "q02"]', "--batch-size", "4", "--json"],
    "share": ["--layers", "0", "--epoch", "1", "--rank", "1", "--world-size", "2", "--batch-size", "5",
              "--seed", "2", "--format", "pt", "--phases", "prefill,forward"],
}
"""Each good case's flags; the loader options they must equal are in ``LOADER``."""

LOADER = {
    "shuffled": dict(hooks=["resid_post", "mlp_out"], layers=[1], runs=["r1"], batch_size=7, shuffle_buffer=16,
                     seed=3, with_tokens=True),
    "filtered": dict(layers=[1, 2], dtype=torch.float64, shuffle=False, layout="concat", batch_size=4,
                     where="phase = %(p)s AND request_id IN %(ids)s", params={"p": "prefill", "ids": ("q01", "q02")}),
    "share": dict(layers=[0], rank=1, world_size=2, batch_size=5, seed=2, phases=["prefill", "forward"]),
}


def _bad(out: Path, blocker: Path) -> dict[str, tuple[list[str], int, str]]:
    """Each case: argv after ``export``, the exit status, a piece of the one error line."""
    m = ["m", "-o", str(out / "never")]
    return {
        "layer_not_held": ([*m, "--layers", "5"], 1, "holds layers [0, 1, 2] of resid_post"),
        "layers_past": ([*m, "--layers", "1:9"], 1, "asks for [3, 4, 5, 6, 7, 8]"),
        "layer_not_held_by_a_hook": ([*m, "--hooks", "resid_post,mlp_out", "--layers", "0"], 1,
                                     "holds layers [0, 1, 2] of resid_post, layers [1] of mlp_out; "
                                     "--layers 0 asks for [0] of mlp_out, which were not captured"),
        "layers_text": ([*m, "--layers", "x"], 2, "cannot read layers 'x'"),
        "hook": ([*m, "--hooks", "no_such_hook"], 2, "unknown hook 'no_such_hook'"),
        "model": (["no-such-model", "-o", str(out / "never")], 1, "no model 'no-such-model' in the catalog at"),
        "model_layers": (["no-such-model", "-o", str(out / "never"), "--layers", "0"], 1,
                         "'no-such-model' holds no records of resid_post"),
        "param_no_equals": ([*m, "--where", "phase = %(p)s", "--param", "p"], 2, "write NAME=VALUE"),
        "param_twice": ([*m, "--where", "phase = %(p)s", "--param", "p=a", "--param", "p=b"], 2,
                        "--param p given twice"),
        "param_missing": ([*m, "--where", "phase = %(p)s"], 2, "names the parameter 'p'"),
        "where_escapes": ([*m, "--where", "1); DROP TABLE x; SELECT (1"], 2, "closes a parenthesis"),
        "where_column": ([*m, "--where", "no_such_column > 1"], 1, "UNKNOWN_IDENTIFIER"),
        "global_layers": ([*m, "--hooks", "logits", "--layers", "0"], 2, "logits: global hooks have no layers"),
        "not_aligned": ([*m, "--hooks", "resid_post,mlp_out", "--layers", "1"], 1,
                        "not aligned; narrow the selection (runs=, layers=, where=; on the command line --runs, "
                        "--layers, --where)"),
        "not_empty": (["m", "-o", str(blocker.parent)], 2, "is not empty"),
        "output_is_a_file": (["m", "-o", str(blocker)], 2, "cannot create the export directory"),
        "npy_bfloat16": (["m", "-o", str(out / "bf16"), "--format", "npy", "--dtype", "bfloat16"], 2,
                         "numpy cannot hold"),
        "format": ([*m, "--format", "csv"], 2, "invalid choice: 'csv'"),
        "epoch": ([*m, "--epoch", "-1"], 2, "epoch must be an int >= 0"),
        "batch_size": ([*m, "--batch-size", "0"], 2, "batch_size must be an int >= 1"),
        "rank_alone": ([*m, "--rank", "1"], 2, "world_size"),
        "no_output": (["m"], 2, "-o/--output"),
    }


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """The loader tests' records and one global ``logits`` record, published; the catalog closed
    again for the subprocess."""
    home = tmp_path_factory.mktemp("export-home")
    with dmi.open(home=home) as store:
        descriptors = []
        with PackWriter(store.packs, max_records=10, on_seal=descriptors.append) as writer:
            _write(writer)
            writer.append(RecordKey("m", "r1", "q00", "logits", GLOBAL_LAYER, 0, 3, phase="prefill"), torch.zeros(3, 5))
        with store.catalog.publisher("export-test") as publisher:
            publisher.publish(descriptors)
    return home


@pytest.fixture(scope="module")
def damaged_packs(home, tmp_path_factory) -> tuple[Path, str, int]:
    """The packs copied with one payload byte of one ``r2`` layer-0 record flipped: the copy,
    the damaged pack id and the record's token count."""
    copy = tmp_path_factory.mktemp("export-damaged") / "packs"
    shutil.copytree(home / "packs", copy)
    with dmi.open(home=home) as store:
        victim = store.catalog.select_records("m", run_ids="r2", hooks="resid_post", layers=[0])[0]
    path = copy / PackStore.local(copy).location(victim.pack_id).rsplit("/", 1)[-1]
    data = bytearray(path.read_bytes())
    data[victim.payload.offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return copy, victim.pack_id, victim.meta.key.n_tokens


@pytest.fixture(scope="module")
def ran(home, damaged_packs, tmp_path_factory) -> dict[str, dict]:
    """Every command of this module in one subprocess: name → rc, stdout, stderr (and ``out``)."""
    out = tmp_path_factory.mktemp("export-out")
    blocker = out / "taken" / "a-file"
    blocker.parent.mkdir()
    blocker.write_text("not a directory")
    copy, _, _ = damaged_packs
    catalog = f"chdb://{home / 'catalog'}"
    argvs = {name: ["export", "m", "-o", str(out / name), *flags, "--home", str(home)] for name, flags in GOOD.items()}
    argvs |= {f"bad_{name}": ["export", *argv, "--home", str(home)]
              for name, (argv, _, _) in _bad(out, blocker).items()}
    damaged = ["export", "m", "--layers", "0", "--batch-size", "5", "--catalog", catalog, "--packs", str(copy)]
    argvs["damaged"] = [*damaged, "-o", str(out / "damaged")]
    argvs["damaged_skip"] = [*damaged, "-o", str(out / "damaged_skip"), "--on-error", "skip", "--json"]
    argvs["damaged_skip_drop_last"] = [*damaged, "-o", str(out / "damaged_skip_drop_last"), "--on-error", "skip",
                                       "--json", "--no-shuffle", "--shuffle-buffer", "10", "--batch-size", "45",
                                       "--drop-last"]
    argvs["damaged_skip_drop_last_text"] = [arg for arg in argvs["damaged_skip_drop_last"] if arg != "--json"]
    argvs["damaged_skip_drop_last_text"][argvs["damaged_skip_drop_last_text"].index("-o") + 1] += "_text"
    proc = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps(list(argvs.values())), capture_output=True,
                          text=True, env=_env(home), timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = dict(zip(argvs, json.loads(proc.stdout)))
    for result in results.values():
        result["out"] = out
    return results


def _expected(home: Path, name: str, epoch: int = 0) -> list:
    with dmi.open(home=home) as store:
        loader = store.loader("m", **LOADER[name])
        loader.set_epoch(epoch)
        return list(loader)


def _ok(result: dict) -> dict:
    assert result["rc"] == 0 and "Traceback" not in result["stderr"], result
    return result


def test_shards_hold_the_loader_s_batches_with_their_tokens(home, ran):
    result = _ok(ran["shuffled"])
    root = result["out"] / "shuffled"
    manifest = json.loads((root / "manifest.json").read_text())
    expected = _expected(home, "shuffled")
    shards = [load_file(root / s["file"])["x"] for s in manifest["shards"]]
    assert len(shards) == len(expected) > 1
    assert all(torch.equal(got, x) for got, (x, _) in zip(shards, expected))
    index = pq.read_table(root / "tokens.parquet").to_pylist()
    assert [(r["run_id"], r["request_id"], r["position"]) for r in index] == [t for _, ts in expected for t in ts]
    assert sorted((r["run_id"], r["request_id"], r["position"]) for r in index) == sorted(ALL_R1)
    assert manifest["features"] == ["resid_post.1", "mlp_out.1"] and manifest["rows"] == len(ALL_R1)
    assert result["stdout"].splitlines() == [
        f"exported {len(ALL_R1)} rows x resid_post.1, mlp_out.1 (float32, epoch 0) as {len(expected)} shards, "
        f"{_human_bytes(sum(s['bytes'] for s in manifest['shards']))}, to {root}",
        f"manifest: {root / 'manifest.json'}",
    ]


def _human_bytes(n: int) -> str:
    from dmi._human import human_bytes

    return human_bytes(n)


def test_layers_from_the_end_a_filter_with_parameters_npy_and_json(home, ran):
    result = _ok(ran["filtered"])
    summary = json.loads(result["stdout"])
    expected = _expected(home, "filtered")
    root = Path(summary["directory"])
    arrays = [np.load(root / f"shard-{i:05d}.npy") for i in range(summary["shards"])]
    assert len(arrays) == len(expected) and all(a.dtype == np.float64 for a in arrays)
    assert all(torch.equal(torch.from_numpy(a), x) for a, x in zip(arrays, expected))
    prefill = sum(n for r, n in R1 if r in ("q01", "q02"))
    assert summary["rows"] == prefill and summary["features"] == ["resid_post.1", "resid_post.2"]
    assert summary["dtype"] == "torch.float64" and summary["skipped_rows"] == 0
    assert summary["bytes"] == sum(os.path.getsize(root / f"shard-{i:05d}.npy") for i in range(summary["shards"]))


def test_an_epoch_and_a_rank_s_share(home, ran):
    _ok(ran["share"])
    root = ran["share"]["out"] / "share"
    manifest = json.loads((root / "manifest.json").read_text())
    expected = _expected(home, "share", epoch=1)
    shards = [torch.load(root / s["file"]) for s in manifest["shards"]]
    assert len(shards) == len(expected) and all(torch.equal(a, b) for a, b in zip(shards, expected))
    assert (manifest["epoch"], manifest["rank"], manifest["world_size"]) == (1, 1, 2)
    share = len({t for t in ALL if t[0] == "r2"} | {("r1", r, p) for r, n in R1 for p in range(n)})
    assert manifest["rows"] == share - share // 2  # rank 1 holds the second, larger half


@pytest.mark.parametrize("case", list(_bad(Path("/o"), Path("/b/f"))))
def test_a_bad_argument_is_one_error_line(ran, case):
    result = ran[f"bad_{case}"]
    _, code, needle = _bad(Path("/o"), Path("/b/f"))[case]
    assert "Traceback" not in result["stderr"], result["stderr"]
    assert result["rc"] == code, result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmi: error: ") and needle in lines[0], result["stderr"]
    assert not (result["out"] / "never").exists()


def test_a_damaged_pack_stops_the_export_with_its_name(ran, damaged_packs):
    _, pack_id, _ = damaged_packs
    result = ran["damaged"]
    assert result["rc"] == 1 and "Traceback" not in result["stderr"]
    [line] = result["stderr"].strip().splitlines()
    assert line.startswith("dmi: error: ") and pack_id in line
    assert not (result["out"] / "damaged" / "manifest.json").exists()  # no manifest: not a finished export


def test_skip_mode_says_and_records_what_it_left_out(ran, damaged_packs):
    _, pack_id, n_tokens = damaged_packs
    result = _ok(ran["damaged_skip"])
    summary = json.loads(result["stdout"])
    assert summary["skipped_rows"] == n_tokens and summary["rows"] == len(ALL) - n_tokens
    [damage] = summary["damaged_records"]
    assert pack_id in damage
    manifest = json.loads(Path(summary["manifest"]).read_text())
    assert manifest["skipped_rows"] == n_tokens and manifest["damaged_records"] == [damage]
    assert summary["dropped_rows"] == manifest["dropped_rows"] == 0
    [line] = result["stderr"].strip().splitlines()
    assert line.startswith(f"dmi: skipped {n_tokens} rows of 1 damaged record")


def test_skip_mode_records_damage_after_the_last_batch_and_what_drop_last_left_out(ran, damaged_packs):
    """Unshuffled, in windows of 10 rows, drop_last reads 90 of the 93 rows: two batches of 45
    places, the damaged record's rows (in the window of rows 80-89) skipped in their places, so
    the second batch is shorter by them. Its damage must still be recorded, and the 3 rows
    drop_last left out counted."""
    _, pack_id, n_tokens = damaged_packs
    result = _ok(ran["damaged_skip_drop_last"])
    summary = json.loads(result["stdout"])
    assert (summary["rows"], summary["skipped_rows"], summary["dropped_rows"]) == (90 - n_tokens, n_tokens, 3)
    assert summary["rows"] + summary["skipped_rows"] + summary["dropped_rows"] == len(ALL)
    [damage] = summary["damaged_records"]
    assert pack_id in damage
    manifest = json.loads(Path(summary["manifest"]).read_text())
    assert (manifest["skipped_rows"], manifest["dropped_rows"], manifest["damaged_records"]) == (n_tokens, 3, [damage])
    assert result["stderr"].startswith(f"dmi: skipped {n_tokens} rows of 1 damaged record")
    said = _ok(ran["damaged_skip_drop_last_text"])["stdout"]
    assert f"exported {90 - n_tokens} rows" in said and "left out 3 rows that did not fill a whole batch (--drop-last)" in said


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_that_fails_part_way_leaves_no_file(tmp_path, monkeypatch):
    """The file is written under a temporary name that here leads to /dev/full (every write:
    no space left): a named error that says nothing was written, and no file at all."""
    import dmi._export as export
    from dmi._export import export_tensor
    from dmi.storage.errors import ExportError

    def to_dev_full(out):
        temp = f"{out}.part"
        os.symlink("/dev/full", temp)
        return open(temp, "wb"), temp

    monkeypatch.setattr(export, "_open_temp", to_dev_full)
    target = tmp_path / "x.safetensors"
    with pytest.raises(ExportError, match=r"could not write .*x\.safetensors \(No space left on device\); nothing was "
                                        "written") as raised:
        export_tensor(torch.zeros(1000, 8), target, name="x")
    assert isinstance(raised.value, OSError) and isinstance(raised.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []
    target.write_bytes(b"before")  # a file already there is left as it was
    with pytest.raises(ExportError, match="nothing was written"):
        export_tensor(torch.zeros(1000, 8), target, name="x")
    assert list(tmp_path.iterdir()) == [target] and target.read_bytes() == b"before"


def test_progress_is_drawn_on_a_terminal(home, tmp_path):
    """stderr on a pseudo-terminal (where a user sees it): the bar reaches every shard."""
    leader, follower = pty.openpty()
    drawn = bytearray()
    reader = threading.Thread(target=_drain, args=(leader, drawn))
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "dmi.cli", "export", "m", "-o", str(tmp_path / "x"), "--layers",
                               "0", "--batch-size", "10", "--home", str(home)], stderr=follower,
                              stdout=subprocess.PIPE, text=True, env=_env(home), timeout=240)
    finally:
        os.close(follower)
        reader.join(timeout=30)
        os.close(leader)
    shards = -(-len(ALL) // 10)
    assert proc.returncode == 0
    assert f"exporting [{'#' * 30}] {shards}/{shards}" in drawn.decode()
    assert proc.stdout.startswith(f"exported {len(ALL)} rows")


def test_help_names_every_flag(capsys):
    from dmi.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: dmi export")
    for flag in ("--home", "--format", "--hooks", "--layers", "--runs", "--phases", "--where", "--param", "--dtype",
                 "--layout", "--normalize", "--with-tokens", "--batch-size", "--drop-last", "--seed", "--no-shuffle",
                 "--shuffle-buffer", "--epoch", "--rank", "--world-size", "--on-error", "--json"):
        assert flag in out, flag


def _drain(fd: int, into: bytearray) -> None:
    """Read a pty until its other end is closed (so the writer never blocks on a full buffer)."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every writer closed the terminal
            return
        if not chunk:
            return
        into.extend(chunk)
