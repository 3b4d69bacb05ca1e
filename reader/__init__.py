"""``dmi.reader``: fetch records from packs and reassemble them into torch tensors.

Its lower half imports no torch: :mod:`dmi.reader._raw` (records as checked NumPy bytes), the
footer cache and the range planner, imported here. The tensor half (``_read``, ``_assemble``)
loads torch, so its names are imported when first asked for (module ``__getattr__``):
``dmi show`` reads a request's token strings without it.
"""

import importlib as _importlib

from dmi.reader._footer_cache import CacheStats, FooterCache
from dmi.reader._ranges import DEFAULT_MAX_GAP, PlannedRead, plan_reads
from dmi.reader._raw import PackFooter, find_record, load_footer, read_raw_records

_TENSOR_HALF = {"read_record": "_read", "read_records": "_read", "read_by_key": "_read", "check_records": "_read",
                "assemble": "_assemble"}

__all__ = [
    "read_record",
    "read_records",
    "read_raw_records",
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
    module = _TENSOR_HALF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_importlib.import_module(f"{__name__}.{module}"), name)
