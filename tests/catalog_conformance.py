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

from dmi.catalog import Catalog, HookContents, ModelTotals, RequestTotals, Watermark, open_catalog
from dmi.catalog._schema import SCHEMA_VERSION
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
from dmi.catalog import _schema
from dmi.catalog._catalog_backend import unavailable

HUGE_CHECKSUM = 2**64 - 12345


def entry(pack_id, index, *, model="gpt2", run="run-1", request="req-1", hook="resid_post", layer=0,
          start=0, n=4, shard_rank=0, tp_size=1, shard=None, stats=True, shape=(4, 8), dtype="bfloat16",
          token_axis=0, key_axis=None):
    key = RecordKey(model, run, request, hook, layer, start, n, step=start, phase="prefill" if start == 0 else "decode",
                    shard_rank=shard_rank, tp_size=tp_size)
    meta = RecordMeta(
        key=key, dtype=dtype, shape=tuple(shape), codec="zstd-shuffle", raw_size=64 * (index + 1),
        checksum=HUGE_CHECKSUM - index, shard=shard,
        stats=RecordStats(float(layer) + 0.5, -0.25, 3.0) if stats else None,
        token_axis=token_axis, key_axis=key_axis,
    )
    return RecordEntry(meta=meta, pack_id=pack_id, payload=ByteRange(1000 + 64 * index, 64))



class ManualClock:
    """Unix seconds that move only when a test says so, starting from the real time (so that
    holders on the real clock and on this one agree until the test advances it)."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def manual_catalog_clock(monkeypatch) -> ManualClock:
    """The clock loss rows and tombstones are stamped with (``recorded_at``, ``deleted_at``),
    moved only by the test: stands in for time passing between a deletion and a new capture."""
    import types

    from dmi.catalog import _catalog, _deletion

    clock = ManualClock()
    stand_in = types.SimpleNamespace(time=clock, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(_catalog, "time", stand_in)
    monkeypatch.setattr(_deletion, "time", stand_in)
    return clock


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


class InterleavingBackend:
    """Runs ``before()`` once, just before the first lease row of ``kind`` is inserted.

    Stands in for a rival's statements landing between two of ours: a real race between
    two claimers cannot be steered to that exact point, so the rival runs inside it.
    """

    def __init__(self, inner, kind: str, before):
        self._inner = inner
        self._kind = kind
        self._before = before

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def insert(self, table, data):
        if self._before is not None and "leases" in table and self._kind in data.column("kind").to_pylist():
            before, self._before = self._before, None
            before()
        return self._inner.insert(table, data)


def publisher_on(catalog, backend, scope, holder, lease_seconds=30.0):
    """A publisher of ``catalog`` whose statements go through ``backend`` (a test wrapper)."""
    original = catalog._backend
    catalog._backend = backend
    try:
        return catalog.publisher(scope, holder=holder, lease_seconds=lease_seconds)
    finally:
        catalog._backend = original


def fence_without_confirm(catalog, scope, holder):
    """Run a successor's claim and fence for real, then fail its confirm (certainly not landed).

    What a successor that crashed (or lost its connection) between fence and confirm leaves:
    a fence of a higher term and no confirm for it. Returns the successor's term.
    """
    faulty = FaultyBackend(catalog._backend)
    successor = publisher_on(catalog, faulty, scope, holder)
    faulty.arm("leases", landed=False, kind="confirm")
    with pytest.raises(CatalogUnavailableError):
        successor.acquire()
    assert successor.term is None and not successor.quarantined
    return catalog.lease_state(scope).max_fence


CRASHING_WRITER = r"""
import os, signal, sys
import torch
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, PackWriter, RecordKey

uri, packs, scope = sys.argv[1:4]
store = LocalPackStore(packs)
writer = PackWriter(store, writer_id="crashy")
catalog = open_catalog(uri)
publisher = catalog.publisher(scope, holder="crashy", lease_seconds=600.0)
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


def _clock_past(monkeypatch, expires_at: float) -> None:
    """Every publisher made from now on (recovery's too) reads a lease clock that runs at real
    speed from just past ``expires_at``."""
    shift = expires_at + 0.1 - time.time()
    publisher = Catalog.publisher
    monkeypatch.setattr(Catalog, "publisher",
                        lambda self, *args, **kwargs: publisher(self, *args, clock=lambda: time.time() + shift, **kwargs))


class RecoveryConformance:
    """Kill a writer between seal and publish; recovery publishes the pack exactly once."""

    def test_kill_between_seal_and_publish_then_recover_once(self, catalog_uri, tmp_path, monkeypatch):
        """The dead writer's lease is long, so that it is still live when recovery is first
        refused however slow the machine; the recoverers then read their lease clock just past
        its expiry — as after waiting for it, without the wait."""
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
            state = catalog.lease_state("writer-scope")
            assert state.holder == "crashy"
            _clock_past(monkeypatch, state.expires_at)
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

    def test_a_recovery_overtaken_while_it_works_raises_instead_of_claiming_the_packs(
        self, catalog_uri, tmp_path, monkeypatch
    ):
        """A stand-in for a race met once in 26 runs of the test above on a loaded machine: a
        second recoverer takes the scope over while the first is between its re-check and its
        publish (here the same holder name, which may take over its own lease), and publishes
        the orphan itself. The first must not report the orphan as its own recovery too."""
        import torch

        from dmi.storage import LocalPackStore, PackWriter

        store = LocalPackStore(tmp_path / "packs")
        with PackWriter(store, writer_id="w") as writer:
            for layer in range(2):
                writer.append(RecordKey("m", "run", "orphan", "resid_post", layer, 0, 3), torch.randn(3, 8))
            orphan = writer.seal().pack_id
        with open_catalog(catalog_uri) as catalog, open_catalog(catalog_uri) as other:
            restore = Catalog._restore_index_rows
            successor: list[list[str]] = []

            def restore_then_overtaken(self, descriptors, **kwargs):
                restore(self, descriptors, **kwargs)
                if self is catalog and not successor:
                    successor.append(other.recover(store, scope="s", holder="same"))

            monkeypatch.setattr(Catalog, "_restore_index_rows", restore_then_overtaken)
            with pytest.raises(LeaseLostError, match="a successor took over"):
                catalog.recover(store, scope="s", holder="same")
            assert successor == [[orphan]]
            assert catalog.recover(store, scope="s") == []
            assert [w.pack_ids for w in catalog.watermarks("s")] == [(orphan,)]
            assert [e.meta.key.layer for e in catalog.find_records("m", "orphan")] == [0, 1]



CRASHING_DELETER = r"""
import os, signal, sys
from dmi.catalog import open_catalog
from dmi.storage import LocalPackStore, PackStore

uri, packs, kill_at = sys.argv[1:4]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


# Stand-ins for a power cut at a chosen point: the process really dies by SIGKILL there.
catalog = open_catalog(uri)
insert = catalog._backend.insert
if kill_at == "before-tombstone":
    catalog._backend.insert = lambda table, data: die() if "deletions" in table else insert(table, data)
removed = []


def delete(self, pack_id):
    if kill_at == "after-tombstone" or (kill_at == "midway" and removed):
        die()
    PackStore.delete(self, pack_id)
    removed.append(pack_id)


LocalPackStore.delete = delete
catalog.delete_runs("m", "doomed")
catalog.purge_deleted(LocalPackStore(packs))
print("finished", flush=True)
"""


def write_real_packs(packs_dir, runs):
    """Seal one real pack per ``(model, run, request, n_layers)``; returns the descriptors."""
    import torch

    from dmi.storage import LocalPackStore, PackWriter

    writer = PackWriter(LocalPackStore(packs_dir), writer_id="test")
    sealed = []
    for model, run, request, n_layers in runs:
        for layer in range(n_layers):
            writer.append(RecordKey(model, run, request, "resid_post", layer, 0, 3), torch.randn(3, 8))
        sealed.append(writer.seal())
    return sealed


class DeletionCrashConformance:
    """Kill a delete by SIGKILL at a chosen point: no other run loses a record, the deleted run
    is fully visible or fully gone, and a later purge (or delete) finishes the removal."""

    @pytest.mark.parametrize("kill_at", ["before-tombstone", "after-tombstone", "midway"])
    def test_a_killed_delete_is_all_or_nothing_and_finishes_later(self, catalog_uri, tmp_path, kill_at):
        import subprocess
        import sys

        from dmi.storage import LocalPackStore

        packs = tmp_path / "packs"
        doomed = write_real_packs(packs, [("m", "doomed", "d1", 2), ("m", "doomed", "d2", 3), ("m", "doomed", "d3", 1)])
        kept = write_real_packs(packs, [("m", "kept", "k1", 2), ("other", "doomed", "o1", 2)])
        with open_catalog(catalog_uri) as catalog:
            with catalog.publisher("s", holder="w") as pub:
                pub.publish(doomed + kept)
            before = {(e.meta.key.run_id, e.meta.key.request_id, e.meta.key.layer, e.pack_id)
                      for model in ("m", "other") for e in catalog.find_records(model)}
        proc = subprocess.run([sys.executable, "-c", CRASHING_DELETER, catalog_uri, str(packs), kill_at],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == -9, proc.stdout + proc.stderr
        store = LocalPackStore(packs)
        doomed_ids = {d.pack_id for d in doomed}
        on_disk = set(store.list_packs())
        assert {d.pack_id for d in kept} <= on_disk  # no file another run needs was removed
        if kill_at == "midway":
            assert len(doomed_ids - on_disk) == 1
        with open_catalog(catalog_uri) as catalog:
            m = {(e.meta.key.run_id, e.meta.key.request_id, e.meta.key.layer, e.pack_id)
                 for e in catalog.find_records("m")}
            other = {(e.meta.key.run_id, e.meta.key.request_id, e.meta.key.layer, e.pack_id)
                     for e in catalog.find_records("other")}
            kept_rows = {row for row in before if row[0] == "kept"}
            assert {row for row in m if row[0] == "kept"} == kept_rows
            assert other == {row for row in before if row[1] == "o1"}  # the same run id in another model
            doomed_rows = {row for row in m if row[0] == "doomed"}
            if kill_at == "before-tombstone":  # fully visible: nothing happened
                assert doomed_rows == {row for row in before if row[0] == "doomed" and row[1] != "o1"}
                assert catalog.deleted_pack_ids() == set()
                assert catalog.purge_deleted(store) == []
                assert set(store.list_packs()) == on_disk
                assert [d.run_id for d in catalog.delete_runs("m", "doomed")] == ["doomed"]
            else:  # fully gone, though some files are still there
                assert doomed_rows == set()
                assert catalog.runs("m") == ["kept"]
                assert catalog.deleted_pack_ids() == doomed_ids
                assert catalog.recover(store) == []  # recovery does not bring deleted packs back
                assert catalog.runs("m") == ["kept"]
            lingering = doomed_ids & set(store.list_packs())
            assert lingering
            assert set(catalog.purge_deleted(store)) == lingering
            assert set(store.list_packs()) == {d.pack_id for d in kept}
            assert catalog.purge_deleted(store) == []
            assert catalog.runs("m") == ["kept"] and catalog.runs("other") == ["doomed"]
            assert {(e.meta.key.run_id, e.meta.key.request_id, e.meta.key.layer, e.pack_id)
                    for e in catalog.find_records("m")} == kept_rows


# The version-1 published view, verbatim: an existing catalog of the previous version has it.
V1_PUBLISHED_RECORDS_VIEW = """
    CREATE VIEW {records_published} AS
    SELECT * FROM {records}
    WHERE pack_id IN (SELECT DISTINCT arrayJoin(pack_ids) AS pack_id FROM (""" + "{visible}" + """))
    LIMIT 1 BY pack_id, record_index"""


class CatalogConformance(RecoveryConformance, DeletionCrashConformance):
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

    def test_a_version_1_catalog_is_upgraded_in_place(self, catalog, catalog_uri):
        """Turn a fresh catalog into what version 1 created (no deletions table, the old view,
        version row 1), then open it: upgraded, its records kept, deletion honoured."""
        from dmi.catalog import _schema

        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1"), pack(run="r2", request="req-2")])
        t = catalog.tables
        for name in ("deletions", "records_published", "schema"):
            catalog._backend.command(f"DROP TABLE {t[name]}")
        catalog._backend.command(_schema.ddl_statements(t)[0])
        catalog._backend.insert(t["schema"], pa.table({"version": pa.array([1], pa.uint32()), "written_at": [0.0],
                                                       "written_by": ["dmi 1"]}))
        visible = _schema.VISIBLE_WATERMARKS.format(**t)
        catalog._backend.command(V1_PUBLISHED_RECORDS_VIEW.format(visible=visible, **t))
        assert catalog.schema_version() == 1
        with self.open_more(catalog_uri) as upgraded:
            assert upgraded.schema_version() == _schema.SCHEMA_VERSION
            assert upgraded.runs("gpt2") == ["r1", "r2"]
            assert [d.run_id for d in upgraded.delete_runs("gpt2", "r1")] == ["r1"]
            view = upgraded.sql(f"SELECT DISTINCT run_id FROM {t['records_published']}").column("run_id").to_pylist()
            assert view == ["r2"]
            assert upgraded.runs("gpt2") == ["r2"]
        with self.open_more(catalog_uri) as again:  # upgrading is done once
            versions = again.sql(f"SELECT version FROM {t['schema']} ORDER BY version").column("version").to_pylist()
            assert versions == [1, _schema.SCHEMA_VERSION]

    # ------------------------------------------------------------------ deletion
    def test_delete_a_run_hides_it_at_once_and_only_it(self, catalog, catalog_uri):
        """Run r1 alone in one pack, r2 alone in another, both in a third (the pack writer
        allows that): deleting r1 hides every r1 record everywhere, r2 keeps all of its own."""
        mixed = pack(entries=[entry("", 0, run="r1", request="a", layer=5),
                              entry("", 1, run="r2", request="b", layer=5)])
        only_r1, only_r2 = pack(run="r1", request="a"), pack(run="r2", request="b")
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([only_r1, only_r2, mixed])
        with self.open_more(catalog_uri) as reader:
            assert len(reader.find_records("gpt2")) == 8  # the reader has cached what it sees
            deleted = catalog.delete_runs("gpt2", "r1", deleted_by="me")
            assert [(d.model_id, d.run_id, d.pack_ids, d.n_records, d.deleted_by) for d in deleted] == [
                ("gpt2", "r1", tuple(sorted([only_r1.pack_id, mixed.pack_id])), 4, "me")
            ]
            for cat in (reader, catalog):
                found = cat.find_records("gpt2")
                assert {(e.meta.key.run_id, e.pack_id) for e in found} == {
                    ("r2", only_r2.pack_id), ("r2", mixed.pack_id)
                }
                assert len(found) == 4
                assert cat.find_records("gpt2", run_id="r1") == []
                assert cat.find_records("gpt2", scope="s") == found
                assert cat.runs("gpt2") == ["r2"] and cat.requests("gpt2") == ["b"] and cat.models() == ["gpt2"]
                assert cat.request_contents("gpt2", "a") == {}
                assert cat.request_contents("gpt2", "b")["resid_post"].n_records == 4
                view = cat.sql(f"SELECT run_id, count() AS n FROM {cat.tables['records_published']} GROUP BY run_id")
                assert view.to_pylist() == [{"run_id": "r2", "n": 4}]
                assert cat.run_totals().column("run_id").to_pylist() == ["r2"]
        assert catalog.deleted_pack_ids() == {only_r1.pack_id}  # the mixed pack still holds r2
        assert catalog.delete_runs("gpt2", "r1") == []  # nothing left to delete
        catalog.delete_runs("gpt2", "r2")
        assert catalog.deleted_pack_ids() == {only_r1.pack_id, only_r2.pack_id, mixed.pack_id}
        assert catalog.models() == [] and catalog.find_records("gpt2") == []

    def test_delete_a_whole_model_in_one_tombstone(self, catalog):
        hostile = "it's `x` %(y)s ../ ; DROP TABLE z"
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1"), pack(run="r2"), pack(model="kept", run="r1"),
                         pack(model=hostile, run=hostile)])
        assert [d.run_id for d in catalog.delete_runs(hostile, hostile)] == [hostile]
        assert catalog.deletions(model_id=hostile, run_id=hostile)[0].model_id == hostile
        deleted = catalog.delete_runs("gpt2")
        assert [d.run_id for d in deleted] == ["r1", "r2"]
        assert len({d.deletion_id for d in deleted}) == 1
        assert catalog.models() == ["kept"]
        assert sorted((d.model_id, d.run_id) for d in catalog.deletions()) == [("gpt2", "r1"), ("gpt2", "r2"),
                                                                                (hostile, hostile)]
        assert catalog.deletions(model_id="kept") == []
        assert len(catalog.find_records("kept", run_id="r1")) == 3

    @pytest.fixture
    def catalog_clock(self, monkeypatch):
        return manual_catalog_clock(monkeypatch)

    def test_losses_of_a_deleted_run_are_hidden_and_a_recapture_shows_only_its_own(self, catalog, catalog_clock):
        """A tombstone hides its run's losses recorded no later than its ``deleted_at`` (losses
        name no pack); the same run id captured again shows only the losses recorded since, and
        other runs (of the same id in another model too) keep theirs."""
        def loss(run, request, hook, layer, count, model="gpt2"):
            return {"model_id": model, "run_id": run, "request_id": request, "hook": hook, "layer": layer,
                    "reason": "ring full", "count": count}

        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1", request="a"), pack(run="r2", request="b")])
        catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, 5, "ring full")
        catalog.record_losses("gpt2", "r1", "a", "logits", -1, 1, "ring full")
        catalog.record_losses("gpt2", "r2", "b", "resid_post", 0, 2, "ring full")
        catalog.record_losses("other", "r1", "a", "resid_post", 3, 4, "ring full")
        catalog_clock.advance(1.0)
        assert [d.run_id for d in catalog.delete_runs("gpt2", "r1")] == ["r1"]
        catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, 6, "ring full")  # at deleted_at: hidden too
        kept = [loss("r2", "b", "resid_post", 0, 2), loss("r1", "a", "resid_post", 3, 4, model="other")]
        assert catalog.losses().to_pylist() == sorted(kept, key=lambda r: (r["model_id"], r["run_id"]))
        assert catalog.losses("gpt2").to_pylist() == [kept[0]]
        assert catalog.losses("gpt2", "r1").num_rows == 0
        assert catalog.losses("gpt2", request_id="a").num_rows == 0

        catalog_clock.advance(1.0)  # the run captured again under the same id
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1", request="a")])
        catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, 7, "ring full")
        assert catalog.losses("gpt2").to_pylist() == [loss("r1", "a", "resid_post", 3, 7), kept[0]]
        assert catalog.losses("gpt2", "r1", "a").to_pylist() == [loss("r1", "a", "resid_post", 3, 7)]
        catalog_clock.advance(1.0)
        assert [d.run_id for d in catalog.delete_runs("gpt2")] == ["r1", "r2"]
        assert catalog.losses().to_pylist() == [kept[1]]

    def test_audits_of_a_deleted_run_are_hidden_and_a_recapture_shows_only_its_own(self, catalog, catalog_clock):
        """An audit checked records a deletion hid: its rows of that run, stamped at or before the
        tombstone, are hidden with them (``dmi runs`` and ``dmi show`` read ``audits``); an audit
        of the run captured again under the same id shows, and other runs keep theirs."""
        def row(audit_id, run, request, verdict):
            return {"audit_id": audit_id, "model_id": "gpt2", "run_id": run, "request_id": request,
                    "hook": "resid_post", "layer": 0, "verdict": verdict, "tolerance": "exact", "bound": 0.0,
                    "n_records": 1, "n_tokens": 3, "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0,
                    "first_diff": -1, "first_fail": -1, "detail": "", "model": "tiny", "seed": 0,
                    "audited_at": catalog_clock()}

        def seen(**selection):
            return [(r["audit_id"], r["run_id"], r["request_id"], r["checks"], r["exact"], r["failed"])
                    for r in catalog.audits(**selection).to_pylist()]

        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1", request="a"), pack(run="r2", request="b")])
        catalog.record_audit([row("a1", "r1", "a", "exact"), row("a1", "r2", "b", "fail")])
        catalog_clock.advance(1.0)
        catalog.delete_runs("gpt2", "r1")
        assert seen() == [("a1", "r2", "b", 1, 0, 1)]
        assert seen(model_id="gpt2", run_id="r1") == [] and seen(audit_id="a1") == [("a1", "r2", "b", 1, 0, 1)]

        catalog_clock.advance(1.0)  # the run captured again under the same id, and audited
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1", request="a")])
        catalog.record_audit([row("a2", "r1", "a", "fail")])
        assert seen() == [("a2", "r1", "a", 1, 0, 1), ("a1", "r2", "b", 1, 0, 1)]
        assert seen(run_id="r1", request_id="a") == [("a2", "r1", "a", 1, 0, 1)]

    def test_a_run_that_holds_only_losses_is_deleted_and_its_losses_hidden(self, catalog, catalog_clock):
        """Capture dropped every record of runs r3 and r4: the catalog has their losses and no
        record of them. Deleting r3, or the whole model, tombstones such a run too (naming no
        pack, counting no record), which hides its losses like any deleted run's; the same run
        id in another model keeps its own, and losses recorded after the tombstone show."""
        def loss(run, request, hook, layer, count, model="gpt2"):
            return {"model_id": model, "run_id": run, "request_id": request, "hook": hook, "layer": layer,
                    "reason": "ring full", "count": count}

        kept = pack(run="r1", request="a")
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([kept])
        catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, 5, "ring full")
        catalog.record_losses("gpt2", "r3", "z", "resid_post", 3, 9, "ring full")
        catalog.record_losses("gpt2", "r3", "y", "logits", -1, 3, "ring full")
        catalog.record_losses("gpt2", "r4", "w", "resid_post", 0, 2, "ring full")
        catalog.record_losses("other", "r3", "z", "resid_post", 3, 4, "ring full")
        assert catalog.loss_only_runs("gpt2") == {"r3": 12, "r4": 2}
        assert catalog.loss_only_runs("gpt2", "r1") == {} and catalog.loss_only_runs("other") == {"r3": 4}
        catalog_clock.advance(1.0)

        deleted = catalog.delete_runs("gpt2", "r3", deleted_by="tester")
        assert [(d.model_id, d.run_id, d.pack_ids, d.n_records, d.deleted_by, d.deleted_at) for d in deleted] == [
            ("gpt2", "r3", (), 0, "tester", catalog_clock())]
        assert catalog.deletions("gpt2", "r3") == deleted
        assert catalog.losses("gpt2").to_pylist() == [loss("r1", "a", "resid_post", 3, 5),
                                                      loss("r4", "w", "resid_post", 0, 2)]
        assert catalog.losses("other").to_pylist() == [loss("r3", "z", "resid_post", 3, 4, model="other")]
        assert catalog.loss_only_runs("gpt2") == {"r4": 2}
        assert catalog.delete_runs("gpt2", "r3") == []  # already deleted
        assert catalog.deleted_pack_ids() == set() and len(catalog.find_records("gpt2", run_id="r1")) == 3
        catalog_clock.advance(1.0)

        whole = catalog.delete_runs("gpt2")
        assert [(d.run_id, d.pack_ids, d.n_records) for d in whole] == [("r1", (kept.pack_id,), 3), ("r4", (), 0)]
        assert catalog.losses().to_pylist() == [loss("r3", "z", "resid_post", 3, 4, model="other")]
        assert catalog.loss_only_runs("gpt2") == {} and catalog.delete_runs("gpt2") == []
        catalog_clock.advance(1.0)  # r1 captured again under the same id, every record dropped

        catalog.record_losses("gpt2", "r1", "a", "resid_post", 3, 6, "ring full")
        assert catalog.loss_only_runs("gpt2") == {"r1": 6}
        assert [(d.run_id, d.pack_ids, d.n_records) for d in catalog.delete_runs("gpt2")] == [("r1", (), 0)]
        assert catalog.losses("gpt2").num_rows == 0

    def test_purge_keeps_a_pack_whose_index_lost_another_runs_rows(self, catalog, tmp_path):
        """One pack holds runs ``doomed`` and ``kept``; the index rows of ``kept`` are missing
        (lost, or never landed: its ``packs`` row says 4 records, 2 are indexed). Deleting
        ``doomed`` hides all the catalog knows of the pack, yet the file holds ``kept``: purge
        keeps it, and recovery brings ``kept`` back."""
        import torch

        from dmi.storage import LocalPackStore, PackWriter

        store = LocalPackStore(tmp_path / "packs")
        writer = PackWriter(store, writer_id="t")
        for run, request in (("doomed", "d1"), ("kept", "k1")):
            for layer in range(2):
                writer.append(RecordKey("m", run, request, "resid_post", layer, 0, 3), torch.randn(3, 8))
        full = writer.seal()
        doomed_only = PackDescriptor(full.pack_id, full.location, full.size, full.writer_id, full.format_version,
                                     full.sealed_at, tuple(e for e in full.records if e.meta.key.run_id == "doomed"))
        with catalog.publisher("s", holder="w") as pub:
            pub.publish([doomed_only])
            catalog._backend.insert(  # stands in for the lost rows: the packs row of the whole pack
                catalog.tables["packs"], _schema.packs_table([full], scope="s", term=pub.term, now=time.time())
            )
        assert catalog.packs_to_recover([full.pack_id]) == [full.pack_id]
        assert [d.run_id for d in catalog.delete_runs("m", "doomed")] == ["doomed"]
        assert catalog.deleted_pack_ids() == set()
        assert catalog.purge_deleted(store) == []
        assert store.list_packs() == [full.pack_id]
        assert catalog.recover(store) == [full.pack_id]
        assert catalog.runs("m") == ["kept"]
        assert [(e.meta.key.request_id, e.meta.key.layer) for e in catalog.find_records("m")] == [("k1", 0), ("k1", 1)]
        assert catalog.purge_deleted(store) == [] and store.list_packs() == [full.pack_id]

    def test_run_totals(self, catalog):
        with catalog.publisher("s", holder="A") as pub:
            pub.publish([pack(run="r1", request="a"), pack(run="r1", request="b"), pack(run="r2")])
            pub.publish([pack(model="other", run="r9")])
        rows = catalog.run_totals("gpt2").to_pylist()
        assert [(r["run_id"], r["requests"], r["records"], r["packs"], r["stored_bytes"], r["raw_bytes"])
                for r in rows] == [("r1", 2, 6, 2, 6 * 64, 2 * 384), ("r2", 1, 3, 1, 3 * 64, 384)]  # raw: 64+128+192
        assert {(r["first_sealed_at"], r["last_sealed_at"]) for r in rows} == {(1700000000.5, 1700000000.5)}
        assert catalog.run_totals().column("model_id").to_pylist() == ["gpt2", "gpt2", "other"]

    def test_schema_1_records_table_is_upgraded_in_place(self, catalog, catalog_uri):
        """Tables as schema version 1 left them (no token layout columns, version row 1) open
        as version 2, and old rows read with the layout v1 implied (attn_pattern: 1 and 2)."""
        prefix = f"v1_{uuid.uuid4().hex[:8]}_"
        database = catalog.tables["records"].split(".")[0]
        names = {t: f"{database}.`{prefix}{t}`" for t in ("schema", "records")}
        v1_ddl = _schema.ddl_statements({**catalog.tables, **names})
        for statement in v1_ddl[:3]:  # schema, packs (unused), records
            catalog._backend.command(statement.replace(",\n            token_axis Int32,\n            key_axis Int32", ""))
        entries = [entry("x", 0, hook="attn_pattern", shape=(2, 4, 4), token_axis=1, key_axis=2), entry("x", 1)]
        rows = _schema.records_table([pack(entries=entries)]).drop(["token_axis", "key_axis"])
        catalog._backend.insert(names["records"], rows)
        catalog._backend.insert(names["schema"], pa.table({"version": pa.array([1], pa.uint32()), "written_at": [0.0],
                                                         "written_by": ["dmi 1"]}))
        with open_catalog(catalog_uri, table_prefix=prefix) as old:
            assert old.schema_version() == _schema.SCHEMA_VERSION
            table = old.sql(f"SELECT * FROM {old.tables['records']} ORDER BY record_index")
        got = _schema.entries_from_table(table)
        assert [(e.meta.token_axis, e.meta.key_axis) for e in got] == [(1, 2), (0, None)]
        assert [e.meta for e in got] == [e.meta for e in entries]

    # ------------------------------------------------------------------ publish and find
    def test_publish_then_find_round_trips_every_field(self, catalog):
        geometry = ShardGeometry(axis=1, offset=16, full_shape=(4, 32))
        entries = [
            entry("x", 0, layer=3, shard=geometry, shard_rank=1, tp_size=2, shape=(4, 16)),
            entry("x", 1, layer=-1, hook="token_ids", stats=False, shape=(), dtype="int64"),
            entry("x", 2, layer=3, start=4, n=1, shape=(0, 16)),
            entry("x", 3, layer=1, hook="attn_pattern", shape=(2, 4, 4), token_axis=1, key_axis=2),
        ]
        desc = pack(entries=entries)
        with catalog.publisher("scope-a", holder="h1") as pub:
            watermark = pub.publish([desc])
        assert watermark.pack_ids == (desc.pack_id,)
        assert watermark.n_records == 4
        found = catalog.find_records("gpt2")
        expected = sorted(desc.records, key=lambda e: (e.meta.key.hook, e.meta.key.layer, e.meta.key.shard_rank,
                                                       e.meta.key.start_token))
        assert found == expected
        assert found[0].meta.shard is None or found[0].meta.shard == geometry
        assert {e.meta.checksum for e in found} == {HUGE_CHECKSUM - i for i in range(4)}
        assert {(e.meta.key.hook, e.meta.token_axis, e.meta.key_axis) for e in found} >= {("attn_pattern", 1, 2)}
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

    def test_summaries_count_each_published_record_once(self, catalog):
        a = pack(entries=[entry("", i, request="r1", layer=i % 2, start=4 * (i // 2)) for i in range(4)])
        b = pack(entries=[entry("", 0, run="run-2", request="r1", hook="logits", layer=-1, shape=(4, 97)),
                          entry("", 1, run="run-2", request="r2")])
        hidden = pack(entries=[entry("", 0, model="ghost")])
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([a, b])
            pub.publish([a])  # published twice: counted once
        catalog._index([hidden], scope="s", term=1)  # indexed, never published: what a crash leaves
        assert catalog.model_totals() == [ModelTotals("gpt2", 2, 2, 6, 6 * 64, 64 * (1 + 2 + 3 + 4) + 64 * (1 + 2))]
        assert catalog.request_totals("gpt2") == [
            RequestTotals("run-1", "r1", 8, ("resid_post",), 4, 4 * 64, 64 * 10),
            RequestTotals("run-2", "r1", 4, ("logits",), 1, 64, 64),
            RequestTotals("run-2", "r2", 4, ("resid_post",), 1, 64, 128),
        ]
        assert [r.request_id for r in catalog.request_totals("gpt2", run_id="run-2")] == ["r1", "r2"]
        assert catalog.request_totals("ghost") == []
        assert catalog.request_runs("gpt2", "r1") == ["run-1", "run-2"]
        assert catalog.request_runs("gpt2", "r2") == ["run-2"]
        assert catalog.request_runs("ghost", "req-1") == []
        assert catalog.request_contents("gpt2", "r1", run_id="run-1") == {
            "resid_post": HookContents("resid_post", (0, 1), (0,), (1,), 4, 8, "bfloat16", (8,), 4 * 64, 64 * 10,
                                         (-1,)),
        }
        assert catalog.request_contents("gpt2", "r1", run_id="run-2")["logits"].feature_shape == (97,)
        counts = catalog.pack_record_counts([a.pack_id, b.pack_id, hidden.pack_id, a.pack_id])
        assert counts == {a.pack_id: 4, b.pack_id: 2}
        assert catalog.pack_record_counts([]) == {}

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

    def test_sql_percent_percent_is_a_literal_percent_with_params(self, catalog):
        rows = catalog.sql("SELECT '50%%' AS p, %(v)s AS v", {"v": "x"}).to_pylist()
        assert rows == [{"p": "50%", "v": "x"}]

    @pytest.mark.parametrize(
        ("query", "params", "message"),
        [
            ("SELECT %(missing)s", {"v": 1}, "'missing'"),
            ("SELECT '50%' AS p, %(v)s", {"v": 1}, "stray '%'"),
            ("SELECT %(v)s", {"v": object()}, "cannot pass a object"),
            ("SELECT 1 IN %(v)s", {"v": ()}, "empty tuple"),
        ],
    )
    def test_sql_binding_problems_are_argument_errors(self, catalog, query, params, message):
        with pytest.raises(InvalidArgumentError, match=message) as info:
            catalog.sql(query, params)
        assert not isinstance(info.value, (KeyError, TypeError))

    @pytest.mark.parametrize(
        "statement",
        [
            "DROP TABLE {records}",
            "TRUNCATE TABLE {records}",
            "INSERT INTO {schema} (version, written_at, written_by) VALUES (99, 0, 'x')",
            "ALTER TABLE {records} DELETE WHERE 1",
            "CREATE TABLE {db}.evil (x Int8) ENGINE = Memory",
            "DROP DATABASE {db}",
            "SET readonly = 0",
            "SYSTEM DROP MARK CACHE",
            "SELECT 1 SETTINGS readonly = 0",
        ],
    )
    def test_sql_is_read_only(self, catalog, statement):
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([pack()])
        tables = {name: table for name, table in catalog.tables.items()}
        text = statement.format(db=tables["records"].split(".")[0], **tables)
        with pytest.raises(ServerError) as info:
            catalog.sql(text)
        assert info.value.code == 164 and info.value.name == "READONLY", info.value
        assert "read-only" in str(info.value)
        assert len(catalog.find_records("gpt2")) == 3
        assert catalog.schema_version() == SCHEMA_VERSION
        assert catalog.sql("SELECT 1 AS one").to_pylist() == [{"one": 1}]

    @pytest.mark.parametrize(
        ("statement", "message"),
        [
            ("SELECT 'gone' AS a INTO OUTFILE {target} TRUNCATE FORMAT CSV", "INTO OUTFILE"),
            ("SELECT 'gone' AS a INTO OUTFILE {target} TRUNCATE", "INTO OUTFILE"),
            ("select 'new' as a into outfile {fresh}", "INTO OUTFILE"),
            ("SELECT 'new' AS a INTO /* c */ OUTFILE {fresh}", "INTO OUTFILE"),
            ("SELECT * FROM (SELECT 'new' AS a INTO OUTFILE {fresh})", "INTO OUTFILE"),
            ("SELECT 1 AS a FORMAT JSON", "FORMAT clause"),
            ("select 1 as a format CSV;", "FORMAT clause"),
            ("SELECT 1 AS a -- x\nFORMAT TabSeparated", "FORMAT clause"),
        ],
    )
    def test_sql_refuses_into_outfile_and_format(self, catalog, tmp_path, statement, message):
        """chDB runs INTO OUTFILE even under readonly=1: it would truncate a sealed pack."""
        target, fresh = tmp_path / "sealed.dmipack", tmp_path / "new.csv"
        target.write_bytes(b"SEALED-PACK-BYTES")
        with pytest.raises(InvalidArgumentError, match=message):
            catalog.sql(statement.format(target=f"'{target}'", fresh=f"'{fresh}'"))
        assert target.read_bytes() == b"SEALED-PACK-BYTES"
        assert not fresh.exists()

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("SELECT 'INTO OUTFILE x FORMAT JSON' AS a", "INTO OUTFILE x FORMAT JSON"),
            ("SELECT 'b' AS a -- INTO OUTFILE 'x' FORMAT JSON", "b"),
            ("SELECT /* FORMAT CSV */ 'c' AS a", "c"),
            ("SELECT a FROM (SELECT 'd' AS a, 1 AS format)", "d"),
            ("SELECT `format` AS a FROM (SELECT 'e' AS `format`)", "e"),
        ],
    )
    def test_sql_output_keywords_in_text_or_names_are_fine(self, catalog, text, expected):
        assert catalog.sql(text).to_pylist() == [{"a": expected}]

    def test_sql_text_that_is_not_unicode_is_an_argument_error(self, catalog):
        with pytest.raises(InvalidArgumentError, match="not valid Unicode"):
            catalog.sql("SELECT '\ud800' AS a")
        with pytest.raises(InvalidArgumentError, match="not valid Unicode"):
            catalog.select_records("gpt2", where="hook = '\ud800'")
        assert catalog.sql("SELECT 'é' AS a").to_pylist() == [{"a": "é"}]

    @pytest.mark.parametrize(
        "text",
        [
            "SELECT 1; SELECT 2",
            "SELECT 1;DROP TABLE x",
            "SELECT ';' AS a; SELECT 2",
            "SELECT 1 -- comment\n; SELECT 2",
        ],
    )
    def test_sql_refuses_a_second_statement(self, catalog, text):
        with pytest.raises(InvalidArgumentError, match="one statement per call"):
            catalog.sql(text)

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("SELECT ';' AS a", ";"),
            ("SELECT 'it''s;' AS a;", "it's;"),
            ("SELECT 'a\\';b' AS a ; ", "a';b"),
            ("SELECT `x;y` AS a FROM (SELECT 'q' AS `x;y`) -- ; not a statement", "q"),
            ("SELECT /* ; */ 'c' AS a", "c"),
        ],
    )
    def test_sql_semicolons_inside_text_are_not_statements(self, catalog, text, expected):
        assert catalog.sql(text).to_pylist() == [{"a": expected}]

    def test_server_errors_keep_code_and_name(self, catalog):
        with pytest.raises(ServerError) as info:
            catalog.sql("SELEC 1")
        assert info.value.code == 62 and info.value.name == "SYNTAX_ERROR"
        with pytest.raises(ServerError) as info:
            catalog.sql(f"SELECT nope FROM {catalog.tables['records']}")
        assert info.value.code == 47 and info.value.name == "UNKNOWN_IDENTIFIER"

    def test_audits_by_audit_id_alone(self, catalog):
        def row(audit_id, request, verdict):
            return {"audit_id": audit_id, "model_id": "gpt2", "run_id": "run-1", "request_id": request,
                    "hook": "resid_post", "layer": 0, "verdict": verdict, "tolerance": "exact", "bound": 0.0,
                    "n_records": 1, "n_tokens": 3, "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0,
                    "first_diff": -1, "first_fail": -1, "detail": "", "model": "tiny", "seed": 0,
                    "audited_at": time.time()}

        catalog.record_audit([row("a1", "r1", "exact"), row("a1", "r2", "fail")])
        catalog.record_audit([row("a2", "r1", "noise")])
        rows = catalog.audits(audit_id="a1").to_pylist()
        assert sorted((r["audit_id"], r["request_id"], r["exact"], r["failed"]) for r in rows) == [
            ("a1", "r1", 1, 0), ("a1", "r2", 0, 1)
        ]
        assert [r["noise"] for r in catalog.audits(audit_id="a2").to_pylist()] == [1]
        assert catalog.audits(audit_id="nope").num_rows == 0

    def test_losses_are_counted(self, catalog):
        catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 3, 5, "ring full")
        catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 3, 2, "ring full")
        catalog.record_losses("gpt2", "run-1", "r2", "logits", -1, 1, "ring full")
        rows = catalog.losses("gpt2").to_pylist()
        assert [(r["request_id"], r["layer"], r["count"]) for r in rows] == [("r1", 3, 7), ("r2", -1, 1)]
        assert catalog.losses("gpt2", request_id="r2").num_rows == 1
        with pytest.raises(InvalidArgumentError):
            catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 3, 0, "ring full")

    def test_who_fields_and_loss_numbers_are_checked_where_they_enter(self, catalog):
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([pack()])
        for bad in ("\ud800", None, "new\nline"):
            with pytest.raises(InvalidIdentifierError, match="deleted_by"):
                catalog.delete_runs("gpt2", "run-1", deleted_by=bad)
            with pytest.raises(InvalidIdentifierError, match="recorded_by"):
                catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 0, 1, "ring full", recorded_by=bad)
        for layer, count in ((2**40, 1), (-(2**31) - 1, 1), (0, 2**70), (0, 2**64)):
            with pytest.raises(InvalidArgumentError, match="layer" if count == 1 else "count"):
                catalog.record_losses("gpt2", "run-1", "r1", "resid_post", layer, count, "ring full")
        for lease_seconds in ("30", True, 0, float("nan")):
            with pytest.raises(InvalidArgumentError, match="lease_seconds"):
                catalog.publisher("s2", lease_seconds=lease_seconds)
        assert catalog.deletions() == [] and len(catalog.find_records("gpt2")) == 3
        assert catalog.losses().num_rows == 0
        catalog.record_losses("gpt2", "run-1", "r1", "resid_post", 2**31 - 1, 2**40, "ring full", recorded_by="me")
        assert [(r["layer"], r["count"]) for r in catalog.losses().to_pylist()] == [(2**31 - 1, 2**40)]
        assert [d.deleted_by for d in catalog.delete_runs("gpt2", "run-1", deleted_by="me")] == ["me"]

    # ------------------------------------------------------------------ watermarks
    def test_upto_of_another_scope_is_refused(self, catalog):
        with catalog.publisher("A", holder="h") as pub:
            wa = pub.publish([pack(request="from-A")])
        with catalog.publisher("B", holder="h") as pub:
            wb = pub.publish([pack(request="from-B")])
        with pytest.raises(InvalidArgumentError, match="scope 'B', not of the scope 'A'"):
            catalog.find_records("gpt2", scope="A", upto=wb)
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2", scope="A", upto=wa)} == {"from-A"}
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2", scope="B", upto=wb)} == {"from-B"}
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2", upto=wb)} == {"from-B"}

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
        clock = ManualClock()  # expiry by a clock the test moves: no dependence on the machine's speed
        a = catalog.publisher("s", holder="A", lease_seconds=1.5, clock=clock)
        b = catalog.publisher("s", holder="B", lease_seconds=30, clock=clock)
        a.acquire()
        a.publish([pack(request="by-a")])
        with pytest.raises(LeaseHeldError):
            b.acquire()
        clock.advance(1.6)
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
        clock = ManualClock()
        a = catalog.publisher("s", holder="A", lease_seconds=0.3, clock=clock)
        a.acquire()
        clock.advance(0.4)
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
        with pytest.raises(LeaseLostError, match="a successor took over"):
            a.publish([pack(request="zombie")])  # it landed, behind b's fence: refused, not returned
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

    def test_a_successors_fence_alone_ends_the_holders_term(self, catalog):
        """The fence clause of the holder's still-mine check: a successor that fenced but never
        confirmed has still ended the term, so the holder must not publish into the cut."""
        a = catalog.publisher("s", holder="A", lease_seconds=30)
        a.acquire()
        a.publish([pack(request="before")])
        assert fence_without_confirm(catalog, "s", holder="A") == 2  # a restarted "A" that failed to confirm
        state = catalog.lease_state("s")
        assert (state.term, state.holder, state.max_fence) == (1, "A", 2)  # term 1 is still the confirmed one
        with pytest.raises(LeaseLostError, match="successor took over"):
            a.publish([pack(request="after-fence")])
        assert a.term is None
        rows = catalog.sql(f"SELECT term, seq FROM {catalog.tables['watermarks']} ORDER BY term, seq").to_pylist()
        assert rows == [{"term": 1, "seq": 1}]  # refused before its watermark was written

    def test_a_fenced_lease_is_not_live_and_is_taken_over_at_once(self, catalog):
        """The fence clause of the lease state's liveness: a confirmed, unexpired term that a
        higher fence cut is over, so another holder may claim without waiting for expiry."""
        a = catalog.publisher("s", holder="A", lease_seconds=30)
        a.acquire()
        fence_without_confirm(catalog, "s", holder="A")
        state = catalog.lease_state("s")
        assert state.expires_at > time.time() and not state.released
        assert not state.live(time.time())
        c = catalog.publisher("s", holder="C", lease_seconds=30)
        assert c.acquire() == 3  # above the fence's term, not refused as "held by 'A'"
        c.publish([pack(request="by-c")])
        assert {e.meta.key.request_id for e in catalog.find_records("gpt2")} == {"by-c"}

    @pytest.mark.parametrize("rival_confirms", [True, False], ids=["rival-confirmed", "rival-fenced-only"])
    def test_a_claim_overtaken_before_its_confirm_is_refused(self, catalog, rival_confirms):
        """The "overtaken at once" check after a claim: a rival that read the state before our
        claim landed is alone at a higher term; once it has fenced (and maybe confirmed) our
        confirm must not make us a holder."""
        def rival():
            if rival_confirms:
                catalog.publisher("s", holder="B", lease_seconds=30).acquire()
            else:
                fence_without_confirm(catalog, "s", holder="B")

        a = publisher_on(catalog, InterleavingBackend(catalog._backend, "confirm", rival), "s", holder="A")
        with pytest.raises(LeaseHeldError, match="overtaken at once by term 2"):
            a.acquire()
        assert a.term is None
        with pytest.raises(LeaseError, match="acquire"):
            a.publish([pack(request="by-a")])
        assert catalog.find_records("gpt2") == []

    def test_renewal_keeps_the_lease(self, catalog):
        clock = ManualClock()
        a = catalog.publisher("s", holder="A", lease_seconds=2.0, clock=clock)
        a.acquire()
        for _ in range(3):
            clock.advance(0.8)
            a.renew()  # 2.4 s after acquiring: alive only because it was renewed
        with pytest.raises(LeaseHeldError):
            catalog.publisher("s", holder="B", clock=clock).acquire()
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

    def test_required_ids_may_not_be_none(self, catalog):
        """``None`` would drop the filter: every model's records, or a WHERE-less statement."""
        with catalog.publisher("s", holder="h") as pub:
            pub.publish([pack(request="r1"), pack(model="other", request="r2")])
        calls = [
            lambda: catalog.find_records(None), lambda: catalog.find_records(None, hook="resid_post"),
            lambda: catalog.runs(None), lambda: catalog.requests(None), lambda: catalog.request_totals(None),
            lambda: catalog.request_contents("gpt2", None), lambda: catalog.request_runs(None, "r1"),
            lambda: catalog.request_phases("gpt2", "r1", None), lambda: catalog.rank_request_ids("gpt2", None),
        ]
        for call in calls:
            with pytest.raises(InvalidIdentifierError, match="must be a str, not NoneType"):
                call()
        assert {e.meta.key.model_id for e in catalog.find_records("gpt2", hook="resid_post")} == {"gpt2"}
        assert catalog.runs("other") == ["run-1"] and catalog.request_runs("gpt2", "r1") == ["run-1"]


def _schema_records(descs):
    from dmi.catalog import _schema

    return _schema.records_table(descs)



