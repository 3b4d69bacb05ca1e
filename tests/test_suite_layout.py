"""The test suite's own bookkeeping, checked."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import VLLM_MODULES

TESTS = Path(__file__).resolve().parent


def test_every_module_that_needs_vllm_is_left_out_where_it_is_not_installed():
    """A module that skips itself without vLLM but is missing from ``VLLM_MODULES`` shows up as
    a skip in the main pass (which must not skip) instead of not being collected."""
    skip_call = "importorskip(" + '"vllm"'
    needing = sorted(p.name for p in TESTS.glob("test_*.py") if skip_call in p.read_text())
    assert needing and sorted(VLLM_MODULES) == needing
