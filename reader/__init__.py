"""``dmi.reader``: fetch records from packs and reassemble them into torch tensors."""

from dmi.reader._assemble import assemble
from dmi.reader._footer_cache import CacheStats, FooterCache
from dmi.reader._ranges import DEFAULT_MAX_GAP, PlannedRead, plan_reads
from dmi.reader._read import PackFooter, check_records, find_record, load_footer, read_by_key, read_record, read_records

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
