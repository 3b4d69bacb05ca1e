"""The catalog conformance suite: every backend subclasses :class:`CatalogConformance`.

A subclass provides the ``catalog_uri`` fixture (a fresh, empty catalog). Everything here
talks to the catalog only through its public API, except where a test has to stand in for
a crash or a lost connection (say so where it happens).
"""

from __future__ import annotations

import threading
import time
import uuid

import pyarrow as pa
import pytest

from dmi.catalog._schema import SCHEMA_VERSION
from dmi.catalog import Watermark, open_catalog
from dmi.storage import (
    ByteRange,
    CatalogUnavailableError,
    InvalidArgumentError,
    InvalidIdentifierError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    PackDescriptor,
    QuarantinedError,
    RecordEntry,
    RecordKey,
    RecordMeta,
    RecordStats,
    SchemaVersionError,
    ServerError,
    ShardGeometry,
)
from dmi.catalog import _leases
from dmi.catalog._catalog_backend import unavailable

HUGE_CHECKSUM = 2**64 - 12345


def entry(pack_id, index, *, model="gpt2", run="run-1", request="req-1", hook="resid_post", layer=0,
          start=0, n=4, shard_rank=0, tp_size=1, shard=None, stats=True, shape=(4, 8), dtype="bfloat16"):
    key = RecordKey(model, run, request, hook, layer, start, n, step=start, phase="prefill" if start == 0 else "decode",
                    shard_rank=shard_rank, tp_size=tp_size)
    meta = RecordMeta(
        key=key, dtype=dtype, shape=tuple(shape), codec="zstd-shuffle", raw_size=64 * (index + 1),
        checksum=HUGE_CHECKSUM - index, shard=shard,
        stats=RecordStats(float(layer) + 0.5, -0.25, 3.0) if stats else None,
    )
    return RecordEntry(meta=meta, pack_id=pack_id, payload=ByteRange(1000 + 64 * index, 64))


def pack(pack_id=None, entries=None, **kw):
    pack_id = pack_id or f"pack-{uuid.uuid4().hex[:12]}"
    if entries is None:
        entries = [entry(pack_id, i, layer=i, **kw) for i in range(3)]
    else:
        entries = [RecordEntry(e.meta, pack_id, e.payload) for e in entries]
    return PackDescriptor(pack_id, f"/packs/{pack_id}.dmipack", 4096, "writer-1", 1, 1700000000.5, tuple(entries))


class FaultyBackend:
    """Stands in for a lost connection (the real one is in test_catalog_faults.py).

    ``arm(table, landed=True)``: the next insert into ``table`` reaches the backend, then
    raises as if the connection broke before the answer came (outcome unknown);
    ``landed=False``: raises as if the connection could not be made (nothing sent).
    """

    def __init__(self, inner):
        self._inner = inner
        self.armed: tuple[str, bool, str | None] | None = None

    def arm(self, table: str, landed: bool = True, kind: str | None = None):
        self.armed = (table, landed, kind)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def insert(self, table, data):
        if self.armed and self.armed[0] in table and (
            self.armed[2] is None or self.armed[2] in data.column("kind").to_pylist()
        ):
            _, landed, _ = self.armed
            self.armed = None
            if landed:
                self._inner.insert(table, data)
            raise unavailable("injected: connection lost", outcome_unknown=landed)
        return self._inner.insert(table, data)


CRASHING_WRITER = r"""
import os, signal, sys
import torch
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, PackWriter, RecordKey

uri, packs, scope = sys.argv[1:4]
store = LocalPackStore(packs)
writer = PackWriter(store, writer_id="crashy")
catalog = open_catalog(uri)
publisher = catalog.publisher(scope, holder="crashy", lease_seconds=8.0)
publisher.acquire()
for layer in range(4):
    writer.append(RecordKey("m", "run", "published", "resid_post", layer, 0, 3), torch.randn(3, 8))
publisher.publish([writer.seal()])
for layer in range(4):
    writer.append(RecordKey("m", "run", "orphan", "resid_post", layer, 0, 3), torch.randn(3, 8))
sealed = writer.seal()
print(sealed.pack_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies between seal and publish
"""


class RecoveryConformance:
    """Kill a writer between seal and publish; recovery publishes the pack exactly once."""

    def test_kill_between_seal_and_publish_then_recover_once(self, catalog_uri, tmp_path):
        import subprocess
        import sys

        from dmi.storage import LeaseHeldError, LocalPackStore

        packs = tmp_path / "packs"
        proc = subprocess.run(
            [sys.executable, "-c", CRASHING_WRITER, catalog_uri, str(packs), "writer-scope"],
            capture_output=True, text=True, timeout=180,
        )
        assert proc.returncode == -9, proc.stderr
        orphan = proc.stdout.strip()
        store = LocalPackStore(packs)
        assert orphan in store.list_packs() and len(store.list_packs()) == 2
        with open_catalog(catalog_uri) as catalog, open_catalog(catalog_uri) as other:
            assert catalog.requests("m") == ["published"]
            with pytest.raises(LeaseHeldError, match="crashy"):
                catalog.recover(store, scope="writer-scope")  # the dead writer's lease is still live
            state = _leases.read_state(catalog, "writer-scope")
            assert state.holder == "crashy"
            time.sleep(max(0.0, state.expires_at - time.time()) + 0.1)
            outcomes: dict[str, object] = {}

            def run(name, cat):
                try:
                    outcomes[name] = cat.recover(store, scope="writer-scope", holder=name)
                except Exception as exc:  # noqa: BLE001 - checked below
                    outcomes[name] = exc

            threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("r1", catalog), ("r2", other))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            recovered = [v for v in outcomes.values() if isinstance(v, list) and v]
            others = [v for v in outcomes.values() if not (isinstance(v, list) and v)]
            # The loser was refused (held, or overtaken by a higher term) or found nothing left.
            assert all(v == [] or isinstance(v, (LeaseHeldError, LeaseLostError)) for v in others), outcomes
            assert recovered == [[orphan]], outcomes
            assert catalog.recover(store, scope="writer-scope") == []
            assert catalog.requests("m") == ["orphan", "published"]
            found = catalog.find_records("m", "orphan")
            assert [e.meta.key.layer for e in found] == [0, 1, 2, 3]
            assert {e.pack_id for e in found} == {orphan}
            published_in = [w.pack_ids for w in catalog.watermarks("writer-scope")]
            assert sum(p.count(orphan) for p in published_in) == 1


class CatalogConformance(RecoveryConformance):
    @pytest.fixture
    def catalog_uri(self):  # pragma: no cover - subclasses override
        raise NotImplementedError

    @pytest.fixture
    def catalog(self, catalog_uri):
        with open_catalog(catalog_uri) as cat:
            yield cat

    def open_more(self, catalog_uri):
        """A second, independent catalog object on the same data."""
        return open_catalog(catalog_uri)

    # ------------------------------------------------------------------ schema
    def test_schema_version_row_and_idempotent_creation(self, catalog, catalog_uri):
        assert catalog.schema_version() == SCHEMA_VERSION
        with self.open_more(catalog_uri) as again:
            assert again.schema_version() == SCHEMA_VERSION
        rows = catalog.sql(f"SELECT version FROM {catalog.tables['schema']}").column("version").to_pylist()
        assert rows == [SCHEMA_VERSION]

    def test_newer_schema_is_refused(self, catalog, catalog_uri):
        catalog._backend.insert(
            catalog.tables["schema"],
            pa.table({"version": pa.array([99], pa.uint32()), "written_at": [0.0], "written_by": ["future"]}),
        )
        with pytest.raises(SchemaVersionError, match="schema version 99"):
            open_catalog(catalog_uri)

    # ------------------------------------------------------------------ publish and find
    def test_publish_then_find_round_trips_every_field(self, catalog):
        geometry = ShardGeometry(axis=1, offset=16, full_shape=(4, 32))
        entries = [
            entry("x", 0, layer=3, shard=geometry, shard_rank=1, tp_size=2, shape=(4, 16)),
            entry("x", 1, layer=-1, hook="token_ids", stats=False, shape=(), dtype="int64"),
            entry("x", 2, layer=3, start=4, n=1, shape=(0, 16)),
        ]
        desc = pack(entries=entries)
        with catalog.publisher("scope-a", holder="h1") as pub:
            watermark = pub.publish([desc])
        assert watermark.pack_ids == (desc.pack_id,)
        assert watermark.n_records == 3
        found = catalog.find_records("gpt2")
        expected = sorted(desc.records, key=lambda e: (e.meta.key.hook, e.meta.key.layer, e.meta.key.shard_rank,
                                                       e.meta.key.start_token))
        assert found == expected
        assert found[0].meta.shard is None or found[0].meta.shard == geometry
        assert {e.meta.checksum for e in found} == {HUGE_CHECKSUM, HUGE_CHECKSUM - 1, HUGE_CHECKSUM - 2}
        assert catalog.pack_locations([desc.pack_id, "absent"]) == {desc.pack_id: desc.location}

    def test_indexed_but_unpublished_records_are_invisible(self, catalog):
        desc = pack()
        catalog._index([desc], scope="s", term=1)  # what a crash right before the watermark leaves
        assert catalog.find_records("gpt2") == []
        assert catalog.models() == []
        n = catalog.sql(f"SELECT count() AS n FROM {catalog.tables['records_published']}").column("n").to_pylist()
        assert n == [0]

    def test_publishing_a_pack_twice_is_harmless(self, catalog):
        desc = pack()
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([desc])
            pub.publish([desc, desc])
        with catalog.publisher("s", holder="h2") as pub:
            pub.publish([desc])
        assert len(catalog.find_records("gpt2")) == 3
        assert catalog.request_contents("gpt2", "req-1")["resid_post"].n_records == 3
        # Even rows indexed twice by a race (bypassing the already-indexed check) show once.
        catalog._backend.insert(catalog.tables["records"], _schema_records([desc]))
        assert len(catalog.find_records("gpt2")) == 3
        n = catalog.sql(f"SELECT count() AS n FROM {catalog.tables['records_published']}").column("n").to_pylist()
        assert n == [3]

    def test_queries_filter_and_order(self, catalog):
        a = pack(entries=[entry("", i, request="r1", layer=i % 3, hook=("resid_post", "attn_q")[i % 2], start=4 * (i // 6))
                          for i in range(12)])
        b = pack(entries=[entry("", i, model="llama", run="run-2", request="r9", layer=i, shard_rank=i % 2, tp_size=2)
                          for i in range(4)])
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([a, b])
        assert catalog.models() == ["gpt2", "llama"]
        assert catalog.runs("llama") == ["run-2"]
        assert catalog.requests("gpt2") == ["r1"]
        assert catalog.requests("gpt2", run_id="nope") == []
        contents = catalog.request_contents("gpt2", "r1")
        assert set(contents) == {"attn_q", "resid_post"}
        assert contents["resid_post"].layers == (0, 1, 2)
        assert contents["resid_post"].n_records == 6
        assert catalog.request_contents("llama", "r9")["resid_post"].shard_ranks == (0, 1)
        got = catalog.find_records("gpt2", "r1", "resid_post", layers=range(0, 2))
        keys = [(e.meta.key.layer, e.meta.key.start_token) for e in got]
        assert keys == sorted(keys) and {k[0] for k in keys} == {0, 1}
        assert all(e.meta.key.hook == "resid_post" for e in got)
        assert len(catalog.find_records("gpt2", hook=["resid_post", "attn_q"])) == 12
        assert catalog.find_records("gpt2", hook=[]) == []
        assert [e.meta.key.layer for e in catalog.find_records("llama", shard_rank=1)] == [1, 3]
        assert catalog.find_records("llama", layers=2)[0].meta.key.layer == 2
        assert catalog.find_records("gpt2", run_id="run-2") == []
        with pytest.raises(InvalidArgumentError):
            catalog.find_records("gpt2", layers=["1"])

    def test_sql_one_query_for_mean_l2_per_layer(self, catalog):
        desc = pack(entries=[entry("", i, layer=i % 4, request=f"r{i}") for i in range(8)])
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([desc])
        table = catalog.sql(
            f"SELECT layer, avg(l2_norm) AS mean_l2 FROM {catalog.tables['records_published']} "
            "WHERE model_id = 'gpt2' AND hook = 'resid_post' GROUP BY layer ORDER BY layer"
        )
        assert isinstance(table, pa.Table)
        assert table.to_pylist() == [{"layer": i, "mean_l2": i + 0.5} for i in range(4)]

    def test_sql_takes_values_as_parameters_only(self, catalog):
        hostile = "x' OR 1=1 -- `%s\\"
        rows = catalog.sql("SELECT %(v)s AS v, length(%(v)s) AS n", {"v": hostile}).to_pylist()
        assert rows == [{"v": hostile, "n": len(hostile.encode())}]
        with pytest.raises(InvalidArgumentError):
            catalog.sql("SELECT 1", ["not", "a", "dict"])

    def test_server_errors_keep_code_and_name(self, catalog):
        with pytest.raises(ServerError) as info:
            catalog.sql("SELEC 1")
        assert info.value.code == 62 and info.value.name == "SYNTAX_ERROR"
        with pytest.raises(ServerError) as info:
            catalog.sql(f"SELECT nope FROM {catalog.tables['records']}")
        assert info.value.code == 47 and info.value.name == "UNKNOWN_IDENTIFIER"

    def test_losses_are_counted(self, catalog):
        catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 3, 5, "ring full")
        catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 3, 2, "ring full")
        catalog.record_losses("gpt2", "run-1", "r2", "logits", -1, 1, "ring full")
        rows = catalog.losses("gpt2").to_pylist()
        assert [(r["request_id"], r["layer"], r["count"]) for r in rows] == [("r1", 3, 7), ("r2", -1, 1)]
        assert catalog.losses("gpt2", request_id="r2").num_rows == 1
        with pytest.raises(InvalidArgumentError):
            catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 3, 0, "ring full")

    # ------------------------------------------------------------------ watermarks
    def test_consistent_prefix_and_follow(self, catalog):
        first, second = pack(request="early"), pack(request="late")
        with catalog.publisher("s", holder="h") as pub:
            w1 = pub.publish([first])
            w2 = pub.publish([second])
        assert (w1.term, w1.seq, w2.seq) == (w2.term, 1, 2)
        assert catalog.watermarks("s") == [w1, w2]
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2", upto=w1)} == {"early"}
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2", upto=w2)} == {"early", "late"}
        assert catalog.find_records("gpt2", scope="other") == []
        assert list(catalog.follow("s", after=w1, timeout=0.2, poll_interval=0.05)) == [w2]

    def test_follow_sees_new_watermarks_as_they_arrive(self, catalog):
        seen: list[Watermark] = []
        pub = catalog.publisher("live", holder="h")
        pub.acquire()

        def reader():
            for w in catalog.follow("live", timeout=3.0, poll_interval=0.05):
                seen.append(w)
                if len(seen) == 3:
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        published = []
        for _ in range(3):
            time.sleep(0.1)
            published.append(pub.publish([pack()]))
        thread.join(10)
        pub.release()
        assert seen == published

    # ------------------------------------------------------------------ leases
    def test_one_holder_at_a_time_terms_increase(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=30)
        b = catalog.publisher("s", holder="B", lease_seconds=30)
        assert a.acquire() == 1
        with pytest.raises(LeaseHeldError, match="'A'"):
            b.acquire()
        assert b.term is None
        a.renew()
        a.release()
        assert a.term is None
        with pytest.raises(LeaseError, match="acquire"):
            a.publish([pack()])
        assert b.acquire() == 2
        with pytest.raises(LeaseHeldError):
            a.acquire()
        b.release()

    def test_expired_lease_is_taken_over_and_the_old_holder_is_refused(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=1.5)
        b = catalog.publisher("s", holder="B", lease_seconds=30)
        a.acquire()
        a.publish([pack(request="by-a")])
        with pytest.raises(LeaseHeldError):
            b.acquire()
        time.sleep(max(0.0, a.expires_at - time.time()) + 0.1)
        assert b.acquire() == 2
        with pytest.raises(LeaseLostError):
            a.publish([pack(request="late-a")])
        assert a.term is None
        with pytest.raises(LeaseError, match="acquire"):
            a.renew()
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"by-a"}

    def test_publish_after_takeover_is_refused_by_the_server_check(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=30)
        a.acquire()
        restarted = catalog.publisher("s", holder="A", lease_seconds=30)  # same holder, new process
        assert restarted.acquire() == 2
        with pytest.raises(LeaseLostError, match="successor"):
            a.publish([pack(request="stale")])  # its own clock says the lease is fine
        assert a.term is None
        with pytest.raises(LeaseError):
            a.renew()
        rows = catalog.sql(f"SELECT count() AS n FROM {catalog.tables['watermarks']}").column("n").to_pylist()
        assert rows == [0]
        assert catalog.find_records("gpt2") == []

    def test_renew_after_takeover_is_refused(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=30)
        a.acquire()
        catalog.publisher("s", holder="A").acquire()
        with pytest.raises(LeaseLostError, match="successor"):
            a.renew()
        renewals = catalog.sql(f"SELECT count() AS n FROM {catalog.tables['leases']} WHERE kind = 'renew'")
        assert renewals.column("n").to_pylist() == [0]

    def test_expired_holder_writes_nothing(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=0.3)
        a.acquire()
        time.sleep(0.4)
        late = pack(request="late")
        with pytest.raises(LeaseLostError, match="expired"):
            a.publish([late])
        assert catalog.pack_locations([late.pack_id]) == {}  # refused before any index row

    def test_zombie_publish_after_takeover_is_never_visible(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=30)
        a.acquire()
        a.publish([pack(request="before")])
        # B takes over (A is paused; B is allowed as A's holder name would be after a restart).
        b = catalog.publisher("s", holder="A", lease_seconds=30)
        b.acquire()
        # A wakes up having passed its lease check just before the takeover: stand in for
        # that race by skipping the check, so its watermark really lands after the fence.
        a._still_mine = lambda state, now: True
        zombie = a.publish([pack(request="zombie")])
        assert zombie.term == 1
        rows = catalog.sql(f"SELECT term, seq FROM {catalog.tables['watermarks']} ORDER BY term, seq").to_pylist()
        assert rows == [{"term": 1, "seq": 1}, {"term": 1, "seq": 2}]  # it did land
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"before"}
        assert [w.seq for w in catalog.watermarks("s")] == [1]
        b.publish([pack(request="after")])
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"before", "after"}

    def test_a_fence_alone_hides_a_watermark_from_a_reader_that_already_looked(self, catalog, catalog_uri):
        """Readers cache the visible pack set; a fence that adds no watermark must still end it."""
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(request="early")])
        with self.open_more(catalog_uri) as reader:
            assert {e.meta.key.request_id for e in reader.find_records("gpt2")} == {"early"}
            # A successor's fence whose cut precedes that watermark (as when the watermark
            # landed after the successor read the cut): written directly, nothing else changes.
            catalog._backend.insert(
                catalog.tables["fences"],
                pa.table({
                    "scope": ["s"], "fencing_term": pa.array([2], pa.uint64()),
                    "cut_term": pa.array([0], pa.uint64()), "cut_seq": pa.array([0], pa.uint64()),
                    "holder": ["B"], "nonce": ["n"], "written_at": [0.0],
                }),
            )
            assert reader.find_records("gpt2") == []
            assert catalog.find_records("gpt2") == []

    def test_renewal_keeps_the_lease(self, catalog):
        a = catalog.publisher("s", holder="A", lease_seconds=2.0)
        a.acquire()
        for _ in range(3):
            time.sleep(0.8)
            a.renew()  # 2.4 s after acquiring: alive only because it was renewed
        with pytest.raises(LeaseHeldError):
            catalog.publisher("s", holder="B").acquire()
        a.publish([pack()])
        a.release()

    def test_racing_writers_one_holder_per_term(self, catalog_uri):
        results: list[tuple[int, str]] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)
        catalogs = [self.open_more(catalog_uri) for _ in range(4)]

        def race(i):
            cat = catalogs[i]
            for round_ in range(3):
                pub = cat.publisher("race", holder=f"w{i}", lease_seconds=30)
                try:
                    barrier.wait(10)
                    term = pub.acquire()
                    results.append((term, f"w{i}"))
                    pub.publish([pack(request=f"w{i}-{round_}")])
                    pub.release()
                except (LeaseHeldError, LeaseLostError):
                    pass
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for cat in catalogs:
            cat.close()
        assert not errors, errors
        terms = [t for t, _ in results]
        assert len(terms) == len(set(terms)), f"two holders for one term: {sorted(results)}"
        assert results, "nobody ever won"
        with open_catalog(catalog_uri) as cat:
            confirms = cat.sql(
                f"SELECT term, count() AS n FROM {cat.tables['leases']} WHERE kind = 'confirm' GROUP BY term"
            ).to_pylist()
        assert all(r["n"] == 1 for r in confirms)

    # ------------------------------------------------------------------ quarantine
    @pytest.mark.parametrize("kind", ["claim", "confirm", "renew"])
    def test_unknown_outcome_quarantines(self, catalog, kind):
        faulty = FaultyBackend(catalog._backend)
        catalog._backend = faulty
        pub = catalog.publisher("s", holder="A", lease_seconds=30)
        if kind == "renew":
            pub.acquire()
            pub.publish([pack(request="ok")])
        faulty.arm("leases", landed=True, kind=kind)
        with pytest.raises(QuarantinedError, match="connection broke"):
            pub.renew() if kind == "renew" else pub.acquire()
        assert pub.quarantined and pub.term is None
        with pytest.raises(QuarantinedError):
            pub.publish([pack(request="while-quarantined")])
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} <= {"ok"}
        pub.acquire()
        assert not pub.quarantined
        pub.publish([pack(request="after")])
        assert "after" in {e.meta.key.request_id for e in catalog.find_records("gpt2")}

    def test_unknown_watermark_outcome_quarantines(self, catalog):
        faulty = FaultyBackend(catalog._backend)
        catalog._backend = faulty
        pub = catalog.publisher("s", holder="A")
        pub.acquire()
        faulty.arm("watermarks", landed=True)
        with pytest.raises(QuarantinedError):
            pub.publish([pack(request="maybe")])
        with pytest.raises(QuarantinedError):
            pub.publish([pack(request="never")])
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"maybe"}

    def test_certain_failure_does_not_quarantine(self, catalog):
        faulty = FaultyBackend(catalog._backend)
        catalog._backend = faulty
        pub = catalog.publisher("s", holder="A")
        term = pub.acquire()
        faulty.arm("leases", landed=False, kind="renew")
        with pytest.raises(CatalogUnavailableError):
            pub.renew()
        assert not pub.quarantined and pub.term == term
        with pytest.raises(InvalidArgumentError):
            pub.publish(["not a descriptor"])
        assert not pub.quarantined and pub.term == term
        pub.publish([pack(request="fine")])
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"fine"}

    # ------------------------------------------------------------------ identifiers
    def test_hostile_values_round_trip_verbatim(self, catalog):
        hostile = ["it's", 'say "hi"', "`tick`", "50%", "%(model_id)s", "../../etc/passwd", "x'; DROP TABLE t; --",
                   "back\\slash", "unicode é 漢字 🙂", "a" * 512]
        descs = [pack(entries=[entry("", 0, model=value, request=value, run=value)]) for value in hostile]
        with catalog.publisher("s", holder="h") as pub:
            pub.publish(descs)
        assert catalog.models() == sorted(hostile)
        for value in hostile:
            found = catalog.find_records(value, value, run_id=value)
            assert [e.meta.key.model_id for e in found] == [value]
            assert catalog.requests(value) == [value]
        assert catalog.find_records("it") == []

    def test_hostile_values_that_cannot_round_trip_are_refused(self, catalog):
        for bad in ["nul\x00byte", "new\nline", "a" * 10_000, "", "\ud800"]:
            with pytest.raises(InvalidIdentifierError):
                catalog.find_records(bad)
            with pytest.raises(InvalidIdentifierError):
                with catalog.publisher("s", holder="h") as pub:
                    pub.publish([pack(entries=[entry("", 0, model=bad)])])
            with pytest.raises(InvalidIdentifierError):
                catalog.publisher(bad)
        assert catalog.models() == []


def _schema_records(descs):
    from dmi.catalog import _schema

    return _schema.records_table(descs)



