"""``dmi.catalog``: the lowest layer — the pack format, the pack store and the ClickHouse index."""

from dmi.catalog import errors, records
from dmi.catalog.errors import *  # noqa: F403
from dmi.catalog.records import *  # noqa: F403

__all__ = [*errors.__all__, *records.__all__]

# --- storage core (issue 2): pack format, codecs, pack store, writer -----------------
from dmi.catalog._codecs import CODECS, DEFAULT_CODEC
from dmi.catalog._pack_format import FORMAT_NAME, FORMAT_VERSION, dtype_name, torch_dtype
from dmi.catalog._pack_read import read_pack_descriptor, verify_pack
from dmi.catalog._store import LocalPackStore, PackInput, PackSink, PackStore
from dmi.catalog._writer import DEFAULT_MAX_BYTES, DEFAULT_MAX_RECORDS, PackWriter

__all__ += [
    "CODECS",
    "DEFAULT_CODEC",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "dtype_name",
    "torch_dtype",
    "read_pack_descriptor",
    "verify_pack",
    "PackStore",
    "LocalPackStore",
    "PackInput",
    "PackSink",
    "PackWriter",
    "DEFAULT_MAX_RECORDS",
    "DEFAULT_MAX_BYTES",
]

# --- catalog (issue 3): the ClickHouse index, publisher leases, watermarks ----------
from dmi.catalog._catalog import Catalog, HookContents
from dmi.catalog._factory import CATALOG_ENV, HOME_ENV, default_catalog_uri, open_catalog
from dmi.catalog._leases import Publisher, Watermark

__all__ += [
    "open_catalog",
    "default_catalog_uri",
    "CATALOG_ENV",
    "HOME_ENV",
    "Catalog",
    "HookContents",
    "Publisher",
    "Watermark",
]
