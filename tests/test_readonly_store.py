"""A store on a read-only filesystem: opening it fails with one clear line, no raw ClickHouse error.

chDB must write to its directory even to answer a query (its ``status`` lock file, ``tmp/``),
so the embedded catalog refuses a read-only directory itself, before chDB is asked. The
directory is made read-only with a read-only bind mount where the test may mount (tests
run as root, where ``chmod`` does not stop writes); without mount rights, a non-root user
gets ``chmod 0555``; a root user without mount rights skips, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

import dmi
from dmi.storage import CatalogReadOnlyError


@contextmanager
def read_only_view(source, target):
    """``target`` shows ``source`` read-only (bind mount, or chmod for a non-root user)."""
    target.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode == 0
    if mounted:
        remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True)
        if remount.returncode != 0:
            subprocess.run(["umount", str(target)], check=True)
            mounted = False
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("cannot make a read-only directory: root ignores chmod and mount is not permitted here")
        target.rmdir()
        target = source
        for path in [target, *target.rglob("*")]:
            if path.is_dir():
                path.chmod(0o555)
    try:
        yield target
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=True)
        else:
            for path in [target, *target.rglob("*")]:
                if path.is_dir():
                    path.chmod(0o755)


def test_a_read_only_store_fails_with_one_clear_line(tmp_path):
    source = tmp_path / "store"
    with dmi.open(home=source) as store:
        assert store.models() == []
    with read_only_view(source, tmp_path / "mounted") as home:
        with pytest.raises(CatalogReadOnlyError, match="read-only") as info:
            dmi.open(home=home)
        assert str(home / "catalog") in str(info.value)
        proc = subprocess.run([sys.executable, "-m", "dmi.cli", "models", "--home", str(home)],
                              capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("dmi: error: the embedded catalog directory") and "is read-only" in line
    assert "Code:" not in proc.stderr
