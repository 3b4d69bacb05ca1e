"""``dmi.storage``: the lowest layer — the record schema, value types, the error tree, the pack
format and codecs, the pack store, the writer and pack reading.

It imports nothing of DMI above it and imports torch only lazily, so the catalog and the
reader (which sit side by side above it) and every tool that only lists or verifies packs
can use it without pulling in a model runtime. See ``docs/architecture.md``.
"""

import importlib as _importlib

from dmi.storage import errors, records
from dmi.storage.errors import *  # noqa: F403
from dmi.storage.records import *  # noqa: F403

_LAZY = {
    "CODECS": "_codecs",
    "DEFAULT_CODEC": "_codecs",
    "LOSSY_CODECS": "_codecs",
    "CodecError": "_codecs",
    "checksum": "_codecs",
    "decode": "_codecs",
    "gather_rows": "_native",
    "FORMAT_NAME": "_pack_format",
    "FORMAT_VERSION": "_pack_format",
    "dtype_name": "_pack_format",
    "torch_dtype": "_pack_format",
    "dtype_itemsize": "_pack_format",
    "encode_strings": "_strings",
    "decode_strings": "_strings",
    "pack_strings": "_strings",
    "NO_STRING": "_strings",
    "read_pack_descriptor": "_pack_read",
    "read_pack_index": "_pack_read",
    "verify_pack": "_pack_read",
    "WholePack": "_pack_read",
    "read_whole_pack": "_pack_read",
    "check_whole_pack": "_pack_read",
    "PackStore": "_store",
    "LocalPackStore": "_store",
    "FileSystemPackStore": "_store",
    "S3PackStore": "_store_s3",
    "PackInput": "_store",
    "PackSink": "_store",
    "DIRECT_ALIGNMENT": "_store",
    "PackWriter": "_writer",
    "DEFAULT_MAX_RECORDS": "_writer",
    "DEFAULT_MAX_BYTES": "_writer",
}
"""Names whose modules import pyarrow, numpy or zstandard: loaded on first use, so the
error tree and value types cost nothing to import (``dmi --help`` needs only those)."""

__all__ = [*errors.__all__, *records.__all__, *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
