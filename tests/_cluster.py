"""Start a ClickHouse cluster on loopback for the ``cluster`` tests: ZooKeeper + two replicas.

:class:`LocalCluster` runs, each under one directory (a pytest tmp dir):

* ZooKeeper standalone (Debian's ``zookeeper`` package: ``apt-get install zookeeper``), started
  with ``java`` on a free loopback port and waited for until ``srvr`` answers ``Mode:
  standalone``. ClickHouse 18.16 segfaults on its first ``ON CLUSTER`` statement if it started
  before ZooKeeper answered, so the servers start only after that;
* two ``clickhouse-server`` processes (the binary the ``live`` chain finds), each with the
  project's config (``docker/clickhouse/``) plus a ``config.d`` override: own ports and paths,
  ``interserver_http_host`` 127.0.0.1, macros ``shard``/``replica``, the ``remote_servers``
  cluster :data:`CLUSTER_NAME` of 1 shard x 2 replicas (and :data:`SHARDED_CLUSTER_NAME`), the
  ``zookeeper`` section and the distributed DDL queue. Each is ready once ``system.zookeeper``
  answers on it.

Ports are free ports below the kernel's ephemeral range (:mod:`tests._ports`). Stopping is TERM, then KILL after a deadline.
A replica can be stopped and started again (same ports, same data) to test a replica down.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from tests._clickhouse import find_server_binary, render_config, wait_for_ping
from tests._ports import free_port

CLUSTER_NAME = "dmi_test_cluster"
#: The same two servers as two shards of one replica each (a layout the catalog refuses).
SHARDED_CLUSTER_NAME = "dmi_test_two_shards"
ZOOKEEPER_JARS = ("/usr/share/java/zookeeper.jar",)
ZOOKEEPER_JAVA = os.environ.get("DMI_ZOOKEEPER_JAVA", "java")
STOP_DEADLINE = 15.0


class ClusterUnavailable(Exception):
    """ZooKeeper or the ClickHouse server binary is missing; the message says what to install."""


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One replica of the running cluster: where its native and HTTP ports are."""

    replica: str
    host: str
    port: int
    http_port: int

    def uri(self, database: str, cluster: str = CLUSTER_NAME) -> str:
        """The catalog URI of ``database`` on the cluster, entered through this replica."""
        return f"clickhouse://default:@{self.host}:{self.port}/{quote(database, safe='')}?cluster={cluster}"


def find_zookeeper() -> str | None:
    """The ZooKeeper jar, if Debian's ``zookeeper`` package (or one at the same path) is installed."""
    for jar in ZOOKEEPER_JARS:
        if Path(jar).is_file() and shutil.which(ZOOKEEPER_JAVA):
            return jar
    return None


def zookeeper_mode(port: int) -> str | None:
    """What ZooKeeper's ``srvr`` command says its mode is (``standalone``), or None if no answer."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"srvr")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
    except OSError:
        return None
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None


def stop_process(proc: subprocess.Popen | None, deadline: float = STOP_DEADLINE) -> None:
    """TERM, then KILL if it has not exited within ``deadline`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ZooKeeperProcess:
    """ZooKeeper standalone on a free loopback port, data and config under ``directory``."""

    def __init__(self, jar: str, directory: Path):
        self.jar = jar
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.directory / "zoo.cfg"
        config.write_text(
            f"tickTime=500\ndataDir={data}\nclientPort={self.port}\nclientPortAddress=127.0.0.1\n"
            "admin.enableServer=false\n4lw.commands.whitelist=srvr,ruok\n"
            # ClickHouse asks for its session_timeout_ms; ZooKeeper clamps it to [2, 20] ticks by default.
            "minSessionTimeout=1000\nmaxSessionTimeout=30000\n"
        )
        with open(self.directory / "zookeeper.log", "wb") as log:
            self.proc = subprocess.Popen(
                [ZOOKEEPER_JAVA, "-Xmx256m", "-cp", self.jar, "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                 str(config)],
                cwd=self.directory, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while (mode := zookeeper_mode(self.port)) != "standalone":
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ZooKeeper exited with code {self.proc.returncode}; see {self.directory}/zookeeper.log"
                )
            if time.monotonic() > deadline:
                stop_process(self.proc)
                raise TimeoutError(f"ZooKeeper on port {self.port} did not answer srvr with standalone (got {mode!r})")
            time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc)


def cluster_override(*, replica: str, interserver_port: int, zookeeper_port: int, nodes: list[tuple[str, int]]) -> str:
    """The ``config.d`` file that turns one server into a replica of :data:`CLUSTER_NAME`."""
    replicas = "".join(
        f"<replica><host>{host}</host><port>{port}</port></replica>" for host, port in nodes
    )
    shards = "".join(f"<shard>{replica}</shard>" for replica in re.findall(r"<replica>.*?</replica>", replicas))
    return f"""<?xml version="1.0"?>
<yandex>
    <interserver_http_host>127.0.0.1</interserver_http_host>
    <interserver_http_port>{interserver_port}</interserver_http_port>
    <macros><shard>01</shard><replica>{replica}</replica></macros>
    <remote_servers>
        <{CLUSTER_NAME}><shard><internal_replication>true</internal_replication>{replicas}</shard></{CLUSTER_NAME}>
        <{SHARDED_CLUSTER_NAME}>{shards}</{SHARDED_CLUSTER_NAME}>
    </remote_servers>
    <zookeeper>
        <node><host>127.0.0.1</host><port>{zookeeper_port}</port></node>
        <session_timeout_ms>5000</session_timeout_ms>
    </zookeeper>
    <distributed_ddl><path>/clickhouse/task_queue/ddl</path></distributed_ddl>
</yandex>
"""


class ReplicaProcess:
    """One ``clickhouse-server`` replica; :meth:`start` again after :meth:`stop` keeps its data."""

    def __init__(self, binary: str, directory: Path, replica: str):
        self.binary = binary
        self.directory = directory
        self.node = ClusterNode(replica, "127.0.0.1", free_port(), free_port())
        self.interserver_port = free_port()
        self.proc: subprocess.Popen | None = None

    def configure(self, zookeeper_port: int, nodes: list[tuple[str, int]]) -> None:
        render_config(self.directory, tcp_port=self.node.port, http_port=self.node.http_port, listen_host="127.0.0.1")
        (self.directory / "config.d").mkdir(exist_ok=True)
        (self.directory / "config.d" / "cluster.xml").write_text(
            cluster_override(replica=self.node.replica, interserver_port=self.interserver_port,
                             zookeeper_port=zookeeper_port, nodes=nodes)
        )

    def start(self, timeout: float = 60.0) -> None:
        with open(self.directory / "log" / "stdout.log", "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config-file={self.directory / 'config.xml'}"],
                cwd=self.directory, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        try:
            wait_for_ping(self.node.host, self.node.http_port, timeout, self.proc, self.directory / "log")
            self._wait_for_zookeeper(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_for_zookeeper(self, timeout: float) -> None:
        from clickhouse_driver import Client
        from clickhouse_driver.errors import Error

        deadline = time.monotonic() + timeout
        client = Client(self.node.host, port=self.node.port)
        try:
            while True:
                try:
                    client.execute("SELECT count() FROM system.zookeeper WHERE path = '/'")
                    return
                except Error as exc:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"replica {self.node.replica}: system.zookeeper never answered: {exc}"
                        ) from exc
                    time.sleep(0.1)
        finally:
            client.disconnect()

    def stop(self) -> None:
        stop_process(self.proc)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """ZooKeeper and two ClickHouse replicas under ``directory``; use as a context manager."""

    def __init__(self, directory: Path, replicas: int = 2):
        binary = find_server_binary()
        jar = find_zookeeper()
        missing = []
        if jar is None:
            missing.append(
                f"ZooKeeper ({' or '.join(ZOOKEEPER_JARS)} and {ZOOKEEPER_JAVA!r}; apt-get install zookeeper)"
            )
        if binary is None:
            missing.append("clickhouse-server (apt-get install clickhouse-server)")
        if missing:
            raise ClusterUnavailable("a local ClickHouse cluster needs " + " and ".join(missing))
        self.directory = directory
        self.zookeeper = ZooKeeperProcess(jar, directory / "zookeeper")
        self.replicas = [ReplicaProcess(binary, directory / f"replica-{i + 1}", f"replica-{i + 1}")
                         for i in range(replicas)]

    @property
    def nodes(self) -> list[ClusterNode]:
        return [replica.node for replica in self.replicas]

    def __enter__(self) -> LocalCluster:
        try:
            self.zookeeper.start()
            nodes = [(node.host, node.port) for node in self.nodes]
            for replica in self.replicas:
                replica.configure(self.zookeeper.port, nodes)
            for replica in self.replicas:
                replica.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for replica in self.replicas:
            replica.stop()
        self.zookeeper.stop()
