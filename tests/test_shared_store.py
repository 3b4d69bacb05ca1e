"""One embedded store, several processes at once: captures, CLI readers, a held ``dmi.open()``.

Every test here runs real processes (a capture of a tiny GPT-2 from tests/_models.py in
``tests._shared_store_worker``, the ``dmi`` CLI) on one real store directory. The embedded
catalog (chDB) is held per unit of catalog work, so none of them may fail because another
holds the directory, and chDB must never print its own lock error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter

import pytest

import dmi

LAYERS = 3  # tiny GPT-2
PER_BATCH = 3  # requests per forward (left_padded_batch)


def _worker(home, model_id, run_id, *, rank=0, size=1, batches=3, step=False, env=None) -> subprocess.Popen:
    args = [str(home), model_id, run_id, str(rank), str(size), str(batches)] + (["step"] if step else [])
    return subprocess.Popen([sys.executable, "-m", "tests._shared_store_worker", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _cli(home, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dmi.cli", *args, "--home", str(home)], capture_output=True,
                          text=True, timeout=300)


def _no_raw_errors(stderr: str) -> None:
    assert "Code: " not in stderr and "Cannot lock" not in stderr and "Traceback" not in stderr, stderr


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert out.rstrip().endswith("DONE"), out + err
    _no_raw_errors(err)
    return out, err


class _CliLoop(threading.Thread):
    """``dmi models`` in a loop until stopped: every run must succeed."""

    def __init__(self, home):
        super().__init__(daemon=True)
        self.home, self.results, self.stop = home, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.results.append(_cli(self.home, "models", "--json"))


def test_capture_and_readers_at_once_see_what_is_published_so_far(tmp_path):
    home = tmp_path / "store"
    with dmi.open(home=home) as store:  # held open by this process for the whole capture
        loop = _CliLoop(home)
        capture = _worker(home, "shared-m", "run-1", batches=3, step=True)
        loop.start()
        seen = []
        try:
            for batch in range(3):
                line = capture.stdout.readline()
                assert line.startswith(f"BATCH {batch} "), line + capture.stderr.read()
                expected = PER_BATCH * (batch + 1)
                in_python = store.catalog.requests("shared-m")
                listed = _cli(home, "requests", "shared-m", "--json")
                assert listed.returncode == 0, listed.stderr
                _no_raw_errors(listed.stderr)
                seen.append((len(in_python), len(json.loads(listed.stdout))))
                assert seen[-1] == (expected, expected), seen
                capture.stdin.write("go\n")
                capture.stdin.flush()
            _finish(capture)
        finally:
            loop.stop.set()
            loop.join(300)
            if capture.poll() is None:
                capture.kill()
                capture.communicate()
        assert [s[0] for s in seen] == [3, 6, 9]  # grew as the capture went on
        assert loop.results, "the CLI loop never ran"
        for result in loop.results:
            assert result.returncode == 0, result.stderr
            _no_raw_errors(result.stderr)
        assert len(store.catalog.find_records("shared-m", hook="resid_post")) == 9 * LAYERS


@pytest.mark.parametrize(
    "captures",
    [
        [("run-a", 0, 1), ("run-b", 0, 1)],  # two runs
        [("run-tp", 0, 2), ("run-tp", 1, 2)],  # two ranks of one run
    ],
    ids=["two-runs", "two-ranks"],
)
def test_two_captures_into_one_store_at_once(tmp_path, captures):
    home = tmp_path / "store"
    procs = [_worker(home, "shared-m", run, rank=rank, size=size, batches=4) for run, rank, size in captures]
    for proc in procs:
        _finish(proc)
    with dmi.open(home=home) as store:
        for run, rank, _ in captures:
            entries = store.catalog.find_records("shared-m", run_id=run, shard_rank=rank)
            keys = [(e.meta.key.request_id, e.meta.key.hook, e.meta.key.layer, e.meta.key.start_token)
                    for e in entries]
            assert len(keys) == 4 * PER_BATCH * LAYERS  # nothing lost
            assert not [k for k, n in Counter(keys).items() if n > 1]  # nothing visible twice
            assert len({k[0] for k in keys}) == 4 * PER_BATCH
        assert sorted(store.catalog.runs("shared-m")) == sorted({run for run, _, _ in captures})
        report = store.verify()
        assert report.records_checked == 2 * 4 * PER_BATCH * LAYERS and report.ok


HOLDER = """
    import sys
    import dmi
    store = dmi.open(home={home!r})
    print("HELD", len(store.catalog.requests("shared-m")), flush=True)
    sys.stdin.readline()
    print("AFTER", len(store.catalog.requests("shared-m")), flush=True)
    store.close()
"""


def test_a_process_holding_dmi_open_does_not_block_a_capture(tmp_path):
    home = tmp_path / "store"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER.format(home=str(home)))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().split() == ["HELD", "0"], holder.stderr.read()
        _finish(_worker(home, "shared-m", "run-1", batches=2))
        out, err = holder.communicate("go\n", timeout=300)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
    assert holder.returncode == 0 and out.split() == ["AFTER", str(2 * PER_BATCH)], out + err
    _no_raw_errors(err)


TIGHT_READER = """
    import sys
    from dmi.catalog import open_catalog
    catalog = open_catalog({catalog!r})
    print("READING", flush=True)
    n = 0
    while not catalog.requests("shared-m") or len(catalog.requests("shared-m")) < {expected}:
        catalog.find_records("shared-m", hook="resid_post")
        n += 1
    print("DONE", n > 0, flush=True)
"""


def test_a_reader_in_a_tight_loop_does_not_starve_a_capture(tmp_path):
    """Back-to-back reads share a session; a session busy for long is handed over anyway."""
    home = tmp_path / "store"
    dmi.open(home=home).close()
    code = textwrap.dedent(TIGHT_READER.format(catalog=str(home / "catalog"), expected=2 * PER_BATCH))
    reader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "READING", reader.stderr.read()
        # A capture that waited out a starving reader would fail after this wait.
        _finish(_worker(home, "shared-m", "run-1", batches=2, env={**os.environ, "DMI_CATALOG_LOCK_TIMEOUT": "30"}))
        out, err = reader.communicate(timeout=300)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert reader.returncode == 0 and out.split() == ["DONE", "True"], out + err
    _no_raw_errors(err)
