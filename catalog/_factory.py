"""``open_catalog``: one factory for every backend.

============================================  ===============================================
URI                                           catalog
============================================  ===============================================
``None``                                      chDB in ``$DMI_CATALOG`` if set, else
                                              ``$DMI_HOME/catalog`` if set, else
                                              ``~/.local/share/dmi/catalog``
``chdb:///abs/path`` (``chdb://~/x``, or a    chDB (embedded ClickHouse) in that directory
bare filesystem path)
``clickhouse://user:password@host:port/db``   a ClickHouse server over the native protocol
                                              (port 9000 by default, database ``default``)
``clickhouse://...:port/db?cluster=NAME``     the one-shard replicated cluster ``NAME`` entered
                                              through that server (``docs/scale-out-cluster.md``)
============================================  ===============================================

``DMI_CATALOG`` may itself hold any of these URIs. Settings (keyword arguments) go to the
catalog (``table_prefix="dmi_"``) or to the backend (chDB: ``database="dmi"``,
``lock_timeout=60`` seconds to wait for another process's turn on the directory, default
``$DMI_CATALOG_LOCK_TIMEOUT``; server:
``connect_timeout``, ``send_receive_timeout``, ``create_database``, and any ClickHouse
setting; cluster: also ``quorum_timeout`` and ``ddl_timeout`` in seconds). Backends are
imported only when used; a missing one raises :class:`~dmi.BackendNotInstalledError`
saying what to install.

A malformed URI raises :class:`~dmi.InvalidArgumentError` and creates nothing: a bad port
or host, a query or fragment on a ``chdb://`` URI, a directory holding ``?`` or ``#``, and
a catalog scheme without ``//`` (``chdb:``, ``clickhouse:/host``): such text is a mistyped
URI, not a directory (write ``./chdb:`` for a directory of that name).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from dmi.catalog._catalog import Catalog
from dmi.catalog._sql import validate_identifier
from dmi.storage.errors import InvalidArgumentError

__all__ = ["open_catalog", "default_catalog_uri", "CATALOG_ENV", "HOME_ENV", "LOCK_TIMEOUT_ENV"]

CATALOG_ENV = "DMI_CATALOG"
HOME_ENV = "DMI_HOME"
#: Seconds an embedded catalog waits for another process's turn, when ``lock_timeout`` is not given.
LOCK_TIMEOUT_ENV = "DMI_CATALOG_LOCK_TIMEOUT"


def default_catalog_uri() -> str:
    """The URI ``open_catalog()`` uses when given none (see the module docstring)."""
    explicit = os.environ.get(CATALOG_ENV)
    if explicit:
        return explicit
    home = os.environ.get(HOME_ENV)
    base = Path(home).expanduser() if home else Path.home() / ".local" / "share" / "dmi"
    return "chdb://" + str((base / "catalog").resolve())


_CHDB_SCHEMES = ("chdb", "file")
_SERVER_SCHEMES = ("clickhouse", "ch")


def open_catalog(uri: str | os.PathLike[str] | None = None, **settings) -> Catalog:
    """Open (creating if needed) the catalog at ``uri``; see the module docstring."""
    uri = _uri_text(default_catalog_uri() if uri is None else uri)
    shown = redacted_uri(uri)
    catalog_settings = {k: settings.pop(k) for k in ("table_prefix",) if k in settings}
    if "://" not in uri:
        _refuse_scheme_without_slashes(uri, shown)
        return _open_chdb(Path(uri), settings, catalog_settings)
    parts = _split(uri, shown)
    scheme = parts.scheme.lower()
    if scheme in _CHDB_SCHEMES:
        return _open_chdb(_chdb_directory(uri, parts), settings, catalog_settings)
    if scheme in _SERVER_SCHEMES:
        cluster = _cluster_name(shown, parts)
        if parts.fragment:
            raise InvalidArgumentError(f"{shown!r}: pass settings as keyword arguments, not in the URI")
        database = unquote(parts.path.lstrip("/")) or "default"
        if "/" in database:
            raise InvalidArgumentError(f"{shown!r}: the path must be one database name")
        validate_identifier(database, "database name")
        if cluster is None:
            from dmi.catalog._server import ServerBackend as backend_class
        else:
            from dmi.catalog._cluster import ClusterBackend as backend_class

            settings["cluster"] = cluster
        backend = backend_class(
            parts.hostname or "127.0.0.1",
            _port(shown, parts),
            database,
            unquote(parts.username) if parts.username else "default",
            unquote(parts.password) if parts.password else "",
            **settings,
        )
        return _with_backend(backend, catalog_settings)
    raise InvalidArgumentError(
        f"unknown catalog URI scheme {parts.scheme!r} in {shown!r}; use chdb:///path or "
        "clickhouse://user:password@host:port/database"
    )


def _uri_text(uri: object) -> str:
    """``uri`` (a str or path-like) as a non-empty str, else InvalidArgumentError."""
    try:
        text = os.fspath(uri)
    except TypeError as exc:
        raise InvalidArgumentError(f"catalog URI must be a str or a path, not {type(uri).__name__}") from exc
    if not isinstance(text, str) or not text:
        raise InvalidArgumentError(f"catalog URI must be a non-empty str, not {uri!r}")
    return text


def redacted_uri(uri: str) -> str:
    """``uri`` as error messages show it: a server URI's password (``user:password@``) is
    replaced by ``***``, as the S3 pack store's secrets are. A catalog directory (a path,
    ``chdb://``, ``file://``) holds no credentials and is shown as it is."""
    scheme, sep, rest = uri.partition(":")
    if scheme.lower() in _CHDB_SCHEMES or not sep:
        return uri
    at = rest.rfind("@")  # the userinfo ends at the last '@': a password may hold '/', '#' or '@' unencoded
    user, colon, _ = rest[:at].partition(":") if at >= 0 else ("", "", "")
    return f"{scheme}:{user}:***{rest[at:]}" if colon else uri


def _refuse_scheme_without_slashes(uri: str, shown: str) -> None:
    """Refuse ``chdb:``, ``clickhouse:/host`` and the like: a catalog scheme without ``//``.

    Such text is a mistyped URI, not a directory (it would silently become a chDB catalog
    in the working directory). Other paths, ``./a:b`` or ``mycat`` included, are paths.
    """
    scheme = uri.partition(":")[0].lower()
    if ":" in uri and scheme in _CHDB_SCHEMES + _SERVER_SCHEMES:
        raise InvalidArgumentError(
            f"{shown!r} looks like a {scheme}: URI without '//'; write chdb:///absolute/path or "
            f"clickhouse://user:password@host:port/database (or ./{shown} for a directory of that name)"
        )


def _split(uri: str, shown: str):
    """``urlsplit(uri)``, with its ValueError (an unclosed ``[`` IPv6 host) an InvalidArgumentError."""
    try:
        return urlsplit(uri)
    except ValueError as exc:
        raise InvalidArgumentError(f"malformed catalog URI {shown!r}: {exc}") from exc


def _port(uri: str, parts) -> int:
    """The server URI's port (9000 when absent); one that is not a number in 0-65535 is refused."""
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"{uri!r}: the port must be a number from 1 to 65535 ({exc})") from exc
    return port or 9000


def _chdb_directory(uri: str, parts) -> Path:
    """The directory a ``chdb://`` (or ``file://``) URI names; it takes no query or fragment."""
    if "?" in uri or "#" in uri:
        raise InvalidArgumentError(
            f"{uri!r}: a chDB catalog URI takes no query or fragment ('?', '#'); pass settings as "
            "keyword arguments (open_catalog(uri, database=..., lock_timeout=...))"
        )
    path = unquote(parts.netloc + parts.path)
    if not path:
        raise InvalidArgumentError(f"{uri!r} names no directory; write chdb:///absolute/path")
    return Path(path)


def _cluster_name(uri: str, parts) -> str | None:
    """The ``cluster=NAME`` of a server URI's query, or None; any other query item is refused."""
    if not parts.query:
        return None
    items = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
    if len(items) != 1 or items[0][0] != "cluster" or not items[0][1]:
        raise InvalidArgumentError(
            f"{uri!r}: the only URI query a server catalog takes is ?cluster=NAME; pass settings as keyword arguments"
        )
    return validate_identifier(items[0][1], "cluster name")


def _open_chdb(path: Path, settings: dict, catalog_settings: dict) -> Catalog:
    from dmi.catalog._chdb import ChdbBackend

    unknown = set(settings) - {"database", "lock_timeout"}
    if unknown:
        raise InvalidArgumentError(f"unknown chDB catalog settings: {sorted(unknown)}")
    wait = os.environ.get(LOCK_TIMEOUT_ENV)
    if "lock_timeout" not in settings and wait:
        try:
            settings["lock_timeout"] = float(wait)
        except ValueError as exc:
            raise InvalidArgumentError(f"{LOCK_TIMEOUT_ENV}={wait!r} is not a number of seconds") from exc
    return _with_backend(ChdbBackend(path, **settings), catalog_settings)


def _with_backend(backend, catalog_settings: dict) -> Catalog:
    try:
        return Catalog(backend, **catalog_settings)
    except BaseException:
        backend.close()
        raise
