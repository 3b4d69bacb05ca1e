"""Value objects shared by every layer: what a record is and where it lives.

These are the contract between capture (which produces records), the pack writer
(which stores them and reports byte ranges), the catalog (which indexes them) and the
reader (which fetches them). They are frozen and slotted: cheap, hashable, immutable.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PHASES",
    "GLOBAL_LAYER",
    "HOOK_ORDER",
    "TOKEN_TEXT",
    "PROMPT_TEXT",
    "TEXT_HOOKS",
    "RecordKey",
    "ShardGeometry",
    "RecordStats",
    "ByteRange",
    "RecordMeta",
    "RecordEntry",
    "PackDescriptor",
]

PHASES = ("prefill", "decode", "forward")
"""``prefill`` and ``decode`` during generation; ``forward`` for a plain scoring pass."""

GLOBAL_LAYER = -1
"""Layer number of hooks that are not per layer (``token_ids``, ``embed``, ``logits``...)."""

HOOK_ORDER = ("token_ids", "embed", "resid_pre", "attn_q", "attn_k", "attn_v", "attn_z", "attn_pattern", "attn_out",
              "resid_mid", "mlp_post", "mlp_out", "resid_post", "final_norm", "logits", "router_logits", "router_topk")
"""The hook names in the order of the model's computation: the capture catalogue's (``dmi.capture.HOOKS``,
pinned equal by a test), here so that what only lists and sorts records does not load the
capture package and torch with it."""

TOKEN_TEXT = "token_text"
PROMPT_TEXT = "prompt_text"
TEXT_HOOKS = (TOKEN_TEXT, PROMPT_TEXT)
"""The record names of the strings: not hooks of the model (``HOOK_ORDER`` does not list them),
so readers of tensors and the audit leave them out."""


@dataclass(frozen=True, slots=True)
class RecordKey:
    """Identity of one record: a contiguous token range of one hook, layer, shard, request.

    ``shard_rank`` / ``tp_size`` are the writer's tensor-parallel rank and degree;
    ``dp_rank`` / ``pp_rank`` its data- and pipeline-parallel ranks (schema version 3; ``0``
    for records written before), which keep the replicas of a TP x DP run apart."""

    model_id: str
    run_id: str
    request_id: str
    hook: str
    layer: int
    start_token: int
    n_tokens: int
    step: int = 0
    phase: str = "forward"
    shard_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    pp_rank: int = 0

    def describe(self) -> str:
        """The key in one line, for error messages: ``model/run/request/hook/layer/tokens/rank``
        (a lone surrogate in a field, which the writer refuses, shown escaped: a message that
        cannot be printed would hide the refusal)."""
        text = (
            f"{self.model_id}/{self.run_id}/{self.request_id}/{self.hook}/layer {self.layer}"
            f"/tokens {self.start_token}+{self.n_tokens}/rank {self.shard_rank}"
        )
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    """Where a tensor-parallel shard sits inside the full tensor.

    The stored tensor is the slice ``[offset, offset + shape[axis])`` of the full tensor
    along ``axis``; ``full_shape`` is the full tensor's shape for this record's tokens.
    """

    axis: int
    offset: int
    full_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RecordStats:
    """Summary statistics computed at write time over the record's values.

    Stored as float64; accumulated in float64 (64 lanes, each in element order, then summed
    exactly), with magnitudes for complex values. Records written before stop 29 accumulated
    narrower dtypes in float32.
    """

    l2_norm: float
    mean: float
    absmax: float


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A half-open byte range ``[offset, offset + length)`` of a file."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """Everything about a record except where its bytes live.

    ``token_axis`` is the axis of ``shape`` that runs over the record's ``n_tokens`` tokens
    (chunks of one layer join along it); ``key_axis``, when not ``None``, is an axis that
    runs over the keys each token attended to (attention patterns: it grows from chunk to
    chunk, and the reader zero-fills it to the longest). Both come from the hook catalogue
    at capture time, so readers need no hook names.

    ``codec_max_abs_error`` / ``codec_rel_l2_error``: what a lossy codec (``fp8``, ``int8``)
    lost, measured at write time against the original values — the largest absolute
    difference and ``||decoded - original|| / ||original||`` (schema version 4; ``0`` for
    lossless codecs and for records written before).
    """

    key: RecordKey
    dtype: str
    shape: tuple[int, ...]
    codec: str
    raw_size: int
    checksum: int
    shard: ShardGeometry | None = None
    stats: RecordStats | None = None
    token_axis: int = 0
    key_axis: int | None = None
    codec_max_abs_error: float = 0.0
    codec_rel_l2_error: float = 0.0


@dataclass(frozen=True, slots=True)
class RecordEntry:
    """A record inside a sealed pack: its description and its exact stored bytes."""

    meta: RecordMeta
    pack_id: str
    payload: ByteRange


@dataclass(frozen=True, slots=True)
class PackDescriptor:
    """What sealing a pack returns, and what the catalog indexes."""

    pack_id: str
    location: str
    size: int
    writer_id: str
    format_version: int
    sealed_at: float
    records: tuple[RecordEntry, ...]
