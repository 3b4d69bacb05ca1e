"""What ``dmi show`` and ``dmi runs`` say of a run deleted and then captured again under the
same id: only the losses and audits recorded since the deletion (embedded chDB).

The catalog-level rule (a tombstone hides its run's losses and audit rows stamped at or
before its ``deleted_at``) runs on every backend in ``tests/catalog_conformance.py``; here
it is checked through the facade and the command line. Index rows stand in for a capture
(the commands read only the catalog), so no pack file is needed.
"""

from __future__ import annotations

import json

import pytest

import dmi
from dmi.catalog import _deletion
from dmi.cli import main
from tests.catalog_conformance import manual_catalog_clock, pack


@pytest.fixture
def clock(monkeypatch):
    return manual_catalog_clock(monkeypatch)


def audit_row(audit_id, run, verdict, when):
    return {"audit_id": audit_id, "model_id": "gpt2", "run_id": run, "request_id": "a", "hook": "resid_post",
            "layer": 0, "verdict": verdict, "tolerance": "exact", "bound": 0.0, "n_records": 1, "n_tokens": 3,
            "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "first_diff": -1, "first_fail": -1, "detail": "",
            "model": "tiny", "seed": 0, "audited_at": when}


def capture_stand_in(store, lost: int) -> None:
    """Publish run r1's request ``a`` and count ``lost`` of its records as dropped."""
    with store.catalog.publisher("s", holder="A") as pub:
        pub.publish([pack(run="r1", request="a")])
    store.catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, lost, "ring full")


def show_and_runs(capsys, home):
    assert main(["show", "gpt2", "a", "--json", "--home", str(home)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert main(["runs", "--json", "--home", str(home)]) == 0
    runs = json.loads(capsys.readouterr().out)
    return shown, [(r["run_id"], r["last_audit"]) for r in runs]


def test_show_and_runs_of_a_run_captured_again_report_only_what_came_after_the_deletion(tmp_path, clock, capsys):
    with dmi.open(home=tmp_path) as store:
        capture_stand_in(store, lost=5)
        store.catalog.record_audit([audit_row("old", "r1", "fail", clock())])
        clock.advance(1.0)
        assert [d.run_id for d in store.catalog.delete_runs("gpt2", "r1")] == ["r1"]
        clock.advance(1.0)
        capture_stand_in(store, lost=7)
        assert store.contents("gpt2", "a").losses == (dmi.Loss("resid_post", 3, 7, "ring full"),)
    shown, runs = show_and_runs(capsys, tmp_path)
    assert shown["losses"] == [{"hook": "resid_post", "layer": 3, "count": 7, "reason": "ring full"}]
    assert shown["audits"] == [] and runs == [("r1", "")]

    with dmi.open(home=tmp_path) as store:
        store.catalog.record_audit([audit_row("new", "r1", "exact", clock())])
    shown, runs = show_and_runs(capsys, tmp_path)
    assert [a["audit_id"] for a in shown["audits"]] == ["new"] and runs == [("r1", "passed (exact)")]


@pytest.mark.parametrize("join_use_nulls", [0, 1])
def test_losses_of_runs_never_deleted_show_whatever_the_servers_join_use_nulls(tmp_path, clock, join_use_nulls):
    """A server profile may set ``join_use_nulls``: a run without a tombstone then joins NULL,
    not 0, and its losses must show all the same. The setting is appended to the catalog's own
    statement (stands in for the profile)."""
    from dmi.catalog import open_catalog

    with open_catalog(f"chdb://{tmp_path / 'catalog'}") as catalog:
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1", request="a"), pack(run="r2", request="b")])
        catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, 5, "ring full")
        catalog.record_losses("gpt2", "r2", "b", "resid_post", 3, 2, "ring full")
        clock.advance(1.0)
        catalog.delete_runs("gpt2", "r1")
        undeleted = _deletion.undeleted_rows(catalog, "losses", "recorded_at", "")
        rows = catalog._backend.query(
            f"SELECT run_id, count FROM ({undeleted}) ORDER BY run_id SETTINGS join_use_nulls = {join_use_nulls}"
        ).to_pylist()
    assert rows == [{"run_id": "r2", "count": 2}]
