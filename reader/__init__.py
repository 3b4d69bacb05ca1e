"""``dmi.reader``: fetch records from packs and reassemble them into torch tensors.

Every name is imported on first use (module ``__getattr__``), so the torch-free parts —
:mod:`dmi.reader._raw` (records as checked NumPy bytes), the footer cache, the range
planner — load without torch: ``dmi show`` reads a request's token strings that way.
"""

import importlib as _importlib

_LAZY = {
    "read_record": "dmi.reader._read",
    "read_records": "dmi.reader._read",
    "read_by_key": "dmi.reader._read",
    "check_records": "dmi.reader._read",
    "find_record": "dmi.reader._raw",
    "load_footer": "dmi.reader._raw",
    "PackFooter": "dmi.reader._raw",
    "plan_reads": "dmi.reader._ranges",
    "PlannedRead": "dmi.reader._ranges",
    "DEFAULT_MAX_GAP": "dmi.reader._ranges",
    "FooterCache": "dmi.reader._footer_cache",
    "CacheStats": "dmi.reader._footer_cache",
    "assemble": "dmi.reader._assemble",
}

__all__ = [
    "read_record",
    "read_records",
    "read_by_key",
    "find_record",
    "load_footer",
    "check_records",
    "PackFooter",
    "plan_reads",
    "PlannedRead",
    "DEFAULT_MAX_GAP",
    "FooterCache",
    "CacheStats",
    "assemble",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
