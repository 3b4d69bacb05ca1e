"""How pack files are named: ``<pack id>.arrow``, the id 32 lowercase hex digits.

Kept apart from the pack format (which imports torch for its dtype table) so that the pack
store, and with it listing commands such as ``dmi models``, load no torch.
"""

from __future__ import annotations

import re

__all__ = ["PACK_SUFFIX", "is_pack_id"]

PACK_SUFFIX = ".arrow"

_PACK_ID_RE = re.compile(r"[0-9a-f]{32}")


def is_pack_id(name: str) -> bool:
    """Pack ids are 32 lowercase hex digits (128 random bits), and nothing else: a whole match,
    because ``$`` would also accept a trailing newline."""
    return _PACK_ID_RE.fullmatch(name) is not None
