"""``Store.runs``/``dmi runs`` and ``Store.delete``/``dmi delete`` on real captures (embedded chDB).

The catalog-level cases (tombstones, mixed packs, the schema upgrade, SIGKILLed deletes)
run on both backends in ``tests/catalog_conformance.py``; here the same guarantees are
checked through the facade and the command line, with a tiny Llama captured for real.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import dmi
from dmi.cli import main
from dmi.storage import RecordNotFoundError
from tests._models import left_padded_batch, tiny

HOOKS = "resid_post,token_ids"
# Three requests per forward, four records per request (three layers + token_ids), at most
# five records per pack: every run spans several packs, and packs never mix runs.
CAPTURES = [("m", "keep", ["k1", "k2", "k3"]), ("m", "drop", ["d1", "d2", "d3"]), ("other", "drop", ["o1", "o2", "o3"])]


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture
def home(tmp_path, model):
    """A store holding the three runs of ``CAPTURES``, closed again (chDB: one process at a time)."""
    ids, mask = left_padded_batch()
    started = time.time()
    with dmi.open(home=tmp_path) as store:
        for model_id, run_id, requests in CAPTURES:
            with store.capture(model, hooks=HOOKS, model_id=model_id, run_id=run_id,
                               writer_options={"max_records": 5}) as cap, torch.inference_mode():
                cap.forward(ids, mask, request_ids=requests)
    return SimpleNamespace(path=tmp_path, started=started, finished=time.time())


def tensors(store, model_id, run_id, requests):
    return {r: store.get_internal(model_id, r, "resid_post", run_id=run_id) for r in requests}


def packs_of(store, model_id, run_id):
    return {e.pack_id for e in store.catalog.find_records(model_id, run_id=run_id)}


def test_runs_lists_every_run_with_its_totals(home):
    with dmi.open(home=home.path) as store:
        runs = store.runs()
        assert [(r.model_id, r.run_id) for r in runs] == [("m", "drop"), ("m", "keep"), ("other", "drop")]
        for run in runs:
            entries = store.catalog.find_records(run.model_id, run_id=run.run_id)
            assert run.requests == 3 and run.records == len(entries) == 12
            assert run.packs == len({e.pack_id for e in entries}) == 3
            assert run.stored_bytes == sum(e.payload.length for e in entries)
            assert run.raw_bytes == sum(e.meta.raw_size for e in entries)
            assert home.started - 1 <= run.first_sealed_at <= run.last_sealed_at <= home.finished + 1
        assert store.runs("other") == [runs[2]]
        with pytest.raises(RecordNotFoundError, match="no model 'nope'"):
            store.runs("nope")


def test_delete_a_run_hides_it_removes_its_packs_and_keeps_every_other_record(home):
    with dmi.open(home=home.path) as store:
        keep = tensors(store, "m", "keep", CAPTURES[0][2])
        other = tensors(store, "other", "drop", CAPTURES[2][2])
        doomed = packs_of(store, "m", "drop")
        report = store.delete("m", "drop")
        assert report == dmi.DeleteReport("m", ("drop",), 12, tuple(sorted(doomed)), ())
        assert [(r.model_id, r.run_id) for r in store.runs()] == [("m", "keep"), ("other", "drop")]
        with pytest.raises(RecordNotFoundError):
            store.get_internal("m", "d1", "resid_post")
        assert [r.request_id for r in store.requests("m")] == ["k1", "k2", "k3"]
        assert store.sql("SELECT count() AS n FROM {records} WHERE run_id = 'drop' AND model_id = 'm'").to_pylist() == [
            {"n": 0}
        ]
        for request, tensor in tensors(store, "m", "keep", CAPTURES[0][2]).items():
            assert torch.equal(tensor, keep[request])
        for request, tensor in tensors(store, "other", "drop", CAPTURES[2][2]).items():
            assert torch.equal(tensor, other[request])
        on_disk = set(store.packs.list_packs())
        assert not doomed & on_disk
        assert packs_of(store, "m", "keep") | packs_of(store, "other", "drop") == on_disk
        assert store.verify().ok
        assert store.delete("m", "drop") == dmi.DeleteReport("m", (), 0, (), ())  # already deleted
        with pytest.raises(RecordNotFoundError, match="no run 'never'"):
            store.delete("m", "never")


def test_delete_a_whole_model(home):
    with dmi.open(home=home.path) as store:
        other = packs_of(store, "other", "drop")
        report = store.delete("m")
        assert report.run_ids == ("drop", "keep") and report.records == 24 and len(report.packs_removed) == 6
        assert store.catalog.models() == ["other"]
        assert set(store.packs.list_packs()) == other
        with pytest.raises(RecordNotFoundError, match="no model 'nope'"):
            store.delete("nope")


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_runs_and_delete(home, capsys, monkeypatch):
    where = ("--home", str(home.path))
    rc, out, err = run_cli(capsys, "runs", "--json", *where)
    assert rc == 0, err
    assert [(r["model_id"], r["run_id"], r["requests"], r["records"], r["packs"]) for r in json.loads(out)] == [
        ("m", "drop", 3, 12, 3), ("m", "keep", 3, 12, 3), ("other", "drop", 3, 12, 3)
    ]
    rc, out, err = run_cli(capsys, "runs", "other", *where)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:4] == ["model", "run", "first", "(UTC)"] and len(lines) == 3
    assert lines[2].split()[:2] == ["other", "drop"]
    # Without --yes and without a terminal to ask on: refused, nothing deleted.
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "drop", *where)
    assert rc == 2 and err.startswith("dmi: error: delete run drop of model m: 12 records") and "--yes" in err
    # On a terminal it asks; anything but yes keeps the run. (A pytest run has no terminal:
    # a stdin that says it is one stands in for it.)
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "drop", *where)
    assert rc == 2 and out.startswith("delete run drop of model m: 12 records") and "not deleted" in err
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "drop", *where)
    assert (rc, err) == (0, "")
    # (the question, then the answer's newline a terminal would have echoed, then the report)
    assert out.endswith("? [y/N] deleted 1 run of model m (drop): 12 records\nremoved 3 pack files\n")
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "drop", "--yes", "--json", *where)
    assert rc == 0 and json.loads(out) == {"model_id": "m", "run_ids": [], "records": 0, "packs_removed": [],
                                           "packs_kept": []}
    rc, out, err = run_cli(capsys, "runs", "m", "--json", *where)
    assert [r["run_id"] for r in json.loads(out)] == ["keep"]
    rc, out, err = run_cli(capsys, "delete", "nope", "--yes", *where)
    assert rc == 1 and err.startswith("dmi: error: no model 'nope'") and len(err.splitlines()) == 1


KILLED_DELETE = r"""
import os, signal, sys
from dmi.catalog import Catalog
from dmi.cli import main
from dmi.storage import LocalPackStore, PackStore

home, kill_at = sys.argv[1:3]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


# Stand-ins for a power cut at a chosen point: the process really dies by SIGKILL there.
original_delete_runs = Catalog.delete_runs


def delete_runs(self, *args, **kwargs):
    if kill_at == "before-tombstone":
        insert = self._backend.insert
        self._backend.insert = lambda table, data: die() if "deletions" in table else insert(table, data)
    return original_delete_runs(self, *args, **kwargs)


removed = []


def delete_file(self, pack_id):
    if kill_at == "after-tombstone" or (kill_at == "midway" and removed):
        die()
    PackStore.delete(self, pack_id)
    removed.append(pack_id)


Catalog.delete_runs = delete_runs
LocalPackStore.delete = delete_file
main(["delete", "m", "--run", "drop", "--yes", "--home", home])
"""


@pytest.mark.parametrize("kill_at", ["before-tombstone", "after-tombstone", "midway"])
def test_a_killed_dmi_delete_is_all_or_nothing_and_the_next_one_finishes_it(home, kill_at, capsys):
    with dmi.open(home=home.path) as store:
        keep = tensors(store, "m", "keep", CAPTURES[0][2])
        drop = tensors(store, "m", "drop", CAPTURES[1][2])
        doomed = packs_of(store, "m", "drop")
        kept = set(store.packs.list_packs()) - doomed
    proc = subprocess.run([sys.executable, "-c", KILLED_DELETE, str(home.path), kill_at],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    with dmi.open(home=home.path) as store:
        for request, tensor in tensors(store, "m", "keep", CAPTURES[0][2]).items():
            assert torch.equal(tensor, keep[request])
        assert kept <= set(store.packs.list_packs())
        if kill_at == "before-tombstone":
            assert {r: t.shape for r, t in tensors(store, "m", "drop", CAPTURES[1][2]).items()} == {
                r: t.shape for r, t in drop.items()
            }
            assert set(store.packs.list_packs()) == kept | doomed
        else:
            assert [r.run_id for r in store.runs("m")] == ["keep"]
            assert store.recover() == []  # recovery does not bring the deleted run back
            assert [r.run_id for r in store.runs("m")] == ["keep"]
            assert len(doomed & set(store.packs.list_packs())) == (2 if kill_at == "midway" else 3)
    rc, out, err = run_cli(capsys, "delete", "m", "--run", "drop", "--yes", "--home", str(home.path))
    assert rc == 0, err
    first = ("deleted 1 run of model m (drop): 12 records" if kill_at == "before-tombstone"
             else "nothing to delete: already deleted")
    assert out.splitlines() == [first, f"removed {3 if kill_at != 'midway' else 2} pack files"]
    with dmi.open(home=home.path) as store:
        assert set(store.packs.list_packs()) == kept
        assert [(r.model_id, r.run_id) for r in store.runs()] == [("m", "keep"), ("other", "drop")]
        for request, tensor in tensors(store, "m", "keep", CAPTURES[0][2]).items():
            assert torch.equal(tensor, keep[request])


def test_a_mistyped_model_is_unknown_even_when_the_call_finishes_an_interrupted_delete(home):
    with dmi.open(home=home.path) as store:
        dropped = packs_of(store, "m", "drop")
        store.catalog.delete_runs("m", "drop")  # a delete killed after its tombstone, before its files
        assert dropped <= set(store.packs.list_packs())
        with pytest.raises(RecordNotFoundError, match="no model 'nope'"):
            store.delete("nope")
        assert not dropped & set(store.packs.list_packs())  # the interrupted delete was still finished
        assert [(r.model_id, r.run_id) for r in store.runs()] == [("m", "keep"), ("other", "drop")]


def _the_commands_store(monkeypatch) -> list:
    """The store ``dmi`` opens, once it has opened it (a list to read it from)."""
    import dmi.cli as cli

    opened = []
    open_store = cli._open_store
    monkeypatch.setattr(cli, "_open_store", lambda args: opened.append(open_store(args)) or opened[-1])
    return opened


def _publish_late_run(store, model) -> None:
    """Another writer publishes run "late" of model m (in this process, through the command's
    own store: chDB is one process at a time)."""
    ids, mask = left_padded_batch()
    with store.capture(model, hooks=HOOKS, model_id="m", run_id="late") as cap, torch.inference_mode():
        cap.forward(ids, mask, request_ids=["l1", "l2", "l3"])


def _assert_the_late_run_refused(capsys, home) -> None:
    rc, out, err = run_cli(capsys, "delete", "m", "--home", str(home.path))
    assert out.startswith("delete model m (2 runs): 24 records")
    assert rc == 2 and err == ("dmi: error: not deleted: the selection changed while you were asked (it now holds "
                               "drop (12 records), keep (12 records), late (12 records)); run dmi delete again to "
                               "be asked about what it holds now\n")
    with dmi.open(home=home.path) as store:
        assert [(r.model_id, r.run_id) for r in store.runs()] == [
            ("m", "drop"), ("m", "keep"), ("m", "late"), ("other", "drop")]


def test_cli_delete_refuses_when_a_run_arrives_while_it_asks(home, capsys, monkeypatch, model):
    opened = _the_commands_store(monkeypatch)

    class Answering(Terminal):
        """A terminal whose user says yes after another writer published run "late"."""

        def readline(self, *args):
            _publish_late_run(opened[0], model)
            return super().readline(*args)

    monkeypatch.setattr(sys, "stdin", Answering("y\n"))
    _assert_the_late_run_refused(capsys, home)


def test_cli_delete_refuses_a_run_that_arrives_after_the_yes_while_the_delete_begins(home, capsys, monkeypatch,
                                                                                     model):
    """The run arrives after the user's yes, inside ``Store.delete`` (stood in for by its first
    step, finishing an earlier delete's files): the delete compares what it finds with what the
    user was asked about, so the late run is not deleted unasked."""
    from dmi.catalog import Catalog

    opened = _the_commands_store(monkeypatch)
    purge = Catalog.purge_deleted

    def purge_while_a_run_arrives(self, packs):
        if not opened[0].catalog.requests("m", run_id="late"):
            _publish_late_run(opened[0], model)
        return purge(self, packs)

    monkeypatch.setattr(Catalog, "purge_deleted", purge_while_a_run_arrives)
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    _assert_the_late_run_refused(capsys, home)


def test_store_delete_with_the_counts_it_was_given_deletes_and_with_others_refuses(home):
    from dmi.storage import SelectionChangedError

    with dmi.open(home=home.path) as store:
        with pytest.raises(SelectionChangedError) as changed:
            store.delete("m", expected={"drop": (12, 0)})
        assert changed.value.now == {"drop": (12, 0), "keep": (12, 0)}
        assert str(changed.value) == ("not deleted: the selection changed since it was counted (it now holds "
                                      "drop (12 records), keep (12 records)); count it again and delete what it "
                                      "holds now")
        with pytest.raises(SelectionChangedError):
            store.delete("m", "drop", expected={"drop": (11, 0)})
        assert [(r.model_id, r.run_id) for r in store.runs()] == [("m", "drop"), ("m", "keep"), ("other", "drop")]
        report = store.delete("m", "drop", expected={"drop": (12, 0)})
        assert report.run_ids == ("drop",) and report.records == 12
        assert [(r.model_id, r.run_id) for r in store.runs()] == [("m", "keep"), ("other", "drop")]
