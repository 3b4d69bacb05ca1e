"""``TokenLoader.state_dict()`` taken from another thread while the loader is iterated.

A checkpointing thread may call ``state_dict()`` at any moment. The loader's position
(epoch, each worker's cursor, the next worker in turn) must then read as it stood before or
after one step, never half-updated: a new epoch with the old epoch's cursors resumed an
epoch that had not started as if it were finished (0 batches instead of all of them).

Made deterministic with ``sys.settrace``: the iterating thread stops before every bytecode
the ``TokenLoader`` runs (where a thread switch could fall) and waits while a second thread
takes ``state_dict()``. Records are the loader tests' (``tests/test_loader.py``).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import dmi
from dmi import _loader
from dmi.storage import PackWriter
from dmi.storage.errors import InvalidArgumentError
from tests.test_loader import _same, _write

OPTIONS = dict(layers=[0], batch_size=16, shuffle_buffer=24, with_tokens=True, seed=5)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    home = tmp_path_factory.mktemp("state-thread-home")
    with dmi.open(home=home) as opened:
        descriptors = []
        with PackWriter(opened.packs, max_records=10, on_seal=descriptors.append) as writer:
            _write(writer)
        with opened.catalog.publisher("state-thread-test") as publisher:
            publisher.publish(descriptors)
        yield opened


def _positions(state: dict) -> tuple:
    return state["epoch"], tuple(map(tuple, state["cursors"])), state["next"]


def _between_batches(loader) -> list[tuple]:
    """The positions a consumer sees: before the epoch, after each batch, after the epoch."""
    seen = [_positions(loader.state_dict())]
    for _ in loader:
        seen.append(_positions(loader.state_dict()))
    return seen + [_positions(loader.state_dict())]


def _taken_by_another_thread(loader) -> tuple[list[dict], int]:
    """Iterate one epoch of ``loader``, stopping before every bytecode of a ``TokenLoader``
    method while another thread takes ``state_dict()``; returns those states and the
    number of batches the epoch yielded."""
    states: list[dict] = []
    with ThreadPoolExecutor(max_workers=1) as checkpointer:
        checkpointer.submit(int).result()  # its thread runs before tracing starts

        def step(frame, event, arg):
            if event == "opcode":
                states.append(checkpointer.submit(loader.state_dict).result())
            return step

        def tracer(frame, event, arg):
            code = frame.f_code
            if code.co_filename != _loader.__file__ or not code.co_qualname.startswith("TokenLoader."):
                return None
            frame.f_trace_opcodes = True
            return step

        sys.settrace(tracer)
        try:
            batches = sum(1 for _ in loader)
        finally:
            sys.settrace(None)
    return states, batches


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_mid_step_is_one_the_consumer_could_see(store, workers):
    legal = set(_between_batches(store.loader("m", num_workers=workers, **OPTIONS)))
    loader = store.loader("m", num_workers=workers, **OPTIONS)
    states, batches = _taken_by_another_thread(loader)
    assert batches == len(loader) > 2
    taken = {_positions(s) for s in states}
    assert taken - legal == set()  # no torn position
    assert taken == legal  # the thread did stop before and after every step
    assert loader.epoch == 1 and _positions(loader.state_dict()) == (1, ((0, 0),) * max(1, workers), 0)


def test_every_state_taken_by_another_thread_resumes_what_is_left(store):
    """From each state the other thread took during epoch 0, a fresh loader run to the end
    of epoch 1 yields exactly the uninterrupted run's last batches: all of epoch 1 at least
    (a torn state at the epoch's end resumed epoch 1 as if it were finished)."""
    straight = store.loader("m", **OPTIONS)
    expected = list(straight) + list(straight)
    states, _ = _taken_by_another_thread(store.loader("m", **OPTIONS))
    for state in {repr(s): s for s in states}.values():
        resumed = store.loader("m", **OPTIONS)
        resumed.load_state_dict(state)
        rest = []
        while resumed.epoch < 2:
            rest.extend(resumed)
        assert len(expected) // 2 <= len(rest) <= len(expected), state
        assert _same(rest, expected[len(expected) - len(rest):]), state


def test_the_epoch_is_set_only_with_its_positions(store):
    loader = store.loader("m", **OPTIONS)
    next(iter(loader))
    with pytest.raises(InvalidArgumentError, match=r"epoch is read-only .*set_epoch\(n\)"):
        loader.epoch = 3
    assert loader.epoch == 0 and loader.state_dict()["cursors"] != [[0, 0]]
    loader.set_epoch(3)
    assert _positions(loader.state_dict()) == (3, ((0, 0),), 0)
