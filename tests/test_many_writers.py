"""Many writers: four capture processes publishing at once into one 2-replica ClickHouse cluster
catalog and one S3 bucket (moto), checked through both replicas.

The writers (``tests/_writers.py``): ``w1`` and ``w2`` capture the same model id (different runs,
different prompts), ``w1`` entering the cluster through replica 1 and ``w2`` through replica 2;
``w3`` and ``w4`` are the two tensor-parallel ranks of the same runs of another model id (one
lease scope per rank), one through each replica. They start capturing at the same moment (a go
file) and each publishes a pack every few records (``max_records`` 5, one decode step per
chunk), so their lease claims, index inserts and watermarks interleave on the cluster and their
conditional PUTs on the bucket. Each child writes down every record it appends (key + SHA-256 of
its bytes) and every publish. Afterwards, through each replica: nothing lost, nothing visible
twice, every byte as appended, every run complete (its requests listed, its records counted,
every pack each writer published under one of its scope's watermarks), no pack in the bucket
left unpublished, and ``verify`` clean.

Those cases are marked ``cluster`` and ``s3``; under a forced ``DMI_LIVE_SERVER`` (CI) they may
not skip. A writer retried under its published run id continues the run without writing any
record twice: ``tests/test_run_continuation.py``.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

import dmi
from dmi.reader import read_records
from dmi.storage import PackWriter
from tests._cluster import CLUSTER_NAME, ClusterUnavailable, LocalCluster
from tests._writers import Writer, check_writers, run_writers

pytestmark = pytest.mark.slow

RUNS_PER_WRITER = 2
TOKENS = 3
MAX_RECORDS = 5
TP_HOOKS = "resid_post token_ids"
RECORDS_PER_RUN = {"w1": 90, "w2": 90, "w3": 36, "w4": 36}
"""3 prompts x 3 captured steps (the prefill and 2 decode steps: the 3rd new token is sampled,
not run), each step its own chunk (``decode_chunk_steps=1``), x 10 records for ``w1``/``w2``
(``resid_post``, ``attn_q``, ``mlp_out`` on the 3 layers, and ``token_ids``) or x 4 for each
TP rank (``resid_post`` on the 3 layers and ``token_ids``: the unsharded tiny model has only
replicated hooks to offer a rank; each rank writes its copy, ``tp_replicas="all"``)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """ZooKeeper and two ClickHouse replicas for this module, stopped TERM-then-KILL."""
    try:
        local = LocalCluster(tmp_path_factory.mktemp("writers-cluster"))
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))  # under a forced DMI_LIVE_SERVER, conftest makes this a failure
    with local:
        yield local


@pytest.fixture(scope="module")
def writers_done(cluster, s3_endpoint, tmp_path_factory):
    """The four writers, run to the end; yields (outcomes, catalog URI per replica, packs URI)."""
    database = f"dmi_writers_{uuid.uuid4().hex[:10]}"
    packs = s3_endpoint.uri(s3_endpoint.new_bucket(), "packs")
    entry = [node.uri(database) for node in cluster.nodes]
    writers = [
        Writer("w1", "mw-llama", ("w1-run0", "w1-run1"), entry[0], packs, seed=1),
        Writer("w2", "mw-llama", ("w2-run0", "w2-run1"), entry[1], packs, seed=2),
        Writer("w3", "mw-tp", ("tp-run0", "tp-run1"), entry[0], packs, seed=3, tp=(0, 2), hooks=TP_HOOKS),
        Writer("w4", "mw-tp", ("tp-run0", "tp-run1"), entry[1], packs, seed=3, tp=(1, 2), hooks=TP_HOOKS),
    ]
    outcomes = run_writers(writers, tmp_path_factory.mktemp("writers"), tokens=TOKENS, max_records=MAX_RECORDS,
                           timeout=240.0)
    yield outcomes, entry, packs
    _drop_database(cluster.nodes[0], database)


def _drop_database(node, database: str) -> None:
    from clickhouse_driver import Client

    client = Client(node.host, port=node.port)
    try:
        client.execute("SET distributed_ddl_task_timeout = 60")
        client.execute(f"DROP DATABASE IF EXISTS {database} ON CLUSTER {CLUSTER_NAME}")
    finally:
        client.disconnect()


@pytest.mark.cluster
@pytest.mark.s3
def test_every_writer_exited_cleanly_with_its_runs(writers_done):
    outcomes, _, _ = writers_done
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.output
        events = outcome.events
        assert len(events.appended) == RUNS_PER_WRITER * RECORDS_PER_RUN[outcome.writer.name]
        assert sorted(events.requests) == sorted(outcome.writer.run_ids)
        assert all(len(ids) == 3 for ids in events.requests.values())
        assert sum(p.records for p in events.publishes) == len(events.appended)


@pytest.mark.cluster
@pytest.mark.s3
@pytest.mark.parametrize("replica", [0, 1], ids=["through-replica-1", "through-replica-2"])
def test_nothing_lost_nothing_twice_every_run_complete(writers_done, replica):
    outcomes, entry, packs = writers_done
    appended = sum(len(o.events.appended) for o in outcomes)
    with dmi.open(catalog=entry[replica], packs=packs) as store:
        check = check_writers(store, outcomes)
        assert check.notes == ()
        assert (check.lost, check.double_visible, check.mismatched, check.unexpected, check.incomplete_runs,
                check.unpublished_packs) == (0, 0, 0, 0, 0, 0)
        assert check.published == appended == RUNS_PER_WRITER * sum(RECORDS_PER_RUN.values())
        assert {(r.model_id, r.run_id) for r in store.runs()} == {
            ("mw-llama", "w1-run0"), ("mw-llama", "w1-run1"), ("mw-llama", "w2-run0"), ("mw-llama", "w2-run1"),
            ("mw-tp", "tp-run0"), ("mw-tp", "tp-run1")}
        ranks = {e.meta.key.shard_rank for e in store.catalog.find_records("mw-tp", run_id="tp-run1")}
        assert ranks == {0, 1}
        report = store.verify()
        assert (report.problems, report.unpublished_packs, report.records_checked) == ((), (), appended)
        w2 = outcomes[1]
        request = w2.events.requests["w2-run1"][0]
        tensor = store.get_internal("mw-llama", request, "resid_post", run_id="w2-run1")
        assert tensor.shape == (3, 7 + 2, 32)  # layers, the prompt's 7 tokens + 2 decode steps, hidden


@pytest.mark.cluster
@pytest.mark.s3
def test_a_record_published_twice_is_counted(writers_done):
    """The duplicate guard is real: publish one already-visible record again, in a pack of its
    own under another scope (what a writer retrying with a fresh pack id would do), and the
    check through either replica counts it once as double-visible and nothing else.
    Runs last: it leaves the extra pack in the module's catalog."""
    outcomes, entry, packs = writers_done
    key_fields, *_ = outcomes[0].events.appended[0]
    with dmi.open(catalog=entry[0], packs=packs) as store:
        (original,) = [e for e in store.catalog.find_records("mw-llama", request_id=key_fields[2])
                       if dataclasses.astuple(e.meta.key) == key_fields]
        (tensor,) = read_records(store.packs, [original])
        writer = PackWriter(store.packs, writer_id="duplicate")
        writer.append(original.meta.key, tensor)
        descriptor = writer.seal()
        with store.catalog.publisher("duplicate/retry") as publisher:
            publisher.publish([descriptor])
    for uri in entry:
        with dmi.open(catalog=uri, packs=packs) as store:
            check = check_writers(store, outcomes)
        assert (check.double_visible, check.lost, check.mismatched, check.unexpected) == (1, 0, 0, 0)
        assert check.published == RUNS_PER_WRITER * sum(RECORDS_PER_RUN.values()) + 1
        assert not check.clean
