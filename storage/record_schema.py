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
    "metas_from_columns",
    "entries_from_columns",
    "unstorable",
]

RECORD_SCHEMA_VERSION = 4
"""Version 1: keys, tensor description, shard geometry, statistics. Version 2: token layout.
Version 3: the writer's data- and pipeline-parallel ranks (``dp_rank``, ``pp_rank``).
Version 4: what a lossy codec lost (``codec_max_abs_error``, ``codec_rel_l2_error``)."""


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
    RecordField("dp_rank", "key.dp_rank", pa.int32(), "Int32", since=3, legacy="0", legacy_of=lambda row: 0),
    RecordField("pp_rank", "key.pp_rank", pa.int32(), "Int32", since=3, legacy="0", legacy_of=lambda row: 0),
    RecordField("codec_max_abs_error", "codec_max_abs_error", pa.float64(), "Float64", since=4, legacy="0",
                legacy_of=lambda row: 0.0),
    RecordField("codec_rel_l2_error", "codec_rel_l2_error", pa.float64(), "Float64", since=4, legacy="0",
                legacy_of=lambda row: 0.0),
)
"""Every field of a record's description, in column order (new fields go last)."""

PAYLOAD_FIELDS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("payload_offset", pa.uint64(), "UInt64"),
    ("payload_length", pa.uint64(), "UInt64"),
)
"""Where a record's stored bytes are in its pack (footer index and catalog; not pack rows)."""

_GROUPS: dict[str, Callable[..., Any]] = {"key": RecordKey, "shard": ShardGeometry, "stats": RecordStats}


def _constructor_order(cls) -> list[str]:
    """Attribute names of a value dataclass, in its constructor's order."""
    return list(cls.__dataclass_fields__)


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
    """Column-at-a-time encoded values of every field for ``metas`` (array fields as tuples:
    Arrow and JSON take them as lists). Each group is fetched once, each column in one pass."""
    groups = {name: list(map(attrgetter(name), metas)) for name in _GROUPS}
    present = {name: sum(m is not None for m in members) for name, members in groups.items()}
    n = len(metas)
    columns: dict[str, list] = {}
    for f in RECORD_FIELDS:
        if not f.group:
            values = list(map(attrgetter(f.attribute), metas))
            columns[f.name] = values if f.absent is None else [f.absent if v is None else v for v in values]
        elif present[f.group] == n:
            columns[f.name] = list(map(attrgetter(f.attribute), groups[f.group]))
        elif present[f.group] == 0:
            columns[f.name] = [f.absent] * n
        else:
            get = attrgetter(f.attribute)
            columns[f.name] = [f.absent if m is None else get(m) for m in groups[f.group]]
    return columns


def metas_from_columns(cols: Mapping[str, Sequence[Any]]) -> list[RecordMeta]:
    """The :class:`RecordMeta` of each row, given field name → column of encoded values.

    Built column-wise: each value object is made positionally from its fields' columns
    (in its dataclass field order), a group whose fields all hold ``absent`` is ``None``."""
    built: dict[str, list] = {}
    for group, make in _GROUPS.items():
        by_attr = {f.attribute: f for f in RECORD_FIELDS if f.group == group}
        fields = [by_attr[attr] for attr in _constructor_order(make)]
        columns = [_python_column(f, cols[f.name]) for f in fields]
        if group == "key":
            built[group] = list(map(make, *columns))
            continue
        absent = tuple(_absent_value(f) for f in fields)
        built[group] = [None if row == absent else make(*row) for row in zip(*columns)]
    for f in RECORD_FIELDS:
        if not f.group:
            values = _python_column(f, cols[f.name])
            built[f.attribute] = values if f.absent is None else [None if v == f.absent else v for v in values]
    return list(map(RecordMeta, *(built[attr] for attr in _constructor_order(RecordMeta))))


def _python_column(f: RecordField, values: Sequence[Any]) -> list:
    return [tuple(v) for v in values] if pa.types.is_list(f.arrow) else list(values)


def _absent_value(f: RecordField) -> Any:
    return tuple(f.absent) if isinstance(f.absent, list) else f.absent


def entries_from_columns(cols: Mapping[str, Sequence[Any]], pack_ids: Sequence[str]) -> list[RecordEntry]:
    """:class:`RecordEntry` of each row: its meta plus ``payload_offset``/``payload_length``."""
    ranges = map(ByteRange, map(int, cols["payload_offset"]), map(int, cols["payload_length"]))
    return list(map(RecordEntry, metas_from_columns(cols), pack_ids, ranges))


_INTEGER_RANGES = {pa.int32(): (-(2**31), 2**31 - 1), pa.int64(): (-(2**63), 2**63 - 1)}


def _domain(arrow: pa.DataType) -> tuple[str, int, int]:
    """(``"str"``, ``"int"`` or ``"ints"``, and the integer range) of a caller-supplied column."""
    if pa.types.is_string(arrow):
        return "str", 0, 0
    if pa.types.is_list(arrow):
        return ("ints", *_INTEGER_RANGES[arrow.value_type])
    return ("int", *_INTEGER_RANGES[arrow])


_CHECKED = {
    group: tuple((f.attribute, f.name, *_domain(f.arrow)) for f in RECORD_FIELDS if f.group == group)
    for group in ("key", "shard")
}
"""The fields a caller supplies (a record's key, a shard's geometry), checked at append."""


def unstorable(key: RecordKey, shard: ShardGeometry | None) -> str | None:
    """Why ``key`` (or ``shard``) cannot be stored — a field whose value does not fit its column:
    not a ``str`` Arrow can hold (UTF-8: no lone surrogate), not an ``int`` (a ``bool`` or a numpy
    integer is refused too: JSON and the catalog would not take it), or out of the column's
    integer range — or ``None``.

    The writer checks this at ``append``, so that one bad key is refused alone: found at the
    seal instead, it would fail the Arrow conversion of its pack's rows, every record with it."""
    for group, value in (("key", key), ("shard", shard)):
        if value is None:
            continue
        for attribute, name, kind, low, high in _CHECKED[group]:
            field_value = getattr(value, attribute)
            if kind == "str":
                problem = _text_problem(field_value)
            elif kind == "int":
                problem = _int_problem(field_value, low, high)
            else:
                problem = _ints_problem(field_value, low, high)
            if problem is not None:
                return f"{name} {problem}"
    return None


def _text_problem(value: Any) -> str | None:
    if type(value) is str and value.isascii():
        return None
    if not isinstance(value, str):
        return f"must be a str, got {type(value).__name__} {value!r}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{value!r} is not valid Unicode text (a lone surrogate): its column holds UTF-8"
    return None


def _int_problem(value: Any, low: int, high: int) -> str | None:
    if type(value) is int and low <= value <= high:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        return f"must be an int, got {type(value).__name__} {value!r}"
    return f"{value} does not fit its column ({low}..{high})"


def _ints_problem(value: Any, low: int, high: int) -> str | None:
    if not isinstance(value, (tuple, list)):
        return f"must be a tuple of ints, got {type(value).__name__} {value!r}"
    bad = [v for v in value if _int_problem(v, low, high) is not None]
    return f"holds {bad[0]!r}: every item must be an int in {low}..{high}" if bad else None
