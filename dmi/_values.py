"""What the facade returns: small frozen summaries of the catalog, each with ``as_dict()``.

They are plain values (no handle on the store), so they can be printed, compared,
pickled and turned into JSON by the CLI without touching the catalog again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from dmi.storage.records import RecordKey

__all__ = [
    "ModelSummary",
    "RequestSummary",
    "HookSummary",
    "RequestContents",
    "Loss",
    "StorageSummary",
    "Problem",
    "VerifyReport",
    "RecoveredPack",
    "PhaseSpan",
    "phase_spans",
    "decode_start",
    "RunSummary",
    "DeleteReport",
]


class _AsDict:
    __slots__ = ()

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain ``dict`` (nested values included), ready for JSON."""
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class ModelSummary(_AsDict):
    """One model id in the catalog, with totals over every published record."""

    model_id: str
    runs: int
    requests: int
    records: int
    stored_bytes: int
    raw_bytes: int

    @property
    def ratio(self) -> float:
        """Raw bytes over stored bytes (the compression ratio of the payloads)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass(frozen=True, slots=True)
class RequestSummary(_AsDict):
    """One captured request: how many tokens, which hooks, how many records and bytes."""

    model_id: str
    run_id: str
    request_id: str
    n_tokens: int
    hooks: tuple[str, ...]
    records: int
    stored_bytes: int
    raw_bytes: int


@dataclass(frozen=True, slots=True)
class HookSummary(_AsDict):
    """One hook of one request: its layers, shards, tokens, dtype and per-token shape."""

    hook: str
    layers: tuple[int, ...]
    shard_ranks: tuple[int, ...]
    n_tokens: int
    dtype: str
    feature_shape: tuple[int, ...]
    records: int
    stored_bytes: int
    raw_bytes: int
    tp_layout: str = ""  # how tensor parallelism holds it ("" when not sharded); see Store.contents


@dataclass(frozen=True, slots=True)
class Loss(_AsDict):
    """Records of one hook and layer that capture dropped under an explicit drop policy."""

    hook: str
    layer: int
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class RequestContents(_AsDict):
    """What one request holds, hook by hook (catalogue order), what capture dropped, and the
    request's phases in its own token positions (``phases``: e.g. prefill ``[0, 7)``, decode
    ``[7, 10)``; each span runs from the phase's first to its last captured position)."""

    model_id: str
    run_id: str
    request_id: str
    hooks: tuple[HookSummary, ...]
    losses: tuple[Loss, ...] = ()
    phases: tuple[PhaseSpan, ...] = ()

    @property
    def decode_start(self) -> int | None:
        """The request's first decode position (the prefill/decode boundary); ``None``
        when no decode step was captured."""
        return decode_start(self.phases)

    def hook(self, name: str) -> HookSummary:
        """The summary of hook ``name``; ``KeyError`` if the request does not hold it."""
        for summary in self.hooks:
            if summary.hook == name:
                return summary
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class StorageSummary(_AsDict):
    """Totals over a selection of records: how much was captured and what it costs on disk."""

    records: int
    packs: int
    raw_bytes: int
    stored_bytes: int
    pack_bytes: int

    @property
    def ratio(self) -> float:
        """Raw payload bytes over bytes on disk (whole pack files, footers included)."""
        return self.raw_bytes / self.pack_bytes if self.pack_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass(frozen=True, slots=True)
class Problem(_AsDict):
    """A record ``verify`` could not read back: which pack, which record, why."""

    kind: str
    pack_id: str
    key: RecordKey | None
    reason: str

    def describe(self) -> str:
        """One line naming the record by its key, then the reason."""
        if self.key is None:
            return self.reason
        k = self.key
        return (
            f"model {k.model_id} run {k.run_id} request {k.request_id} hook {k.hook} layer {k.layer} "
            f"shard {k.shard_rank} tokens {k.start_token}+{k.n_tokens}: {self.reason}"
        )


@dataclass(frozen=True, slots=True)
class VerifyReport(_AsDict):
    """What ``Store.verify`` checked and what it found (``ok`` when nothing is wrong)."""

    records_checked: int
    packs_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]
    unpublished_packs: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass(frozen=True, slots=True)
class RecoveredPack(_AsDict):
    """A sealed pack that recovery found unpublished and published."""

    pack_id: str
    records: int


@dataclass(frozen=True, slots=True)
class PhaseSpan(_AsDict):
    """Positions ``[start, stop)`` along a read's token axis that one phase produced:
    ``"prefill"`` (the prompt's forward), ``"decode"`` (one token per generation step) or
    ``"forward"`` (a scoring pass)."""

    phase: str
    start: int
    stop: int


def phase_spans(keys: Iterable[RecordKey]) -> tuple[PhaseSpan, ...]:
    """The phases along the token axis that ``keys`` assemble into, in token order.

    Only the token axis counts: the records of the lowest layer and shard rank, one per
    start token (every layer and rank of a request covers the same positions). Position
    ``i`` of the axis is the ``i``-th stored token, so a hook that keeps only some positions
    (``logits``: the last prompt position, then one per step) is counted in its own
    positions. Consecutive records of one phase merge into one span.
    """
    keys = list(keys)
    if not keys:
        return ()
    first = min((k.layer, k.shard_rank) for k in keys)
    chunks = {k.start_token: k for k in reversed(keys) if (k.layer, k.shard_rank) == first}
    spans: list[PhaseSpan] = []
    position = 0
    for start in sorted(chunks):
        key = chunks[start]
        end = position + key.n_tokens
        if spans and spans[-1].phase == key.phase:
            spans[-1] = PhaseSpan(key.phase, spans[-1].start, end)
        else:
            spans.append(PhaseSpan(key.phase, position, end))
        position = end
    return tuple(spans)


def decode_start(spans: Iterable[PhaseSpan]) -> int | None:
    """Where decoding starts along the token axis (the prefill/decode boundary); ``None``
    when no decode step is held."""
    return next((span.start for span in spans if span.phase == "decode"), None)


@dataclass(frozen=True, slots=True)
class RunSummary(_AsDict):
    """One visible run of one model: when it was captured, how much it holds.

    ``first_sealed_at``/``last_sealed_at`` are Unix seconds: when the run's first and last
    pack were sealed (packs seal as capture goes, so together they span the capture).
    ``stored_bytes`` are the payload bytes on disk, ``raw_bytes`` before compression.
    """

    model_id: str
    run_id: str
    first_sealed_at: float
    last_sealed_at: float
    requests: int
    records: int
    packs: int
    stored_bytes: int
    raw_bytes: int


@dataclass(frozen=True, slots=True)
class DeleteReport(_AsDict):
    """What ``Store.delete`` did: the runs hidden now, their records, the pack files removed
    (including those of an earlier delete that was interrupted), and the packs kept because
    another run still has records in them."""

    model_id: str
    run_ids: tuple[str, ...]
    records: int
    packs_removed: tuple[str, ...]
    packs_kept: tuple[str, ...]
