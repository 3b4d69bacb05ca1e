"""Every error DMI raises, in one tree.

The root lives here, in the lowest layer (``dmi.storage``), so that capture and
reader share it without importing each other. Third-party exceptions (pyarrow,
zstandard, chdb, clickhouse-driver, torch) are translated where they cross into
DMI with ``raise ... from exc``; callers never need to catch a library's own
exception types. Builtin mix-ins are added where callers naturally expect them.

::

    DMIError
    ├── InvalidArgumentError (ValueError)        bad input rejected where it enters
    │   ├── InvalidIdentifierError               model/request id, scope, db/table name
    │   ├── PlanError                            a capture plan file refused, at a field path
    │   ├── LossyCodecError                      a lossy codec (fp8, int8) asked for integer values
    │   ├── DuplicateRecordError                 a record key the writer's open pack already holds
    │   ├── StaleLoaderStateError                an old loader state that cannot say where it stopped
    │   └── SelectionChangedError                a deletion's runs changed since they were counted
    ├── PackError                                the pack files (format, storage)
    │   ├── PackNotFoundError (FileNotFoundError)
    │   ├── PackCorruptError                     checksum mismatch, undecodable payload
    │   │   └── PackTruncatedError               file shorter than its records claim
    │   ├── PackFormatError                      not a DMI pack, or an unknown version
    │   ├── PackSealError (OSError)              could not make a pack durable (disk full, ...)
    │   │   └── PackNotDurableError              sealed whole and visible, but the directory fsync failed
    │   ├── PackReplacedError                    replaced under its name while being read (S3 If-Match refused)
    │   ├── RecoveryIncompleteError              recover went around entries that are no pack files
    │   ├── PackStoreNotInstalledError (ImportError)   a pack store's optional package (boto3 for s3://)
    │   └── UnsupportedDtypeError (TypeError)
    ├── CatalogError                             the ClickHouse index
    │   ├── CatalogUnavailableError (ConnectionError)   server unreachable / connection lost
    │   │   └── QuorumError                      a cluster write not confirmed by every replica
    │   ├── CatalogLockedError                   chDB directory held by another process too long
    │   ├── CatalogReadOnlyError                 chDB directory on a read-only filesystem
    │   ├── BackendNotInstalledError (ImportError)
    │   ├── ServerError                          ClickHouse answered with an error (code, name)
    │   ├── SchemaVersionError                   catalog written by a newer DMI
    │   └── LeaseError                           publisher leases
    │       ├── LeaseHeldError                   another holder has the scope
    │       ├── LeaseLostError                   expired or taken over (fenced)
    │       └── QuarantinedError                 claim/renewal outcome unknown; re-acquire
    ├── ReaderError                              turning records back into tensors
    │   ├── RecordNotFoundError (LookupError)
    │   ├── DuplicateChunkError                  same request/hook/layer/start twice
    │   └── ShardMergeError                      TP geometry missing or ambiguous
    │       └── MissingShardError                a TP rank's shard is absent (lists ranks present/missing)
    ├── CaptureError                             hooks, ring, drain
    │   ├── HookSelectionError (InvalidArgumentError)   unknown hook/group, bad layer range
    │   ├── AttachError                          model already owned, unsupported model
    │   │   └── VLLMConfigError (InvalidArgumentError)   a vLLM engine hooks would miss steps in (CUDA graphs, prefix cache)
    │   ├── AttentionImplementationError         attn_pattern needs eager attention
    │   ├── UnsupportedGenerationError (InvalidArgumentError)   beam search: refused before the model runs
    │   ├── RequestExistsError (InvalidArgumentError)   a request id its run already holds: no record twice
    │   ├── RingFullError (TimeoutError)         producer waited its bound for a free slot
    │   └── DrainError                           the drain thread failed; cause attached
    ├── AuditError                               a capture cannot be audited (no token ids, gaps, TP)
    ├── ExportError (OSError)                    an exported file could not be written (disk full, ...)
    └── ModelError                               getting a model to capture from (``dmi.load_model``)
        ├── ModelNotInstalledError (ImportError) its package, or what loads it, is absent; the pip command is in the message
        └── ModelCacheError (OSError)            the converted model's cache could not be written or read
"""

from __future__ import annotations

__all__ = [
    "DMIError",
    "InvalidArgumentError",
    "InvalidIdentifierError",
    "PlanError",
    "LossyCodecError",
    "DuplicateRecordError",
    "StaleLoaderStateError",
    "SelectionChangedError",
    "PackError",
    "PackNotFoundError",
    "PackCorruptError",
    "PackTruncatedError",
    "PackFormatError",
    "PackSealError",
    "PackNotDurableError",
    "PackReplacedError",
    "RecoveryIncompleteError",
    "PackStoreNotInstalledError",
    "UnsupportedDtypeError",
    "CatalogError",
    "CatalogUnavailableError",
    "QuorumError",
    "CatalogLockedError",
    "CatalogReadOnlyError",
    "BackendNotInstalledError",
    "ServerError",
    "SchemaVersionError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "QuarantinedError",
    "ReaderError",
    "RecordNotFoundError",
    "DuplicateChunkError",
    "ShardMergeError",
    "MissingShardError",
    "CaptureError",
    "HookSelectionError",
    "AttachError",
    "VLLMConfigError",
    "AttentionImplementationError",
    "UnsupportedGenerationError",
    "RequestExistsError",
    "RingFullError",
    "DrainError",
    "AuditError",
    "ExportError",
    "ModelError",
    "ModelNotInstalledError",
    "ModelCacheError",
]


class DMIError(Exception):
    """Root of every error DMI raises."""


class InvalidArgumentError(DMIError, ValueError):
    """An argument was refused where it entered DMI; nothing was changed."""


class InvalidIdentifierError(InvalidArgumentError):
    """A model id, request id, scope, database or table name is not acceptable."""


class PlanError(InvalidArgumentError):
    """A capture plan (YAML) was refused; ``field`` is the path of the field that caused it
    (``"schedule.step_stride"``, ``"hooks[2]"``) and ``source`` the file (or ``"<string>"``)."""

    def __init__(self, source: str, field: str, reason: str):
        super().__init__(f"{source}: {field}: {reason}")
        self.source = source
        self.field = field
        self.reason = reason

    def __reduce__(self):
        """Made again from its fields (its one argument is the message they make): pickling
        carries it to another process — a DataLoader worker's, a vLLM worker's."""
        return type(self), (self.source, self.field, self.reason), self.__dict__


class LossyCodecError(InvalidArgumentError):
    """A lossy codec (``fp8``, ``int8``) was asked to store integer or boolean values (token
    ids, router choices, token text): those are stored losslessly or not at all."""


class DuplicateRecordError(InvalidArgumentError):
    """A record was appended under a key the pack writer's open pack already holds: readers
    would find two records for the same tokens (``DuplicateChunkError``). The record was not
    written; the one already under that key, and the rest of the pack, stay."""


class StaleLoaderStateError(InvalidArgumentError):
    """A loader state saved before version 4 stops inside a window that holds rows skipped as
    damaged: its row counted only the kept rows, in an order drawn over them alone, and the
    state records neither the damage it met nor its ``on_error``, so which rows it had yielded
    cannot be told. Resumed, rows would come twice or never; it is refused instead."""


class SelectionChangedError(InvalidArgumentError):
    """A deletion was told which runs to expect, with their record and loss counts, and found
    others (a run published or records dropped since they were counted): nothing was deleted.
    ``now`` is what it found, ``{run_id: (records, lost)}`` in run order; ``holds``, the same
    as text (``r1 (3 records), r2 (0 records, 12 lost)``, or ``nothing``)."""

    def __init__(self, *args, now=None):
        self.now = dict(sorted((now or {}).items()))
        self.holds = ", ".join(f"{run} ({records} records{f', {lost} lost' if lost else ''})"
                               for run, (records, lost) in self.now.items()) or "nothing"
        super().__init__(*args or (f"not deleted: the selection changed since it was counted (it now holds "
                                   f"{self.holds}); count it again and delete what it holds now",))


class PackError(DMIError):
    """A problem with a pack file."""


class PackNotFoundError(PackError, FileNotFoundError):
    """The pack file named by the catalog does not exist in the pack store."""


class PackCorruptError(PackError):
    """Stored bytes do not match their checksum or cannot be decoded."""


class PackTruncatedError(PackCorruptError):
    """The pack file is shorter than the records it describes."""


class PackFormatError(PackError):
    """The file is not a DMI pack, or uses a format version this code cannot read."""


class PackSealError(PackError, OSError):
    """A pack could not be made durable; no partial pack is visible. ``lost_keys``: the keys
    of the records discarded with it (empty where the writer had none to lose), so a caller
    can count them."""

    def __init__(self, *args, lost_keys=()):
        super().__init__(*args)
        self.lost_keys = tuple(lost_keys)


class PackNotDurableError(PackSealError):
    """A pack was sealed whole and is visible under its id, but the directory fsync after its
    rename failed: it may not survive a power loss. None of its records is lost (``lost_keys``
    is empty); ``descriptor`` is the sealed pack's (set by the pack writer, which hands it to its
    ``on_seal`` as for any seal; ``None`` from a store's sink), to publish it as usual."""

    def __init__(self, *args, descriptor=None):
        super().__init__(*args)
        self.descriptor = descriptor


class PackReplacedError(PackError):
    """The pack was replaced under its name after it was opened and before a read finished;
    reading it again opens it as it is now."""


class RecoveryIncompleteError(PackError):
    """Recovery went around entries named like packs that are not regular files (a FIFO, a
    directory) and recovered every pack around them. ``recovered``: the ids of the packs it
    published; ``skipped``: each skipped entry's pack id → what it is (``"FIFO"``, ...)."""

    def __init__(self, *args, recovered=(), skipped=None):
        super().__init__(*args)
        self.recovered = tuple(recovered)
        self.skipped = dict(skipped or {})


class PackStoreNotInstalledError(PackError, ImportError):
    """The optional package a pack store needs is not installed (the message says how to install it)."""


class UnsupportedDtypeError(PackError, TypeError):
    """A tensor dtype the pack format cannot represent."""


class CatalogError(DMIError):
    """A problem with the ClickHouse catalog."""


class CatalogUnavailableError(CatalogError, ConnectionError):
    """The catalog could not be reached, or the connection broke mid-call."""


class QuorumError(CatalogUnavailableError):
    """A write to a replicated (cluster) catalog was not confirmed by every replica.

    ``outcome_unknown`` is ``False`` when ClickHouse refused it before writing anything (too few
    live replicas), ``True`` when it was written on one replica but not confirmed in time;
    ``code`` is ClickHouse's error code (285, 286 or 319)."""


class CatalogLockedError(CatalogError):
    """An embedded (chDB) catalog directory stayed held by another process past the wait."""


class CatalogReadOnlyError(CatalogError):
    """An embedded (chDB) catalog directory cannot be written (chDB writes even to read)."""


class BackendNotInstalledError(CatalogError, ImportError):
    """The package a catalog backend needs is not installed."""


class ServerError(CatalogError):
    """ClickHouse answered with an error; ``code`` and ``name`` are ClickHouse's own."""

    def __init__(self, message: str, *, code: int | None = None, name: str | None = None):
        super().__init__(message)
        self.code = code
        self.name = name


class SchemaVersionError(CatalogError):
    """The catalog's schema is newer than this code understands."""


class LeaseError(CatalogError):
    """A publisher lease problem; nothing was published."""


class LeaseHeldError(LeaseError):
    """Another holder owns the publishing scope."""


class LeaseLostError(LeaseError):
    """The lease expired or a successor fenced this holder's term."""


class QuarantinedError(LeaseError):
    """The outcome of a claim or renewal is unknown; re-acquire before publishing."""


class ReaderError(DMIError):
    """Records could not be turned back into the requested tensor."""


class RecordNotFoundError(ReaderError, LookupError):
    """No published record matches the selection."""


class DuplicateChunkError(ReaderError):
    """Two records claim the same request, hook, layer and start token."""


class ShardMergeError(ReaderError):
    """Tensor-parallel shards cannot be merged: geometry missing or ambiguous."""


class MissingShardError(ShardMergeError):
    """A sharded tensor lacks some tensor-parallel ranks' shards (a rank died, or its packs
    are not recovered yet): the full tensor cannot be formed, and a narrower one is never
    returned. ``present`` and ``missing`` are the ranks, sorted."""

    def __init__(self, message: str, *, present: tuple[int, ...] = (), missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.present = tuple(present)
        self.missing = tuple(missing)


class CaptureError(DMIError):
    """A problem attaching to a model or moving its internals off the device."""


class HookSelectionError(CaptureError, InvalidArgumentError):
    """Unknown hook or group name, or a layer range that selects nothing."""


class AttachError(CaptureError):
    """The model is already attached, or cannot be attached to."""


class VLLMConfigError(AttachError, InvalidArgumentError):
    """A vLLM engine configured so that hooks would miss steps or tokens silently (CUDA graphs,
    ``torch.compile``, prefix caching, speculative decoding), or running where its model cannot
    be reached; the message names the ``LLM(...)`` argument or variable that fixes it."""


class AttentionImplementationError(CaptureError):
    """``attn_pattern`` needs eager attention; the model uses another implementation."""


class UnsupportedGenerationError(CaptureError, InvalidArgumentError):
    """A ``generate`` mode capture cannot record exactly (beam search); refused before the model runs."""


class RequestExistsError(CaptureError, InvalidArgumentError):
    """A capture was given a request id that its run already holds (published by an earlier
    capture under the same run id and publishing scope, or used earlier in this session):
    writing it again would make readers see its records twice."""


class RingFullError(CaptureError, TimeoutError):
    """The producer waited its bound for a free ring slot."""


class DrainError(CaptureError):
    """The drain thread failed; the original exception is the ``__cause__``."""


class AuditError(DMIError):
    """A capture cannot be audited: the request lacks its ``token_ids``, has gaps, was
    captured with tensor parallelism, or does not fit the model given for the re-run.
    (An audit that runs and finds wrong values is a result, not this error.)"""


class ExportError(DMIError, OSError):
    """An exported file (``dmi get``, ``dmi export``, ``loader.export``) could not be written:
    the disk is full, a file size limit, ... The partial file was removed: nothing was written
    under the file's name (an earlier file there is left as it was)."""


class ModelError(DMIError):
    """Getting a model to capture from failed (``dmi.load_model``): see the subclasses."""


class ModelNotInstalledError(ModelError, ImportError):
    """A model's package, or a package needed to load it, is not installed; the message
    holds the exact ``pip install`` command."""


class ModelCacheError(ModelError, OSError):
    """A converted model's cache in the DMI home could not be written, or what is there
    cannot be loaded; the message names the directory (removing it makes the next load
    convert again)."""
