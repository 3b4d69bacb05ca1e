"""The audits table: one row per (audit, request, hook, layer) checked by ``dmi audit``.

Kept with its DDL and Arrow schema here so the catalog's schema module only lists it.
Rows are appended once per audit and never changed; ``audit_id`` groups them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from dmi.storage.errors import InvalidArgumentError

__all__ = ["AUDITS_DDL", "AUDIT_SCHEMA", "audit_rows_table", "VERDICTS"]

VERDICTS = ("exact", "noise", "fail")

AUDITS_DDL = """
        CREATE TABLE IF NOT EXISTS {audits} (
            audit_id String, model_id String, run_id String, request_id String, hook String, layer Int32,
            verdict String, tolerance String, bound Float64, n_records UInt64, n_tokens UInt64,
            max_abs Float64, max_rel Float64, rel_l2 Float64, first_diff Int64, first_fail Int64,
            detail String, model String, seed Int64, audited_at Float64
        ) ENGINE = MergeTree ORDER BY (model_id, run_id, request_id, audited_at, audit_id, hook, layer)"""

AUDIT_SCHEMA = pa.schema([
    ("audit_id", pa.string()), ("model_id", pa.string()), ("run_id", pa.string()), ("request_id", pa.string()),
    ("hook", pa.string()), ("layer", pa.int32()), ("verdict", pa.string()), ("tolerance", pa.string()),
    ("bound", pa.float64()), ("n_records", pa.uint64()), ("n_tokens", pa.uint64()), ("max_abs", pa.float64()),
    ("max_rel", pa.float64()), ("rel_l2", pa.float64()), ("first_diff", pa.int64()), ("first_fail", pa.int64()),
    ("detail", pa.string()), ("model", pa.string()), ("seed", pa.int64()), ("audited_at", pa.float64()),
])
"""``first_diff`` / ``first_fail``: a token position, or -1 for none."""


def audit_rows_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    """The rows as an Arrow table of :data:`AUDIT_SCHEMA`; refuses unknown verdicts and missing fields."""
    missing = [n for n in AUDIT_SCHEMA.names if rows and n not in rows[0]]
    if missing:
        raise InvalidArgumentError(f"audit rows lack {', '.join(missing)}")
    bad = sorted({r["verdict"] for r in rows} - set(VERDICTS))
    if bad:
        raise InvalidArgumentError(f"unknown audit verdicts {bad}; verdicts: {', '.join(VERDICTS)}")
    try:
        return pa.Table.from_pylist([{n: r[n] for n in AUDIT_SCHEMA.names} for r in rows], schema=AUDIT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as exc:
        raise InvalidArgumentError(f"malformed audit rows: {exc}") from exc
