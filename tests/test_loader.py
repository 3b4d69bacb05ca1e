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


def test_a_state_from_another_selection_with_the_same_counts_is_refused(store):
    """Leaving out q00 or q05 of r1 leaves as many units and tokens: the digest tells them apart."""
    options = dict(layers=[0], runs="r1", batch_size=4)
    saved = store.loader("m", where="request_id != 'q00'", **options)
    other = store.loader("m", where="request_id != 'q05'", **options)
    state = saved.state_dict()
    assert (saved.n_tokens, len(saved.plan.units)) == (other.n_tokens, len(other.plan.units))
    with pytest.raises(InvalidArgumentError, match="differs in: selection"):
        other.load_state_dict(state)
    store.loader("m", where="request_id != 'q00'", **options).load_state_dict(state)  # the same selection: taken


def test_a_state_from_before_the_selection_digest_resumes_with_a_warning(store):
    options = dict(layers=[0], batch_size=4, with_tokens=True)
    saved = store.loader("m", **options)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    del state["fingerprint"]["selection"]
    resumed = store.loader("m", **options)
    with pytest.raises(InvalidArgumentError, match="selection"):
        resumed.load_state_dict(state)  # a version-3 state must hold it
    with pytest.warns(RuntimeWarning, match="predates the selection digest"):
        resumed.load_state_dict({**state, "version": 2})
    assert _same(list(resumed), list(it))


@pytest.mark.parametrize("change, needle", [
    (dict(epoch=-5), "epoch must be an int >= 0"),
    (dict(epoch="1"), "epoch must be an int >= 0"),
    (dict(epoch=True), "epoch must be an int >= 0"),
    (dict(cursors=[]), r"cursors must be 2 \[window, row\] pairs"),
    (dict(cursors="00"), r"cursors must be 2 \[window, row\] pairs"),
    (dict(cursors=[[0, 0]]), r"cursors must be 2 \[window, row\] pairs"),
    (dict(cursors=[[0, 0], [0]]), r"cursor 1 must be a \[window, row\] pair"),
    (dict(cursors=[[0, 0], [0, 1.5]]), r"cursor 1 must be a \[window, row\] pair"),
    (dict(cursors=[[0, 9999], [0, 0]]), r"cursor 0 \[0, 9999\] lies outside its share"),
    (dict(cursors=[[0, -1], [0, 0]]), r"cursor 0 \[0, -1\] lies outside"),
    (dict(cursors=[[0, 0], [9, 0]]), r"cursor 1 \[9, 0\] lies outside its share \(5 windows"),
    (dict(cursors=[[0, 0], [5, 1]]), r"cursor 1 \[5, 1\] lies outside"),
    (dict(next=2), "next=2 names no worker of 2"),
    (dict(next=-1), "next must be an int >= 0"),
    (dict(next=None), "next must be an int >= 0"),
])
def test_a_state_with_positions_outside_the_loader_is_refused(store, change, needle):
    """Two workers, each share of 46 or 47 rows in 5 windows of 10: positions are checked
    against them before anything is iterated."""
    options = dict(layers=[0], batch_size=4, shuffle_buffer=10, num_workers=2)
    loader = store.loader("m", **options)
    state = {**loader.state_dict(), **change}
    with pytest.raises(InvalidArgumentError, match=needle):
        loader.load_state_dict(state)
    assert loader.state_dict()["cursors"] == [[0, 0], [0, 0]] and loader.epoch == 0  # nothing taken


def test_states_at_the_edges_of_a_share_are_taken(store):
    options = dict(layers=[0], batch_size=4, shuffle_buffer=10, num_workers=2)
    loader = store.loader("m", **options)
    for cursors in ([[4, 5], [4, 6]], [[5, 0], [5, 0]], [[6, 0], [6, 0]]):
        loader.load_state_dict({**loader.state_dict(), "cursors": cursors, "next": 1, "epoch": 3})
        assert loader.state_dict()["cursors"] == cursors


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


def test_the_dataset_used_directly_yields_every_worker_s_share(store):
    """Outside a DataLoader worker, a dataset planned for two workers yields both shares, in
    the order the loader's DataLoader hands them out, from the loader's position on."""
    options = dict(layers=[0], batch_size=4, shuffle_buffer=10, num_workers=2, seed=2, with_tokens=True)
    loader = store.loader("m", **options)
    direct = list(loader.dataset)
    assert _same(direct, _epoch(store.loader("m", **options)))
    assert Counter(_tokens(direct)) == Counter(ALL)
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    it.close()
    assert _same(seen + list(loader.dataset), direct)


def test_a_requested_hook_or_layer_without_records_is_refused(store):
    with pytest.raises(RecordNotFoundError, match=r"no records of resid_post\.7; it holds resid_post\.0$"):
        store.loader("m", layers=[0, 7])
    with pytest.raises(RecordNotFoundError, match=r"no records of mlp_out\.0; it holds resid_post\.0$"):
        store.loader("m", hooks=["resid_post", "mlp_out"], layers=[0])
    with pytest.raises(RecordNotFoundError, match=r"no records of attn_q\.1; it holds resid_post\.1, mlp_out\.1$"):
        store.loader("m", hooks=["resid_post", "mlp_out", "attn_q"], layers=[1], runs="r1")
    with pytest.raises(RecordNotFoundError, match="no records of attn_q; it holds resid_post.0, resid_post.1"):
        store.loader("m", hooks=["resid_post", "attn_q"])
    with pytest.raises(InvalidArgumentError, match="hooks must be a hook name or a list of them, not 5"):
        store.loader("m", hooks=5)
    assert store.loader("m", hooks=["resid_post", "mlp_out"], layers=[1], runs="r1").features == (
        "resid_post.1", "mlp_out.1")


@pytest.mark.parametrize("phases", ["bogus", ["prefill", "bogus"]])
def test_an_unknown_phase_is_refused_naming_the_phases(store, phases):
    with pytest.raises(InvalidArgumentError, match="unknown phase 'bogus'; phases: prefill, decode, forward"):
        store.loader("m", layers=[0], phases=phases)


@pytest.mark.parametrize("arguments, needle", [
    (dict(batches=2.5), "batches must be an int >= 1, not 2.5"), (dict(batches="x"), "batches must be"),
    (dict(batches=None), "batches must be"), (dict(batches=-1), "batches must be"), (dict(batches=0), "batches must"),
    (dict(epoch=-1), "epoch must be an int >= 0 or None"), (dict(epoch="x"), "epoch must be an int >= 0 or None"),
])
def test_shuffle_quality_refuses_bad_arguments(store, arguments, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        store.loader("m", layers=[0], batch_size=8).shuffle_quality(**arguments)


def test_selections_that_cannot_be_served(store):
    with pytest.raises(RecordNotFoundError):
        store.loader("m", where="request_id = %(r)s", params={"r": "nope"})
    with pytest.raises(ReaderError, match="not aligned"):
        store.loader("m", hooks=["resid_post", "mlp_out"], layers=[1])  # r2 has no mlp_out
    with pytest.raises(InvalidArgumentError):
        store.loader("m", batch_size=0)


def test_logits_beside_a_full_hook_is_refused_with_the_phases_that_align_them(tmp_path):
    """Under ``generate`` the prefill keeps one logits row (the last prompt position) and the
    residual stream every prompt row: the refusal says so and names what aligns them, which does."""
    from ._models import left_padded_batch, tiny

    ids, mask = left_padded_batch()
    with dmi.open(home=tmp_path / "home") as store:
        with store.capture(tiny(), model_id="g", hooks="resid_post,logits", layers=[0]) as cap:
            cap.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        with pytest.raises(ReaderError) as info:
            store.loader("g", hooks=["logits", "resid_post"], layout="concat")
        assert info.value.args[0].endswith(
            "the features are not aligned: every feature must hold the same tokens of a request, and a hook that "
            "keeps fewer positions (logits keeps only the last prompt position of a prefill) does not; select the "
            "tokens all of them hold, such as phases='decode' (--phases decode on the command line), or leave "
            "that hook out")
        rows = _tokens(_epoch(store.loader("g", hooks=["logits", "resid_post"], layout="concat", phases="decode",
                                           with_tokens=True)))
        # the two decode steps after the prefill, at each request's own positions (prompts of 7, 4, 6 tokens)
        assert sorted(position for *_, position in rows) == [4, 5, 6, 7, 7, 8]


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


def _damage(store, tmp_path, which: int):
    """The module's packs copied, with one payload byte of ``r2``'s layer-0 record ``which``
    (in request order) flipped: the store over the copy, and the damaged record."""
    copy = tmp_path / "packs"
    shutil.copytree(store.packs.uri.removeprefix("file://"), copy)
    victim = store.catalog.select_records("m", run_ids="r2", hooks="resid_post", layers=[0])[which]
    path = copy / PackStore.local(copy).location(victim.pack_id).rsplit("/", 1)[-1]
    data = bytearray(path.read_bytes())
    data[victim.payload.offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return dmi.Store(store.catalog, PackStore.local(copy)), victim


@pytest.fixture
def damaged(store, tmp_path):
    """The module's packs copied, with one payload byte of the first ``r2`` record flipped."""
    return _damage(store, tmp_path, 0)


@pytest.fixture
def damaged_last(store, tmp_path):
    """The same with the last ``r2`` record damaged: the last rows of an unshuffled epoch."""
    return _damage(store, tmp_path, -1)


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


def _left_out(loader) -> tuple[int, int, int, int]:
    """One epoch of ``loader``: rows yielded, rows skipped, rows dropped, damaged records listed."""
    rows = sum(x.shape[0] for x in loader)
    return rows, loader.skipped_rows, loader.dropped_rows, len(loader.damaged_records)


@pytest.mark.parametrize("options, counts", [
    # damage in the last windows, no batch cut after them
    (dict(shuffle=False, shuffle_buffer=1, batch_size=1), (len(ALL) - 4, 4, 0, 1)),
    # drop_last reads 90 of 93 rows; the damaged unit's first row is one of them and keeps its place:
    # two batches of 45 places, the second of 44 rows; only the 3 rows drop_last never reads drop
    (dict(shuffle=False, shuffle_buffer=10, batch_size=45, drop_last=True), (89, 1, 3, 1)),
])
def test_skip_mode_reports_damage_that_no_batch_follows(damaged_last, options, counts):
    broken, victim = damaged_last
    loader = broken.loader("m", layers=[0], on_error="skip", **options)
    rows, skipped, dropped, damaged = _left_out(loader)
    assert (rows, skipped, dropped, damaged) == counts
    assert rows + skipped + dropped == loader.n_tokens == len(ALL)
    assert victim.pack_id in loader.damaged_records[0]


def test_a_damaged_record_read_by_several_windows_is_listed_once(damaged):
    broken, victim = damaged
    loader = broken.loader("m", layers=[0], on_error="skip", shuffle=False, shuffle_buffer=1, batch_size=3)
    assert _left_out(loader) == (len(ALL) - 4, 4, 0, 1)  # the record's 4 rows lie in 4 windows


def test_drop_last_counts_the_rows_it_leaves_out(store):
    loader = store.loader("m", layers=[0], batch_size=10, drop_last=True, rank=1, world_size=2)
    share = len(ALL) - len(ALL) // 2
    assert _left_out(loader) == (share // 10 * 10, 0, share % 10, 0)
    assert loader.dropped_rows == share % 10  # the same next epoch: counts add up
    _left_out(loader)
    assert loader.dropped_rows == 2 * (share % 10)


@pytest.mark.parametrize("options", [dict(shuffle=False, batch_size=4),
                                     dict(shuffle_buffer=10, batch_size=3, seed=2),
                                     dict(shuffle_buffer=10, batch_size=7, drop_last=True, seed=1)])
def test_skip_mode_counts_damage_once_across_a_break_and_a_resume(damaged, options):
    broken, _ = damaged
    straight = broken.loader("m", layers=[0], on_error="skip", **options)
    batches = list(straight)
    expected = (sum(x.shape[0] for x in batches), straight.skipped_rows, straight.dropped_rows,
                len(straight.damaged_records))
    assert expected[1] == 4 and expected[3] == 1
    for cut in range(1, len(batches) + 1):
        same = broken.loader("m", layers=[0], on_error="skip", **options)  # broken off, then continued
        it = iter(same)
        rows = sum(next(it).shape[0] for _ in range(cut))
        it.close()
        rows += sum(x.shape[0] for x in same)
        assert (rows, same.skipped_rows, same.dropped_rows, len(same.damaged_records)) == expected, cut
        first = broken.loader("m", layers=[0], on_error="skip", **options)  # saved, loaded by another loader
        it = iter(first)
        rows = sum(next(it).shape[0] for _ in range(cut))
        resumed = broken.loader("m", layers=[0], on_error="skip", **options)
        resumed.load_state_dict(first.state_dict())
        it.close()
        rows += sum(x.shape[0] for x in resumed)
        totals = [first.skipped_rows + resumed.skipped_rows, first.dropped_rows + resumed.dropped_rows,
                  len(first.damaged_records) + len(resumed.damaged_records)]
        assert (rows, *totals) == expected, cut


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


def test_a_refused_export_consumes_no_batch(store, tmp_path):
    import json

    loader = store.loader("m", layers=[0], batch_size=10, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="numpy cannot hold torch.bfloat16"):
        loader.export(tmp_path / "npy", suffix=".npy")
    assert not (tmp_path / "npy").exists()
    assert loader.state_dict()["cursors"] == [[0, 0]] and loader.epoch == 0
    manifest = json.loads(loader.export(tmp_path / "st").read_text())
    assert (manifest["epoch"], manifest["rows"], len(manifest["shards"])) == (0, len(ALL), len(loader))


def test_an_export_that_fails_part_way_leaves_the_loader_where_it_stood(damaged, tmp_path, monkeypatch):
    import json

    import dmi._loader_export as loader_export
    from dmi.storage.errors import ExportError

    broken, _ = damaged
    loader = broken.loader("m", layers=[0], batch_size=10, shuffle=False, on_error="skip", with_tokens=True)
    real, written = loader_export.export_tensor, []

    def fail_third(tensor, path, *, name):
        if len(written) == 2:
            raise ExportError(f"could not write {path} (No space left on device); nothing was written")
        written.append(path)
        return real(tensor, path, name=name)

    monkeypatch.setattr(loader_export, "export_tensor", fail_third)
    with pytest.raises(ExportError, match="No space left"):
        loader.export(tmp_path / "full")
    assert loader.state_dict()["cursors"] == [[0, 0]] and loader.epoch == 0
    assert (loader.skipped_rows, loader.dropped_rows, loader.damaged_records) == (0, 0, [])
    monkeypatch.setattr(loader_export, "export_tensor", real)
    manifest = json.loads(loader.export(tmp_path / "again").read_text())
    assert (manifest["epoch"], manifest["rows"], manifest["skipped_rows"]) == (0, len(ALL) - 4, 4)
    assert (manifest["dropped_rows"], len(manifest["damaged_records"])) == (0, 1)
