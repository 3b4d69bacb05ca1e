"""The DMI home: one directory for the embedded catalog, the pack files and the model cache.

Its own module so that the store (``dmi._store``) and the model loader (``dmi._models``)
share it without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from dmi.catalog import HOME_ENV
from dmi.storage.errors import InvalidArgumentError

__all__ = ["DEFAULT_HOME", "default_home"]

DEFAULT_HOME = Path("~/.local/share/dmi")


def default_home() -> str:
    """``$DMI_HOME``, else ``~/.local/share/dmi`` (absolute, user expanded); an empty
    ``$DMI_HOME`` is unset. ``InvalidArgumentError`` for one that names no directory (blank,
    or a control character): it would otherwise become a directory of that name in the
    working directory."""
    value = os.environ.get(HOME_ENV)
    if value and (not value.strip() or any(ord(c) < 32 or c == "\x7f" for c in value)):
        raise InvalidArgumentError(f"${HOME_ENV} is {value!r}: name a directory, or unset it for the default "
                                   f"{DEFAULT_HOME}")
    return str(Path(value or DEFAULT_HOME).expanduser().resolve())
