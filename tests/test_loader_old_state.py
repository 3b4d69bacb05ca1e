"""A loader state saved with ``on_error="skip"`` before skipped rows kept their positions.

Until commit 6e5debd ("rows skipped as damaged keep their places") a window left its damaged
rows out before anything else: its length was its kept rows, a shuffled one was permuted over
them alone, and a cursor ``[window, row]`` counted kept rows (``0bf9ef2:dmi/_loader_read.py``,
``Window.__len__`` = ``len(self.units)``; ``0bf9ef2:dmi/_loader.py``, ``_cursor(w, pos,
len(window))``). Its ``state_dict()`` was ``{"version": 3, "epoch", "cursors", "next",
"fingerprint"}``, the fingerprint computed as today (``_fingerprint`` and ``_selection_digest``
are unchanged since 0bf9ef2), so such a state reads as a current one. Since 6e5debd a row
counts every position, skipped ones included: the old cursor names another row wherever
damage lies before it in its window. These states are crafted here exactly as 0bf9ef2 saved
them, over the damaged store of ``tests/test_loader_properties.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from dmi import StaleLoaderStateError
from tests.test_loader_properties import _damage, _packs_copy, _tokens, captured  # noqa: F401 (a fixture)

OPTIONS = dict(layers=[0], runs="fwd", batch_size=4, shuffle=False, shuffle_buffer=64, on_error="skip",
               with_tokens=True)
"""One window per epoch (the 4 requests of run ``fwd`` hold fewer than 64 rows), read in stream order."""


@pytest.fixture()
def damaged(captured, tmp_path):  # noqa: F811 (the imported fixture)
    """The store with ``fwd``'s request ``a`` damaged, and that request's row count."""
    store, _ = captured
    broken, copy = _packs_copy(store, tmp_path)
    victim = _damage(store, copy, "fwd", "a")
    return broken, victim.meta.key.n_tokens


def _after_the_damage(kept: list, n_a: int) -> int:
    """The kept rows 0bf9ef2 had yielded after the first batch past request ``a``'s rows."""
    at = OPTIONS["batch_size"] * (n_a // OPTIONS["batch_size"] + 1)
    assert n_a < at < len(kept) and not any(request == "a" for _, request, _ in kept)
    return at


def _old_state(loader, kept_rows: int) -> dict:
    """What 0bf9ef2's ``state_dict()`` returned after ``kept_rows`` rows of this one-window,
    unshuffled epoch: its cursor counted the window's kept rows."""
    return {"version": 3, "epoch": 0, "cursors": [[0, kept_rows]], "next": 0,
            "fingerprint": loader.state_dict()["fingerprint"]}


def test_an_old_skip_state_inside_a_damaged_window_is_refused(damaged):
    """0bf9ef2 yielded the kept rows 4 to a batch; after the first batch past request ``a``'s
    (skipped) rows it had yielded the first ``at`` kept rows and saved cursor [0, at]."""
    broken, n_a = damaged
    at = _after_the_damage(_tokens(list(broken.loader("m", **OPTIONS))), n_a)
    loader = broken.loader("m", **OPTIONS)
    with pytest.raises(StaleLoaderStateError) as refused:
        loader.load_state_dict(_old_state(loader, at))
    message = str(refused.value)
    assert message.startswith(f"this loader state (version 3) stops worker 0 at row {at} of window 0, which "
                              f"holds {n_a} rows skipped as damaged")
    assert "set_epoch(0)" in message and "set_epoch(1)" in message
    assert loader.state_dict()["cursors"] == [[0, 0]] and loader.epoch == 0  # nothing moved


def test_an_old_skip_state_resumed_as_a_position_would_repeat_rows(damaged, monkeypatch):
    """What the refusal prevents: read as today's position, [0, at] lies ``n_a`` kept rows
    earlier (request ``a``'s skipped rows stand before it), so those ``n_a`` already-yielded
    rows would come a second time."""
    import dmi._loader as loader_module

    broken, n_a = damaged
    kept = _tokens(list(broken.loader("m", **OPTIONS)))
    at = _after_the_damage(kept, n_a)
    loader = broken.loader("m", **OPTIONS)
    monkeypatch.setattr(loader_module.TokenLoader, "_refuse_shifted_cursors", lambda *args: None)
    loader.load_state_dict(_old_state(loader, at))
    resumed = _tokens(list(loader))
    seen = Counter(kept[:at]) + Counter(resumed)
    assert resumed == kept[at - n_a:]
    assert sorted(t for t, n in seen.items() if n == 2) == sorted(kept[at - n_a:at])


def test_an_old_skip_state_in_a_window_without_damage_resumes_exactly(damaged):
    """Windows of 8 rows: request ``a``'s rows fill the first ones. In the first window past them
    nothing was skipped, so 0bf9ef2's kept-row count there is today's position: a state stopped
    3 rows into it resumes into exactly the kept rows 0bf9ef2 had not yet yielded."""
    broken, n_a = damaged
    options = {**OPTIONS, "shuffle_buffer": 8}
    kept = _tokens(list(broken.loader("m", **options)))
    w = -(-n_a // 8)  # the first window after request a's rows
    assert (w * 8 + 3 - n_a) < len(kept)
    loader = broken.loader("m", **options)
    loader.load_state_dict({"version": 3, "epoch": 0, "cursors": [[w, 3]], "next": 0,
                            "fingerprint": loader.state_dict()["fingerprint"]})
    assert _tokens(list(loader)) == kept[w * 8 + 3 - n_a:]


def test_an_old_state_resumed_by_a_loader_that_raises_on_damage_names_the_damage(damaged):
    """Without ``on_error="skip"`` nothing is skipped, so nothing is checked at load: the damaged
    window raises its named error when it is read, never a silently shifted resume."""
    from dmi.storage.errors import PackCorruptError

    broken, n_a = damaged
    loader = broken.loader("m", **{**OPTIONS, "on_error": "raise"})
    loader.load_state_dict(_old_state(loader, n_a + 2))
    assert loader.state_dict()["cursors"] == [[0, n_a + 2]] and loader.state_dict()["version"] == 4
    with pytest.raises(PackCorruptError):
        list(loader)


def test_a_version_3_state_must_still_hold_the_selection_digest(damaged):
    """Version 3 brought the digest: only versions 1 and 2 resume without it (with a warning)."""
    from dmi.storage.errors import InvalidArgumentError

    broken, _ = damaged
    loader = broken.loader("m", **OPTIONS)
    state = _old_state(loader, 0)
    del state["fingerprint"]["selection"]
    refusal = r"^this state belongs to a different loader \(differs in: selection\)$"
    with pytest.raises(InvalidArgumentError, match=refusal):
        loader.load_state_dict(state)
