"""``store.loader`` under real DistributedDataParallel: two spawned ranks (gloo, file
rendezvous, ``tests/_tp_harness.run_ranks``), each taking its rank and world size from
torch.distributed and training a tiny SAE wrapped in ``DistributedDataParallel``.

Records: one real pack store and chDB catalog written here, twelve requests of one
``resid_post`` record each (49 tokens). Each rank opens the store, makes its loaders and
closes the store before training (the loader needs the catalog only while it is made, and
forked DataLoader workers then inherit no catalog session). Three selections:

* ``even``: 48 tokens (the one-token request ``q00`` left out), batch 4: every rank and
  worker share holds whole batches, so ranks step in lock step without help;
* ``ragged``: all 49 tokens, batch 4, ``drop_last=False``: rank 1 has one batch more, and
  the ranks train through it with DDP's ``join()`` (the documented way);
* ``dropped``: 47 tokens, batch 4, ``drop_last=True``: shares one token apart used to hold
  different numbers of whole batches (rank 0 five, rank 1 six), which hangs DDP; every
  rank now yields the same count.

Each over two epochs, with ``num_workers`` 0 and 2. The workers come from a fork server that
imported DMI once (``_worker_context``): a spawned rank's children are spawned by default,
which re-imports torch and DMI in every worker every epoch (seconds each), and forking the
rank itself deadlocks a worker now and then on CPython before 3.11.10 (see
``_worker_context``). Spawned workers are covered by ``tests/test_loader_spawn.py``, forked
ones outside DDP by ``tests/test_loader.py``. Then resume: a pair of ranks trains
``k`` batches and saves loader, model and optimizer state; a fresh pair loads them and must
yield exactly the remaining batches and end with the uninterrupted run's parameters.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import warnings
from collections import Counter

import pytest
import torch

import dmi
from dmi.storage import PackWriter
from dmi.storage.records import RecordKey
from tests._tp_harness import RankFailed, run_ranks

WORLD = 2
D, HIDDEN = 6, 12
EPOCHS = 2
LENGTHS = {"q00": 1, "q01": 1, "q02": 1, "q03": 4, "q04": 5, "q05": 6, "q06": 7, "q07": 3, "q08": 5, "q09": 6,
           "q10": 4, "q11": 6}
SELECTIONS = {  # name: (requests left out, drop_last)
    "even": (("q00",), False),
    "ragged": ((), False),
    "dropped": (("q00", "q01"), True),
}
BATCH = 4
WORKERS = (0, 2)
RESUME_AT = {0: 3, 2: 8}  # num_workers: batches trained before the checkpoint (2: inside epoch 1)


def _loader_options(selection: str, workers: int) -> dict:
    left_out, drop_last = SELECTIONS[selection]
    return dict(layers=[0], batch_size=BATCH, shuffle_buffer=8, seed=3, with_tokens=True, drop_last=drop_last,
                num_workers=workers, multiprocessing_context=_worker_context() if workers else None,
                where="request_id NOT IN %(out)s", params={"out": left_out or ("none",)})


def _worker_context():
    """The workers' start method: a fork server that has imported the loader (and torch) once.

    Not a fork of the rank: after each backward, DDP's gloo threads enter Python to release
    the autograd context its all-reduce captured, and a fork at that moment leaves the child
    waiting forever for a lock of the interpreter's (CPython gh-112275, fixed in 3.11.10 and
    3.12)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dmi._loader"])
    return context


def _tokens(selection: str) -> set:
    left_out = SELECTIONS[selection][0]
    return {("r", r, p) for r, n in LENGTHS.items() if r not in left_out for p in range(n)}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("ddp-home")
    with dmi.open(home=home) as store:
        descriptors = []
        with PackWriter(store.packs, max_records=5, on_seal=descriptors.append) as writer:
            for request, n in LENGTHS.items():
                g = torch.Generator().manual_seed(int(request[1:]))
                writer.append(RecordKey("ddp", "r", request, "resid_post", 0, 0, n, phase="forward"),
                              torch.randn(n, D, generator=g))
        with store.catalog.publisher("ddp-test") as publisher:
            publisher.publish(descriptors)
    return str(home)


# ------------------------------------------------------------------------------ in each rank


def _sae() -> torch.nn.Module:
    torch.manual_seed(0)  # the same start on every rank and in every run
    return torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, D))


def _trainer():
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_sae())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, opt, x: torch.Tensor) -> None:
    opt.zero_grad()
    recon = model(x)
    loss = (recon - x).pow(2).mean() + 1e-3 * model.module[0](x).relu().abs().mean()
    loss.backward()
    opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def _train(loader, model, opt, *, batches: int | None = None, join: bool = False) -> list:
    """Train epoch after epoch until ``EPOCHS`` epochs (or ``batches`` batches) are done;
    returns what each epoch yielded, as ``[(x, tokens), ...]``."""
    seen: list[list] = []
    done = 0
    while loader.epoch < EPOCHS and (batches is None or done < batches):
        epoch = []
        with model.join() if join else contextlib.nullcontext():
            for x, tokens in loader:
                _step(model, opt, x)
                epoch.append((x, tokens))
                done += 1
                if done == batches:
                    break
        seen.append(epoch)
    return seen


def _gathered(value) -> list:
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _rank_training(rank: int, world: int, home: str, workdir: str) -> dict:
    """Every selection and worker count over two epochs; then the first part of each resume
    run, its checkpoint saved under ``workdir``."""
    with dmi.open(home=home) as store:
        loaders = {(s, w): store.loader("ddp", **_loader_options(s, w)) for s in SELECTIONS for w in WORKERS}
        partial = {w: store.loader("ddp", **_loader_options("even", w)) for w in WORKERS}
    out: dict = {"world": (loaders["even", 0].rank, loaders["even", 0].world_size)}
    for (selection, workers), loader in loaders.items():
        model, opt = _trainer()
        # only "ragged" should need join(); gathering the lengths turns a regression into a
        # failed assertion instead of ranks hanging in an all-reduce
        epochs = _train(loader, model, opt, join=len(set(_gathered(len(loader)))) > 1)
        out[selection, workers] = dict(epochs=epochs, length=len(loader), params=_params(model))
    for workers, loader in partial.items():
        model, opt = _trainer()
        out["head", workers] = _train(loader, model, opt, batches=RESUME_AT[workers])
        torch.save({"loader": loader.state_dict(), "model": model.module.state_dict(), "opt": opt.state_dict()},
                   f"{workdir}/checkpoint-{workers}-{rank}.pt")
    return out


def _rank_resume(rank: int, world: int, home: str, workdir: str) -> dict:
    """A fresh process: load each checkpoint and train to the end of the two epochs."""
    with dmi.open(home=home) as store:
        loaders = {w: store.loader("ddp", **_loader_options("even", w)) for w in WORKERS}
    out = {}
    for workers, loader in loaders.items():
        state = torch.load(f"{workdir}/checkpoint-{workers}-{rank}.pt", weights_only=False)
        loader.load_state_dict(state["loader"])
        model, opt = _trainer()
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        out[workers] = dict(epochs=_train(loader, model, opt), params=_params(model))
    return out


# ------------------------------------------------------------------------------ the test


def _ok(results: list) -> list:
    for result in results:
        assert not isinstance(result, (RankFailed, int)), result
    return results


def _flat(epochs: list) -> list:
    return [batch for epoch in epochs for batch in epoch]


@pytest.fixture(scope="module")
def full(home) -> dict:
    """Each request's rows as ``store.get_internal`` reads them."""
    with dmi.open(home=home) as store:
        return {r: store.get_internal("ddp", r, "resid_post", layers=0, run_id="r")[0] for r in LENGTHS}


@pytest.fixture(scope="module")
def ranks(home, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ddp-ranks")
    trained = _ok(run_ranks(_rank_training, WORLD, workdir, home, str(workdir)))
    resumed = _ok(run_ranks(_rank_resume, WORLD, workdir / "resume", home, str(workdir)))
    return trained, resumed


@pytest.mark.slow
def test_rank_and_world_come_from_the_process_group(ranks):
    trained, _ = ranks
    assert [r["world"] for r in trained] == [(0, 2), (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("selection", ["even", "ragged"])
def test_each_epoch_the_ranks_split_the_selection_exactly_once(ranks, full, selection, workers):
    trained, _ = ranks
    runs = [r[selection, workers] for r in trained]
    for epoch in range(EPOCHS):
        per_rank = [[t for _, tokens in run["epochs"][epoch] for t in tokens] for run in runs]
        assert Counter(per_rank[0] + per_rank[1]) == Counter(_tokens(selection))  # every row once, none twice
        assert not set(per_rank[0]) & set(per_rank[1])
    for run in runs:
        assert [len(epoch) for epoch in run["epochs"]] == [run["length"]] * EPOCHS
        order = [[t for _, tokens in epoch for t in tokens] for epoch in run["epochs"]]
        assert order[0] != order[1]  # the next epoch is reshuffled
    lengths = [run["length"] for run in runs]
    # 48 tokens in shares of 24 (12 per worker) are whole batches; 49 leave rank 1 one more
    assert lengths == ([6, 6] if selection == "even" else [6, 7])
    for run in runs:
        for x, tokens in _flat(run["epochs"]):
            assert torch.equal(x, torch.stack([full[r][p] for _, r, p in tokens]))


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
def test_drop_last_gives_every_rank_the_same_number_of_batches(ranks, workers):
    """47 tokens: shares of 23 and 24 rows (workers: 11, 12, 12, 12) used to hold 5 and 6
    whole batches; every share now keeps as many as the smallest holds."""
    trained, _ = ranks
    runs = [r["dropped", workers] for r in trained]
    expected = 5 if workers == 0 else 4  # (47 // 2) // 4 per rank; 2 x (47 // 4) // 4 with workers
    for epoch in range(EPOCHS):
        per_rank = [[t for _, tokens in run["epochs"][epoch] for t in tokens] for run in runs]
        assert [len(run["epochs"][epoch]) for run in runs] == [expected, expected]
        assert all(x.shape[0] == BATCH for run in runs for x, _ in run["epochs"][epoch])
        seen = Counter(per_rank[0] + per_rank[1])
        assert max(seen.values()) == 1 and set(seen) <= _tokens("dropped")
    assert [run["length"] for run in runs] == [expected, expected]


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_ddp_keeps_the_ranks_parameters_identical(ranks, selection, workers):
    """Ranks see different rows; equal parameters after training mean the gradients were
    all-reduced (and training moved them from the shared start). For ``ragged`` it shows less:
    ``join()`` ends by broadcasting the last joiner's parameters (checked: with DDP's
    ``no_sync()`` around every step, ``even`` and ``dropped`` fail here, ``ragged`` passes)."""
    trained, _ = ranks
    first, second = (r[selection, workers]["params"] for r in trained)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    start = [p.detach() for p in _sae().parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(first, start, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
def test_a_fresh_pair_of_ranks_resumes_exactly(ranks, workers):
    trained, resumed = ranks
    for rank in range(WORLD):
        straight = trained[rank]["even", workers]
        head, rest = _flat(trained[rank]["head", workers]), _flat(resumed[rank][workers]["epochs"])
        assert len(head) == RESUME_AT[workers]
        got = head + rest
        assert len(got) == len(_flat(straight["epochs"]))
        for (x, tokens), (y, expected) in zip(got, _flat(straight["epochs"])):
            assert tokens == expected and torch.equal(x, y)
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank][workers]["params"], straight["params"], strict=True))


def test_drop_last_shares_hold_the_same_number_of_batches_in_one_process(home):
    """The same guarantee without processes, with explicit ranks (fast, and what fails first
    if the cut per share comes back): batch counts equal over ranks, and ``len()`` agrees."""
    with dmi.open(home=home) as store:
        for workers in WORKERS:
            options = {**_loader_options("dropped", workers), "num_workers": 0}
            world = WORLD * max(1, workers)  # the worker shares, as ranks
            loaders = [store.loader("ddp", rank=r, world_size=world, **options) for r in range(world)]
            counts = [len(list(loader)) for loader in loaders]
            assert counts == [len(loader) for loader in loaders] == [(47 // world) // BATCH] * world


# ------------------------------------------------------------------------------ the fork warning

FIRST_FIXED = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}
FORK_CAN_HANG = sys.version_info[:2] < (3, 12) and sys.version_info < FIRST_FIXED[sys.version_info[:2]]
"""This interpreter's fork can deadlock the child (CPython gh-112275)."""


def _runtime_warnings(store, **options) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.loader("ddp", layers=[0], **options)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _rank_fork_warnings(rank: int, world: int, home: str) -> dict:
    """What ``store.loader`` warns about in a rank, per start method of the workers."""
    forkserver = multiprocessing.get_context("forkserver")
    with dmi.open(home=home) as store:
        return {
            "fork": _runtime_warnings(store, num_workers=2, multiprocessing_context="fork"),
            "fork context": _runtime_warnings(store, num_workers=2,
                                              multiprocessing_context=multiprocessing.get_context("fork")),
            "default (spawn, as the rank was)": _runtime_warnings(store, num_workers=2),
            "forkserver": _runtime_warnings(store, num_workers=2, multiprocessing_context=forkserver),
            "no workers": _runtime_warnings(store, num_workers=0, multiprocessing_context="fork"),
        }


@pytest.mark.slow
def test_forking_workers_from_a_rank_warns_where_the_fork_can_hang(home, tmp_path):
    """A forked worker of a DDP rank can hang for good on this interpreter (see
    ``_worker_context``); the loader says so when it is made, and only then."""
    (seen,) = _ok(run_ranks(_rank_fork_warnings, 1, tmp_path, home))
    forked = seen.pop("fork"), seen.pop("fork context")
    if FORK_CAN_HANG:
        assert forked[0] == forked[1] and len(forked[0]) == 1
        assert sys.version.split()[0] in forked[0][0] and "'forkserver'" in forked[0][0]
    else:
        assert forked == ([], [])
    assert seen == {"default (spawn, as the rank was)": [], "forkserver": [], "no workers": []}


def test_forked_workers_outside_a_process_group_do_not_warn(home):
    with dmi.open(home=home) as store:
        assert _runtime_warnings(store, num_workers=2, multiprocessing_context="fork") == []


@pytest.mark.parametrize(("version", "can_hang"), [
    ((3, 10, 14), True), ((3, 10, 15), False), ((3, 11, 7), True), ((3, 11, 9), True), ((3, 11, 10), False),
    ((3, 12, 0), False), ((3, 13, 1), False),
])
def test_the_fork_warning_knows_which_pythons_are_fixed(monkeypatch, version, can_hang):
    import torch.distributed as dist

    from dmi._loader import fork_may_hang

    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the version gate alone, without a process group
    assert fork_may_hang("fork", version) is can_hang
    assert fork_may_hang("spawn", version) is False
