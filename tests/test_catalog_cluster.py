"""The catalog on a replicated ClickHouse cluster: ZooKeeper + two replicas on loopback.

The conformance suite runs against the cluster with the test's catalog on replica 1 and every
"other" catalog (readers, racers, the upgraded one) on replica 2, and the cases below check
what only a cluster has: replicated DDL, quorum writes seen through the other replica at once,
a replica stopped (a named error, nothing lost, published once it is back) and a replica
killed (unknown outcome: quarantine).

Marked ``cluster``, not ``live``: CI's container pass reruns ``-m live`` where no cluster can
be started. Under a forced ``DMI_LIVE_SERVER`` these tests may not skip (``tests/conftest.py``).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from dmi.catalog import open_catalog
from dmi.catalog._cluster import created_if_missing, on_cluster, zookeeper_component, zookeeper_path
from dmi.catalog._schema import SCHEMA_VERSION, TABLES
from dmi.storage.record_schema import RECORD_FIELDS
from dmi.storage import (
    CatalogError,
    InvalidArgumentError,
    LocalPackStore,
    PackWriter,
    QuarantinedError,
    QuorumError,
    RecordKey,
    ServerError,
)
from tests._cluster import CLUSTER_NAME, SHARDED_CLUSTER_NAME, ClusterUnavailable, LocalCluster
from tests.catalog_conformance import CatalogConformance, pack

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory):
    """ZooKeeper and two ClickHouse replicas for the whole session, stopped TERM-then-KILL."""
    try:
        cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))  # under a forced DMI_LIVE_SERVER, conftest makes this a failure
    with cluster:
        yield cluster


def admin(node):
    from clickhouse_driver import Client

    client = Client(node.host, port=node.port)
    client.execute("SET distributed_ddl_task_timeout = 60")
    return client


@pytest.fixture
def cluster_database(local_cluster):
    """A fresh database name; dropped on every replica afterwards (the catalog creates it)."""
    name = f"dmi_cluster_{uuid.uuid4().hex[:10]}"
    yield name
    for replica in local_cluster.replicas:
        if not replica.running:
            replica.start()
    client = admin(local_cluster.nodes[0])
    try:
        client.execute(f"DROP DATABASE IF EXISTS {name} ON CLUSTER {CLUSTER_NAME}")
    finally:
        client.disconnect()


def wait_until_every_replica_is_active(node, database: str, timeout: float = 60.0) -> None:
    """Until the entry replica sees both replicas of every table active (a restarted replica
    can take a ZooKeeper session timeout to come back)."""
    client = admin(node)
    deadline = time.monotonic() + timeout
    try:
        while True:
            rows = client.execute(
                "SELECT min(active_replicas), min(total_replicas) FROM system.replicas WHERE database = %(db)s",
                {"db": database},
            )
            if rows and rows[0][0] == rows[0][1] == 2:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas of {database} not all active: {rows}")
            time.sleep(0.2)
    finally:
        client.disconnect()


def sealed_packs(directory: Path, n_packs: int, model: str = "m") -> tuple[LocalPackStore, list]:
    """Real packs on disk: ``n_packs`` sealed packs of 3 records each (one request per pack)."""
    store = LocalPackStore(directory)
    writer = PackWriter(store, writer_id="cluster-test")
    descriptors = []
    for i in range(n_packs):
        for layer in range(3):
            writer.append(RecordKey(model, "run", f"req-{i}", "resid_post", layer, 0, 2), torch.randn(2, 4))
        descriptors.append(writer.seal())
    return store, descriptors


# ---------------------------------------------------------------------- conformance
@pytest.mark.cluster
class TestClusterCatalog(CatalogConformance):
    """Every catalog guarantee, with "other" catalogs opened on the other replica."""

    @pytest.fixture
    def catalog_uri(self, local_cluster, cluster_database):
        first, second = local_cluster.nodes
        self._others = itertools.cycle([second.uri(cluster_database), first.uri(cluster_database)])
        return first.uri(cluster_database)

    def open_more(self, catalog_uri):
        return open_catalog(next(self._others))


# ---------------------------------------------------------------------- cluster behaviour
@pytest.mark.cluster
def test_schema_is_replicated_on_every_replica(local_cluster, cluster_database):
    first, second = local_cluster.nodes
    with open_catalog(first.uri(cluster_database)) as catalog:
        assert catalog.backend == "cluster" and catalog.schema_version() == SCHEMA_VERSION
    client = admin(second)
    try:
        engines = dict(client.execute(
            "SELECT name, engine FROM system.tables WHERE database = %(db)s", {"db": cluster_database}
        ))
        replicas = client.execute(
            "SELECT table, total_replicas, zookeeper_path FROM system.replicas WHERE database = %(db)s ORDER BY table",
            {"db": cluster_database},
        )
    finally:
        client.disconnect()
    assert {engines[f"dmi_{table}"] for table in TABLES} <= {"ReplicatedMergeTree", "ReplicatedReplacingMergeTree"}
    assert engines["dmi_records_published"] == "View"
    assert [(table, total) for table, total, _ in replicas] == [(f"dmi_{t}", 2) for t in sorted(TABLES)]
    assert replicas[0][2] == f"/clickhouse/tables/01/{zookeeper_component(cluster_database)}/dmi_audits"


@pytest.mark.cluster
def test_an_upgrade_through_one_replica_reaches_the_other(local_cluster, cluster_database):
    """Tables left as schema version 1 (records without the token layout columns, version row 1),
    opened through replica 2, are upgraded on both replicas: replica 1 then has the columns and
    reads both version rows (1 and the current one)."""
    first, second = local_cluster.nodes
    with open_catalog(first.uri(cluster_database)) as catalog:
        records = catalog.tables["records"]
        for field in RECORD_FIELDS:
            if field.since > 1:  # the columns versions 2 and later added
                catalog._backend.command(f"ALTER TABLE {records} DROP COLUMN {field.name}")
        catalog._backend.command(f"DROP TABLE {catalog.tables['schema']}")
        catalog._backend.command(
            f"CREATE TABLE {catalog.tables['schema']} (version UInt32, written_at Float64, written_by String) "
            "ENGINE = MergeTree ORDER BY version"
        )
        catalog._backend.insert(catalog.tables["schema"], pa.table(
            {"version": pa.array([1], pa.uint32()), "written_at": [0.0], "written_by": ["v1"]}
        ))
    with open_catalog(second.uri(cluster_database)) as before:
        assert before.schema_version() == SCHEMA_VERSION  # opening through replica 2 upgrades it, on both
    with open_catalog(first.uri(cluster_database)) as after:
        columns = after._backend.query(f"DESCRIBE TABLE {records}").column("name").to_pylist()
        assert {f.name for f in RECORD_FIELDS} <= set(columns)
        versions = after.sql(f"SELECT version FROM {after.tables['schema']} ORDER BY version").column("version")
        assert versions.to_pylist() == [1, SCHEMA_VERSION]


@pytest.mark.cluster
def test_a_publish_returns_only_once_the_other_replica_has_it(local_cluster, cluster_database):
    """Replica 2 stops fetching parts: a publish through replica 1 waits (quorum of 2) instead of
    returning with the rows on one replica; once fetches resume it returns, and a reader on
    replica 2 sees the watermark and its records at once."""
    first, second = local_cluster.nodes
    with open_catalog(first.uri(cluster_database), quorum_timeout=30) as writer, \
            open_catalog(second.uri(cluster_database)) as reader:
        publisher = writer.publisher("scope-a", holder="A")
        publisher.acquire()
        desc = pack()
        client = admin(second)
        client.execute("SYSTEM STOP FETCHES")
        done = threading.Event()
        outcome = []
        thread = threading.Thread(target=lambda: (outcome.append(publisher.publish([desc])), done.set()))
        try:
            thread.start()
            assert not done.wait(1.5), "the publish returned before replica 2 had the rows"
        finally:
            client.execute("SYSTEM START FETCHES")
            client.disconnect()
            thread.join(30)
        assert done.is_set()
        watermark = outcome[0]
        assert reader.watermarks("scope-a") == [watermark]
        assert [e.pack_id for e in reader.find_records("gpt2")] == [desc.pack_id] * 3


@pytest.mark.cluster
def test_an_unconfirmed_claim_is_invisible_even_on_the_replica_that_took_it(local_cluster, cluster_database):
    """While replica 2 cannot fetch, a claim written through replica 1 waits for its quorum; a
    reader on replica 1 itself must not see it yet (sequential consistency), since the writer
    may still be told the outcome is unknown."""
    first, second = local_cluster.nodes
    with open_catalog(first.uri(cluster_database), quorum_timeout=30) as writer, \
            open_catalog(first.uri(cluster_database)) as reader:
        publisher = writer.publisher("scope-c", holder="C")
        client = admin(second)
        client.execute("SYSTEM STOP FETCHES")
        thread = threading.Thread(target=publisher.acquire)
        try:
            thread.start()
            time.sleep(1.0)
            assert reader.lease_state("scope-c").max_term == 0
            raw = reader._backend.query(
                f"SELECT count() AS n FROM {reader.tables['leases']}", {}
            ).column("n").to_pylist()
            assert raw == [0]
        finally:
            client.execute("SYSTEM START FETCHES")
            client.disconnect()
            thread.join(30)
        assert publisher.term == 1 and reader.lease_state("scope-c").holder == "C"


@pytest.mark.cluster
def test_a_stopped_replica_stops_publishing_then_recovery_publishes_every_pack(local_cluster, cluster_database,
                                                                                 tmp_path):
    first, second = local_cluster.nodes
    store, descriptors = sealed_packs(tmp_path / "packs", 3)
    with open_catalog(first.uri(cluster_database)) as catalog:
        publisher = catalog.publisher("writer", holder="W", lease_seconds=60)
        publisher.acquire()
        first_mark = publisher.publish(descriptors[:1])
        local_cluster.replicas[1].stop()
        started = time.monotonic()
        with pytest.raises(QuorumError, match="fewer than 2 replicas") as info:
            publisher.publish(descriptors[1:])
        assert time.monotonic() - started < 5  # refused at once, not after the quorum timeout
        assert info.value.outcome_unknown is False and info.value.code == 285
        assert not publisher.quarantined and publisher.term == first_mark.term  # nothing unknown happened
        n_indexed = catalog._backend.query(f"SELECT count() AS n FROM {catalog.tables['records']}", {})
        assert n_indexed.column("n").to_pylist() == [3]  # the refused batch wrote nothing
        assert set(catalog.packs_to_recover(store.list_packs())) == {d.pack_id for d in descriptors[1:]}
        publisher.release()
    local_cluster.replicas[1].start()
    wait_until_every_replica_is_active(first, cluster_database)
    with open_catalog(second.uri(cluster_database)) as catalog:
        recovered = catalog.recover(store)
        assert set(recovered) == {d.pack_id for d in descriptors[1:]}
    with open_catalog(first.uri(cluster_database)) as reader:
        assert reader.requests("m") == ["req-0", "req-1", "req-2"]
        assert len(reader.find_records("m")) == 9
        assert reader.packs_to_recover(store.list_packs()) == []


@pytest.mark.cluster
def test_a_killed_replica_makes_the_outcome_unknown_and_the_publisher_quarantines(local_cluster, cluster_database):
    """SIGKILL leaves replica 2 registered as active until its ZooKeeper session expires, so a
    quorum insert is written on replica 1 and then waits; after ``quorum_timeout`` ClickHouse
    answers 319 (unknown status) and the publisher quarantines itself."""
    first, second = local_cluster.nodes
    with open_catalog(first.uri(cluster_database), quorum_timeout=2) as catalog:
        publisher = catalog.publisher("killed", holder="K", lease_seconds=60)
        publisher.acquire()
        local_cluster.replicas[1].proc.send_signal(signal.SIGKILL)
        local_cluster.replicas[1].proc.wait()
        started = time.monotonic()
        with pytest.raises(QuarantinedError, match="renewal") as info:
            publisher.renew()
        assert 2 <= time.monotonic() - started < 30  # waited the quorum timeout, not ClickHouse's 10 minutes
        assert publisher.quarantined and publisher.term is None
        assert isinstance(info.value.__cause__, QuorumError)
        assert info.value.__cause__.outcome_unknown is True and info.value.__cause__.code == 319
    time.sleep(6)  # past the ZooKeeper session timeout (5 s): the stale registration is gone
    local_cluster.replicas[1].start()
    wait_until_every_replica_is_active(first, cluster_database)
    with open_catalog(second.uri(cluster_database)) as catalog:
        successor = catalog.publisher("killed", holder="K", lease_seconds=60)
        assert successor.acquire() > 1  # the renewal that landed later does not keep the old term alive


@pytest.mark.cluster
def test_schema_statements_with_a_replica_down_time_out_and_reach_it_when_it_is_back(local_cluster,
                                                                                      cluster_database):
    first, second = local_cluster.nodes
    local_cluster.replicas[1].stop()
    started = time.monotonic()
    with pytest.raises(ServerError) as info:
        open_catalog(first.uri(cluster_database), ddl_timeout=2)
    assert time.monotonic() - started < 15 and info.value.code == 159  # TIMEOUT_EXCEEDED, after ddl_timeout
    local_cluster.replicas[1].start()
    with open_catalog(first.uri(cluster_database)) as catalog:
        assert catalog.schema_version() == SCHEMA_VERSION
    with open_catalog(second.uri(cluster_database)) as other:
        assert other.schema_version() == SCHEMA_VERSION


@pytest.mark.cluster
def test_a_uri_naming_an_unknown_or_sharded_cluster_is_refused(local_cluster, cluster_database):
    node = local_cluster.nodes[0]
    with pytest.raises(InvalidArgumentError, match="no cluster 'nope'"):
        open_catalog(node.uri(cluster_database, cluster="nope"))
    with pytest.raises(InvalidArgumentError, match="has 2 shards; the catalog runs on one shard"):
        open_catalog(node.uri(cluster_database, cluster=SHARDED_CLUSTER_NAME))


def ddl_tasks(node) -> int:
    client = admin(node)
    try:
        return client.execute("SELECT count() FROM system.zookeeper WHERE path = '/clickhouse/task_queue/ddl'")[0][0]
    finally:
        client.disconnect()


@pytest.mark.cluster
def test_reopening_a_catalog_queues_no_cluster_ddl(local_cluster, cluster_database):
    """Every table exists on the entry replica, so no CREATE goes through the DDL queue again."""
    first, second = local_cluster.nodes
    with open_catalog(first.uri(cluster_database)):
        pass
    before = ddl_tasks(first)
    with open_catalog(second.uri(cluster_database)) as again:
        assert again.schema_version() == SCHEMA_VERSION
    assert ddl_tasks(first) == before


def test_a_skip_under_a_forced_mode_is_a_failure(tmp_path):
    """The conftest hook holds ``cluster`` tests to the live rule: a probe that skips fails
    under a forced DMI_LIVE_SERVER and is only skipped without one."""
    probe = REPO / "tests" / "_cluster_probe.py"
    base = {k: v for k, v in os.environ.items() if k != "DMI_LIVE_SERVER"}
    command = [sys.executable, "-m", "pytest", str(probe.relative_to(REPO)), "-rA", "-p", "no:cacheprovider"]
    forced = subprocess.run(command, cwd=REPO, env={**base, "DMI_LIVE_SERVER": "binary"},
                            capture_output=True, text=True, timeout=120)
    free = subprocess.run(command, cwd=REPO, env=base, capture_output=True, text=True, timeout=120)
    assert "DMI_LIVE_SERVER=binary requires every cluster test to run, but this one skipped: on purpose" in (
        forced.stdout
    ), forced.stdout
    assert forced.returncode == 1 and "1 failed" in forced.stdout
    assert free.returncode == 0 and "1 skipped" in free.stdout, free.stdout


# ---------------------------------------------------------------------- no server needed
def test_ddl_is_placed_on_the_cluster_with_replicated_engines():
    create = "CREATE TABLE IF NOT EXISTS `db`.`dmi_packs` (x UInt8) ENGINE = ReplacingMergeTree ORDER BY x"
    assert on_cluster(create, "c") == (
        "CREATE TABLE IF NOT EXISTS `db`.`dmi_packs` ON CLUSTER `c` (x UInt8) "
        "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/db/dmi_packs', '{replica}') ORDER BY x"
    )
    assert on_cluster("DROP TABLE IF EXISTS `db`.`v`", "c") == "DROP TABLE IF EXISTS `db`.`v` ON CLUSTER `c`"
    assert on_cluster("ALTER TABLE `db`.`t` ADD COLUMN y UInt8", "c") == (
        "ALTER TABLE `db`.`t` ON CLUSTER `c` ADD COLUMN y UInt8"
    )
    assert on_cluster("CREATE DATABASE IF NOT EXISTS `db`", "c") == "CREATE DATABASE IF NOT EXISTS `db` ON CLUSTER `c`"
    assert on_cluster("\n  CREATE VIEW IF NOT EXISTS `db`.`v` AS SELECT 1", "c") == (
        "\n  CREATE VIEW IF NOT EXISTS `db`.`v` ON CLUSTER `c` AS SELECT 1"
    )
    assert on_cluster("INSERT INTO `db`.`t` (x) SELECT 1", "c") is None


@pytest.mark.parametrize("statement", [
    "RENAME TABLE `db`.`a` TO `db`.`b`",
    "CREATE TABLE `db`.`t` (x UInt8) ENGINE = Memory",
    "CREATE TABLE `db`.`t` (x UInt8) ENGINE = ReplicatedMergeTree('/p', 'r') ORDER BY x",
    "TRUNCATE TABLE `db`.`t`",
])
def test_ddl_that_cannot_be_placed_on_every_replica_is_refused(statement):
    with pytest.raises(CatalogError, match="cannot"):
        on_cluster(statement, "c")


def test_what_a_create_if_not_exists_names():
    assert created_if_missing("CREATE DATABASE IF NOT EXISTS `d-b`") == ("d-b",)
    assert created_if_missing(" CREATE TABLE IF NOT EXISTS `db`.`t` (x UInt8)") == ("db", "t")
    assert created_if_missing("CREATE VIEW IF NOT EXISTS `db`.`v` AS SELECT 1") == ("db", "v")
    assert created_if_missing("CREATE TABLE IF NOT EXISTS t (x UInt8)") is None  # not a database name
    assert created_if_missing("CREATE TABLE `db`.`t` (x UInt8)") is None


def test_zookeeper_paths_cannot_be_steered_by_a_name():
    assert zookeeper_path("`my-db`.`dmi_records`") == "/clickhouse/tables/{shard}/my-db/dmi_records"
    assert zookeeper_component("d{replica}'é.x") == "d@7breplica@7d@27@c3@a9@2ex"
    assert zookeeper_component("a@2e") != zookeeper_component("a.")


@pytest.mark.parametrize("query", ["?cluster=", "?cluster=a&cluster=b", "?shards=2", "?cluster=a%60b"])
def test_the_uri_takes_only_a_valid_cluster_name(query):
    with pytest.raises(InvalidArgumentError):
        open_catalog(f"clickhouse://default:@127.0.0.1:1/db{query}")


def test_settings_the_cluster_owns_are_refused():
    with pytest.raises(InvalidArgumentError, match="insert_quorum"):
        open_catalog("clickhouse://default:@127.0.0.1:1/db?cluster=c", insert_quorum=1)


def test_the_compose_cluster_file_parses_and_names_its_config_files():
    """docker/docker-compose.cluster.yml cannot be run here (no container engine): check that it
    is YAML with the services the docs name, and that every file it mounts exists."""
    from xml.etree import ElementTree

    import yaml

    compose = yaml.safe_load((REPO / "docker" / "docker-compose.cluster.yml").read_text())
    services = compose["services"]
    assert {"keeper", "clickhouse-1", "clickhouse-2", "minio"} <= set(services)
    mounts = [volume.split(":")[0] for service in services.values() for volume in service.get("volumes", [])
              if volume.startswith("./")]
    assert len(mounts) == 5
    for mount in mounts:
        assert ElementTree.parse(REPO / "docker" / mount).getroot().tag == "clickhouse", mount
    assert services["clickhouse-1"]["image"] == services["clickhouse-2"]["image"]
