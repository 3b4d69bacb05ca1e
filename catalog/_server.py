"""Server backend: a ClickHouse server (or cluster entry point) over the native protocol.

Uses clickhouse-driver. Values travel as driver parameters (the driver escapes them on the
client and substitutes ``%(name)s``; this is why ``%`` is refused in identifiers). Inserts
are columnar native blocks built from the Arrow table. One connection per catalog, one
statement at a time (a lock), reconnecting on the next call after a failure.

Before a statement the connection is checked and, where it is closed or fails its ping
(a server killed or restarted since the last statement), established again, separately, so
a failure there is known not to have reached the server (``outcome_unknown=False``); a
failure once the statement is under way is ``outcome_unknown=True``.

Waits are bounded by the two timeouts, each where it belongs: the ping by the driver's 5 s,
establishing a connection — the TCP connect *and* the handshake — by ``connect_timeout``
(a server that is stopped, not dead, accepts the TCP connection and never answers: the
driver alone would wait ``send_receive_timeout`` for its hello), a statement's answer by
``send_receive_timeout``. A timeout is named as one, with the setting that bounded it.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Mapping

import pyarrow as pa

from dmi.catalog._catalog_backend import CatalogBackend, server_error_from_message, unavailable
from dmi.catalog._sql import quote_identifier, validate_identifier
from dmi.storage.errors import BackendNotInstalledError, CatalogError

_SIMPLE_TYPES = {
    "Int8": pa.int8(),
    "Int16": pa.int16(),
    "Int32": pa.int32(),
    "Int64": pa.int64(),
    "UInt8": pa.uint8(),
    "UInt16": pa.uint16(),
    "UInt32": pa.uint32(),
    "UInt64": pa.uint64(),
    "Float32": pa.float32(),
    "Float64": pa.float64(),
    "String": pa.string(),
}
_WRAPPER = re.compile(r"^(Nullable|LowCardinality|Array)\((.*)\)$")


def arrow_type(ch_type: str) -> pa.DataType | None:
    """Arrow type for a ClickHouse type name, or None to let pyarrow infer."""
    match = _WRAPPER.match(ch_type)
    if match:
        outer, inner = match.groups()
        inner_type = arrow_type(inner)
        if outer == "Array":
            return None if inner_type is None else pa.list_(inner_type)
        return inner_type
    if ch_type.startswith("FixedString("):
        return None
    return _SIMPLE_TYPES.get(ch_type)


def _import_driver():
    try:
        import clickhouse_driver
        from clickhouse_driver import errors as driver_errors
    except ImportError as exc:  # pragma: no cover - exercised only without the driver
        raise BackendNotInstalledError(
            "a server catalog needs clickhouse-driver: pip install 'clickhouse-driver>=0.2.6' "
            "(or use the embedded default: open_catalog() / open_catalog('chdb:///path'))"
        ) from exc
    _quiet(logging.getLogger("clickhouse_driver"))
    return clickhouse_driver, driver_errors


def _quiet(driver_logger: logging.Logger) -> None:
    """Give the driver's logger a handler that drops records, once: with none anywhere,
    Python's last-resort handler prints its "Failed to connect" warning with a traceback to
    stderr, beside the :class:`CatalogUnavailableError` that already says what happened and
    what to do. Records still reach handlers the application configured (propagation is kept)."""
    if not any(isinstance(h, logging.NullHandler) for h in driver_logger.handlers):
        driver_logger.addHandler(logging.NullHandler())


@functools.cache
def _checked_connection(base: type) -> type:
    """``base`` (the driver's ``Connection``) without the ping of ``force_connect``.

    ``Client.execute`` calls ``force_connect``, which pings an open connection before every
    statement: a second round trip, as :meth:`ServerBackend._ensure_connected` has just
    pinged it (and reconnected where that failed, with the guarantees the module docstring
    gives). An open connection is only marked as running a query here; a closed one (never
    so after ``_ensure_connected``) is left to the driver."""

    class CheckedConnection(base):
        def force_connect(self):
            if not self.connected:
                return super().force_connect()
            self.check_query_execution()
            return None

    return CheckedConnection


class ServerBackend(CatalogBackend):
    kind = "server"

    def __init__(
        self,
        host: str,
        port: int = 9000,
        database: str = "default",
        user: str = "default",
        password: str = "",
        *,
        connect_timeout: float = 10.0,
        send_receive_timeout: float = 300.0,
        create_database: bool = True,
        **client_settings: object,
    ):
        driver, self._errors = _import_driver()
        self.database = validate_identifier(database, "database name")
        self.host, self.port = host, int(port)
        self.where = f"clickhouse://{host}:{self.port}/{self.database}"
        self._network_errors = (
            self._errors.NetworkError,
            self._errors.SocketTimeoutError,
            self._errors.UnexpectedPacketFromServerError,
            EOFError,
            OSError,
        )
        self._lock = threading.RLock()
        self._closed = False
        # establishing a connection, its handshake included, waits this long at most
        self._connect_timeout = min(connect_timeout, send_receive_timeout)
        self._send_receive_timeout = send_receive_timeout
        self._client = driver.Client(
            host,
            port=self.port,
            user=user,
            password=password,
            database="default",
            connect_timeout=connect_timeout,
            send_receive_timeout=send_receive_timeout,
            settings=dict(client_settings) or None,
        )
        connection = self._client.connection
        connection.__class__ = _checked_connection(type(connection))
        try:
            if create_database:
                self.command(f"CREATE DATABASE IF NOT EXISTS {quote_identifier(self.database, 'database name')}")
        except BaseException:
            self.close()
            raise

    def _execute(self, sql: str, params=None, **kwargs):
        if self._closed:
            raise CatalogError(f"the catalog at {self.where} is closed")
        with self._lock:
            try:
                self._ensure_connected()
            except self._network_errors as exc:
                self._client.disconnect()
                raise unavailable(
                    f"cannot reach ClickHouse at {self.host}:{self.port}: {self._describe(exc, 'connect_timeout')}; "
                    "check that the server is running and reachable", outcome_unknown=False
                ) from exc
            except self._errors.ServerException as exc:  # e.g. authentication failed
                self._client.disconnect()
                raise server_error_from_message(exc.message, code=exc.code, name=self._name(exc.code)) from None
            try:
                return self._client.execute(sql, params, **kwargs)
            except self._errors.ServerException as exc:
                raise server_error_from_message(exc.message, code=exc.code, name=self._name(exc.code)) from None
            except self._network_errors as exc:
                self._client.disconnect()
                raise unavailable(
                    f"connection to ClickHouse at {self.host}:{self.port} broke during a statement; "
                    f"whether it took effect is unknown: {self._describe(exc, 'send_receive_timeout')}",
                    outcome_unknown=True,
                ) from exc

    def _ensure_connected(self) -> None:
        """A live connection before a statement: made if there is none, made again if the open
        one fails its ping (the server went away since the last statement). Establishing it
        waits ``connect_timeout`` at most, the handshake included (see the module docstring)."""
        connection = self._client.connection
        if connection.connected and connection.ping():
            return
        connection.send_receive_timeout = self._connect_timeout
        try:
            connection.connect()
        finally:
            connection.send_receive_timeout = self._send_receive_timeout
        connection.socket.settimeout(self._send_receive_timeout)

    def _describe(self, exc: BaseException, setting: str) -> str:
        """``exc`` in words; a timeout (the driver says only "Code: 209") names the setting that bounded it."""
        if not isinstance(exc, self._errors.SocketTimeoutError):
            return str(exc)
        seconds = self._connect_timeout if setting == "connect_timeout" else self._send_receive_timeout
        return f"no answer within {seconds:g} s ({setting}; a server stopped or overloaded answers nothing): {exc}"

    def _name(self, code: int | None) -> str | None:
        if code is None:
            return None
        codes = self._errors.ErrorCodes
        for name in dir(codes):
            if name.isupper() and getattr(codes, name) == code:
                return name
        return None

    def command(self, sql: str, params: Mapping[str, object] | None = None) -> None:
        self._execute(sql, dict(params) if params else None)

    def query(self, sql: str, params: Mapping[str, object] | None = None, *, readonly: bool = False) -> pa.Table:
        settings = {"readonly": 1} if readonly else None
        rows, columns = self._execute(
            sql, dict(params) if params else None, with_column_types=True, columnar=True, settings=settings
        )
        names = [name for name, _ in columns]
        if not rows:
            rows = [[] for _ in columns]
        arrays = []
        for values, (_, ch_type) in zip(rows, columns):
            arrow = arrow_type(ch_type)
            values = list(values)
            arrays.append(pa.array(values, type=arrow) if arrow is not None else pa.array(values))
        return pa.Table.from_arrays(arrays, names=names) if names else pa.table({})

    def insert(self, table: str, data: pa.Table) -> None:
        if data.num_rows == 0:
            return
        columns = ", ".join(quote_identifier(name, "column name") for name in data.column_names)
        payload = [column.to_pylist() for column in data.columns]
        self._execute(f"INSERT INTO {table} ({columns}) VALUES", payload, columnar=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._client.disconnect()
