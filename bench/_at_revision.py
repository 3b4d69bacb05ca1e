"""One module of DMI as it was at a git revision, loaded into this process beside today's code:
the ``@REV`` rows of ``bench_pack_writer.py`` and ``bench_loader.py``, and ``bench_native.py
--rev`` (a change measured against what it replaced in the same run, on the same disk minute)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_at(rev: str, path: str) -> str:
    """The text of ``path`` (from the repository root) at git revision ``rev``."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def module_at(rev: str, path: str, name: str, imports: dict[str, str]):
    """``path`` (from the repository root) at git revision ``rev`` as module ``name``, each key of
    ``imports`` in its source replaced by its value (to load it over other modules of ``rev``)."""
    source = source_at(rev, path)
    for old, new in imports.items():
        source = source.replace(old, new)
    file = Path(tempfile.mkdtemp(prefix="dmi-at-revision-")) / Path(path).name
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
