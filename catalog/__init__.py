"""``dmi.catalog``: the ClickHouse index over sealed packs — schema, publisher leases,
watermarks, recovery and the chDB / server backends.

It sits on :mod:`dmi.storage` (records, the error tree, pack descriptors) and knows
nothing of capture or the reader. See ``docs/catalog-protocol.md``.
"""

from dmi.catalog._catalog import Catalog, HookContents, ModelTotals, RequestTotals
from dmi.catalog._deletion import Deletion
from dmi.catalog._factory import CATALOG_ENV, HOME_ENV, default_catalog_uri, open_catalog
from dmi.catalog._leases import Publisher, Watermark
from dmi.catalog._sql import validate_value_id

__all__ = [
    "open_catalog",
    "default_catalog_uri",
    "CATALOG_ENV",
    "HOME_ENV",
    "Catalog",
    "HookContents",
    "ModelTotals",
    "RequestTotals",
    "Deletion",
    "Publisher",
    "Watermark",
    "validate_value_id",
]
