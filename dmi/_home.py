"""The DMI home: one directory for the embedded catalog, the pack files and the model cache.

Its own module so that the store (``dmi._store``) and the model loader (``dmi._models``)
share it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from dmi.catalog import HOME_ENV

__all__ = ["DEFAULT_HOME", "default_home"]

DEFAULT_HOME = Path("~/.local/share/dmi")


def default_home() -> str:
    """``$DMI_HOME``, else ``~/.local/share/dmi`` (absolute, user expanded)."""
    return str(Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser().resolve())
