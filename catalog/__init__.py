"""``dmi.catalog``: the lowest layer — the pack format, the pack store and the ClickHouse index."""

from dmi.catalog import errors, records
from dmi.catalog.errors import *  # noqa: F403
from dmi.catalog.records import *  # noqa: F403

__all__ = [*errors.__all__, *records.__all__]
