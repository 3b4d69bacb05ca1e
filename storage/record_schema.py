"""The record schema: every field of a record, declared once.

A record is described in four places — the pack file's row columns, the pack's footer
index, the catalog's ClickHouse table and the Arrow table that fills it — and all four
are generated from :data:`RECORD_FIELDS`. Each :class:`RecordField` names the value in
:class:`~dmi.storage.records.RecordMeta` it encodes (``path``), its Arrow type, its
ClickHouse type, the value stored when the Python value (or its whole group) is ``None``,
and, for fields added after version 1, the record schema version that added them and
what a record written before then means: ``legacy``, a ClickHouse expression over older
columns (the default of the column an older catalog gains), and ``legacy_of``, the same
rule in Python over an older row (what an older pack's records get).

Adding a field: one line at the end of :data:`RECORD_FIELDS` (and the attribute on the
value object it encodes), then bump :data:`RECORD_SCHEMA_VERSION`. Packs and catalogs of
every earlier version keep reading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import pyarrow as pa

from dmi.storage.records import ByteRange, RecordEntry, RecordKey, RecordMeta, RecordStats, ShardGeometry

__all__ = [
    "RECORD_SCHEMA_VERSION",
    "RecordField",
    "RECORD_FIELDS",
    "PAYLOAD_FIELDS",
    "fields_of_version",
    "add_legacy_columns",
    "field_columns",
    "meta_from_row",
    "entry_from_row",
]

RECORD_SCHEMA_VERSION = 2
"""Version 1: keys, tensor description, shard geometry, statistics. Version 2: token layout."""


@dataclass(frozen=True, slots=True)
class RecordField:
    """One field of a record in every encoding.

    ``path`` is where the value lives in a :class:`RecordMeta`: ``"dtype"`` (an attribute),
    or ``"key.layer"``, ``"shard.axis"``, ``"stats.mean"`` (an attribute of a group).
    ``absent`` is what is stored when the Python value or its group is ``None``; a group
    whose fields all read back as ``absent`` is ``None``.
    """

    name: str
    path: str
    arrow: pa.DataType
    clickhouse: str
    absent: Any = None
    since: int = 1
    legacy: str | None = None
    legacy_of: Callable[[Mapping[str, Any]], Any] | None = None

    @property
    def nullable(self) -> bool:
        return self.clickhouse.startswith("Nullable(")

    @property
    def group(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.path.rpartition(".")[2]

    def getter(self) -> Callable[[RecordMeta], Any]:
        """Encoded value of this field for a meta (``absent`` for ``None``; tuples as lists)."""
        group, attr, absent = self.group, self.attribute, self.absent
        if group == "key":
            return attrgetter(self.path)
        if group:
            outer = attrgetter(group)

            def grouped(meta: RecordMeta) -> Any:
                value = outer(meta)
                return absent if value is None else _plain(getattr(value, attr))

            return grouped
        return lambda meta: _plain(absent if (v := getattr(meta, attr)) is None else v)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


_I64S = pa.list_(pa.int64())

_V1_PATTERN_HOOK = "attn_pattern"
"""Before version 2 recorded the token layout, the one hook whose tokens were not on axis 0
(``[heads, q_tokens, kv_tokens]``). Only the legacy rules below name it."""

RECORD_FIELDS: tuple[RecordField, ...] = (
    RecordField("model_id", "key.model_id", pa.string(), "String"),
    RecordField("run_id", "key.run_id", pa.string(), "String"),
    RecordField("request_id", "key.request_id", pa.string(), "String"),
    RecordField("hook", "key.hook", pa.string(), "String"),
    RecordField("layer", "key.layer", pa.int32(), "Int32"),
    RecordField("start_token", "key.start_token", pa.int64(), "Int64"),
    RecordField("n_tokens", "key.n_tokens", pa.int64(), "Int64"),
    RecordField("step", "key.step", pa.int64(), "Int64"),
    RecordField("phase", "key.phase", pa.string(), "String"),
    RecordField("shard_rank", "key.shard_rank", pa.int32(), "Int32"),
    RecordField("tp_size", "key.tp_size", pa.int32(), "Int32"),
    RecordField("dtype", "dtype", pa.string(), "String"),
    RecordField("shape", "shape", _I64S, "Array(Int64)"),
    RecordField("codec", "codec", pa.string(), "String"),
    RecordField("raw_size", "raw_size", pa.uint64(), "UInt64"),
    RecordField("checksum", "checksum", pa.uint64(), "UInt64"),
    RecordField("shard_axis", "shard.axis", pa.int32(), "Int32", absent=-1),
    RecordField("shard_offset", "shard.offset", pa.int64(), "Int64", absent=0),
    RecordField("full_shape", "shard.full_shape", _I64S, "Array(Int64)", absent=[]),
    RecordField("l2_norm", "stats.l2_norm", pa.float64(), "Nullable(Float64)"),
    RecordField("mean", "stats.mean", pa.float64(), "Nullable(Float64)"),
    RecordField("absmax", "stats.absmax", pa.float64(), "Nullable(Float64)"),
    RecordField("token_axis", "token_axis", pa.int32(), "Int32", since=2,
                legacy=f"if(hook = '{_V1_PATTERN_HOOK}', 1, 0)",
                legacy_of=lambda row: 1 if row["hook"] == _V1_PATTERN_HOOK else 0),
    RecordField("key_axis", "key_axis", pa.int32(), "Int32", absent=-1, since=2,
                legacy=f"if(hook = '{_V1_PATTERN_HOOK}', 2, -1)",
                legacy_of=lambda row: 2 if row["hook"] == _V1_PATTERN_HOOK else -1),
)
"""Every field of a record's description, in column order (new fields go last)."""

PAYLOAD_FIELDS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("payload_offset", pa.uint64(), "UInt64"),
    ("payload_length", pa.uint64(), "UInt64"),
)
"""Where a record's stored bytes are in its pack (footer index and catalog; not pack rows)."""

_GROUPS: dict[str, Callable[..., Any]] = {"key": RecordKey, "shard": ShardGeometry, "stats": RecordStats}


def fields_of_version(version: int) -> tuple[RecordField, ...]:
    """The fields records of schema ``version`` hold, in column order."""
    return tuple(f for f in RECORD_FIELDS if f.since <= version)


def add_legacy_columns(cols: dict[str, list], n: int, version: int) -> None:
    """Add to ``cols`` (``n`` rows of schema ``version``) every later field, by its legacy rule."""
    later = [f for f in RECORD_FIELDS if f.since > version]
    if not later:
        return
    names = [f.name for f in fields_of_version(version)]
    rows = [{name: cols[name][i] for name in names} for i in range(n)]
    for f in later:
        cols[f.name] = [f.legacy_of(row) for row in rows]


def field_columns(metas: Sequence[RecordMeta]) -> dict[str, list]:
    """Column-at-a-time encoded values of every field for ``metas``."""
    return {f.name: list(map(f.getter(), metas)) for f in RECORD_FIELDS}


def meta_from_row(row: Mapping[str, Any]) -> RecordMeta:
    """The :class:`RecordMeta` of one row (any mapping from field name to encoded value)."""
    groups: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
    direct: dict[str, Any] = {}
    absent_in: dict[str, bool] = {name: True for name in _GROUPS}
    for f in RECORD_FIELDS:
        value = row[f.name]
        if isinstance(value, list):
            value = tuple(value)
        if f.group:
            groups[f.group][f.attribute] = value
            absent_in[f.group] &= value == _absent_value(f)
        else:
            direct[f.attribute] = None if f.absent is not None and value == f.absent else value
    built = {
        name: None if absent_in[name] and name != "key" else make(**groups[name])
        for name, make in _GROUPS.items()
    }
    return RecordMeta(key=built["key"], shard=built["shard"], stats=built["stats"], **direct)


def _absent_value(f: RecordField) -> Any:
    return tuple(f.absent) if isinstance(f.absent, list) else f.absent


def entry_from_row(row: Mapping[str, Any], pack_id: str) -> RecordEntry:
    """A :class:`RecordEntry`: the meta of ``row`` plus its ``payload_offset``/``payload_length``."""
    return RecordEntry(meta_from_row(row), pack_id, ByteRange(int(row["payload_offset"]), int(row["payload_length"])))
