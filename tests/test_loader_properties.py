"""``store.loader`` over real captured packs, checked as properties over many small configurations.

A tiny randomly initialised Llama (``dmi._models.load_model("tiny-llama")``) is captured for
real (``resid_post`` and ``mlp_out``, four layers): run ``fwd`` scores four prompts (one
``forward`` record per request and hook layer), run ``gen`` generates three tokens for them
(a prefill record and a two-token decode record each), run ``one`` generates two tokens for
one prompt (a one-token decode record: a selection of one row). Every batch is compared with
the rows read straight from the store (``get_internal``), bit for bit after the same dtype
conversion.

Properties, for world sizes 1 to 4, batch sizes that do and do not divide the rows,
``drop_last`` on and off, seeds, shuffle buffers, epochs, hook/layer/request filters and
dtypes: every row once per epoch across the ranks and no row on two ranks; a state saved
after any batch resumes into exactly the rest of an uninterrupted run; a state is refused by
a loader that would place rows elsewhere; with ``on_error="skip"`` and ``drop_last`` every
rank still yields the same number of batches (DDP's lock step), however the damage falls.
"""

from __future__ import annotations

import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

import dmi
from dmi.catalog._catalog import MAX_SELECTED_VALUES
from dmi.storage import PackStore
from dmi.storage.errors import InvalidArgumentError, PackCorruptError, PackNotFoundError, RecordNotFoundError

PROMPTS = {"a": "the quick brown fox jumps", "b": "hi", "c": "a b c d e f g h", "d": "one two three"}
HOOKS = ("resid_post", "mlp_out")


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The store with runs ``fwd``, ``gen`` and ``one``, and every captured row by
    (run, request, hook, layer): ``[tokens, d]``."""
    from dmi._models import load_model

    tiny = load_model("tiny-llama")
    enc = tiny.tokenizer(list(PROMPTS.values()), return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with dmi.open(home=tmp_path_factory.mktemp("loader-properties")) as store:
        for run, call in (("fwd", lambda cap: cap.forward(ids, mask, request_ids=list(PROMPTS))),
                          ("gen", lambda cap: cap.generate(ids, mask, request_ids=list(PROMPTS), max_new_tokens=3,
                                                           do_sample=False)),
                          ("one", lambda cap: cap.generate(ids[1:2], mask[1:2], request_ids=["b"], max_new_tokens=2,
                                                           do_sample=False))):
            with store.capture(tiny.model, hooks=",".join(HOOKS), model_id="m", run_id=run) as cap:
                with torch.inference_mode():
                    call(cap)
        rows = {}
        for run, requests in (("fwd", PROMPTS), ("gen", PROMPTS), ("one", ["b"])):
            for request in requests:
                for hook in HOOKS:
                    for layer, values in enumerate(store.get_internal("m", request, hook, run_id=run)):
                        rows[(run, request, hook, layer)] = values
        yield store, rows


def _expected(rows, runs, features, requests=None, first=0) -> Counter:
    """Every token of the selection once: (run, request, position) from position ``first``."""
    hook, layer = features[0]
    return Counter((run, request, p) for (run, request, h, lay), values in rows.items()
                   if run in runs and h == hook and lay == layer and (requests is None or request in requests)
                   for p in range(first, values.shape[0]))


def _check_values(rows, batches, features, dtype, layout) -> None:
    """Each row of each batch is the stored row of its token, converted to ``dtype``."""
    for x, tokens in batches:
        assert x.shape[0] == len(tokens) and x.dtype == dtype
        for got, (run, request, position) in zip(x, tokens):
            want = [rows[(run, request, hook, layer)][position].to(dtype) for hook, layer in features]
            whole = want[0] if len(want) == 1 else torch.stack(want) if layout == "stack" else torch.cat(want)
            assert torch.equal(got, whole), (run, request, position)


def _configurations(n: int, seed: int):
    """``n`` random small configurations: (loader options, features, runs, requests, world)."""
    pick = random.Random(seed)
    for _ in range(n):
        runs = pick.choice([("fwd",), ("gen",), ("fwd", "gen"), ("fwd", "gen", "one")])
        hooks = pick.choice(["resid_post", ["resid_post", "mlp_out"], ["mlp_out", "resid_post"]])
        layers = pick.choice([[pick.randint(0, 3)], [1, 3]])
        requests = pick.choice([None, ("b",), ("a", "c")])
        options = dict(hooks=hooks, layers=layers, runs=list(runs), batch_size=pick.choice([1, 2, 3, 5, 7, 16, 500]),
                       drop_last=pick.random() < 0.5, seed=pick.randint(0, 5), shuffle=pick.random() < 0.8,
                       shuffle_buffer=pick.choice([1, 3, 8, 20, 65536]), layout=pick.choice(["stack", "concat"]),
                       dtype=pick.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
                       with_tokens=True)
        if requests:
            options.update(where="request_id IN %(requests)s", params={"requests": requests})
        features = [(h, layer) for h in ([hooks] if isinstance(hooks, str) else hooks) for layer in layers]
        yield options, features, runs, requests, pick.randint(1, 4)


def _tokens(batches) -> list:
    return [t for _, tokens in batches for t in tokens]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


# ------------------------------------------------------------------------------ exactly once


@pytest.mark.parametrize("seed", [0, 1])
def test_every_row_once_per_epoch_on_one_rank_only_and_bit_exact(captured, seed):
    store, rows = captured
    for options, features, runs, requests, world in _configurations(14, seed):
        expected = _expected(rows, runs, features, requests)
        for epoch in range(2):
            per_rank, dropped = [], 0
            for rank in range(world):
                loader = store.loader("m", rank=rank, world_size=world, **options)
                loader.set_epoch(epoch)
                batches = list(loader)
                assert len(batches) == len(loader), options
                _check_values(rows, batches, features, options["dtype"], options["layout"])
                if options["drop_last"]:
                    assert [x.shape[0] for x, _ in batches] == [options["batch_size"]] * len(batches)
                per_rank.append(_tokens(batches))
                dropped += loader.dropped_rows
            seen = Counter(t for tokens in per_rank for t in tokens)
            assert max(seen.values(), default=1) == 1 and not seen - expected, options  # no row twice, none foreign
            assert seen.total() + dropped == expected.total(), options
            if not options["drop_last"]:
                assert seen == expected, options
            else:  # DDP's lock step: every rank the same count
                assert len({len(tokens) for tokens in per_rank}) == 1, options


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_one_row_and_fewer_rows_than_ranks(captured, world, drop_last):
    """Run ``one``'s decode phase holds a single row: one rank gets it (or, with drop_last and
    a batch of 2, nobody, and it is counted as dropped); the others get nothing."""
    store, rows = captured
    for batch_size in (1, 2):
        got, dropped, counts = [], 0, set()
        for rank in range(world):
            loader = store.loader("m", layers=[2], runs="one", phases="decode", batch_size=batch_size,
                                  drop_last=drop_last, rank=rank, world_size=world, with_tokens=True)
            batches = list(loader)
            _check_values(rows, batches, [("resid_post", 2)], torch.float32, "stack")
            got += _tokens(batches)
            dropped += loader.dropped_rows
            counts.add(len(batches))
            assert len(batches) == len(loader)
        token = ("one", "b", rows[("one", "b", "resid_post", 2)].shape[0] - 1)
        dropped_it = drop_last and (batch_size == 2 or world > 1)  # drop_last: total // world rows per rank
        assert (got, dropped) == (([], 1) if dropped_it else ([token], 0))
        if drop_last:
            assert counts == ({1} if world == 1 and batch_size == 1 else {0})


def test_an_empty_selection_is_refused_naming_what_was_asked(captured):
    store, _ = captured
    with pytest.raises(RecordNotFoundError) as refused:
        store.loader("m", layers=[0], where="request_id = %(r)s", params={"r": "nobody"})
    assert str(refused.value) == (
        "model 'm': the selection (hooks=('resid_post',), layers=[0], where='request_id = %(r)s') matches no "
        "published records; see what it holds with `dmi requests m` and `dmi show m REQUEST`")
    with pytest.raises(RecordNotFoundError) as unknown:
        store.loader("no-such-model")
    assert re.fullmatch(r"no model 'no-such-model' in the catalog at chdb://\S+ \(models: m\)", str(unknown.value))


def test_a_selection_listing_more_values_than_a_query_can_hold_is_refused_before_it_is_listed(captured):
    store, _ = captured
    with pytest.raises(InvalidArgumentError, match=f"layers range.* lists more than {MAX_SELECTED_VALUES} values"):
        store.loader("m", layers=range(0, 10**12))  # a slip for range(0, 12): refused at once, not listed


# ------------------------------------------------------------------------------ resume


def _run_to(loader, k: int) -> list:
    """The first ``k`` batches of ``loader``'s epochs, broken off after the ``k``-th."""
    seen = []
    while len(seen) < k:
        for batch in loader:
            seen.append(batch)
            if len(seen) == k:
                break
    return seen


def _resumed_rest(store, options, state, want: int) -> list:
    """What a fresh loader given ``state`` yields until ``want`` batches came, epoch after epoch."""
    resumed = store.loader("m", **options)
    resumed.load_state_dict(state)
    rest = []
    while len(rest) < want:
        rest.extend(resumed)
    return rest


def _assert_resumes_after_every_batch(store, options, cuts=None) -> None:
    straight = store.loader("m", **options)
    expected = list(straight) + list(straight)  # two epochs: states across the boundary
    for k in range(len(expected) + 1) if cuts is None else cuts:
        first = store.loader("m", **options)
        seen = _run_to(first, k)
        state = first.state_dict()
        assert first.state_dict() == state  # saving changes nothing
        assert _same(seen + _resumed_rest(store, options, state, len(expected) - k), expected), (options, k)


@pytest.mark.parametrize("options", [
    dict(layers=[0], runs=["fwd", "gen"], batch_size=5, shuffle_buffer=7, seed=1, rank=1, world_size=3),
    dict(hooks=["resid_post", "mlp_out"], layers=[2], batch_size=4, shuffle_buffer=20, seed=2, drop_last=True,
         rank=0, world_size=2, dtype=torch.bfloat16),
    dict(layers=[1, 3], runs="gen", batch_size=16, shuffle_buffer=3, seed=0, rank=3, world_size=4, layout="concat"),
    dict(layers=[0], runs="fwd", batch_size=3, shuffle=False, drop_last=True, rank=1, world_size=2),
    dict(layers=[0], runs="fwd", batch_size=6, where="request_id IN %(r)s", params={"r": ("a", "c")}),
])
def test_a_state_after_any_batch_resumes_into_the_rest_of_the_run(captured, options):
    store, _ = captured
    _assert_resumes_after_every_batch(store, {**options, "with_tokens": True})


def test_a_state_taken_by_two_workers_resumes_into_the_rest_of_the_run(captured):
    store, _ = captured
    options = dict(layers=[1], runs=["fwd", "gen"], batch_size=5, shuffle_buffer=9, seed=4, num_workers=2,
                   rank=1, world_size=2, with_tokens=True)
    _assert_resumes_after_every_batch(store, options, cuts=(0, 1, 4, 9))


@pytest.mark.parametrize("change, differs", [
    (dict(seed=1), "seed"), (dict(batch_size=6), "batch_size"), (dict(shuffle_buffer=8), "shuffle_buffer"),
    (dict(drop_last=True), "drop_last"), (dict(shuffle=False), "shuffle"), (dict(rank=0), "rank"),
    (dict(rank=1, world_size=3), "world_size"), (dict(num_workers=2), "num_workers"),
    (dict(layers=[1]), "features, selection"), (dict(runs="gen"), "n_tokens, n_units, selection"),
])
def test_a_state_is_refused_by_a_loader_that_places_rows_elsewhere(captured, change, differs):
    store, _ = captured
    options = dict(layers=[0], runs=["fwd", "gen"], batch_size=5, shuffle_buffer=7, rank=1, world_size=2)
    state = store.loader("m", **options).state_dict()
    other = store.loader("m", **{**options, **change})
    with pytest.raises(InvalidArgumentError, match=f"differs in: {differs}\\)"):
        other.load_state_dict(state)
    assert other.state_dict()["cursors"] == [[0, 0]] * max(1, other.num_workers) and other.epoch == 0


# ------------------------------------------------------------------------------ damage


def _packs_copy(store, tmp_path) -> tuple[dmi.Store, Path]:
    copy = tmp_path / "packs"
    shutil.copytree(store.packs.uri.removeprefix("file://"), copy)
    return dmi.Store(store.catalog, PackStore.local(copy)), copy


def _damage(store, copy: Path, run: str, request: str, hook: str = "resid_post", layer: int = 0):
    """Flip one payload byte of ``run``'s first record of ``request`` (its checksum then fails)."""
    victim = next(e for e in store.catalog.select_records("m", run_ids=run, hooks=hook, layers=[layer])
                  if e.meta.key.request_id == request)
    path = copy / PackStore.local(copy).location(victim.pack_id).rsplit("/", 1)[-1]
    data = bytearray(path.read_bytes())
    data[victim.payload.offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return victim


@pytest.mark.parametrize("batch_size", [2, 4, 7])
def test_skipped_damage_keeps_every_rank_at_the_same_batch_count(captured, tmp_path, batch_size):
    """The prefill record of ``gen``'s request ``a`` is damaged. With ``drop_last`` a DDP rank
    that yields fewer batches than the others leaves them waiting in an all-reduce for good:
    every rank must yield ``len(loader)`` batches, the batches that held damaged rows being
    shorter. Nothing is lost or doubled: per rank, rows + skipped + dropped is its share."""
    store, rows = captured
    broken, copy = _packs_copy(store, tmp_path)
    victim = _damage(store, copy, "gen", "a")
    lost = Counter(("gen", "a", p) for p in range(victim.meta.key.n_tokens))
    expected = _expected(rows, ("fwd", "gen"), [("resid_post", 0)]) - lost
    total = expected.total() + lost.total()
    for world in (1, 2, 3, 4):
        for seed in range(3):
            counts, seen, left_out, damaged = [], Counter(), 0, 0
            for rank in range(world):
                loader = broken.loader("m", layers=[0], runs=["fwd", "gen"], batch_size=batch_size, seed=seed,
                                       shuffle_buffer=8, drop_last=True, on_error="skip", rank=rank,
                                       world_size=world, with_tokens=True)
                batches = list(loader)
                _check_values(rows, batches, [("resid_post", 0)], torch.float32, "stack")
                assert all(x.shape[0] <= batch_size for x, _ in batches)
                counts.append(len(batches))
                assert len(batches) == len(loader) == (total // world) // batch_size, (world, seed, rank)
                seen.update(_tokens(batches))
                share = total * (rank + 1) // world - total * rank // world
                assert len(_tokens(batches)) + loader.skipped_rows + loader.dropped_rows == share
                left_out += loader.skipped_rows
                damaged += bool(loader.damaged_records)
            assert len(set(counts)) == 1
            assert max(seen.values()) == 1 and not seen - expected and damaged >= 1
            assert left_out <= lost.total()


def test_skipped_damage_resumes_after_any_batch_into_the_rest_of_the_run(captured, tmp_path):
    store, _ = captured
    broken, copy = _packs_copy(store, tmp_path)
    _damage(store, copy, "fwd", "c")
    options = dict(layers=[0], runs=["fwd", "gen"], batch_size=4, seed=1, shuffle_buffer=8, drop_last=True,
                   on_error="skip", rank=1, world_size=2, with_tokens=True)
    assert any(x.shape[0] < 4 for x, _ in broken.loader("m", **options))  # the damage falls in this share
    _assert_resumes_after_every_batch(broken, options)


@pytest.mark.parametrize("drop_last", [False, True])
def test_packs_deleted_after_the_plan_are_a_named_error_or_counted(captured, tmp_path, drop_last):
    """Every pack of run ``one`` is deleted once the loaders are made: the default raises
    ``PackNotFoundError`` naming a pack; ``on_error="skip"`` yields its ``len`` batches
    without rows (the count holds), counting every row and listing the packs."""
    store, rows = captured
    broken, copy = _packs_copy(store, tmp_path)
    options = dict(layers=[0], runs="one", batch_size=2, drop_last=drop_last, with_tokens=True)
    raising, skipping = broken.loader("m", **options), broken.loader("m", on_error="skip", **options)
    packs = {e.pack_id for e in store.catalog.select_records("m", run_ids="one", hooks="resid_post", layers=[0])}
    for pack_id in packs:
        (copy / PackStore.local(copy).location(pack_id).rsplit("/", 1)[-1]).unlink()
    with pytest.raises(PackNotFoundError, match="|".join(packs)):
        list(raising)
    batches = list(skipping)
    n = rows[("one", "b", "resid_post", 0)].shape[0]
    assert len(batches) == len(skipping) == (n // 2 if drop_last else -(-n // 2))
    assert all(x.shape == (0, 64) and tokens == () for x, tokens in batches)
    assert (skipping.skipped_rows, skipping.dropped_rows) == ((n // 2 * 2, n % 2) if drop_last else (n, 0))
    assert skipping.damaged_records and all(any(p in d for p in packs) for d in skipping.damaged_records)


def test_a_pack_corrupted_after_the_plan_is_a_named_error(captured, tmp_path):
    store, _ = captured
    broken, copy = _packs_copy(store, tmp_path)
    loader = broken.loader("m", layers=[0], runs="fwd", batch_size=4, rank=0, world_size=2)
    victim = _damage(store, copy, "fwd", "a")
    with pytest.raises(PackCorruptError, match=victim.pack_id):
        list(loader)


# ------------------------------------------------------------------------------ shuffle quality


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_quality_measures_the_batches_the_loader_yields(captured, drop_last):
    """Requests per batch from the plan alone equal those counted in the batches themselves.
    With drop_last the share is cut to whole batches, which shortens (and so permutes
    otherwise) its last window: seed 0, windows of 8, batch 4 was measured 1.53 against 1.47."""
    store, _ = captured
    for seed, window in ((0, 8), (0, 13), (2, 8), (1, 5)):
        loader = store.loader("m", layers=[0], runs=["fwd", "gen"], batch_size=4, seed=seed, shuffle_buffer=window,
                              drop_last=drop_last, rank=1, world_size=2, with_tokens=True)
        full = [tokens for x, tokens in loader if x.shape[0] == 4]
        quality = loader.shuffle_quality(batches=len(full), epoch=0)
        counted = sum(len({token[:2] for token in tokens}) for tokens in full) / len(full)
        assert quality.batches == len(full) and quality.requests_per_batch == pytest.approx(counted, abs=1e-12)
