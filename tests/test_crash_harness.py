"""The crash harness, short: a capturing child killed with SIGKILL once in each named phase, on
local disk + chDB and on S3 (moto) + a ClickHouse server (the harness's two default backends);
after recovery nothing is lost, torn, visible twice or different from what the child appended.
``bench/crash_harness.py`` runs the long version.

The S3 + server tests carry the ``live`` and ``s3`` markers: CI's live passes run them (on the
local binary and in a container) and, under ``DMI_LIVE_SERVER``, a skip there is a failure.

Deterministic: fixed kill points (the k-th call of each phase in a one-run child, well inside
what such a run makes), no timing; the random-time kills are the bench's.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from bench.crash_harness import Backend, check_trial, drop_trial_catalog, kill_trial

pytestmark = pytest.mark.slow

KILLS = [("copy", 7), ("encode", 23), ("seal", 6), ("seal-publish", 2), ("publish", 2)]
"""(phase, k): a one-run child makes 30 ring reservations, 90 encodings and 18 seals, and
publishes at least once: its packs wait for the lease, acquired beside the drain, so one
publish may carry them all. The publishing phases' children therefore make two runs."""


def rounds_for(phase: str) -> int:
    """Runs of a child killed in ``phase``: enough that the ``KILLS`` hit is reached whenever
    the lease comes."""
    return 2 if phase in ("seal-publish", "publish") else 1


def kill_and_check(backend: Backend, tmp_path, phase: str, hit: int):
    trial = kill_trial(backend, tmp_path, phase, hit, rng=random.Random(0), rounds=rounds_for(phase))
    assert trial.notes == () and trial.killed, trial
    return trial, check_trial(trial)


def assert_clean(result) -> None:
    assert (result.lost, result.torn, result.double_visible, result.mismatched, result.verify_problems) == (0, 0, 0, 0, 0), result
    assert result.notes == ()


@pytest.mark.parametrize("phase, hit", KILLS)
def test_local_disk_and_chdb(tmp_path, phase, hit):
    trial, result = kill_and_check(Backend("local disk + chDB"), tmp_path, phase, hit)
    assert_clean(result)
    if phase in ("seal-publish", "publish"):  # the child had sealed packs: recovery published them
        assert trial.events.sealed and result.published_records > 0


def test_the_checks_count_what_is_wrong(tmp_path):
    """Guards on the harness itself, on one killed child: without recovery its sealed packs
    count as lost; a record the child appended differently counts as mismatched; a pack cut
    short afterwards counts as torn."""
    trial = kill_trial(Backend("local disk + chDB"), tmp_path, "seal-publish", 2, rng=random.Random(0),
                       rounds=rounds_for("seal-publish"))
    before = check_trial(trial, recover=False)
    assert before.lost >= 1 and before.verify_problems >= 1
    after = check_trial(trial)
    assert_clean(after)
    assert after.published_records > before.published_records

    key, (_, dtype, shape) = next(iter(trial.events.expected.items()))
    altered = dict(trial.events.expected) | {key: ("0" * 64, dtype, shape)}
    other = dataclasses.replace(trial, events=dataclasses.replace(trial.events, expected=altered))
    assert check_trial(other).mismatched == 1

    victim = sorted(n for n in os.listdir(trial.packs) if n.endswith(".arrow") and not n.startswith("."))[0]
    with open(os.path.join(trial.packs, victim), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    cut = check_trial(trial)
    assert cut.torn == 1 and cut.verify_problems >= 1 and cut.mismatched >= 1


@pytest.fixture
def s3_and_server(s3_endpoint, clickhouse_server):
    """The harness's S3 + server backend: a fresh bucket on the session's moto, a fresh database
    per trial on the session's live server."""
    server = clickhouse_server.uri("default").rpartition("/")[0]
    return Backend("S3 (moto) + server", f"s3://{s3_endpoint.new_bucket()}?endpoint_override={s3_endpoint.url}", server)


@pytest.mark.live
@pytest.mark.s3
@pytest.mark.parametrize("phase, hit", KILLS)
def test_s3_and_server(s3_and_server, tmp_path, phase, hit):
    trial = kill_trial(s3_and_server, tmp_path, phase, hit, rng=random.Random(0), rounds=rounds_for(phase))
    try:
        assert trial.notes == () and trial.killed, trial
        assert trial.packs.startswith("s3://") and trial.catalog.startswith("clickhouse://")
        result = check_trial(trial)
    finally:
        drop_trial_catalog(trial)
    assert_clean(result)
    if phase in ("seal-publish", "publish"):  # the child had sealed packs: recovery published them
        assert trial.events.sealed and result.published_records > 0


@pytest.mark.live
def test_each_server_trial_has_its_own_database(clickhouse_server, tmp_path):
    """Two trials on one server never share a catalog, and a checked trial's database is dropped."""
    from clickhouse_driver import Client

    backend = Backend("local disk + server", server_uri=clickhouse_server.uri("default").rpartition("/")[0])
    first, second = (kill_trial(backend, tmp_path, "publish", 1, rng=random.Random(0), rounds=1) for _ in range(2))
    assert first.catalog != second.catalog
    client = Client(clickhouse_server.host, port=clickhouse_server.port, user=clickhouse_server.user,
                    password=clickhouse_server.password)
    databases = {first.catalog.rpartition("/")[2], second.catalog.rpartition("/")[2]}

    def present() -> set[str]:
        return databases & {row[0] for row in client.execute("SHOW DATABASES")}

    try:
        assert present() == databases
        for trial in (first, second):
            assert_clean(check_trial(trial))
            drop_trial_catalog(trial)
        assert present() == set()
    finally:
        client.disconnect()
