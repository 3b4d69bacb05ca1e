"""SmolLM2-135M-Instruct for tests: converted at most once per test session, shared by every file.

``smollm2(tmp_path_factory)`` converts the installed package's GGUF file into a DMI home under
the session's base temporary directory on its first call (about a minute) and returns that first
load; later calls, from any test file, return the same load, and ``dmi.load_model("smollm2",
home=...)`` reads the cache there in seconds. Where the package (or gguf / accelerate) is
absent, the calling test is skipped with the install command — except under a forced
``DMI_LIVE_SERVER`` (CI), where it fails: CI installs the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from dmi import LoadedModel, ModelNotInstalledError, load_model

from ._clickhouse import MODE_VARIABLE, chain_mode


@dataclass(frozen=True, slots=True)
class FirstLoad:
    """The session's first load of SmolLM2: its DMI home, the model, and the progress lines it printed."""

    home: Path
    loaded: LoadedModel
    progress: tuple[str, ...]


_FIRST_LOADS: dict[Path, FirstLoad] = {}


def smollm2(tmp_path_factory: pytest.TempPathFactory) -> FirstLoad:
    """The session's SmolLM2 (converted on the first call); skips the test where it is not installed."""
    home = tmp_path_factory.getbasetemp() / "smollm2-home"
    if home not in _FIRST_LOADS:
        lines: list[str] = []
        try:
            loaded = load_model("smollm2", home=home, progress=lines.append)
        except ModelNotInstalledError as exc:
            if chain_mode() != "auto":  # CI (a forced DMI_LIVE_SERVER) installs it: never a skip there
                pytest.fail(f"{MODE_VARIABLE}={chain_mode()} requires the real model to be installed: {exc}")
            pytest.skip(str(exc))
        _FIRST_LOADS[home] = FirstLoad(home, loaded, tuple(lines))
    return _FIRST_LOADS[home]
