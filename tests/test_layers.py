"""The layering, checked: import-linter's contracts (``[tool.importlinter]`` in pyproject.toml)
over the source as it is laid out in the repository, and what importing each lower layer
actually loads at run time.

The repository maps top-level folders onto one import root (``capture/`` → ``dmi.capture``),
which import-linter cannot follow through the editable install, so the test lays the same
files out as the ``dmi`` package tree in a temporary directory and runs ``lint-imports`` there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER_FOLDERS = ("storage", "catalog", "reader", "capture")


def _lay_out_package(dest: Path) -> Path:
    package = dest / "dmi"
    shutil.copytree(ROOT / "dmi", package, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in LAYER_FOLDERS:
        shutil.copytree(ROOT / folder, package / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is missing: install the test extras (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [lint, str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120,
    )


def test_import_contracts_hold(tmp_path):
    result = _lint_imports(_lay_out_package(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout or "broken" not in result.stdout


def test_import_contracts_catch_an_upward_import(tmp_path):
    """The check can fail: storage importing the reader breaks the layers contract."""
    tree = _lay_out_package(tmp_path)
    codecs = tree / "dmi" / "storage" / "_codecs.py"
    codecs.write_text(codecs.read_text() + "\nfrom dmi.reader import assemble  # noqa\n")
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert "dmi.storage._codecs -> dmi.reader" in result.stdout


def _modules_after_import(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


@pytest.mark.parametrize("package", ["dmi.storage", "dmi.catalog", "dmi.storage.errors", "dmi"])
def test_lower_layers_load_no_torch_capture_or_reader(package):
    loaded = _modules_after_import(f"import {package}")
    assert not loaded & {"torch", "dmi.capture", "dmi.reader", "transformers"}, sorted(
        loaded & {"torch", "dmi.capture", "dmi.reader", "transformers"}
    )


def test_dmi_cli_loads_no_numeric_library_to_print_help():
    loaded = _modules_after_import("import dmi.cli")
    assert not loaded & {"torch", "numpy", "pyarrow", "chdb"}
