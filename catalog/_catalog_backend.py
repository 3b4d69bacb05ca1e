"""The narrow contract between the catalog and a ClickHouse backend.

A backend runs statements and moves Arrow tables; that is all. Schema, leases, publishing
and queries live once, in :class:`dmi.catalog.Catalog`, on top of these primitives.

Statements use pyformat placeholders (``%(name)s``) for values. Each backend binds them its
own way, in one place: chDB renders literals with :func:`dmi.catalog._sql.bind`; the server
backend passes the parameters to clickhouse-driver. Identifiers are already validated and
quoted by the caller.

Errors a backend raises are DMI's own:

* :class:`~dmi.ServerError` — ClickHouse answered with an error (``code``, ``name``
  are ClickHouse's). The statement did not take effect.
* :class:`~dmi.CatalogUnavailableError` — the connection failed. Its attribute
  ``outcome_unknown`` is ``True`` when the statement may have reached the server (the
  connection broke mid-call), ``False`` when it certainly did not (could not connect).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping

import pyarrow as pa

from dmi.storage.errors import CatalogUnavailableError, ServerError

_CODE = re.compile(r"Code:\s*(\d+)")
_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)\s*(?:\(version [^)]*\))?\s*$")


def server_error_from_message(message: str, code: int | None = None, name: str | None = None) -> ServerError:
    """Build a ServerError, parsing ``Code: N`` and a trailing ``(NAME)`` when not given."""
    if code is None:
        match = _CODE.search(message)
        code = int(match.group(1)) if match else None
    if name is None:
        match = _NAME.search(message.strip())
        name = match.group(1) if match else None
    first_line = message.strip().splitlines()[0] if message.strip() else message
    return ServerError(f"ClickHouse error {code} {name or ''}: {first_line}".replace("  ", " "), code=code, name=name)


def unavailable(message: str, *, outcome_unknown: bool) -> CatalogUnavailableError:
    error = CatalogUnavailableError(message)
    error.outcome_unknown = outcome_unknown
    return error


class CatalogBackend(ABC):
    """Primitives a ClickHouse backend provides. Thread-safe: callers may share one."""

    #: ``"chdb"``, ``"server"`` or ``"cluster"``.
    kind: str
    #: Human description of where the data lives (a directory or host:port/database).
    where: str
    #: The database the catalog's tables live in (validated, unquoted).
    database: str

    @abstractmethod
    def command(self, sql: str, params: Mapping[str, object] | None = None) -> None:
        """Run a statement that returns nothing useful (DDL, INSERT ... SELECT)."""

    @abstractmethod
    def query(self, sql: str, params: Mapping[str, object] | None = None, *, readonly: bool = False) -> pa.Table:
        """Run a SELECT and return its result as an Arrow table.

        ``readonly=True`` runs it under ClickHouse's own ``readonly=1`` setting (user SQL):
        any statement that writes, changes the schema or changes a setting is refused by
        ClickHouse with code 164 (``READONLY``). The catalog's own statements never set it.
        """

    @abstractmethod
    def insert(self, table: str, data: pa.Table) -> None:
        """Insert an Arrow table into ``table`` (a quoted, qualified name); columns by name."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection or session; idempotent."""
