"""PackWriter: records in, sealed packs out.

``append`` encodes a record (checksum, statistics, compression — all outside the GIL and
outside the writer's lock, so several threads can encode at once), then adds it to the
open pack. Records of at least ``batch_bytes`` are written at once as their own record
batch, straight from the caller's memory; smaller ones are copied, once, into a shared batch
of at most ``batch_bytes`` (the caller may reuse its memory as soon as ``append`` returns),
so that the fixed cost of a record batch (its metadata columns and its write) is not paid
per record. The pack seals at ``max_records`` records,
before it would pass ``max_bytes`` stored bytes, on :meth:`PackWriter.seal`, and on
:meth:`PackWriter.close`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from dmi.storage._codecs import CODECS, DEFAULT_CODEC, LOSSY_CODECS, checksum, encode, encode_lossy
from dmi.storage._native import moments
from dmi.storage.record_schema import _text_problem, field_columns, unstorable
from dmi.storage._pack_format import PACK_ROW_SCHEMA, FORMAT_VERSION, dtype_name, encode_index, schema_with_metadata, torch_dtype
from dmi.storage._store import PackSink, PackStore, full_disk_advice
from dmi.storage.errors import (
    DuplicateRecordError,
    InvalidArgumentError,
    LossyCodecError,
    PackError,
    PackNotDurableError,
    PackSealError,
    UnsupportedDtypeError,
)
from dmi.storage.records import ByteRange, PackDescriptor, RecordEntry, RecordKey, RecordMeta, RecordStats, ShardGeometry

__all__ = ["PackWriter", "DEFAULT_MAX_RECORDS", "DEFAULT_MAX_BYTES", "DEFAULT_BATCH_BYTES"]

DEFAULT_MAX_RECORDS = 10_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_BATCH_BYTES = 2 * 1024 * 1024  # the lowest writer CPU of 0.25–4 MiB (docs/benchmarks.md, stop 30)
_GATHER_START = 64 * 1024 * 1024  # a gathered batch's first buffer at most (batch_bytes may be far larger)
_IPC_ALIGNMENT = 8  # Arrow IPC pads every body buffer to a multiple of 8 bytes
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression=None)


@dataclass(frozen=True, slots=True)
class _Encoded:
    """A record ready for the pack: its description and its stored bytes."""

    meta: RecordMeta
    stored: object  # buffer-like; may alias the caller's tensor until written
    length: int


class PackWriter:
    """Append records; get sealed packs (and their descriptors) back.

    Thread-safe. ``on_seal(descriptor)`` runs, under the writer's lock, after each pack
    is sealed (automatically or on demand); if it raises, the pack stays sealed and the
    exception reaches whoever triggered the seal. A pack sealed whole whose durability the
    store could not ensure (:class:`PackNotDurableError`: its directory fsync failed) goes to
    ``on_seal`` too, then that error reaches whoever triggered the seal, with the pack's
    ``descriptor``: none of its records is lost, and the writer goes on.

    A key the open pack already holds is refused (:class:`DuplicateRecordError`): readers
    would find two records for the same tokens. Only the open pack's keys are kept (a set, so
    the check costs one lookup); a key repeated across packs is the reader's to refuse.

    ``batch_bytes``: a record at least this big is a record batch of its own, written from
    the caller's memory; smaller records share batches of at most this many payload bytes.
    """

    def __init__(
        self,
        store: PackStore,
        *,
        writer_id: str | None = None,
        codec: str = DEFAULT_CODEC,
        max_records: int = DEFAULT_MAX_RECORDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        on_seal: Callable[[PackDescriptor], object] | None = None,
        stats: bool = True,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ):
        _check_codec(codec)
        for name, value in (("max_records", max_records), ("max_bytes", max_bytes), ("batch_bytes", batch_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        problem = _text_problem(writer_id) if writer_id is not None else None
        if problem is not None:
            raise InvalidArgumentError(f"writer_id {problem}")
        self.store = store
        self.writer_id = writer_id or f"w-{secrets.token_hex(6)}"
        self.codec = codec
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.on_seal = on_seal
        self.stats = stats
        self.batch_bytes = batch_bytes
        self._lock = threading.RLock()
        self._pack: _OpenPack | None = None
        self._closed = False
        _run_arrow_lazy_imports()

    def append(
        self,
        key: RecordKey,
        data,
        *,
        shard: ShardGeometry | None = None,
        dtype: str | torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
        token_axis: int = 0,
        key_axis: int | None = None,
        codec: str | None = None,
    ) -> None:
        """Add one record. ``data``: a tensor, or bytes/a buffer described by ``dtype``/``shape``.

        ``token_axis``/``key_axis``: the record's token layout (see :class:`RecordMeta`),
        as the hook catalogue declares it; they must be distinct axes of the stored shape.
        ``codec``: this record's codec instead of the writer's (the capture drain stores
        ``raw`` while it is behind the model); recorded in the record's row like any other.
        A lossy codec (``fp8``, ``int8``) takes floating-point records only
        (:class:`LossyCodecError` otherwise) and records what it lost in the record's row.
        A key the open pack already holds: :class:`DuplicateRecordError`, nothing written.
        :class:`PackNotDurableError` (a pack this append sealed is whole but not known durable):
        this record is stored all the same.
        """
        self._check_open()
        if not isinstance(key, RecordKey):
            raise InvalidArgumentError(f"key must be a RecordKey, got {type(key).__name__}")
        if shard is not None and not isinstance(shard, ShardGeometry):
            raise InvalidArgumentError(f"shard must be a ShardGeometry, got {type(shard).__name__}")
        problem = unstorable(key, shard)
        if problem is not None:
            raise InvalidArgumentError(f"record {key.describe()}: {problem}; the record was not written")
        if codec is not None:
            _check_codec(codec)
        encoded = self._encode(key, data, shard, dtype, shape, codec or self.codec)
        encoded = _with_layout(encoded, token_axis, key_axis)
        with self._lock:
            self._check_open()
            try:
                self._add_locked(encoded)
            except PackNotDurableError:
                raise  # the record is stored: nothing lost
            except PackSealError as exc:
                if key not in exc.lost_keys:  # failed before the record joined a pack: lost with it
                    exc.lost_keys += (key,)
                raise

    def _add_locked(self, encoded: _Encoded) -> None:
        """Seal the open pack first if ``encoded`` would take it past ``max_bytes``, then add it.
        A pack sealed whole but not durable (:class:`PackNotDurableError`) does not stop the
        record: it goes into the next pack, then the error is raised."""
        pack = self._pack
        if pack is not None and pack.count and pack.stored_bytes + encoded.length > self.max_bytes:
            try:
                self._seal_locked()
            except PackNotDurableError:
                self._add_to_open(encoded)
                raise
        self._add_to_open(encoded)

    def _add_to_open(self, encoded: _Encoded) -> None:
        """Add ``encoded`` to the open pack (opened if none), refusing a key it already holds;
        seal it once it is full."""
        if self._pack is None:
            self._pack = _OpenPack(self.store, self.writer_id, self.batch_bytes)
        key = encoded.meta.key
        if key in self._pack.keys:
            raise DuplicateRecordError(
                f"record {key.describe()} (step {key.step}, {key.phase}): pack {self._pack.pack_id} already holds a "
                "record under this key, and readers would find both; this one was not written (the first stays). "
                "Give each record its own key"
            )
        self._pack.add(encoded, self._forget_pack)
        if self._pack.count >= self.max_records or self._pack.stored_bytes >= self.max_bytes:
            self._seal_locked()

    def seal(self) -> PackDescriptor | None:
        """Seal the open pack now; ``None`` if it has no records."""
        with self._lock:
            self._check_open()
            return self._seal_locked()

    def close(self) -> PackDescriptor | None:
        """Seal what is open and refuse further appends. Idempotent."""
        with self._lock:
            if self._closed:
                return None
            try:
                return self._seal_locked()
            finally:
                self._closed = True

    def abort(self) -> None:
        """Discard the open pack (nothing becomes visible) and close the writer."""
        with self._lock:
            pack, self._pack = self._pack, None
            self._closed = True
            if pack is not None:
                pack.abort()

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PackError(f"pack writer {self.writer_id} is closed")

    def _forget_pack(self) -> None:
        self._pack = None

    def _seal_locked(self) -> PackDescriptor | None:
        """Seal the open pack and hand its descriptor to ``on_seal`` — also where the store could
        not make it durable (:class:`PackNotDurableError`, raised after): it is whole and visible."""
        pack, self._pack = self._pack, None
        if pack is None:
            return None
        try:
            descriptor = pack.seal()
        except PackNotDurableError as exc:
            self._sealed(exc.descriptor)
            raise
        self._sealed(descriptor)
        return descriptor

    def _sealed(self, descriptor: PackDescriptor) -> None:
        """A pack is sealed: tell ``on_seal``."""
        if self.on_seal is not None:
            self.on_seal(descriptor)

    def _encode(self, key, data, shard, dtype, shape, codec: str) -> _Encoded:
        flat, tensor, dtype_str, shape_t = _as_bytes(data, dtype, shape)
        stats = _stats(tensor) if self.stats and tensor is not None else None
        errors = (0.0, 0.0)
        if codec in LOSSY_CODECS:
            stored, errors = _encode_lossy(codec, key, tensor, dtype_str, stats)
        else:
            stored = encode(codec, flat, torch_dtype(dtype_str).itemsize)
        view = memoryview(stored).cast("B") if not isinstance(stored, np.ndarray) else stored
        length = view.nbytes
        meta = RecordMeta(
            key=key,
            dtype=dtype_str,
            shape=shape_t,
            codec=codec,
            raw_size=flat.nbytes,
            checksum=checksum(view),
            shard=shard,
            stats=stats,
            codec_max_abs_error=errors[0],
            codec_rel_l2_error=errors[1],
        )
        return _Encoded(meta, view, length)


def _encode_lossy(codec: str, key: RecordKey, tensor: torch.Tensor | None, dtype_str: str,
                  stats: RecordStats | None):
    """(stored payload, (max abs error, relative L2 error)) of a floating record under ``codec``;
    ``stats``, the record's own statistics where the writer keeps them (its L2 norm is reused).

    Refuses anything but float16/bfloat16/float32/float64 values: quantising token ids or
    expert indices would silently change what they mean."""
    if tensor is None or not tensor.is_floating_point() or tensor.element_size() < 2:
        raise LossyCodecError(
            f"record {key.describe()}: {codec} is lossy and stores floating-point values only, not {dtype_str}; "
            "store it with a lossless codec (raw, zstd, split-zstd)"
        )
    stored, error = encode_lossy(codec, tensor)
    return stored, lossy_errors(tensor, error, None if stats is None else stats.l2_norm)


def lossy_errors(original: torch.Tensor, error: torch.Tensor, norm: float | None = None) -> tuple[float, float]:
    """Largest absolute value of ``error`` (``decoded - original``) and ``||error|| / ||original||``
    (0 when the original is all zeros or empty; rescaled where its squares underflow); NaN where
    the original holds NaN.

    The codec takes the difference in float32 (float64 for float64 records), exactly: a decoded value
    is 0 or within about a factor of two of its original (fp8 keeps 3 mantissa bits, int8 rounds
    to the nearest step of its row's scale), and float32 holds such a difference of two 16-bit
    values, or of two float32 ones (Sterbenz). Its sums of squares are the statistics' float64
    lanes (:func:`_stats`): one pass over the difference and one over the original, no float64
    copy of the record. ``norm``: the original's L2 norm, where its statistics already hold it."""
    if original.numel() == 0:
        return 0.0, 0.0
    diff = _stats(error)
    if norm is None:
        norm = _stats(original).l2_norm
    if not norm and diff.absmax:  # every square of the original underflowed (float64 under ~1e-154)
        return diff.absmax, _rescaled_relative_l2(original, error)
    return diff.absmax, diff.l2_norm / norm if norm else 0.0


def _rescaled_relative_l2(original: torch.Tensor, error: torch.Tensor) -> float:
    """``||error|| / ||original||`` for an original too small to square in float64: both divided
    by the original's largest magnitude first (the ratio is unchanged, the squares no longer
    vanish), rather than calling a record whose values were all lost exact."""
    scale = original.abs().max().double()
    return float(torch.linalg.vector_norm(error.double() / scale) / torch.linalg.vector_norm(original.double() / scale))


def _check_codec(codec: str) -> None:
    if codec not in CODECS and codec not in LOSSY_CODECS:
        raise InvalidArgumentError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS + LOSSY_CODECS)}")


def _as_bytes(data, dtype, shape):
    """(contiguous uint8 numpy view, tensor for stats or None, dtype name, shape)."""
    if isinstance(data, torch.Tensor):
        if dtype is not None or shape is not None:
            raise InvalidArgumentError("dtype=/shape= describe bytes payloads; a tensor describes itself")
        if data.is_quantized:
            raise UnsupportedDtypeError(
                f"quantized dtype {data.dtype}: a pack stores no scale/zero-point; dequantize first"
            )
        tensor = data.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
        name = dtype_name(tensor.dtype)
        try:
            flat = tensor.reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as exc:
            raise UnsupportedDtypeError(f"dtype {name} cannot be stored as bytes: {exc}") from exc
        return flat, tensor, name, tuple(tensor.shape)
    try:
        flat = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"data must be a tensor or a contiguous buffer, got {type(data).__name__}") from exc
    torch_type = torch_dtype(dtype) if isinstance(dtype, str) else (dtype or torch.uint8)
    name = dtype_name(torch_type)
    if torch_type in _QUANTIZED_DTYPES:
        raise UnsupportedDtypeError(f"quantized dtype {name}: a pack stores no scale/zero-point; dequantize first")
    shape_t = _checked_shape(shape) if shape is not None else (flat.nbytes // torch_type.itemsize,)
    if math.prod(shape_t) * torch_type.itemsize != flat.nbytes:
        raise InvalidArgumentError(f"{flat.nbytes} bytes do not hold a {name} tensor of shape {shape_t}")
    tensor = None
    if flat.nbytes:
        # torch takes only writable memory (a read-only buffer: its copy, for statistics and lossy codecs)
        writable = flat if flat.flags.writeable else flat.copy()
        tensor = torch.from_numpy(writable).view(torch_type).reshape(shape_t)
    return flat, tensor, name, shape_t


_QUANTIZED_DTYPES = frozenset(
    getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, name)
)
_MAX_DIM = 2**63 - 1  # a dimension is an Int64 in the pack's columns and the catalog


def _checked_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints each in ``0..2**63-1``, or :class:`InvalidArgumentError`:
    a shape that only fails when its pack is sealed would take the pack's other records along."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidArgumentError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= _MAX_DIM for d in dims):
        raise InvalidArgumentError(f"shape {shape!r} must hold ints from 0 to 2**63-1")
    return dims


def _stats(tensor: torch.Tensor) -> RecordStats | None:
    """L2 norm, mean and absmax, or ``None`` (empty tensor, or a dtype with no float view).

    One pass on the calling thread (:func:`moments`: C for bf16/float32/float64, numpy
    otherwise), not torch's reductions, which would use the intra-op thread pool the model's own
    forward needs. Sums are float64 in ``MOMENT_LANES`` lanes, each added in element order (so
    the C loop and numpy agree to the bit), then the lanes summed exactly (``math.fsum``).
    """
    if tensor.numel() == 0:
        return None
    numbers = _as_numpy_numbers(tensor)
    if numbers is None:
        return None
    values, bf16 = numbers
    m = moments(values, bf16=bf16)
    squares = _lane_total(m.squares)
    mean = _lane_total(m.sums) / tensor.numel()
    absmax = math.nan if math.isnan(squares) else max(abs(m.low), abs(m.high))  # NaN only shows in the squares
    return RecordStats(l2_norm=math.sqrt(squares), mean=mean, absmax=absmax)


def _lane_total(lanes: np.ndarray) -> float:
    """The lanes' exact sum, rounded once; inf and NaN as IEEE addition gives them."""
    try:
        return math.fsum(lanes.tolist())
    except (ValueError, OverflowError):  # inf + -inf, or finite lanes whose sum passes float64
        with np.errstate(all="ignore"):
            return float(np.add.reduce(lanes))


_NUMPY_NATIVE = {
    torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64, torch.bool,
}


def _as_numpy_numbers(tensor: torch.Tensor) -> tuple[np.ndarray, bool] | None:
    """(real values as a numpy array, whether they are bf16 bits): magnitudes for complex,
    float32 for float8; ``None`` for a dtype with no float view."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy(), True
    if tensor.dtype in _NUMPY_NATIVE:
        return tensor.numpy(), False
    if tensor.dtype in (torch.complex64, torch.complex128):
        return np.abs(tensor.numpy()), False
    try:  # float8 and other narrow types torch can widen; None where it cannot
        if tensor.is_complex():
            return np.abs(torch.view_as_real(tensor).to(torch.float32).numpy().view(np.complex64)), False
        return tensor.to(torch.float32).numpy(), False
    except (RuntimeError, TypeError, NotImplementedError):
        return None


class _OpenPack:
    """One pack being written: Arrow IPC file writer over a store sink, plus its index."""

    def __init__(self, store: PackStore, writer_id: str, batch_bytes: int):
        self.pack_id = secrets.token_hex(16)
        self.store = store
        self.writer_id = writer_id
        self.batch_bytes = batch_bytes
        self.sink: PackSink = store.create(self.pack_id)
        self.records: list[RecordEntry] = []
        self.keys: set[RecordKey] = set()  # of every record added, written or gathered
        self.gathered: np.ndarray | None = None  # small records' bytes, back to back
        self.gathered_bytes = 0
        self.gathered_metas: list[RecordMeta] = []
        self.gathered_lengths: list[int] = []
        self.stored_bytes = 0
        try:
            self.ipc = pa.ipc.new_file(self.sink.stream, schema_with_metadata(self.pack_id, writer_id), options=_IPC_OPTIONS)
        except Exception as exc:
            left = self.abort()
            raise PackSealError(f"pack {self.pack_id}: cannot start the Arrow file: {exc}{left}") from exc

    @property
    def count(self) -> int:
        return len(self.records) + len(self.gathered_metas)

    def _keys(self) -> list[RecordKey]:
        """The keys of the records the pack holds so far (written, and gathered to be)."""
        return [r.meta.key for r in self.records] + [m.key for m in self.gathered_metas]

    def add(self, encoded: _Encoded, on_failure: Callable[[], None]) -> None:
        try:
            if encoded.length >= self.batch_bytes:
                self._flush()
                self._write([encoded.meta], [encoded.length], encoded.stored)  # straight from the caller's memory
            else:
                if self.gathered_bytes + encoded.length > self.batch_bytes:
                    self._flush()
                self._gather(encoded)
            self.keys.add(encoded.meta.key)
        except Exception as exc:
            lost = len(self.records) + len(self.gathered_metas) + 1
            try:
                left = self.abort()
            finally:
                on_failure()
            raise PackSealError(
                f"pack {self.pack_id}: write failed ({exc}); the pack was discarded with its {lost} records"
                f"{full_disk_advice(exc, self.store.uri)}{left}", lost_keys=[*self._keys(), encoded.meta.key]
            ) from exc
        self.stored_bytes += encoded.length

    def seal(self) -> PackDescriptor:
        sealed_at = time.time()
        try:
            self._flush()
            index = pa.RecordBatch.from_pylist([], schema=PACK_ROW_SCHEMA)
            self.ipc.write_batch(index, custom_metadata=encode_index(self.records, sealed_at, self.writer_id))
            self.ipc.close()
            written = self.sink.stream.tell()  # the pack's size, should the seal leave it whole but not durable
        except Exception as exc:
            left = self.abort()
            raise PackSealError(
                f"pack {self.pack_id}: could not finish the file ({exc}); nothing published, "
                f"its {self.count} records lost{full_disk_advice(exc, self.store.uri)}{left}",
                lost_keys=self._keys(),
            ) from exc
        try:
            size = self.sink.seal()
        except PackNotDurableError as exc:
            exc.descriptor = self._descriptor(written, sealed_at)  # whole and visible: nothing lost
            raise
        except PackSealError as exc:
            exc.lost_keys = tuple(self._keys())
            raise
        return self._descriptor(size, sealed_at)

    def _descriptor(self, size: int, sealed_at: float) -> PackDescriptor:
        """What the sealed pack is, for ``on_seal`` and the catalog."""
        return PackDescriptor(
            pack_id=self.pack_id,
            location=self.store.location(self.pack_id),
            size=size,
            writer_id=self.writer_id,
            format_version=FORMAT_VERSION,
            sealed_at=sealed_at,
            records=tuple(self.records),
        )

    def abort(self) -> str:
        """Discard the pack; what it left behind, as the end of an error message ("" if nothing)."""
        left = self.sink.abort()
        return f"; {left}" if left else ""

    def _gather(self, encoded: _Encoded) -> None:
        """Copy a small record's bytes after those gathered so far (its one copy: the caller's
        memory may be reused once ``append`` returns)."""
        start = self.gathered_bytes
        end = start + encoded.length
        if self.gathered is None or end > self.gathered.nbytes:
            self._grow(end)
        self.gathered[start:end] = _as_uint8(encoded.stored)
        self.gathered_bytes = end
        self.gathered_metas.append(encoded.meta)
        self.gathered_lengths.append(encoded.length)

    def _grow(self, needed: int) -> None:
        """Room for ``needed`` gathered bytes: a fresh buffer per batch (a stream may keep what it
        was given) of ``batch_bytes`` — up to :data:`_GATHER_START` at first, doubled after."""
        held = 0 if self.gathered is None else self.gathered.nbytes
        size = max(needed, min(self.batch_bytes, max(2 * held, _GATHER_START)))
        grown = np.empty(size, dtype=np.uint8)
        if self.gathered_bytes:
            grown[: self.gathered_bytes] = self.gathered[: self.gathered_bytes]
        self.gathered = grown

    def _flush(self) -> None:
        if self.gathered_metas:
            self._write(self.gathered_metas, self.gathered_lengths, self.gathered[: self.gathered_bytes])
            self.gathered, self.gathered_bytes, self.gathered_metas, self.gathered_lengths = None, 0, [], []

    def _write(self, metas: list[RecordMeta], lengths: list[int], data) -> None:
        """Write one record batch: ``metas``' rows, their payloads ``data`` (``lengths`` bytes
        each, back to back); record each payload's file offset.

        ``payload`` is the schema's last column, so its data buffer is the last buffer of
        the batch body: it starts ``pad8(total)`` bytes before the stream position after
        the write. ``verify_pack`` checks this against the file independently.
        """
        total = sum(lengths)
        self.ipc.write_batch(_record_batch(metas, lengths, data))
        self.sink.written()
        pos = self.sink.stream.tell() - _pad(total)
        for meta, length in zip(metas, lengths):
            self.records.append(RecordEntry(meta, self.pack_id, ByteRange(pos if length else 0, length)))
            pos += length


def _with_layout(encoded: _Encoded, token_axis: int, key_axis: int | None) -> _Encoded:
    """``encoded`` with its token layout, refused unless the axes exist in its shape."""
    if token_axis == 0 and key_axis is None and type(token_axis) is int:  # every record has an axis 0
        return encoded
    ndim = max(len(encoded.meta.shape), 1)
    axes = [token_axis] if key_axis is None else [token_axis, key_axis]
    if any(not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < ndim for a in axes) or len(set(axes)) != len(axes):
        raise InvalidArgumentError(
            f"token_axis={token_axis!r}, key_axis={key_axis!r} are not distinct axes of shape {encoded.meta.shape}"
        )
    meta = dataclasses.replace(encoded.meta, token_axis=token_axis, key_axis=key_axis)
    return _Encoded(meta, encoded.stored, encoded.length)


@functools.cache
def _run_arrow_lazy_imports() -> None:
    """Build one empty record batch, once per process, while a writer is made.

    pyarrow's first conversion of a Python list imports pandas where it is installed
    (0.2–0.4 s here, holding the GIL). A capture makes its writer before the model runs; left
    to the first seal, that import would run on the drain thread and stall the model's."""
    _record_batch([], [], np.empty(0, dtype=np.uint8))


def _pad(n: int) -> int:
    return -(-n // _IPC_ALIGNMENT) * _IPC_ALIGNMENT


def _as_uint8(stored) -> np.ndarray:
    return stored if isinstance(stored, np.ndarray) else np.frombuffer(stored, dtype=np.uint8)


def _record_batch(metas: list[RecordMeta], lengths: list[int], data) -> pa.RecordBatch:
    offsets = np.zeros(len(metas) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    payload = pa.Array.from_buffers(pa.large_binary(), len(metas), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    columns = field_columns(metas)
    arrays = [pa.array(columns[f.name], type=f.type) for f in PACK_ROW_SCHEMA if f.name != "payload"]
    return pa.RecordBatch.from_arrays([*arrays, payload], schema=PACK_ROW_SCHEMA)
