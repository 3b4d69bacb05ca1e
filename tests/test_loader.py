"""``store.loader``: selection, token-level exactly-once over epochs, workers and ranks, values
bit-exact with ``get_internal``, resume equivalence, seed determinism, the SQL filter,
damaged packs and normalisation.

Records are written with a real PackWriter into real pack files and published into a real
chDB catalog (one per module: chDB serves one directory per process). Run ``r1`` holds 12
requests, each a prefill record plus two one-token decode records for ``resid_post``
(layers 0-2) and one two-token decode record for ``mlp_out`` (layer 1) — so the two hooks
are chunked differently and must still align. Run ``r2`` reuses three request ids with a
plain forward pass of ``resid_post`` only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zlib
from collections import Counter

import pytest
import torch

import dmi
from dmi.storage import PackStore, PackWriter
from dmi.storage.errors import (
    DuplicateChunkError,
    InvalidArgumentError,
    PackCorruptError,
    ReaderError,
    RecordNotFoundError,
)
from dmi.storage.records import RecordKey

D = 8
R1 = [(f"q{i:02d}", 3 + i % 5) for i in range(12)]  # (request, prefill tokens); 2 decode tokens each
R2 = [(f"q{i:02d}", 4) for i in range(3)]


def _values(*parts) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))
    return torch.randn(1, D, generator=g)


def _rows(run, request, hook, layer, start, n) -> torch.Tensor:
    return torch.cat([_values(run, request, hook, layer, start + i) for i in range(n)])


def _write(writer: PackWriter) -> None:
    def put(run, request, hook, layer, start, n, phase, step=0):
        key = RecordKey("m", run, request, hook, layer, start, n, step=step, phase=phase)
        writer.append(key, _rows(run, request, hook, layer, start, n))

    for request, n in R1:
        for layer in range(3):
            put("r1", request, "resid_post", layer, 0, n, "prefill")
            put("r1", request, "resid_post", layer, n, 1, "decode", 1)
            put("r1", request, "resid_post", layer, n + 1, 1, "decode", 2)
        put("r1", request, "mlp_out", 1, 0, n, "prefill")
        put("r1", request, "mlp_out", 1, n, 2, "decode", 1)
    for request, n in R2:
        for layer in range(3):
            put("r2", request, "resid_post", layer, 0, n, "forward")
    for rank in range(2):  # model m2: two tensor-parallel ranks hold the same tokens
        key = RecordKey("m2", "r1", "s", "resid_post", 0, 0, 4, phase="forward", shard_rank=rank, tp_size=2)
        writer.append(key, _rows("m2", rank, "resid_post", 0, 0, 4))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    home = tmp_path_factory.mktemp("loader-home")
    with dmi.open(home=home) as opened:
        descriptors = []
        with PackWriter(opened.packs, max_records=10, on_seal=descriptors.append) as writer:
            _write(writer)
        with opened.catalog.publisher("loader-test") as publisher:
            publisher.publish(descriptors)
        yield opened


ALL_R1 = {("r1", r, p) for r, n in R1 for p in range(n + 2)}
ALL = ALL_R1 | {("r2", r, p) for r, n in R2 for p in range(n)}


def _epoch(loader) -> list:
    return list(loader)


def _tokens(batches) -> list:
    return [t for _, tokens in batches for t in tokens]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


# ------------------------------------------------------------------------------ exactly once


def test_every_token_once_per_epoch_aligned_and_bit_exact(store):
    loader = store.loader("m", hooks=["resid_post", "mlp_out"], layers=[1], runs="r1", batch_size=7,
                          shuffle_buffer=16, with_tokens=True, seed=3)
    assert loader.features == ("resid_post.1", "mlp_out.1")
    epochs = [_epoch(loader), _epoch(loader)]
    assert loader.epoch == 2
    for batches in epochs:
        tokens = _tokens(batches)
        assert Counter(tokens) == Counter(ALL_R1)  # each (run, request, position) exactly once
        assert [x.shape for x, _ in batches[:-1]] == [(7, 2, D)] * (len(batches) - 1)
        assert len(batches) == len(loader) == -(-len(ALL_R1) // 7)
    assert _tokens(epochs[0]) != _tokens(epochs[1])  # the next epoch is reshuffled
    full = {(r, h): store.get_internal("m", r, h, layers=1, run_id="r1")[0] for r, _ in R1 for h in ("resid_post", "mlp_out")}
    for x, tokens in epochs[0]:
        for row, (_, request, pos) in zip(x, tokens):
            assert torch.equal(row[0], full[(request, "resid_post")][pos])
            assert torch.equal(row[1], full[(request, "mlp_out")][pos])


def _record_memory_pools(monkeypatch) -> list:
    """Every ``LoaderMemory`` the loader makes from now on, in order."""
    import dmi._loader as loader_module
    from dmi._loader_memory import LoaderMemory

    pools = []

    class Recorded(LoaderMemory):
        def __init__(self, prefetch):
            super().__init__(prefetch)
            pools.append(self)

    monkeypatch.setattr(loader_module, "LoaderMemory", Recorded)
    return pools


@pytest.mark.parametrize("keep", [True, False], ids=["loop keeps batches", "loop drops batches"])
@pytest.mark.parametrize("layout", ["stack", "concat"])
def test_rows_stay_exact_while_read_and_batch_memory_is_lent_again(store, monkeypatch, layout, keep):
    """The loader lends a window's read region again once the window is consumed, and a
    batch's memory once the loop lets go of it (dmi/_loader_memory.py), while later windows
    are read ahead. Whether the loop keeps every batch until the epoch ends or drops each one
    once checked, each row must be its own token's — a region lent while the window being
    consumed, or a batch the loop holds, still used it would be overwritten under the loop.
    Both features land in place in the batch."""
    pools = _record_memory_pools(monkeypatch)
    loader = store.loader("m", runs="r1", hooks="resid_post", layers=[0, 2], layout=layout, batch_size=4,
                          shuffle_buffer=12, with_tokens=True, seed=3, prefetch=2)
    seen = Counter()

    def check(x, tokens):
        for row, (run, request, pos) in zip(x, tokens):
            expected = torch.stack([_values(run, request, "resid_post", layer, pos)[0] for layer in (0, 2)])
            assert torch.equal(row, expected if layout == "stack" else expected.reshape(-1))
        seen.update(tokens)

    if keep:
        for x, tokens in list(loader):
            check(x, tokens)
    else:
        for x, tokens in loader:
            check(x, tokens)
            del x, tokens
    assert seen == Counter(ALL_R1)
    (memory,) = pools
    assert memory.reads.reused > 0
    assert (memory.batches.reused > 0) is not keep


def test_a_loader_reads_its_next_epoch_into_the_memory_of_the_last(store, monkeypatch):
    """Fresh memory is mapped one page fault at a time, and on a VM whose free pages went back
    to its host each fault waits for the host. A loader read in its own process keeps its
    pools between epochs: its second epoch reads its windows into the regions of the first
    (a new one only for a window larger than each of them) and its batches into the first's
    batch memory, and each row is still its own token's."""
    pools = _record_memory_pools(monkeypatch)
    loader = store.loader("m", runs="r1", hooks="resid_post", layers=[0], batch_size=4, shuffle_buffer=12,
                          with_tokens=True, seed=3, prefetch=2)
    counts = []
    for _ in range(2):
        seen = Counter()
        for x, tokens in loader:
            for row, (run, request, pos) in zip(x, tokens):
                assert torch.equal(row, _values(run, request, "resid_post", 0, pos)[0])
            seen.update(tokens)
            del x
        assert seen == Counter(ALL_R1)
        (memory,) = pools
        counts.append((memory.reads.mapped, memory.reads.reused, memory.batches.mapped))
    windows = -(-len(ALL_R1) // 12)
    (mapped, reused, batches), (mapped_2, reused_2, batches_2) = counts
    assert mapped + reused == windows and mapped_2 + reused_2 == 2 * windows
    assert mapped_2 - mapped < mapped  # a window larger than every kept region still maps one
    assert batches_2 == batches > 0


def test_an_epoch_left_open_at_exit_is_closed_before_the_interpreter_tears_down(tmp_path):
    """A script that keeps an unfinished loader iterator in a global and exits: the epoch's
    read threads are shut down at exit, not by the interpreter's last collection, where
    ``concurrent.futures`` is already torn down and the clean-up printed a traceback."""
    script = textwrap.dedent(f"""
        import torch, dmi
        from dmi.storage import PackWriter
        from dmi.storage.records import RecordKey
        store = dmi.open(home={str(tmp_path / "home")!r})
        sealed = []
        with PackWriter(store.packs, on_seal=sealed.append) as writer:
            for r in range(4):
                writer.append(RecordKey("m", "run", f"q{{r}}", "resid_post", 0, 0, 64, phase="forward"),
                              torch.full((64, 8), float(r)))
        with store.catalog.publisher("exit-test") as publisher:
            publisher.publish(sealed)
        unfinished = iter(store.loader("m", batch_size=16, shuffle_buffer=64))
        print(next(unfinished).shape[0])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["16"]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_ranks_are_disjoint_and_complete(store):
    per_rank = []
    for rank in range(3):
        loader = store.loader("m", layers=[0], batch_size=5, shuffle_buffer=8, with_tokens=True, rank=rank,
                              world_size=3, seed=1)
        batches = _epoch(loader)
        assert len(batches) == len(loader)
        per_rank.append(_tokens(batches))
    assert Counter(t for tokens in per_rank for t in tokens) == Counter(ALL)
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_workers_share_an_epoch_exactly_once_in_rank_order(store):
    """Two DataLoader workers of one rank yield, interleaved, exactly the batches of two
    single-worker ranks: the same shares of the same order."""
    options = dict(layers=[2], batch_size=6, shuffle_buffer=10, with_tokens=True, seed=5)
    got = _epoch(store.loader("m", num_workers=2, **options))
    ranks = [_epoch(store.loader("m", rank=r, world_size=2, **options)) for r in range(2)]
    interleaved = [b for pair in zip(*ranks) for b in pair] + ranks[0][len(ranks[1]):] + ranks[1][len(ranks[0]):]
    assert _same(got, interleaved)
    assert Counter(_tokens(got)) == Counter(ALL)


def test_drop_last_leaves_out_each_share_s_partial_batch(store):
    loader = store.loader("m", layers=[0], batch_size=10, num_workers=0, rank=1, world_size=2, drop_last=True,
                          with_tokens=True)
    batches = _epoch(loader)
    share = len(ALL) - len(ALL) // 2  # rank 1 holds the second, larger half
    assert len(batches) == len(loader) == share // 10
    assert all(x.shape[0] == 10 for x, _ in batches)


# ------------------------------------------------------------------------------ determinism, resume


def test_seed_decides_the_order(store):
    options = dict(layers=[0], batch_size=9, shuffle_buffer=20, with_tokens=True)
    a, b = _epoch(store.loader("m", seed=11, **options)), _epoch(store.loader("m", seed=11, **options))
    assert _same(a, b)
    assert _tokens(a) != _tokens(_epoch(store.loader("m", seed=12, **options)))
    sequential = _tokens(_epoch(store.loader("m", shuffle=False, **options)))
    assert sequential == sorted(sequential, key=lambda t: (t[0], t[1], t[2]))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_any_batch_yields_what_an_uninterrupted_run_would(store, workers):
    options = dict(layers=[0, 1], batch_size=8, shuffle_buffer=12, with_tokens=True, seed=7, num_workers=workers)
    straight = store.loader("m", **options)
    expected = _epoch(straight) + _epoch(straight)  # two epochs
    cuts = range(len(expected)) if workers == 0 else (3, len(expected) // 2 + 1)
    for cut in cuts:
        first = store.loader("m", **options)
        seen = []
        while len(seen) < cut:
            for batch in first:
                seen.append(batch)
                if len(seen) == cut:
                    break
        state = first.state_dict()
        resumed = store.loader("m", **options)
        resumed.load_state_dict(state)
        rest = []
        while len(seen) + len(rest) < len(expected):
            rest.extend(resumed)
        assert _same(seen + rest, expected), cut


def test_a_state_from_another_loader_is_refused(store):
    state = store.loader("m", layers=[0], batch_size=8, seed=1).state_dict()
    other = store.loader("m", layers=[0], batch_size=4, seed=1)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        other.load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match="not a DMI loader state"):
        other.load_state_dict({"epoch": 3})


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_version_1_state_resumes_only_where_the_cut_did_not_change(store, drop_last):
    """Version 2 changed what drop_last leaves out (equal batch counts across shares); a
    version-1 state without drop_last means the same positions and is taken, with it refused."""
    options = dict(layers=[0], batch_size=4, seed=1, drop_last=drop_last, with_tokens=True)
    saved = store.loader("m", **options)
    it = iter(saved)
    next(it)
    state = {**saved.state_dict(), "version": 1}
    resumed = store.loader("m", **options)
    if drop_last:
        with pytest.raises(InvalidArgumentError, match="state version 1"):
            resumed.load_state_dict(state)
    else:
        resumed.load_state_dict(state)
        assert _same(list(resumed), list(it))


# ------------------------------------------------------------------------------ selection


def test_sql_filter_with_parameters(store):
    """The caller's own condition, values as parameters (a quote in a value is just a value)."""
    loader = store.loader("m", layers=[0], batch_size=50, with_tokens=True,
                          where="request_id IN %(ids)s AND phase = %(phase)s AND l2_norm > %(floor)s",
                          params={"ids": ("q01", "q02", "q'x"), "phase": "prefill", "floor": 0.0})
    assert set(_tokens(_epoch(loader))) == {("r1", r, p) for r, n in R1 if r in ("q01", "q02") for p in range(n)}


def test_selection_by_runs_and_phases(store):
    got = set(_tokens(_epoch(store.loader("m", layers=0, runs=["r2"], batch_size=50, with_tokens=True))))
    assert got == {("r2", r, p) for r, n in R2 for p in range(n)}
    decode = set(_tokens(_epoch(store.loader("m", layers=0, phases="decode", batch_size=50, with_tokens=True))))
    assert decode == {("r1", r, p) for r, n in R1 for p in (n, n + 1)}


@pytest.mark.parametrize("fragment", ["1); DROP TABLE x; SELECT (1", "1 -- and the rest", "1 /* c */", "(1",
                                      "1) OR (1", "'unterminated", "1 # c"])
def test_filter_fragments_that_could_leave_their_expression_are_refused(store, fragment):
    with pytest.raises(InvalidArgumentError):
        store.loader("m", where=fragment)


def test_filter_guards_keep_quotes_and_reserved_names(store):
    # parentheses and comment marks inside quotes are text, not structure
    loader = store.loader("m", layers=0, where="request_id != ')--;#'", batch_size=50, with_tokens=True)
    assert set(_tokens(_epoch(loader))) == ALL
    with pytest.raises(InvalidArgumentError, match="reserved"):
        store.loader("m", where="model_id = %(dmi_model_id)s", params={"dmi_model_id": "x"})


def test_tokens_held_twice_are_refused_until_one_copy_is_chosen(store):
    with pytest.raises(DuplicateChunkError, match="shard_rank"):
        store.loader("m2")
    [x] = _epoch(store.loader("m2", where="shard_rank = 1", dtype=None, batch_size=10, shuffle=False))
    assert torch.equal(x, store.get_internal("m2", "s", "resid_post", layers=0, shard_rank=1)[0])


def test_rank_and_world_come_from_torch_distributed(store, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        loader = store.loader("m", layers=[0])
        assert (loader.rank, loader.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()
    with pytest.raises(InvalidArgumentError, match="both"):
        store.loader("m", rank=1)
    with pytest.raises(InvalidArgumentError, match="rank < world_size"):
        store.loader("m", rank=2, world_size=2)


def test_the_dataset_under_the_loader_feeds_a_plain_dataloader(store):
    from torch.utils.data import DataLoader

    loader = store.loader("m", layers=[0], batch_size=6, shuffle_buffer=10, num_workers=2, seed=2)
    plain = [x for x in DataLoader(loader.dataset, batch_size=None, num_workers=2)]
    assert all(torch.equal(a, b) for a, b in zip(plain, _epoch(loader), strict=True))


def test_selections_that_cannot_be_served(store):
    with pytest.raises(RecordNotFoundError):
        store.loader("m", where="request_id = %(r)s", params={"r": "nope"})
    with pytest.raises(ReaderError, match="not aligned"):
        store.loader("m", hooks=["resid_post", "mlp_out"], layers=[1])  # r2 has no mlp_out
    with pytest.raises(InvalidArgumentError):
        store.loader("m", batch_size=0)


# ------------------------------------------------------------------------------ rows


def test_concat_layout_and_dtype(store):
    loader = store.loader("m", layers=[0, 2], runs="r2", layout="concat", dtype=torch.bfloat16, batch_size=50,
                          with_tokens=True)
    [(x, tokens)] = _epoch(loader)
    assert x.shape == (12, 2 * D) and x.dtype == torch.bfloat16
    for row, (_, request, pos) in zip(x, tokens):
        full = store.get_internal("m", request, "resid_post", layers=[0, 2], run_id="r2")
        assert torch.equal(row, full[:, pos].reshape(-1).to(torch.bfloat16))


def test_normalize_from_catalog_statistics(store):
    loader = store.loader("m", layers=[1], normalize=True, batch_size=1000, dtype=torch.float64)
    [x] = _epoch(loader)
    raw = torch.cat([store.get_internal("m", r, "resid_post", layers=1, run_id=run)[0]
                     for run, reqs in (("r1", R1), ("r2", R2)) for r, _ in reqs]).double()
    expected = (raw.shape[0] / raw.pow(2).sum()).sqrt()
    assert loader.scales["resid_post.1"] == pytest.approx(float(expected), rel=1e-5)
    assert float(x.pow(2).sum(dim=1).mean()) == pytest.approx(1.0, rel=1e-5)


def test_shuffle_quality_against_uniform(store):
    shuffled = store.loader("m", layers=[0], batch_size=8, shuffle_buffer=64).shuffle_quality(batches=5)
    sequential = store.loader("m", layers=[0], batch_size=8, shuffle=False).shuffle_quality(batches=5)
    assert shuffled.batches == sequential.batches == 5
    assert shuffled.ideal_requests_per_batch == sequential.ideal_requests_per_batch > 5
    assert sequential.requests_per_batch <= 2.0 < shuffled.requests_per_batch
    assert shuffled.request_ratio > 0.7 > sequential.request_ratio


# ------------------------------------------------------------------------------ damage


@pytest.fixture
def damaged(store, tmp_path):
    """The module's packs copied, with one payload byte of one ``r2`` record flipped."""
    copy = tmp_path / "packs"
    shutil.copytree(store.packs.uri.removeprefix("file://"), copy)
    victim = store.catalog.select_records("m", run_ids="r2", hooks="resid_post", layers=[0])[0]
    path = copy / PackStore.local(copy).location(victim.pack_id).rsplit("/", 1)[-1]
    data = bytearray(path.read_bytes())
    data[victim.payload.offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return dmi.Store(store.catalog, PackStore.local(copy)), victim


def test_a_corrupt_pack_surfaces_as_a_named_error(damaged):
    broken, victim = damaged
    with pytest.raises(PackCorruptError, match=victim.pack_id):
        _epoch(broken.loader("m", layers=[0], batch_size=5))


def test_skip_mode_counts_what_it_left_out(damaged):
    broken, victim = damaged
    loader = broken.loader("m", layers=[0], batch_size=5, on_error="skip", with_tokens=True)
    tokens = _tokens(_epoch(loader))
    lost = {("r2", victim.meta.key.request_id, p) for p in range(victim.meta.key.n_tokens)}
    assert Counter(tokens) == Counter(ALL - lost)
    assert loader.skipped_rows == len(lost)
    assert len(loader.damaged_records) == 1 and victim.pack_id in loader.damaged_records[0]


# ------------------------------------------------------------------------------ server catalog


@pytest.mark.live
def test_the_loader_over_a_clickhouse_server(clickhouse_uri, tmp_path):
    """The selection query and its filter on a real server (the oldest supported ClickHouse)."""
    from dmi.catalog import open_catalog

    served = dmi.Store(open_catalog(clickhouse_uri), PackStore.local(tmp_path / "packs"))
    with served:
        descriptors = []
        with PackWriter(served.packs, max_records=10, on_seal=descriptors.append) as writer:
            _write(writer)
        with served.catalog.publisher("loader-live") as publisher:
            publisher.publish(descriptors)
        loader = served.loader("m", layers=[0], batch_size=7, with_tokens=True, num_workers=0,
                               where="run_id = %(run)s AND n_tokens >= %(n)s", params={"run": "r1", "n": 1})
        assert Counter(_tokens(_epoch(loader))) == Counter(ALL_R1)
        with pytest.raises(InvalidArgumentError):
            served.loader("m", where="1) UNION ALL SELECT (1")


# ------------------------------------------------------------------------------ export


def test_export_writes_one_epoch_as_shards_with_a_token_index(store, tmp_path):
    import json

    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    loader = store.loader("m", layers=[0], runs="r2", batch_size=5, with_tokens=True, seed=4)
    expected = _epoch(store.loader("m", layers=[0], runs="r2", batch_size=5, with_tokens=True, seed=4))
    manifest = json.loads(loader.export(tmp_path / "out").read_text())
    assert manifest["rows"] == 12 and manifest["features"] == ["resid_post.0"] and manifest["dtype"] == "torch.float32"
    shards = [load_file(tmp_path / "out" / s["file"])["x"] for s in manifest["shards"]]
    assert all(torch.equal(got, x) for got, (x, _) in zip(shards, expected, strict=True))
    index = pq.read_table(tmp_path / "out" / "tokens.parquet").to_pylist()
    assert [(r["run_id"], r["request_id"], r["position"]) for r in index] == _tokens(expected)
    assert loader.epoch == 1
    with pytest.raises(InvalidArgumentError, match="not empty"):
        loader.export(tmp_path / "out")
    with pytest.raises(InvalidArgumentError, match="numpy cannot hold"):
        store.loader("m", layers=[0], dtype=torch.bfloat16).export(tmp_path / "npy", suffix=".npy")
