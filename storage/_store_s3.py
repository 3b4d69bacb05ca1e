"""Packs in an S3 bucket (AWS S3, MinIO, moto, ...): :class:`S3PackStore`.

``s3://bucket/prefix`` holds ``<prefix>/<pack_id>.arrow`` objects. The connection is
configured as pyarrow's ``S3FileSystem`` takes it: URI query parameters ``endpoint_override``
(``host:port`` or a full URL), ``scheme`` (``http``/``https``), ``region``, ``access_key``,
``secret_key``, ``session_token``; whatever the URI does not say comes from the environment
(``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``,
``~/.aws``), which boto3 reads itself. Secrets never appear in :attr:`S3PackStore.uri`.

It talks to S3 through boto3/botocore rather than pyarrow's filesystem because sealing
needs a conditional PUT (``If-None-Match: *``) that pyarrow cannot send:

* **Sealing** is one PUT of the whole pack to its final key, created only if absent.
  The pack is gathered in memory while it is written (so a writer holds at most
  ``max_bytes`` of it; nothing reaches the bucket before the seal, so a crash leaves
  nothing behind). S3 makes a PUT visible atomically, whole or not at all; a 412
  (``PreconditionFailed``) means the key exists — :class:`PackSealError`, and the first
  body stays. No rename, no copy, no multipart upload (a single PUT takes up to 5 GiB).
* **Reads** are ranged GETs. Opening a pack fetches its last :data:`TAIL_BYTES` (one
  suffix-range GET that also tells the size and whether the pack exists), so the footer
  cache loads a footer in that one round trip. Each :meth:`PackInput.read_into` is one GET
  of exactly the planned (coalesced) range, streamed straight into the caller's buffer.
  It carries ``If-Match`` with the ETag of the GET that opened the pack, so an object put
  under the key since (a restore, a re-seal) is refused by S3 (412), and the read fails with
  a :class:`PackReplacedError` saying the pack was replaced while it was being read — never the new
  object's bytes behind the opened one's footer.
* **Listing** is ``ListObjectsV2`` on the prefix (recovery finds sealed packs that way).

boto3 is an optional dependency (``pip install 'dmi-capture[s3]'``); without it, opening an
``s3://`` store raises :class:`PackStoreNotInstalledError` with that hint.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

import pyarrow as pa

from dmi.storage._pack_names import PACK_SUFFIX
from dmi.storage._store import PackInput, PackSink, PackStore
from dmi.storage.errors import (
    InvalidArgumentError,
    PackError,
    PackNotFoundError,
    PackReplacedError,
    PackSealError,
    PackStoreNotInstalledError,
)

__all__ = ["S3PackStore", "S3Location", "TAIL_BYTES", "MAX_PUT_BYTES"]

TAIL_BYTES = 256 * 1024
"""Bytes fetched from the end of a pack when it is opened: the Arrow footer and the record
index of a pack of a few thousand records fit, so a footer costs one GET."""

MAX_PUT_BYTES = 5 * 1024**3
"""S3's limit for one PUT; a bigger pack is refused at seal (lower the writer's ``max_bytes``)."""

_QUERY_KEYS = ("endpoint_override", "scheme", "region", "access_key", "secret_key", "session_token")
_SECRET_KEYS = ("access_key", "secret_key", "session_token")
_CHUNK_BYTES = 1024 * 1024
_INSTALL_HINT = "s3:// pack stores need boto3: pip install 'dmi-capture[s3]'"


@dataclass(frozen=True, slots=True)
class S3Location:
    """Where an :class:`S3PackStore` keeps its packs and how it reaches the endpoint.

    Fields left ``None`` are resolved by boto3 from the environment. ``endpoint_url``
    is a full URL (``http://127.0.0.1:9000``).
    """

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    session_token: str | None = None

    @staticmethod
    def parse(uri: str) -> S3Location:
        """Parse ``s3://bucket/prefix?endpoint_override=...&region=...``; unknown parameters are refused."""
        parts = urlsplit(uri)
        if parts.scheme != "s3" or not parts.netloc:
            raise InvalidArgumentError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
        if "#" in uri:  # what follows is not shown: it may be the rest of a secret
            raise InvalidArgumentError(
                f"{_redacted(uri.split('#', 1)[0]) + '#...'!r}: an S3 pack store URI takes no fragment ('#'); "
                "write a '#' inside a parameter value as %23"
            )
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - set(_QUERY_KEYS))
        if unknown:
            raise InvalidArgumentError(
                f"unknown S3 URI parameter(s) {', '.join(unknown)} in {_redacted(uri)!r}; "
                f"known: {', '.join(_QUERY_KEYS)}"
            )
        scheme = query.get("scheme") or "https"
        if scheme not in ("http", "https"):
            raise InvalidArgumentError(f"S3 URI scheme= must be http or https, not {scheme!r}")
        endpoint = query.get("endpoint_override") or None
        if endpoint is not None and "://" not in endpoint:
            endpoint = f"{scheme}://{endpoint}"
        return S3Location(
            bucket=parts.netloc,
            prefix=parts.path.strip("/"),
            endpoint_url=endpoint,
            region=query.get("region") or None,
            access_key=query.get("access_key") or None,
            secret_key=query.get("secret_key") or None,
            session_token=query.get("session_token") or None,
        )

    def key(self, name: str) -> str:
        """The object key of ``name`` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def uri(self) -> str:
        """The store as a URI, with the endpoint and region but never a secret."""
        base = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        query = [("endpoint_override", self.endpoint_url), ("region", self.region)]
        shown = "&".join(f"{k}={v}" for k, v in query if v)
        return f"{base}?{shown}" if shown else base


class S3PackStore(PackStore):
    """Sealed packs as objects under one prefix of one bucket (see the module docstring).

    The bucket must exist; DMI never creates or deletes buckets. The boto3 client is made
    on first use in each process (boto3 clients are thread-safe but must not cross a fork).
    """

    def __init__(self, location: S3Location | str):
        self.s3 = location if isinstance(location, S3Location) else S3Location.parse(location)
        _import_boto3()  # fail now, with the install hint, not at the first read
        self._client = None
        self._client_pid = -1
        self._client_lock = threading.Lock()

    @property
    def uri(self) -> str:
        return self.s3.uri

    @property
    def client(self):
        """This process's boto3 S3 client."""
        with self._client_lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = _make_client(self.s3)
                self._client_pid = os.getpid()
            return self._client

    def __getstate__(self) -> dict:
        return {"s3": self.s3}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["s3"])

    def _key(self, pack_id: str) -> str:
        return self.s3.key(f"{pack_id}{PACK_SUFFIX}")

    def _location(self, pack_id: str) -> str:
        return f"s3://{self.s3.bucket}/{self._key(pack_id)}"

    def _list_names(self) -> list[str]:
        prefix = self.s3.key("")
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.s3.bucket, Prefix=prefix, Delimiter="/"
        )
        names = []
        with _translated(f"cannot list pack store {self.uri}"):
            for page in pages:
                names.extend(item["Key"][len(prefix):] for item in page.get("Contents", ()))
        return names

    def _exists(self, pack_id: str) -> bool:
        try:
            self._head(pack_id)
        except PackNotFoundError:
            return False
        return True

    def _open_input(self, pack_id: str) -> PackInput:
        return _S3PackInput(self, pack_id)

    def _create(self, pack_id: str) -> PackSink:
        return _S3PackSink(self, pack_id)

    def _delete(self, pack_id: str) -> None:
        self._head(pack_id)  # S3 deletes a missing key silently; the contract says not found
        with _translated(f"pack {pack_id}: cannot delete from {self.uri}"):
            self.client.delete_object(Bucket=self.s3.bucket, Key=self._key(pack_id))

    def _head(self, pack_id: str) -> dict:
        with _translated(f"pack {pack_id}: cannot look up in {self.uri}", missing=f"pack {pack_id} not found in {self.uri}"):
            return self.client.head_object(Bucket=self.s3.bucket, Key=self._key(pack_id))


class _S3PackSink(PackSink):
    """Gathers the pack in memory; :meth:`seal` is one create-if-absent PUT of the final key."""

    def __init__(self, store: S3PackStore, pack_id: str):
        self.store = store
        self.pack_id = pack_id
        self.stream = pa.BufferOutputStream()

    def seal(self) -> int:
        try:
            size = self.stream.tell()
            body = self.stream.getvalue()
        except (OSError, pa.ArrowException) as exc:
            raise PackSealError(f"pack {self.pack_id}: could not finish the pack in memory: {exc}") from exc
        if size > MAX_PUT_BYTES:
            raise PackSealError(
                f"pack {self.pack_id}: {size} bytes is more than one S3 PUT takes ({MAX_PUT_BYTES}); "
                "lower the writer's max_bytes; nothing was uploaded"
            )
        self._put(body)
        return size

    def _put(self, body: pa.Buffer) -> None:
        """One PUT of the final key, refused by the store if the key exists (HTTP 412)."""
        store = self.store
        what = f"pack {self.pack_id}: upload to {store.uri} failed (if the PUT landed after all, `dmi recover` publishes it)"
        with _translated(what, error=PackSealError, exists=f"pack {self.pack_id} already exists in {store.uri}; it was kept as it was"):
            store.client.put_object(
                Bucket=store.s3.bucket,
                Key=store._key(self.pack_id),
                Body=pa.BufferReader(body),
                ContentLength=body.size,
                IfNoneMatch="*",
            )

    def abort(self) -> None:
        self.stream = pa.BufferOutputStream()  # nothing was uploaded: dropping the bytes is all


class _S3PackInput(PackInput):
    """A sealed pack read with ranged GETs; its tail is fetched at open (size, footer)."""

    def __init__(self, store: S3PackStore, pack_id: str):
        self.store = store
        self.pack_id = pack_id
        self._file = None
        self._size, self._tail, self._etag = self._fetch_tail()

    @property
    def size(self) -> int:
        return self._size

    @property
    def version(self) -> Hashable:
        """Size and ETag, both from the GET that opened the pack: an object put again under the
        pack's key (even of the same size) has another ETag. Every later ranged GET of this
        input requires that ETag, so all its bytes come from this version."""
        return (self._size, self._etag)

    def read_into(self, offset: int, out) -> None:
        view = memoryview(out).cast("B")
        if not view.nbytes:
            return
        if offset < 0 or offset + view.nbytes > self._size:
            raise self._truncated(offset, view.nbytes, max(0, min(view.nbytes, self._size - offset)))
        tail_start = self._size - len(self._tail)
        if offset >= tail_start:
            start = offset - tail_start
            view[:] = self._tail[start : start + view.nbytes]
            return
        self._get_into(offset, view)

    def arrow_file(self) -> pa.NativeFile:
        if self._file is None:
            self._file = pa.PythonFile(_RangedReader(self), mode="r")
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _fetch_tail(self) -> tuple[int, bytes, str | None]:
        """(object size, its last TAIL_BYTES or fewer, its ETag): one suffix-range GET."""
        store = self.store
        with _translated(
            f"pack {self.pack_id}: cannot open in {store.uri}",
            missing=f"pack {self.pack_id} not found in {store.uri}",
        ):
            reply = store.client.get_object(
                Bucket=store.s3.bucket, Key=store._key(self.pack_id), Range=f"bytes=-{TAIL_BYTES}"
            )
            tail = reply["Body"].read()
        total = reply.get("ContentRange", "").rpartition("/")[2]
        size = int(total) if total.isdigit() else len(tail)
        return size, tail, reply.get("ETag")

    def _get_into(self, offset: int, view: memoryview) -> None:
        """One ranged GET of exactly ``view``'s length at ``offset``, streamed into ``view``.

        It carries ``If-Match`` with the ETag seen at open, so S3 refuses (412) to serve the
        bytes of an object put under the key since: they would be read behind the opened
        object's footer (another object's bytes, silently where the layouts match)."""
        store = self.store
        end = offset + view.nbytes - 1
        filled = 0
        with _translated(f"pack {self.pack_id}: read at {offset} failed in {store.uri}",
                         missing=f"pack {self.pack_id} not found in {store.uri}",
                         replaced=self._replaced_message()):
            reply = store.client.get_object(
                Bucket=store.s3.bucket, Key=store._key(self.pack_id), Range=f"bytes={offset}-{end}",
                **self._unchanged(),
            )
            for chunk in reply["Body"].iter_chunks(_CHUNK_BYTES):
                take = min(len(chunk), view.nbytes - filled)
                view[filled : filled + take] = chunk[:take]
                filled += take
        if filled != view.nbytes:
            raise self._truncated(offset, view.nbytes, filled)

    def _unchanged(self) -> dict[str, str]:
        """The GET's condition that the object is still the one opened (none where the
        endpoint gave no ETag: nothing then tells the objects apart)."""
        return {"IfMatch": self._etag} if self._etag else {}

    def _replaced_message(self) -> str:
        """What a 412 to a ranged GET means: the object was replaced after this input opened it."""
        return (
            f"pack {self.pack_id} was replaced in {self.store.uri} while it was being read (it was opened as "
            f"ETag {self._etag}; the object under its key now has another): read it again, which opens "
            "the pack as it is now"
        )


class _RangedReader:
    """A read-only, seekable file object over a :class:`_S3PackInput`, for ``pyarrow.ipc``."""

    def __init__(self, source: _S3PackInput):
        self._source = source
        self._pos = 0
        self.closed = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def size(self) -> int:
        return self._source.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._source.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._source.size - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        out = bytearray(n)
        self._source.read_into(self._pos, out)
        self._pos += n
        return bytes(out)

    def close(self) -> None:
        self.closed = True


def _redacted(uri: str) -> str:
    parts = urlsplit(uri)
    query = [(k, "***" if k in _SECRET_KEYS else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return parts._replace(query="&".join(f"{k}={v}" for k, v in query)).geturl()


def _import_boto3():
    try:
        import boto3
    except ImportError as exc:
        raise PackStoreNotInstalledError(_INSTALL_HINT) from exc
    return boto3


def _make_client(location: S3Location):
    boto3 = _import_boto3()
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"} if location.endpoint_url else {},
        retries={"mode": "standard"},
        max_pool_connections=32,
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=location.endpoint_url,
        region_name=location.region,
        aws_access_key_id=location.access_key,
        aws_secret_access_key=location.secret_key,
        aws_session_token=location.session_token,
        config=config,
    )


@contextmanager
def _translated(what: str, *, error: type[PackError] = PackError, missing: str | None = None,
                exists: str | None = None, replaced: str | None = None) -> Iterator[None]:
    """Turn botocore's errors into the store's: 404 → ``missing``, 409/412 → ``exists`` (a
    conditional PUT), 412 → ``replaced`` (a GET's ``If-Match``), else ``error``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            raise error(f"{what}: the bucket does not exist (DMI never creates buckets)") from exc
        if missing is not None and (status == 404 or code in ("NoSuchKey", "NotFound")):
            raise PackNotFoundError(missing) from exc
        if exists is not None and (status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")):
            raise PackSealError(exists) from exc
        if replaced is not None and (status == 412 or code == "PreconditionFailed"):
            raise PackReplacedError(replaced) from exc
        raise error(f"{what}: {code or status}: {exc}") from exc
    except PackError:
        raise
    except (BotoCoreError, OSError) as exc:  # connection refused, reset, timed out
        raise error(f"{what}: {exc}") from exc
