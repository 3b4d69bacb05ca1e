"""``Store.delete`` and ``dmi delete`` of a run that holds only losses (capture dropped every
record of it), on embedded chDB.

Run r1 of model m is captured for real; run r3 of m has loss rows and no record (stands in
for a capture that dropped everything). The catalog-level rule (such a run gets a tombstone
naming no pack, which hides its losses) runs on every backend in
``tests/catalog_conformance.py``; here the facade and the command line list it, ask about it
with its loss count, and delete exactly what they asked about.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import dmi
from dmi._human import human_bytes
from tests._models import left_padded_batch
from tests.test_delete import Terminal, model, run_cli  # noqa: F401 - model: the tiny Llama fixture

LOST = (("z", "resid_post", 3, 9), ("y", "logits", -1, 3))  # run r3's losses: 12 records


@pytest.fixture
def home(tmp_path, model):
    """Run r1 of m captured (three requests, four records each), r3 of m only losses."""
    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path) as store:
        with store.capture(model, hooks="resid_post,token_ids", model_id="m", run_id="r1") as cap, \
                torch.inference_mode():
            cap.forward(ids, mask, request_ids=["k1", "k2", "k3"])
        for request, hook, layer, count in LOST:
            store.catalog.record_losses("m", "r3", request, hook, layer, count, "ring full")
    return tmp_path


def stored(home) -> str:
    with dmi.open(home=home) as store:
        (r1,) = store.runs("m")
        return human_bytes(r1.stored_bytes)


def runs_and_losses(capsys, home):
    rc, out, err = run_cli(capsys, "runs", "--json", "--home", str(home))
    assert rc == 0, err
    with dmi.open(home=home) as store:
        lost = [(r["run_id"], r["request_id"], r["count"]) for r in store.catalog.losses("m").to_pylist()]
    return [(r["model_id"], r["run_id"], r["records"]) for r in json.loads(out)], lost


def test_store_delete_deletes_a_loss_only_run_alone_and_with_its_model(home):
    with dmi.open(home=home) as store:
        assert store.catalog.loss_only_runs("m") == {"r3": 12}
        assert store.delete("m", "r3") == dmi.DeleteReport("m", ("r3",), 0, (), ())
        assert store.catalog.losses("m").num_rows == 0 and store.catalog.loss_only_runs("m") == {}
        assert store.delete("m", "r3") == dmi.DeleteReport("m", (), 0, (), ())  # already deleted
        assert [(r.run_id, r.records) for r in store.runs("m")] == [("r1", 12)]
        store.catalog.record_losses("m", "r4", "w", "resid_post", 0, 2, "ring full")
        packs = tuple(sorted({e.pack_id for e in store.catalog.find_records("m", run_id="r1")}))
        assert store.delete("m") == dmi.DeleteReport("m", ("r1", "r4"), 12, packs, ())
        assert store.catalog.losses().num_rows == 0 and store.runs() == []


def test_cli_asks_about_the_loss_only_run_with_its_losses_and_deletes_it_with_the_model(home, capsys, monkeypatch):
    where = ("--home", str(home))
    question = f"delete model m (2 runs): 12 records, {stored(home)} stored; r3: 0 records (12 lost)?"
    rc, out, err = run_cli(capsys, "delete", "m", *where)
    assert (rc, out) == (2, "")
    assert err == f"dmi: error: {question} pass --yes to delete without being asked (stdin is not a terminal)\n"
    assert runs_and_losses(capsys, home) == ([("m", "r1", 12)], [("r3", "y", 3), ("r3", "z", 9)])

    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    rc, out, err = run_cli(capsys, "delete", "m", *where)
    assert (rc, err) == (0, "")
    assert out == f"{question} [y/N] deleted 2 runs of model m (r1, r3): 12 records\nremoved 1 pack file\n"
    assert runs_and_losses(capsys, home) == ([], [])


def test_cli_deletes_the_loss_only_run_alone(home, capsys, monkeypatch):
    where = ("--home", str(home))
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "r3", *where)
    assert (rc, out) == (2, "")
    assert err == ("dmi: error: delete run r3 of model m: 0 records (12 lost)? pass --yes to delete without being "
                   "asked (stdin is not a terminal)\n")

    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "r3", *where)
    assert (rc, err) == (0, "")
    assert out == ("delete run r3 of model m: 0 records (12 lost)? [y/N] deleted 1 run of model m (r3): 0 records\n"
                   "removed 0 pack files\n")
    assert runs_and_losses(capsys, home) == ([("m", "r1", 12)], [])
    rc, out, err = run_cli(capsys, "show", "m", "z", "--run", "r3", *where)
    assert (rc, out, err) == (1, "", "dmi: error: model 'm' has no run 'r3' (list runs with `dmi runs m`)\n")
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "r3", *where)
    assert (rc, out, err) == (0, "nothing to delete: already deleted\nremoved 0 pack files\n", "")


def test_cli_refuses_when_the_loss_only_run_drops_more_while_it_asks(home, capsys, monkeypatch):
    import dmi.cli as cli

    opened = []
    open_store = cli._open_store
    monkeypatch.setattr(cli, "_open_store", lambda args: opened.append(open_store(args)) or opened[-1])

    class Answering(Terminal):
        """A terminal whose user says yes after the capture of r3 dropped one more record (in
        this process, through the command's own store: chDB is one process at a time)."""

        def readline(self, *args):
            opened[0].catalog.record_losses("m", "r3", "z", "resid_post", 3, 1, "ring full")
            return super().readline(*args)

    question = f"delete model m (2 runs): 12 records, {stored(home)} stored; r3: 0 records (12 lost)?"
    monkeypatch.setattr(sys, "stdin", Answering("y\n"))
    rc, out, err = run_cli(capsys, "delete", "m", "--home", str(home))
    assert out == f"{question} [y/N] "
    assert rc == 2 and err == ("dmi: error: not deleted: the selection changed while you were asked (it now holds "
                               "r1 (12 records), r3 (0 records, 13 lost)); run dmi delete again to be asked about "
                               "what it holds now\n")
    assert runs_and_losses(capsys, home) == ([("m", "r1", 12)], [("r3", "y", 3), ("r3", "z", 10)])
