"""Cluster backend: the catalog on a replicated ClickHouse cluster (one shard, N replicas).

``clickhouse://user:password@host:port/db?cluster=NAME`` enters the cluster ``NAME`` (as the
server's ``remote_servers`` names it) through the replica at ``host:port``. Everything else is
the server backend's; this module adds three things, and nothing in the catalog's own code
knows about them:

* **DDL on every replica.** Each schema statement the catalog issues is placed ``ON CLUSTER``
  (:func:`on_cluster`) and its ``MergeTree`` engines become ``ReplicatedMergeTree`` with the
  ZooKeeper path ``/clickhouse/tables/{shard}/<database>/<table>`` and replica ``{replica}``
  (the servers' macros). A DDL statement this module cannot place on the cluster is refused,
  never run on one replica only. ``distributed_ddl_task_timeout`` is set with ``SET`` before
  each one (clickhouse-driver 0.2.11 sends it to 18.16 as a setting in a form the server reads
  as a negative number, which waits forever). A ``CREATE ... IF NOT EXISTS`` of something the
  entry replica already has is skipped, so reopening a catalog queues no DDL.
* **Quorum writes, sequentially consistent reads.** Every insert is written with
  ``insert_quorum`` = the number of replicas, so an insert returns only once every replica
  has the rows; every read runs with ``select_sequential_consistency=1``, so a part whose quorum
  is not confirmed yet is not read (not even on the replica that took it), and a replica that
  lacks a confirmed part refuses the read instead of answering from older data. A claim,
  fence or watermark confirmed through one replica is thus what readers of every replica see.
  Index rows are written with the same quorum, so a watermark is never visible on a replica
  before the records it names. Servers that have ``insert_quorum_parallel`` (newer than 18.16)
  get it set to 0: sequential consistency is defined over linearized quorum inserts.
* **What a quorum failure means** (:func:`quorum_error`): ClickHouse checks the number of live
  replicas before it writes anything, so ``TOO_FEW_LIVE_REPLICAS`` (285) certainly wrote
  nothing; ``UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE`` (286, another quorum insert into the table
  is still in flight: refused by the same check, or by the ZooKeeper transaction that would
  have committed the part, which then commits nothing) also wrote nothing and is retried until
  ``quorum_timeout``;
  ``UNKNOWN_STATUS_OF_INSERT`` (319, the rows were written on the entry replica but not
  confirmed by the others within ``insert_quorum_timeout``) is an unknown outcome, which the
  lease protocol answers with quarantine.

One shard only: the catalog is small next to the packs it indexes, and the protocol's read-
backs (is this claim alone? which fences exist?) must see every row, so the tables are plain
replicated tables read directly — no ``Distributed`` table. A cluster with more shards is
refused.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

from dmi.catalog._server import ServerBackend
from dmi.catalog._sql import validate_identifier
from dmi.storage.errors import CatalogError, InvalidArgumentError, QuorumError, ServerError

__all__ = ["ClusterBackend", "on_cluster", "created_if_missing", "zookeeper_path", "quorum_error"]

TOO_FEW_LIVE_REPLICAS = 285
UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE = 286
UNKNOWN_STATUS_OF_INSERT = 319

#: Settings the cluster backend owns: the consistency argument above depends on their values.
OWNED_SETTINGS = ("insert_quorum", "insert_quorum_timeout", "insert_quorum_parallel",
                  "select_sequential_consistency", "distributed_ddl_task_timeout")

_NAME = r"(?:`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)"
_QUALIFIED = rf"{_NAME}(?:\.{_NAME})?"
_PLACEMENTS = [
    re.compile(rf"^\s*CREATE\s+DATABASE\s+(?:IF\s+NOT\s+EXISTS\s+)?{_NAME}", re.IGNORECASE),
    re.compile(rf"^\s*DROP\s+DATABASE\s+(?:IF\s+EXISTS\s+)?{_NAME}", re.IGNORECASE),
    re.compile(rf"^\s*CREATE\s+(?:TABLE|VIEW)\s+(?:IF\s+NOT\s+EXISTS\s+)?(?P<table>{_QUALIFIED})", re.IGNORECASE),
    re.compile(rf"^\s*DROP\s+(?:TABLE|VIEW)\s+(?:IF\s+EXISTS\s+)?{_QUALIFIED}", re.IGNORECASE),
    re.compile(rf"^\s*ALTER\s+TABLE\s+{_QUALIFIED}", re.IGNORECASE),
]
_CREATE_IF_MISSING = re.compile(
    rf"^\s*CREATE\s+(?P<kind>DATABASE|TABLE|VIEW)\s+IF\s+NOT\s+EXISTS\s+(?P<name>{_QUALIFIED})", re.IGNORECASE
)
_DDL_VERB = re.compile(r"^\s*(CREATE|DROP|ALTER|RENAME|TRUNCATE|ATTACH|DETACH)\b", re.IGNORECASE)
_ENGINE = re.compile(r"\bENGINE\s*=\s*(?P<engine>[A-Za-z]*)(?P<args>\s*\()?")
_PATH_SAFE = re.compile(r"[A-Za-z0-9_-]")


def zookeeper_component(name: str) -> str:
    """``name`` as one ZooKeeper path component: letters, digits, ``_`` and ``-`` kept, every
    other UTF-8 byte written ``@HH`` (so ``/``, ``.``, quotes and macro braces cannot change the
    path, and two different names never share one)."""
    return "".join(
        char if _PATH_SAFE.fullmatch(char) else "".join(f"@{byte:02x}" for byte in char.encode())
        for char in name
    )


def _unquote(name: str) -> str:
    return name[1:-1] if name.startswith("`") else name


def zookeeper_path(qualified_table: str) -> str:
    """The replicated table's ZooKeeper path for ```db`.`table```: one per table, per shard."""
    parts = [_unquote(part) for part in re.findall(_NAME, qualified_table)]
    if len(parts) != 2:
        raise CatalogError(f"a replicated table needs a database-qualified name, not {qualified_table!r}")
    return "/clickhouse/tables/{shard}/" + "/".join(zookeeper_component(part) for part in parts)


def _replicated_engine(statement: str, table: str) -> str:
    """``statement`` with its MergeTree engine made the Replicated one, arguments filled in."""
    match = _ENGINE.search(statement)
    if match is None:
        return statement  # a VIEW: it stores nothing, so there is nothing to replicate
    engine = match.group("engine")
    if not engine.endswith("MergeTree") or engine.startswith("Replicated") or match.group("args"):
        raise CatalogError(
            f"cannot replicate the engine {engine!r} of {table} on a cluster (only plain MergeTree-family "
            "engines without arguments are made Replicated)"
        )
    path = zookeeper_path(table).replace("\\", "\\\\").replace("'", "\\'")
    replicated = f"ENGINE = Replicated{engine}('{path}', '{{replica}}')"
    return statement[: match.start()] + replicated + statement[match.end():]


def created_if_missing(statement: str) -> tuple[str, ...] | None:
    """``(database,)`` or ``(database, table)`` that a ``CREATE ... IF NOT EXISTS`` statement
    names, or None for any other statement (and for a table not qualified by its database)."""
    match = _CREATE_IF_MISSING.match(statement)
    if match is None:
        return None
    name = tuple(_unquote(part) for part in re.findall(_NAME, match.group("name")))
    expected = 1 if match.group("kind").upper() == "DATABASE" else 2
    return name if len(name) == expected else None


def on_cluster(statement: str, cluster: str) -> str | None:
    """The DDL ``statement`` placed ``ON CLUSTER cluster`` with replicated engines, or None when
    it is not DDL (INSERT, SELECT, ...). Raises CatalogError for DDL it cannot place."""
    for pattern in _PLACEMENTS:
        match = pattern.match(statement)
        if match is None:
            continue
        placed = statement[: match.end()] + f" ON CLUSTER `{cluster}`" + statement[match.end():]
        table = match.groupdict().get("table")
        return _replicated_engine(placed, table) if table else placed
    if _DDL_VERB.match(statement):
        first = statement.strip().splitlines()[0]
        raise CatalogError(f"refusing DDL the cluster catalog cannot run on every replica: {first!r}")
    return None


def quorum_error(exc: ServerError, entry: str, quorum: int, timeout: float) -> QuorumError | None:
    """The :class:`QuorumError` a quorum failure of ``exc`` stands for, or None for any other error.

    ``outcome_unknown`` says whether the rows may have been written (see the module docstring).
    """
    if exc.code == TOO_FEW_LIVE_REPLICAS:
        text = (f"fewer than {quorum} replicas of the cluster are alive (entry {entry}), so the insert "
                "was refused before anything was written; it can be retried once every replica is back")
        unknown = False
    elif exc.code == UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE:
        text = (f"an earlier quorum insert into the same table was still not confirmed by all {quorum} "
                f"replicas after {timeout:g} s (entry {entry}); this insert was refused before anything was written")
        unknown = False
    elif exc.code == UNKNOWN_STATUS_OF_INSERT:
        text = (f"the insert reached the entry replica {entry} but not all {quorum} replicas confirmed it "
                f"within {timeout:g} s; whether it took effect is unknown")
        unknown = True
    else:
        return None
    error = QuorumError(f"{text} ({exc})")
    error.outcome_unknown = unknown
    error.code = exc.code
    return error


class ClusterBackend(ServerBackend):
    """A server backend whose DDL runs on every replica and whose writes wait for all of them.

    ``quorum_timeout`` (seconds) bounds how long an insert waits for every replica to confirm
    it (ClickHouse's ``insert_quorum_timeout``, default there 10 minutes); ``ddl_timeout``
    (seconds) how long a schema statement waits for every replica to run it.
    """

    kind = "cluster"

    def __init__(
        self,
        host: str,
        port: int = 9000,
        database: str = "default",
        user: str = "default",
        password: str = "",
        *,
        cluster: str,
        quorum_timeout: float = 30.0,
        ddl_timeout: float = 120.0,
        **settings: object,
    ):
        self.cluster = validate_identifier(cluster, "cluster name")
        owned = sorted(set(settings) & set(OWNED_SETTINGS))
        if owned:
            raise InvalidArgumentError(
                f"{owned} are set by the cluster catalog (all replicas, sequential reads); use "
                "quorum_timeout= and ddl_timeout= (seconds) for the timeouts"
            )
        for name, value in (("quorum_timeout", quorum_timeout), ("ddl_timeout", ddl_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgumentError(f"{name} must be a positive number of seconds, not {value!r}")
        self.quorum_timeout = float(quorum_timeout)
        self.ddl_timeout = float(ddl_timeout)
        self.quorum = 0  # known once the cluster has been looked up, before any DDL or insert
        create_database = settings.pop("create_database", True)
        super().__init__(host, port, "default", user, password, create_database=False, **settings)
        self.where = f"clickhouse://{host}:{self.port}/{database}?cluster={self.cluster}"
        try:
            self.database = validate_identifier(database, "database name")
            self.quorum = self._replicas()
            self._client.settings.update(
                insert_quorum=self.quorum,
                insert_quorum_timeout=int(self.quorum_timeout * 1000),
                select_sequential_consistency=1,
            )
            if self._server_has_setting("insert_quorum_parallel"):  # newer servers; 18.16 always linearizes
                self._client.settings["insert_quorum_parallel"] = 0
            if create_database:
                self.command(f"CREATE DATABASE IF NOT EXISTS `{self.database}`")
        except BaseException:
            self.close()
            raise

    def _replicas(self) -> int:
        """How many replicas the cluster's one shard has; refuses an unknown or sharded cluster,
        and a server without the ``shard`` and ``replica`` macros the replicated paths need."""
        rows = super().query(
            "SELECT shard_num, count() AS replicas FROM system.clusters WHERE cluster = %(cluster)s GROUP BY shard_num",
            {"cluster": self.cluster},
        ).to_pylist()
        if not rows:
            raise InvalidArgumentError(
                f"the server at {self.host}:{self.port} has no cluster {self.cluster!r} in its remote_servers "
                "(SELECT DISTINCT cluster FROM system.clusters lists the ones it has)"
            )
        if len(rows) > 1:
            raise InvalidArgumentError(
                f"cluster {self.cluster!r} has {len(rows)} shards; the catalog runs on one shard of replicas "
                "(see docs/scale-out-cluster.md)"
            )
        macros = set(super().query("SELECT macro FROM system.macros").column("macro").to_pylist())
        if not {"shard", "replica"} <= macros:
            raise CatalogError(
                f"the server at {self.host}:{self.port} lacks the macros {sorted({'shard', 'replica'} - macros)} "
                "that name each replica's copy of a replicated table (<macros> in its config)"
            )
        return int(rows[0]["replicas"])

    def _execute(self, sql: str, params=None, **kwargs):
        deadline = time.monotonic() + self.quorum_timeout
        pause = 0.01
        while True:
            try:
                return super()._execute(sql, params, **kwargs)
            except ServerError as exc:
                error = quorum_error(exc, f"{self.host}:{self.port}", self.quorum, self.quorum_timeout)
                if error is None:
                    raise
                if exc.code == UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE and time.monotonic() < deadline:
                    time.sleep(pause)  # nothing was written: wait for the earlier insert's quorum
                    pause = min(pause * 2, 0.5)
                    continue
                raise error from exc

    def command(self, sql: str, params: Mapping[str, object] | None = None) -> None:
        placed = on_cluster(sql, self.cluster)
        if placed is None:
            return super().command(sql, params)
        if self._exists(created_if_missing(sql)):
            return  # created ON CLUSTER before: the DDL queue runs it on every replica, even one down then
        with self._lock:  # the SET and the DDL on one connection, nothing in between
            super().command(f"SET distributed_ddl_task_timeout = {int(self.ddl_timeout)}")
            super().command(placed, params)

    def _server_has_setting(self, name: str) -> bool:
        rows = self.query("SELECT count() AS n FROM system.settings WHERE name = %(name)s", {"name": name})
        return rows.column("n").to_pylist() == [1]

    def _exists(self, name: tuple[str, ...] | None) -> bool:
        """Whether the database or table ``name`` exists on the entry replica (False for None).

        Opening a catalog issues every ``CREATE ... IF NOT EXISTS``; on a cluster each one is a
        round through the distributed DDL queue (about 0.1 s, and a wait for every replica), so
        one that already exists here is skipped.
        """
        if name is None:
            return False
        if len(name) == 1:
            sql, params = "SELECT count() AS n FROM system.databases WHERE name = %(db)s", {"db": name[0]}
        else:
            sql = "SELECT count() AS n FROM system.tables WHERE database = %(db)s AND name = %(table)s"
            params = {"db": name[0], "table": name[1]}
        return self.query(sql, params).column("n").to_pylist() == [1]
