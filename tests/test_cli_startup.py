"""Startup cost of the command line: each command imports only what it needs.

``dmi --help`` loads no DMI layer below the error tree and no third-party library;
``dmi models``, ``dmi requests``, ``dmi sql`` and ``dmi show`` (which also reads a request's token
strings from its packs) open the catalog, but load no torch, transformers, safetensors or
matplotlib. Checked by the modules a fresh process holds after the command,
not by its time (the time is measured by ``bench/bench_cli.py``, in docs/cli.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "safetensors", "matplotlib", "tokenizers")

_PROBE = r"""
import json, sys
from dmi.cli import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit:
    pass
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def modules_after(argv: list[str]) -> set[str]:
    """Top-level module names a fresh interpreter holds after ``dmi ARGV``."""
    return run_probe(argv)[0]


def run_probe(argv: list[str]) -> tuple[set[str], str]:
    """(top-level module names a fresh interpreter holds after ``dmi ARGV``, what it printed)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    *printed, modules = proc.stdout.strip().splitlines()
    return set(json.loads(modules)), "\n".join(printed)


def test_help_imports_no_library():
    loaded = modules_after(["--help"])
    assert not loaded & {*HEAVY, "pyarrow", "numpy", "chdb", "clickhouse_driver"}, loaded


@pytest.mark.parametrize("command", [["models"], ["sql", "SELECT count() AS n FROM {records}"]])
def test_listing_commands_import_no_torch(tmp_path, command):
    loaded = modules_after([*command, "--home", str(tmp_path), "-q"])
    assert "chdb" in loaded  # the command really opened the catalog
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


@pytest.fixture(scope="module")
def captured_home(tmp_path_factory):
    """A home holding one request of ``tiny-llama`` captured by ``dmi capture`` (with its tokenizer)."""
    home = tmp_path_factory.mktemp("home")
    capture_tiny_llama(home)
    return home


def capture_tiny_llama(home) -> None:
    subprocess.run([sys.executable, "-m", "dmi.cli", "capture", "--model", "tiny-llama", "--prompt", "a b",
                    "--max-new-tokens", "1", "--hooks", "resid_post,embed", "--home", str(home), "-q"],
                   check=True, capture_output=True, timeout=300)


def test_listing_a_models_requests_imports_no_torch(captured_home):
    """``dmi requests`` sorts each request's hooks in the catalogue's order: it takes that order
    from ``dmi.storage.HOOK_ORDER``, not from the capture package (which loads torch)."""
    loaded = modules_after(["requests", "tiny-llama", "--home", str(captured_home), "-q"])
    assert "chdb" in loaded
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_showing_a_request_reads_its_tokens_without_torch(captured_home):
    """``dmi show`` prints the request's prompt and token strings, read from its packs as checked
    bytes (``dmi.reader.read_raw_records``), and its hooks, with no torch loaded, nor pandas (pyarrow
    imports it whenever it converts a Python list; the catalog's point query builds its sets
    without one, ``dmi.catalog._schema.string_array``)."""
    import dmi

    with dmi.open(home=captured_home) as store:
        (request,) = store.requests("tiny-llama")
        tokens = store.tokens("tiny-llama", request.request_id)
    loaded, printed = run_probe(["show", "tiny-llama", request.request_id, "--home", str(captured_home)])
    assert not loaded & {*HEAVY, "pandas"}, loaded & {*HEAVY, "pandas"}
    assert "prompt text: 'a b'" in printed
    assert " ".join(f"'{t}'" for t in tokens.tokens[:2]) in printed
    assert "resid_post" in printed and "embed" in printed


def test_showing_a_request_beside_a_deleted_run_loads_no_pandas(tmp_path):
    """With a run deleted, the point query also filters out the keys of the records it hid
    (``hidden_record_keys``): a list of strings, turned into an Arrow array without pandas
    (``dmi.catalog._schema.string_array``), and the kept request still shows."""
    import dmi

    home = tmp_path / "home"
    capture_tiny_llama(home)
    capture_tiny_llama(home)
    with dmi.open(home=home) as store:
        kept, dropped = store.requests("tiny-llama")  # oldest run first
        store.delete("tiny-llama", dropped.run_id)
        assert [r.request_id for r in store.requests("tiny-llama")] == [kept.request_id]
    loaded, printed = run_probe(["show", "tiny-llama", kept.request_id, "--home", str(home)])
    assert not loaded & {*HEAVY, "pandas"}, loaded & {*HEAVY, "pandas"}
    assert "prompt text: 'a b'" in printed
